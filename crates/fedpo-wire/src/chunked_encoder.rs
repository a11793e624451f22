//! A payload encoded straight into transfer-sized pieces.
//!
//! A model or an update is hundreds of megabytes. Encoding it into one buffer and then
//! copying that buffer into chunks costs two passes and two model-sized allocations, on
//! devices whose memory is the scarcest thing they have. [`EncodedPayload`] writes the
//! CBOR into chunk-sized pieces as the serialiser produces it and digests it on the way, so
//! the pieces become the chunks as they are.

use std::borrow::Cow;
use std::io::Write;

use serde::ser::{Serialize, SerializeSeq, Serializer};

use crate::digest::Hasher;
use crate::message::{Manifest, TensorInfo, TransferChunk};
use crate::update_codec::UpdateCodec;
use crate::wire_tensor::{TensorPayload, ToWire, WireDType};

/// A payload's wire bytes in pieces of at most `chunk_bytes`, with their digest.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedPayload {
    pieces: Vec<Vec<u8>>,
    len: u64,
    digest: Vec<u8>,
    tensors: Vec<TensorInfo>,
}

/// Cuts what it is given into pieces of `size` bytes and digests it.
struct PieceWriter {
    size: usize,
    pieces: Vec<Vec<u8>>,
    hasher: Hasher,
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

/// A [`TensorPayload`]'s serialised form, with each tensor encoded only when the serialiser
/// reaches it: the same bytes as encoding the payload first (the field names and order are
/// [`crate::WireTensor`]'s), with at most one tensor's encoding alive at a time.
struct LazyPayload<'a, T> {
    tensors: LazyTensors<'a, T>,
}

struct LazyTensors<'a, T> {
    items: &'a [T],
    codec: UpdateCodec,
}

/// One tensor's fields as [`crate::WireTensor`] serialises them.
#[derive(serde::Serialize)]
struct TensorFields<'a> {
    name: &'a str,
    dtype: WireDType,
    shape: Vec<u64>,
    #[serde(with = "serde_bytes")]
    data: Cow<'a, [u8]>,
}

impl<T: ToWire> Serialize for LazyPayload<'_, T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut s = serializer.serialize_struct("TensorPayload", 1)?;
        s.serialize_field("tensors", &self.tensors)?;
        s.end()
    }
}

impl<T: ToWire> Serialize for LazyTensors<'_, T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut seq = serializer.serialize_seq(Some(self.items.len()))?;
        for t in self.items {
            let shape = t.wire_shape();
            let data = match self.codec {
                // f32 is the values' own little-endian bytes: written from where they lie.
                UpdateCodec::F32 if cfg!(target_endian = "little") => {
                    Cow::Borrowed(bytemuck::cast_slice(t.wire_values()))
                }
                codec => Cow::Owned(codec.encode(t.wire_name(), &shape, t.wire_values()).into_data()),
            };
            seq.serialize_element(&TensorFields { name: t.wire_name(), dtype: self.codec.dtype(), shape, data })?;
        }
        seq.end()
    }
}

impl EncodedPayload {
    /// Encodes `payload` into pieces of `chunk_bytes` (at least 1) and digests it.
    pub fn new(payload: &TensorPayload, chunk_bytes: usize) -> Self {
        let tensors = payload
            .tensors
            .iter()
            .map(|t| TensorInfo { name: t.name().to_string(), dtype: t.dtype(), shape: t.shape().to_vec() })
            .collect();
        Self::write(payload, tensors, chunk_bytes)
    }

    /// Encodes tensors with an update codec straight into pieces: the bytes of
    /// `TensorPayload::compress` followed by [`EncodedPayload::new`], without the payload
    /// in between. The aggregator encodes its model this way every round, and a device its
    /// update: in f32 the values go from their own buffers into the pieces, so the only
    /// model-sized allocation is the pieces themselves. Codecs with error feedback need the
    /// payload itself ([`crate::Residual::compress`]).
    pub fn compress<T: ToWire>(tensors: &[T], codec: UpdateCodec, chunk_bytes: usize) -> Self {
        let infos = tensors
            .iter()
            .map(|t| TensorInfo { name: t.wire_name().to_string(), dtype: codec.dtype(), shape: t.wire_shape() })
            .collect();
        Self::write(&LazyPayload { tensors: LazyTensors { items: tensors, codec } }, infos, chunk_bytes)
    }

    fn write(payload: &impl Serialize, tensors: Vec<TensorInfo>, chunk_bytes: usize) -> Self {
        let mut w = PieceWriter { size: chunk_bytes.max(1), pieces: Vec::new(), hasher: Hasher::default(), len: 0 };
        // Writing to memory cannot fail, and every payload value serialises.
        let _ = serde_cbor::to_writer(&mut w, payload);
        if w.pieces.is_empty() {
            w.pieces.push(Vec::new());
        }
        Self { pieces: w.pieces, len: w.len, digest: w.hasher.finish(), tensors }
    }

    /// The bytes' digest ([`crate::digest`]): what receivers verify.
    pub fn digest(&self) -> &[u8] {
        &self.digest
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
            .map(|(i, bytes)| TransferChunk {
                transfer: transfer.to_string(),
                index: i as u32,
                count,
                bytes: bytes.into(),
            })
            .collect();
        let manifest = Manifest {
            transfer: transfer.to_string(),
            bytes: self.len,
            chunks: count,
            digest: self.digest,
            tensors: self.tensors,
        };
        (manifest, chunks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire_tensor::{ToWire, WireDType};

    struct Named(&'static str, Vec<u64>, Vec<f32>);
    impl ToWire for Named {
        fn wire_name(&self) -> &str {
            self.0
        }
        fn wire_shape(&self) -> Vec<u64> {
            self.1.clone()
        }
        fn wire_values(&self) -> &[f32] {
            &self.2
        }
    }

    #[test]
    fn compressing_straight_into_pieces_gives_the_bytes_of_the_payload_route_for_every_codec() {
        let values = |n: usize, k: f32| (0..n).map(|i| ((i as f32) * k).sin() * 2.0).collect::<Vec<f32>>();
        let tensors = [
            Named("h.0.attn.c_attn.weight", vec![30, 70], values(2100, 0.37)),
            Named("ln_f.bias", vec![5], values(5, 1.1)),
            Named("empty", vec![0], Vec::new()),
        ];
        let codecs = [UpdateCodec::F32, UpdateCodec::Bf16, UpdateCodec::F16, UpdateCodec::Int8, UpdateCodec::TopK(0.1)];
        for codec in codecs {
            for chunk_bytes in [7, 1000, 1 << 20] {
                let direct = EncodedPayload::compress(&tensors, codec, chunk_bytes);
                let routed = EncodedPayload::new(&TensorPayload::compress(&tensors, codec), chunk_bytes);
                assert_eq!(direct, routed, "{codec}, {chunk_bytes}-byte chunks");
            }
        }
    }

    #[test]
    fn pieces_are_the_payload_bytes_cut_at_the_chunk_size_and_digested_whole() {
        let values = (0..10_000).map(|i| i as f32).collect();
        let payload = TensorPayload::encode(&[Named("h.0.mlp.c_fc.weight", vec![10_000], values)], WireDType::F32);
        let whole = payload.to_bytes();
        for chunk_bytes in [1, 7, 4096, whole.len(), whole.len() + 1] {
            let encoded = EncodedPayload::new(&payload, chunk_bytes);
            assert_eq!(encoded.len(), whole.len() as u64);
            assert_eq!(encoded.digest(), crate::digest(&whole).as_slice());
            let (manifest, chunks) = encoded.into_transfer("r1/global");
            assert_eq!(manifest.chunks as usize, whole.len().div_ceil(chunk_bytes));
            assert!(chunks.iter().all(|c| c.bytes.len() <= chunk_bytes && c.count == manifest.chunks));
            let joined: Vec<u8> = chunks.iter().flat_map(|c| c.bytes.iter().copied()).collect();
            assert_eq!(joined, whole, "chunk size {chunk_bytes}");
        }
    }
}
