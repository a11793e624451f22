//! What a fedpo process needs from its operating system, shared by `fedpo-device` and
//! `fedpo-aggregator` (and the libraries below them) so that neither binary reaches into
//! the other for it:
//!
//! - [`files`]: crash-safe writes (a power cut leaves the old file or the new one);
//! - [`usage`]: peak memory, CPU time, the memory the kernel has available;
//! - [`allocator`] and [`threads`]: glibc and thread-pool settings for processes that train;
//! - [`logging`]: one way for both binaries to log and to report failure.

pub mod allocator;
pub mod files;
pub mod logging;
pub mod threads;
pub mod usage;

pub use files::FileError;
