//! Expanding a 32-byte seed into a mask of u32 values (ChaCha20, so the expansion is a
//! standard stream cipher keyed by the seed), and deriving seeds from X25519 agreements.

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;
use sha2::{Digest, Sha256};

/// `len` pseudo-random u32 values from `seed`.
pub(crate) fn mask(seed: &[u8; 32], len: usize) -> impl Iterator<Item = u32> {
    let mut rng = ChaCha20Rng::from_seed(*seed);
    (0..len).map(move |_| rng.next_u32())
}

/// Adds (or with `negative`, subtracts) the mask of `seed` to `values`, mod 2³².
pub(crate) fn apply(values: &mut [u32], seed: &[u8; 32], negative: bool) {
    let len = values.len();
    for (v, m) in values.iter_mut().zip(mask(seed, len)) {
        *v = if negative { v.wrapping_sub(m) } else { v.wrapping_add(m) };
    }
}

/// A key for `purpose` from an X25519 shared secret, bound to the round and to the
/// unordered pair of parties, so that no two rounds or pairs share a mask or a key.
pub(crate) fn derive(shared: &[u8; 32], purpose: &str, round: u64, a: u16, b: u16) -> [u8; 32] {
    let (lo, hi) = if a < b { (a, b) } else { (b, a) };
    let mut h = Sha256::new();
    h.update(b"fedpo-secagg/1/");
    h.update(purpose.as_bytes());
    h.update(round.to_le_bytes());
    h.update(lo.to_le_bytes());
    h.update(hi.to_le_bytes());
    h.update(shared);
    h.finalize().into()
}
