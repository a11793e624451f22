//! Secure aggregation (Bonawitz et al., CCS 2017): the aggregator learns the sum of the
//! devices' updates and nothing about any single one, even when some devices vanish
//! mid-round.
//!
//! One round, for the devices that take part:
//!
//! 1. **Advertise.** Each device draws two X25519 key pairs (one to encrypt shares to its
//!    peers, one to derive masks) and a self-mask seed, and sends both public keys.
//! 2. **Share.** Each device splits its mask secret key and its self-mask seed into
//!    Shamir shares (threshold t) and sends each peer its shares, encrypted with
//!    ChaCha20-Poly1305 under a key agreed with that peer, so the aggregator relaying them
//!    reads nothing.
//! 3. **Masked input.** Each device quantizes its weighted update to fixed point mod 2³²
//!    and adds a self mask PRG(b_i) and, for every peer j, ±PRG(s_ij), where s_ij comes
//!    from X25519 between their mask keys: + if i < j, − if i > j. Summed over all devices
//!    the pairwise masks cancel.
//! 4. **Unmask.** The aggregator names who sent an input. Each survivor returns its share
//!    of every survivor's self-mask seed and of every dropped device's mask key, never
//!    both for one device. With t shares each, the aggregator removes the survivors'
//!    self masks and the dropped devices' leftover pairwise masks, and decodes the sum.
//!
//! The threat model is the paper's honest-but-curious aggregator: it follows the protocol
//! but would like to read individual updates. Up to t − 1 colluding devices learn nothing
//! beyond the sum either. The crate is transport-free: every step takes and returns plain
//! serde messages that fedpo's wire carries.

mod client;
mod error;
mod fixed_point;
mod keys;
mod prg;
mod server;

pub use client::{Client, ShareBundle};
pub use error::SecAggError;
pub use fixed_point::FixedPoint;
pub use keys::PublicKeys;
pub use server::{Server, UnmaskRequest, UnmaskResponse};

/// A device's place in the round: its index in the sorted list of participants, 0-based.
pub type Party = u16;

/// Most parties one round can hold: Shamir shares are numbered 1–255.
pub const MAX_PARTIES: usize = 255;
