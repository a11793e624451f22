//! Any bytes given to `Message::decode` are refused or decoded, never a panic; whatever
//! decodes encodes back to bytes that decode to the same message, and decoding in place
//! (`Message::decode_shared`) accepts exactly what `decode` accepts, as the same message.
#![no_main]

use fedpo_wire::{Bytes, Message};
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let limits = common::limits();
    let shared = Message::decode_shared(&Bytes::copy_from_slice(data), &limits);
    let copied = Message::decode(data, &limits);
    assert_eq!(format!("{:?}", shared.ok()), format!("{:?}", copied.as_ref().ok()));
    if let Ok(message) = copied {
        let again = Message::decode(&message.encode(), &limits).expect("a decoded message re-encodes validly");
        // NaN-free by validation, so equality is meaningful.
        assert_eq!(format!("{message:?}"), format!("{again:?}"));
    }
});
