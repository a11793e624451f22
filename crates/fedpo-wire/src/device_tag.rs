//! Hellos and goodbyes a device tags with its broker password.
//!
//! A broker without per-topic ACLs (the embedded rumqttd) lets any client that logs in
//! publish under any device's topic: a goodbye that takes another device offline, or
//! hellos with other instance numbers that get its id left out of the job as claimed
//! twice. The aggregator that hosts such a broker knows every device's password, so a
//! device tags what says who it is, its hellos and goodbyes, with an HMAC-SHA256 under
//! its password, and the aggregator ignores those whose tag does not verify. A tag binds
//! the message's instance number, and the aggregator takes a goodbye only from the
//! instance it knows, so a goodbye recorded from an earlier process cannot be replayed.

use ring::hmac;

use crate::message::{DeviceBye, DeviceHello};

pub use crate::limits::TAG_BYTES;

/// A message a device tags. Sealed: hellos and goodbyes, each with its own domain.
pub trait Tagged: Clone + serde::Serialize + sealed::Sealed {
    /// Prefix of the tagged bytes.
    const DOMAIN: &'static [u8];
    /// The tag field.
    fn tag_mut(&mut self) -> &mut Vec<u8>;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for crate::message::DeviceHello {}
    impl Sealed for crate::message::DeviceBye {}
}

impl Tagged for DeviceHello {
    const DOMAIN: &'static [u8] = b"fedpo device hello v1\0";
    fn tag_mut(&mut self) -> &mut Vec<u8> {
        &mut self.tag
    }
}

impl Tagged for DeviceBye {
    const DOMAIN: &'static [u8] = b"fedpo device bye v1\0";
    fn tag_mut(&mut self) -> &mut Vec<u8> {
        &mut self.tag
    }
}

fn tagged_bytes<M: Tagged>(message: &M) -> (Vec<u8>, Vec<u8>) {
    let mut untagged = message.clone();
    let tag = std::mem::take(untagged.tag_mut());
    let mut bytes = M::DOMAIN.to_vec();
    bytes.extend(serde_cbor::to_vec(&untagged).expect("a message always encodes"));
    (tag, bytes)
}

/// Tags `message` in place with `password`.
pub fn tag<M: Tagged>(message: &mut M, password: &str) {
    let (_, bytes) = tagged_bytes(message);
    let key = hmac::Key::new(hmac::HMAC_SHA256, password.as_bytes());
    *message.tag_mut() = hmac::sign(&key, &bytes).as_ref().to_vec();
}

/// Whether `message` carries a tag made with `password`.
pub fn verify<M: Tagged>(message: &M, password: &str) -> bool {
    let (tag, bytes) = tagged_bytes(message);
    let key = hmac::Key::new(hmac::HMAC_SHA256, password.as_bytes());
    hmac::verify(&key, &bytes, &tag).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_verifies_under_its_password_only_and_covers_the_instance() {
        let mut hello = DeviceHello {
            device: "pi-7".into(),
            pairs: 4,
            backend: "cpu".into(),
            memory_mb: 0,
            instance: 9,
            connection: 1,
            model: Vec::new(),
            tag: Vec::new(),
        };
        assert!(!verify(&hello, "s3cret"), "an untagged hello");
        tag(&mut hello, "s3cret");
        assert_eq!(hello.tag.len(), TAG_BYTES);
        assert!(verify(&hello, "s3cret"));
        assert!(!verify(&hello, "other"), "another device's password");
        let mut other_instance = hello.clone();
        other_instance.instance = 10;
        assert!(!verify(&other_instance, "s3cret"), "the instance is covered");

        let mut bye = DeviceBye::last_will("pi-7").from_instance(9);
        tag(&mut bye, "s3cret");
        assert!(verify(&bye, "s3cret"));
        let mut dressed = bye.clone();
        dressed.tag = hello.tag.clone();
        assert!(!verify(&dressed, "s3cret"), "a hello's tag never passes for a goodbye");
    }
}
