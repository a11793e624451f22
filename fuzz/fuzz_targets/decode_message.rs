//! Any bytes given to `Message::decode` are refused or decoded, never a panic; whatever
//! decodes encodes back to bytes that decode to the same message.
#![no_main]

use fedpo_wire::Message;
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let limits = common::limits();
    if let Ok(message) = Message::decode(data, &limits) {
        let again = Message::decode(&message.encode(), &limits).expect("a decoded message re-encodes validly");
        // NaN-free by validation, so equality is meaningful.
        assert_eq!(format!("{message:?}"), format!("{again:?}"));
    }
});
