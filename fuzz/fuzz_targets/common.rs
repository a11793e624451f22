//! Limits small enough that an allocation past them shows up under libFuzzer's RSS limit.

use fedpo_wire::Limits;

pub fn limits() -> Limits {
    Limits {
        max_message_bytes: 1 << 20,
        max_tensors: 64,
        max_transfer_bytes: 4 << 20,
        max_chunk_bytes: 64 << 10,
        max_name_len: 64,
        max_spec_bytes: 4 << 10,
    }
}
