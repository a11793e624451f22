//! The bounds a decoder enforces before it allocates.

use crate::error::{Result, WireError};

/// Limits applied when decoding untrusted bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest encoded message (a chunk plus its envelope).
    pub max_message_bytes: usize,
    /// Most tensors in one payload or manifest.
    pub max_tensors: usize,
    /// Largest whole transfer (all chunks together).
    pub max_transfer_bytes: u64,
    /// Largest chunk.
    pub max_chunk_bytes: usize,
    /// Longest identifier (device id, transfer id, tensor name).
    pub max_name_len: usize,
    /// Longest model description in a plan.
    pub max_spec_bytes: usize,
}

/// The highest round a job may reach (the closing evaluation round included): far above
/// any real job, and low enough that a round number out of a corrupt file or a hostile
/// plan is recognised as such rather than locking a device out of every later round.
pub const MAX_ROUND: u64 = 1_000_000;

/// Bytes of a device tag (HMAC-SHA256, [`crate::device_tag`]).
pub const TAG_BYTES: usize = 32;

/// Default chunk size: 1 MiB. A whole DistilGPT-2 base in f32 is 328 MB, beyond MQTT's
/// 256 MB packet limit and far beyond what a small broker buffers comfortably.
pub const DEFAULT_CHUNK_BYTES: usize = 1 << 20;

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_message_bytes: DEFAULT_CHUNK_BYTES + (64 << 10),
            max_tensors: 4096,
            max_transfer_bytes: 2 << 30,
            max_chunk_bytes: DEFAULT_CHUNK_BYTES,
            max_name_len: 256,
            max_spec_bytes: 64 << 10,
        }
    }
}

/// Refuses a name (a device id, a tensor or transfer name) longer than the limits allow.
pub(crate) fn check_name(field: &'static str, s: &str, limits: &Limits) -> Result<()> {
    if s.len() > limits.max_name_len {
        return Err(WireError::InvalidField {
            field,
            reason: format!("{} bytes exceed the limit of {}", s.len(), limits.max_name_len),
        });
    }
    Ok(())
}
