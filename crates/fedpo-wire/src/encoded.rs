//! A payload encoded straight into transfer-sized pieces.
//!
//! A model or an update is hundreds of megabytes. Encoding it into one buffer and then
//! copying that buffer into chunks costs two passes and two model-sized allocations, on
//! devices whose memory is the scarcest thing they have. [`EncodedPayload`] writes the
//! CBOR into chunk-sized pieces as the serialiser produces it and hashes it on the way, so
//! the pieces become the chunks as they are.

use std::io::Write;

use sha2::{Digest, Sha256};

use crate::message::{Manifest, TensorInfo, TransferChunk};
use crate::tensor::TensorPayload;

/// A payload's wire bytes in pieces of at most `chunk_bytes`, with their SHA-256.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedPayload {
    pieces: Vec<Vec<u8>>,
    len: u64,
    sha256: Vec<u8>,
    tensors: Vec<TensorInfo>,
}

/// Cuts what it is given into pieces of `size` bytes and hashes it.
struct PieceWriter {
    size: usize,
    pieces: Vec<Vec<u8>>,
    hasher: Sha256,
    len: u64,
}

impl Write for PieceWriter {
    fn write(&mut self, mut buf: &[u8]) -> std::io::Result<usize> {
        let written = buf.len();
        self.hasher.update(buf);
        self.len += written as u64;
        while !buf.is_empty() {
            if self.pieces.last().is_none_or(|p| p.len() == self.size) {
                self.pieces.push(Vec::with_capacity(self.size));
            }
            let piece = self.pieces.last_mut().expect("a piece with room");
            let take = (self.size - piece.len()).min(buf.len());
            piece.extend_from_slice(&buf[..take]);
            buf = &buf[take..];
        }
        Ok(written)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl EncodedPayload {
    /// Encodes `payload` into pieces of `chunk_bytes` (at least 1) and hashes it.
    pub fn new(payload: &TensorPayload, chunk_bytes: usize) -> Self {
        let mut w = PieceWriter { size: chunk_bytes.max(1), pieces: Vec::new(), hasher: Sha256::new(), len: 0 };
        // Writing to memory cannot fail, and every payload value serialises.
        let _ = serde_cbor::to_writer(&mut w, payload);
        if w.pieces.is_empty() {
            w.pieces.push(Vec::new());
        }
        let tensors = payload
            .tensors
            .iter()
            .map(|t| TensorInfo { name: t.name().to_string(), dtype: t.dtype(), shape: t.shape().to_vec() })
            .collect();
        Self { pieces: w.pieces, len: w.len, sha256: w.hasher.finalize().to_vec(), tensors }
    }

    /// SHA-256 of the bytes: what receivers verify.
    pub fn sha256(&self) -> &[u8] {
        &self.sha256
    }

    /// The encoded size in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether nothing was encoded (never: even an empty payload has a CBOR header).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The manifest and chunks of one transfer of these bytes; the pieces become the
    /// chunks without a copy.
    pub fn into_transfer(self, transfer: &str) -> (Manifest, Vec<TransferChunk>) {
        let count = self.pieces.len() as u32;
        let chunks = self
            .pieces
            .into_iter()
            .enumerate()
            .map(|(i, bytes)| TransferChunk { transfer: transfer.to_string(), index: i as u32, count, bytes })
            .collect();
        let manifest = Manifest {
            transfer: transfer.to_string(),
            bytes: self.len,
            chunks: count,
            sha256: self.sha256,
            tensors: self.tensors,
        };
        (manifest, chunks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{ToWire, WireDType};

    struct T(Vec<f32>);
    impl ToWire for T {
        fn wire_name(&self) -> &str {
            "h.0.mlp.c_fc.weight"
        }
        fn wire_shape(&self) -> Vec<u64> {
            vec![self.0.len() as u64]
        }
        fn wire_values(&self) -> &[f32] {
            &self.0
        }
    }

    #[test]
    fn pieces_are_the_payload_bytes_cut_at_the_chunk_size_and_hashed_whole() {
        let payload = TensorPayload::encode(&[T((0..10_000).map(|i| i as f32).collect())], WireDType::F32);
        let whole = payload.to_bytes();
        for chunk_bytes in [1, 7, 4096, whole.len(), whole.len() + 1] {
            let encoded = EncodedPayload::new(&payload, chunk_bytes);
            assert_eq!(encoded.len(), whole.len() as u64);
            assert_eq!(encoded.sha256(), crate::chunk::sha256(&whole).as_slice());
            let (manifest, chunks) = encoded.into_transfer("r1/global");
            assert_eq!(manifest.chunks as usize, whole.len().div_ceil(chunk_bytes));
            assert!(chunks.iter().all(|c| c.bytes.len() <= chunk_bytes && c.count == manifest.chunks));
            let joined: Vec<u8> = chunks.iter().flat_map(|c| c.bytes.iter().copied()).collect();
            assert_eq!(joined, whole, "chunk size {chunk_bytes}");
        }
    }
}
