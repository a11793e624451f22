//! A party's per-round secrets: two X25519 key pairs and the self-mask seed.

use rand::RngCore;
use serde::{Deserialize, Serialize};
use x25519_dalek::{PublicKey, StaticSecret};

/// What a party advertises: the public halves of its channel and mask keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublicKeys {
    pub channel: [u8; 32],
    pub mask: [u8; 32],
}

pub(crate) struct Secrets {
    pub(crate) channel: StaticSecret,
    pub(crate) mask: StaticSecret,
    /// Seed of the self mask b_i.
    pub(crate) self_seed: [u8; 32],
}

impl Secrets {
    pub(crate) fn draw() -> Self {
        let mut bytes = [[0u8; 32]; 3];
        bytes.iter_mut().for_each(|b| rand::rng().fill_bytes(b));
        Self { channel: StaticSecret::from(bytes[0]), mask: StaticSecret::from(bytes[1]), self_seed: bytes[2] }
    }

    pub(crate) fn public(&self) -> PublicKeys {
        PublicKeys { channel: PublicKey::from(&self.channel).to_bytes(), mask: PublicKey::from(&self.mask).to_bytes() }
    }
}

/// X25519 between a secret key's bytes and a public key.
pub(crate) fn agree(secret: &StaticSecret, public: &[u8; 32]) -> [u8; 32] {
    secret.diffie_hellman(&PublicKey::from(*public)).to_bytes()
}
