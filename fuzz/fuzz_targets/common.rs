//! Limits small enough that an allocation past them shows up under libFuzzer's RSS limit.

use fedpo_wire::Limits;

pub fn limits() -> Limits {
    Limits {
        max_message_bytes: 1 << 20,
        max_tensors: 64,
        max_transfer_bytes: 4 << 20,
        // A manifest must announce exactly the chunks its bytes take at this size; the
        // seed transfer (`fedpo-wire`'s fuzz_seeds example) is cut at it, so that the
        // fuzzer starts from a valid transfer of several chunks.
        max_chunk_bytes: 256,
        max_name_len: 64,
        max_spec_bytes: 4 << 10,
    }
}
