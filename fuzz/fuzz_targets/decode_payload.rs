//! Any bytes given to `TensorPayload::from_bytes` are refused or decoded, never a panic,
//! and a decoded payload's tensors hold exactly the bytes their shapes and dtypes imply.
#![no_main]

use fedpo_wire::{byte_bounds, TensorPayload};
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let limits = common::limits();
    for require_finite in [false, true] {
        if let Ok(payload) = TensorPayload::from_bytes(data, &limits, require_finite) {
            assert!(payload.tensors.len() <= limits.max_tensors);
            for t in &payload.tensors {
                let (least, most) = byte_bounds(t.shape(), t.dtype()).expect("a decoded shape does not overflow");
                assert!((least..=most).contains(&(t.data().len() as u64)));
                let values = t.values();
                assert_eq!(values.len(), t.len());
                if require_finite {
                    assert!(values.iter().all(|v| v.is_finite()));
                }
            }
        }
    }
});
