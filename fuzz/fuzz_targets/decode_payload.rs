//! Any bytes given to `TensorPayload::from_bytes` are refused or decoded, never a panic,
//! and a decoded payload's tensors hold exactly the bytes their shapes and dtypes imply.
#![no_main]

use fedpo_wire::{byte_len, TensorPayload};
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let limits = common::limits();
    for require_finite in [false, true] {
        if let Ok(payload) = TensorPayload::from_bytes(data, &limits, require_finite) {
            assert!(payload.tensors.len() <= limits.max_tensors);
            for t in &payload.tensors {
                assert_eq!(Some(t.data().len() as u64), byte_len(t.shape(), t.dtype()));
                let values = t.values();
                if require_finite {
                    assert!(values.iter().all(|v| v.is_finite()));
                }
            }
        }
    }
});
