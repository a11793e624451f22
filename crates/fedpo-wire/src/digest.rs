//! The digest that names a payload and proves it arrived whole: BLAKE3, 32 bytes.
//!
//! Every transfer is hashed by its sender and again by its receiver, and every round
//! moves the model down to each device and an update back up from each: with two
//! DistilGPT-2 devices that is seven hashes of 328 MB a round, on the same cores that
//! train. Even with the CPU's SHA instructions SHA-256 was several times slower than BLAKE3
//! on this project's AVX-512 test machine, and the boards fedpo targets have none
//! (Raspberry Pi 4's Cortex-A72 lacks the ARMv8 crypto extensions) and hash SHA-256 in
//! scalar code. BLAKE3 processes many 1 KiB blocks per vector instruction on AVX-512, AVX2
//! and NEON alike and is as suited to naming a model: a 256-bit output with 128-bit collision
//! resistance, and a signed plan pins the digest as it pinned the SHA-256 before.

/// Bytes in a digest.
pub const DIGEST_BYTES: usize = 32;

/// The digest of `bytes`.
pub fn digest(bytes: &[u8]) -> Vec<u8> {
    blake3::hash(bytes).as_bytes().to_vec()
}

/// A digest taken piece by piece, as chunks are written or arrive.
#[derive(Default, Clone)]
pub(crate) struct Hasher(blake3::Hasher);

impl Hasher {
    pub(crate) fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    pub(crate) fn finish(&self) -> Vec<u8> {
        self.0.finalize().as_bytes().to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_is_blake3_as_published() {
        // The BLAKE3 test vector for the empty input (BLAKE3 specification, appendix).
        assert_eq!(hex::encode(digest(b"")), "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262");
        assert_eq!(digest(b"fedpo").len(), DIGEST_BYTES);
    }

    #[test]
    fn piecewise_digest_equals_the_digest_of_the_whole() {
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i * 31 % 251) as u8).collect();
        for piece in [1, 64, 1024, 1025, 4096, 10_000] {
            let mut h = Hasher::default();
            bytes.chunks(piece).for_each(|c| h.update(c));
            assert_eq!(h.finish(), digest(&bytes), "pieces of {piece}");
        }
    }
}
