//! Chunk reassembly under hostile input. The input is a sequence of length-prefixed
//! messages (u16 little-endian length, then the bytes): the first must decode to a plan or
//! an update, whose manifest (and sections) open a bundle; the rest are fed to it as chunks.
//! Nothing panics, and a bundle only completes with bytes that match the manifest's size
//! and digest.
#![no_main]

use fedpo_wire::{digest, Bundle, BundleProgress, Message};
use libfuzzer_sys::fuzz_target;

#[path = "common.rs"]
mod common;

fn messages(mut data: &[u8]) -> impl Iterator<Item = &[u8]> {
    std::iter::from_fn(move || {
        if data.len() < 2 {
            return None;
        }
        let len = usize::from(u16::from_le_bytes([data[0], data[1]])).min(data.len() - 2);
        let (message, rest) = data[2..].split_at(len);
        data = rest;
        Some(message)
    })
}

fuzz_target!(|data: &[u8]| {
    let limits = common::limits();
    let mut parts = messages(data);
    let Some(first) = parts.next() else { return };
    let (main, sections) = match Message::decode(first, &limits) {
        Ok(Message::Plan(p)) => (p.global_model, p.sections),
        Ok(Message::Update(u)) => (u.update, u.sections),
        _ => return,
    };
    let Ok(mut bundle) = Bundle::new(main.clone(), &sections, &limits) else { return };
    for part in parts {
        let Ok(Message::Chunk(chunk)) = Message::decode(part, &limits) else { continue };
        if let Ok(BundleProgress::Complete(bytes)) = bundle.accept(chunk) {
            assert_eq!(bytes.main.len() as u64, main.bytes);
            assert_eq!(digest(&bytes.main).as_slice(), main.digest.as_slice());
            for (name, section) in &sections {
                let got = &bytes.sections[name];
                assert_eq!(digest(got).as_slice(), section.digest.as_slice());
            }
            return;
        }
    }
});
