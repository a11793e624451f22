//! Named tensors as they travel: dtype, shape and little-endian bytes.
//!
//! Values are `f32` on both ends; the dtype only decides how they are carried. `bf16` and
//! `f16` halve the bytes of an update at a precision cost the caller chooses; `int8` and
//! `sparse` are the compressed encodings of [`crate::update_codec`].

use std::fmt;

use bytes::Bytes;
use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use crate::error::{Result, WireError};
use crate::limits::Limits;
use crate::packed::{self, INT8_BLOCK, SPARSE_ENTRY};

/// How tensor values are carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WireDType {
    /// IEEE f32, little endian.
    F32,
    /// bfloat16 (f32 with a 7-bit mantissa), little endian.
    Bf16,
    /// IEEE half precision, little endian.
    F16,
    /// 32-bit words, little endian: secure aggregation's masked fixed-point values, which
    /// are not numbers until the aggregator removes the masks from their sum.
    U32,
    /// Blocks of [`INT8_BLOCK`] values: an f32 LE absmax scale, then one i8 per value.
    Int8,
    /// (u32 LE index, f32 LE value) entries with strictly rising indices; every other
    /// value is zero.
    Sparse,
}

impl fmt::Display for WireDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
            Self::U32 => "u32",
            Self::Int8 => "int8",
            Self::Sparse => "sparse",
        })
    }
}

/// A tensor that may leave the device.
///
/// This is the only way values get onto the wire: [`TensorPayload::encode`] takes
/// `ToWire` items, and [`WireTensor`] has no public constructor. fedpo-model implements
/// it for its `SharedTensor`, which only the shared and frozen parameter sets produce; a
/// private adapter tensor has no `ToWire` implementation, so sending one does not compile
/// (fedpo-model's `exchange` module shows the compile error.)
pub trait ToWire {
    /// Checkpoint-style name.
    fn wire_name(&self) -> &str;
    /// Dimensions.
    fn wire_shape(&self) -> Vec<u64>;
    /// Row-major values.
    fn wire_values(&self) -> &[f32];
}

impl<T: ToWire + ?Sized> ToWire for &T {
    fn wire_name(&self) -> &str {
        (**self).wire_name()
    }
    fn wire_shape(&self) -> Vec<u64> {
        (**self).wire_shape()
    }
    fn wire_values(&self) -> &[f32] {
        (**self).wire_values()
    }
}

/// The name of a secure-aggregation input's one tensor.
pub const MASKED_TENSOR: &str = "secagg.masked";

/// One named tensor on the wire. Built only from [`ToWire`] values or by decoding.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireTensor {
    name: String,
    dtype: WireDType,
    shape: Vec<u64>,
    /// A CBOR byte string on the wire. Decoded by [`TensorPayload::from_shared`], it is a
    /// slice of the buffer the payload arrived in.
    data: Bytes,
}

/// Values in a shape, or `None` on overflow.
fn value_count(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))
}

/// The least and most bytes a shape of a dtype occupies, or `None` on overflow. They are
/// equal for every dense encoding; a sparse tensor holds anywhere from no entry to one per
/// value.
pub fn byte_bounds(shape: &[u64], dtype: WireDType) -> Option<(u64, u64)> {
    let n = value_count(shape)?;
    let exact = |bytes: Option<u64>| bytes.map(|b| (b, b));
    match dtype {
        WireDType::F32 | WireDType::U32 => exact(n.checked_mul(4)),
        WireDType::Bf16 | WireDType::F16 => exact(n.checked_mul(2)),
        WireDType::Int8 => exact(n.div_ceil(INT8_BLOCK as u64).checked_mul(4).and_then(|s| s.checked_add(n))),
        WireDType::Sparse => Some((0, n.checked_mul(SPARSE_ENTRY as u64)?)),
    }
}

impl WireTensor {
    /// Encodes `values` (row-major, `shape`) with `dtype`.
    pub(crate) fn encode(name: impl Into<String>, shape: &[u64], values: &[f32], dtype: WireDType) -> Self {
        let capacity = byte_bounds(&[values.len() as u64], dtype).map_or(0, |(least, _)| least as usize);
        let mut data = Vec::with_capacity(capacity);
        match dtype {
            WireDType::F32 => values.iter().for_each(|v| data.extend_from_slice(&v.to_le_bytes())),
            WireDType::Bf16 => values.iter().for_each(|v| data.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
            WireDType::F16 => values.iter().for_each(|v| data.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
            // Masked words come from `WireTensor::masked`; floats saturate to words here.
            WireDType::U32 => values.iter().for_each(|v| data.extend_from_slice(&(*v as u32).to_le_bytes())),
            WireDType::Int8 => packed::int8_encode(values, &mut data),
            // Lossless: every non-zero value.
            WireDType::Sparse => {
                let entries: Vec<(u32, f32)> =
                    values.iter().enumerate().filter(|(_, v)| **v != 0.0).map(|(i, v)| (i as u32, *v)).collect();
                return Self::sparse(name, shape, &entries);
            }
        }
        Self { name: name.into(), dtype, shape: shape.to_vec(), data: data.into() }
    }

    /// A tensor of bytes already checked to belong to the payload they came in; they are
    /// validated with the rest of the payload.
    pub(crate) fn from_parts(name: String, dtype: WireDType, shape: Vec<u64>, data: Bytes) -> Self {
        Self { name, dtype, shape, data }
    }

    /// A sparse tensor from (index, value) entries, indices strictly rising.
    pub(crate) fn sparse(name: impl Into<String>, shape: &[u64], entries: &[(u32, f32)]) -> Self {
        let mut data = Vec::with_capacity(entries.len() * SPARSE_ENTRY);
        for (index, value) in entries {
            data.extend_from_slice(&index.to_le_bytes());
            data.extend_from_slice(&value.to_le_bytes());
        }
        Self { name: name.into(), dtype: WireDType::Sparse, shape: shape.to_vec(), data: data.into() }
    }

    /// Encodes a tensor that may leave the device.
    pub fn from_shared(t: &(impl ToWire + ?Sized), dtype: WireDType) -> Self {
        Self::encode(t.wire_name(), &t.wire_shape(), t.wire_values(), dtype)
    }

    /// Checkpoint-style name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Value encoding.
    pub fn dtype(&self) -> WireDType {
        self.dtype
    }

    /// Dimensions.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// The encoded little-endian bytes.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// The encoded bytes, owned (without a copy when nothing else shares them).
    pub(crate) fn into_data(self) -> Vec<u8> {
        self.data.into()
    }

    /// Checks that the bytes match the shape and dtype.
    pub fn validate(&self, limits: &Limits) -> Result<()> {
        if self.name.len() > limits.max_name_len {
            return Err(WireError::InvalidField {
                field: "tensor name",
                reason: format!("{} bytes exceed the limit of {}", self.name.len(), limits.max_name_len),
            });
        }
        let (least, most) = byte_bounds(&self.shape, self.dtype).unwrap_or((u64::MAX, u64::MAX));
        let found = self.data.len() as u64;
        if found < least
            || found > most
            || (self.dtype == WireDType::Sparse && !found.is_multiple_of(SPARSE_ENTRY as u64))
        {
            return Err(WireError::TensorSizeMismatch {
                name: self.name.clone(),
                shape: self.shape.clone(),
                dtype: self.dtype.to_string(),
                expected: if found > most { most } else { least },
                found,
            });
        }
        if self.dtype == WireDType::Sparse {
            // Few bytes can name a huge shape; the dense values it decodes to must fit
            // what a dense transfer may carry.
            let dense = most / SPARSE_ENTRY as u64 * 4;
            if dense > limits.max_transfer_bytes {
                return Err(WireError::TransferTooLarge { size: dense, max: limits.max_transfer_bytes });
            }
            let n = most / SPARSE_ENTRY as u64;
            packed::check_sparse_indices(&self.data, n).map_err(|reason| WireError::InvalidField {
                field: "sparse tensor",
                reason: format!("`{}`: {reason}", self.name),
            })?;
        }
        Ok(())
    }

    /// Number of values the tensor stands for (its shape's product, saturating).
    pub fn len(&self) -> usize {
        value_count(&self.shape).and_then(|n| usize::try_from(n).ok()).unwrap_or(usize::MAX)
    }

    /// Whether the tensor stands for no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Calls `f` with every value in order. The dense encodings are decoded on the way,
    /// without a buffer: an aggregator folds model-sized updates one after another, and
    /// [`WireTensor::values`] would allocate each one afresh.
    pub fn for_each_value(&self, mut f: impl FnMut(f32)) {
        match self.dtype {
            WireDType::F32 => {
                self.data.chunks_exact(4).for_each(|b| f(f32::from_le_bytes([b[0], b[1], b[2], b[3]])));
            }
            WireDType::Bf16 => self.data.chunks_exact(2).for_each(|b| f(bf16::from_le_bytes([b[0], b[1]]).to_f32())),
            WireDType::F16 => self.data.chunks_exact(2).for_each(|b| f(f16::from_le_bytes([b[0], b[1]]).to_f32())),
            WireDType::U32 | WireDType::Int8 | WireDType::Sparse => self.values().into_iter().for_each(f),
        }
    }

    /// Σ v² over the values, in f64.
    pub fn sum_of_squares(&self) -> f64 {
        let mut sum = 0.0;
        self.for_each_value(|v| sum += f64::from(v) * f64::from(v));
        sum
    }

    /// The values as f32.
    pub fn values(&self) -> Vec<f32> {
        match self.dtype {
            WireDType::F32 => self.data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            WireDType::Bf16 => self.data.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            WireDType::F16 => self.data.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            WireDType::U32 => self.words().into_iter().map(|w| w as f32).collect(),
            WireDType::Int8 => packed::int8_decode(&self.data, self.len()),
            WireDType::Sparse => packed::sparse_decode(&self.data, self.len()),
        }
    }

    /// The values as 32-bit words (meaningful for [`WireDType::U32`]).
    pub fn words(&self) -> Vec<u32> {
        self.data.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
    }

    /// A secure-aggregation input: masked fixed-point words, one per shared value in the
    /// shared set's order. Masked words reveal nothing without every other device's masks,
    /// so they need no [`ToWire`] proof of where they came from.
    pub fn masked(words: &[u32]) -> Self {
        let data: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        Self { name: MASKED_TENSOR.into(), dtype: WireDType::U32, shape: vec![words.len() as u64], data: data.into() }
    }

    /// The index of the first NaN or infinite value, if any (words have none).
    ///
    /// The dense encodings are checked on their bytes, without decoding: every received
    /// model and update passes through here, and a decoded copy of DistilGPT-2's embedding
    /// alone is 154 MB.
    pub fn first_non_finite(&self) -> Option<usize> {
        match self.dtype {
            WireDType::U32 => None,
            WireDType::F32 => first_with_max_exponent::<4>(&self.data, 0x7f80_0000),
            WireDType::Bf16 => first_with_max_exponent::<2>(&self.data, 0x7f80),
            WireDType::F16 => first_with_max_exponent::<2>(&self.data, 0x7c00),
            WireDType::Int8 | WireDType::Sparse => self.values().iter().position(|v| !v.is_finite()),
        }
    }
}

/// The index of the first `W`-byte little-endian float whose exponent bits (`mask`) are all
/// set, which is what NaN and infinity are in every IEEE-style format. Blocks are scanned
/// with a branch-free OR, which the compiler vectorises, and only a block with a hit is
/// searched value by value.
fn first_with_max_exponent<const W: usize>(data: &[u8], mask: u32) -> Option<usize> {
    const BLOCK: usize = 1024;
    let word = |b: &[u8]| b.iter().rev().fold(0u32, |w, &byte| (w << 8) | u32::from(byte));
    let hit = |b: &[u8]| word(b) & mask == mask;
    data.chunks(BLOCK * W).enumerate().find_map(|(i, block)| {
        let any = block.chunks_exact(W).fold(false, |any, b| any | hit(b));
        any.then(|| block.chunks_exact(W).position(hit).map(|j| i * BLOCK + j)).flatten()
    })
}

/// The content of a model or update transfer.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TensorPayload {
    /// The tensors, in a stable order.
    pub tensors: Vec<WireTensor>,
}

impl TensorPayload {
    /// Encodes tensors that may leave the device, in the given order.
    pub fn encode<'a, T: ToWire + 'a>(tensors: impl IntoIterator<Item = &'a T>, dtype: WireDType) -> Self {
        Self { tensors: tensors.into_iter().map(|t| WireTensor::from_shared(t, dtype)).collect() }
    }

    /// CBOR bytes of the payload.
    pub fn to_bytes(&self) -> Vec<u8> {
        // Sized up front: grown by doubling, a 328 MB payload would be copied into a 656 MB
        // buffer on its last byte. The bound covers CBOR's headers (at most 9 bytes each for
        // the name, shape entries, dtype and data) with room to spare.
        let bound =
            16 + self.tensors.iter().map(|t| t.data.len() + t.name.len() + 9 * t.shape.len() + 64).sum::<usize>();
        let mut out = Vec::with_capacity(bound);
        match serde_cbor::to_writer(&mut out, self) {
            Ok(()) => out,
            Err(_) => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_codec_is_exact_and_half_codecs_stay_within_their_precision() {
        let values: Vec<f32> = (0..1000).map(|i| ((i as f32) * 0.37).sin() * 3.0).collect();
        let exact = WireTensor::encode("w", &[10, 100], &values, WireDType::F32);
        assert_eq!(exact.values(), values);
        for (dtype, rel) in [(WireDType::Bf16, 1.0 / 128.0), (WireDType::F16, 1.0 / 1024.0)] {
            let t = WireTensor::encode("w", &[10, 100], &values, dtype);
            assert_eq!(t.data.len(), 2000);
            for (a, b) in t.values().iter().zip(&values) {
                assert!((a - b).abs() <= rel * b.abs() + 1e-6, "{dtype}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn values_visited_one_by_one_are_the_decoded_values_in_every_encoding() {
        let values: Vec<f32> = (0..1000).map(|i| ((i as f32) * 0.37).sin() * 3.0).collect();
        let dtypes = [WireDType::F32, WireDType::Bf16, WireDType::F16, WireDType::Int8, WireDType::Sparse];
        for dtype in dtypes {
            let t = match dtype {
                WireDType::Int8 | WireDType::Sparse => {
                    let codec =
                        if dtype == WireDType::Int8 { crate::UpdateCodec::Int8 } else { crate::UpdateCodec::TopK(0.1) };
                    struct V<'a>(&'a [f32]);
                    impl ToWire for V<'_> {
                        fn wire_name(&self) -> &str {
                            "w"
                        }
                        fn wire_shape(&self) -> Vec<u64> {
                            vec![10, 100]
                        }
                        fn wire_values(&self) -> &[f32] {
                            self.0
                        }
                    }
                    TensorPayload::compress(&[V(&values)], codec).tensors.remove(0)
                }
                _ => WireTensor::encode("w", &[10, 100], &values, dtype),
            };
            assert_eq!(t.dtype(), dtype);
            let mut visited = Vec::new();
            t.for_each_value(|v| visited.push(v));
            assert_eq!(visited, t.values(), "{dtype}");
            let squares: f64 = t.values().iter().map(|&v| f64::from(v) * f64::from(v)).sum();
            assert!((t.sum_of_squares() - squares).abs() <= 1e-9 * squares, "{dtype}");
        }
    }

    #[test]
    fn shape_that_disagrees_with_bytes_is_refused_naming_the_tensor() {
        let mut t = WireTensor::encode("h.0.attn.c_attn.weight", &[2, 3], &[0.0; 6], WireDType::F32);
        t.shape = vec![3, 3];
        let err = t.validate(&Limits::default()).unwrap_err().to_string();
        assert!(err.contains("h.0.attn.c_attn.weight") && err.contains("36") && err.contains("24"), "{err}");
    }

    #[test]
    fn overflowing_shape_is_refused_without_allocating() {
        let t = WireTensor { name: "x".into(), dtype: WireDType::F32, shape: vec![u64::MAX, 4], data: Bytes::new() };
        assert!(matches!(t.validate(&Limits::default()), Err(WireError::TensorSizeMismatch { .. })));
    }

    #[test]
    fn payload_with_nan_is_refused_when_finite_values_are_required() {
        let p = TensorPayload { tensors: vec![WireTensor::encode("b", &[3], &[1.0, f32::NAN, 2.0], WireDType::F32)] };
        let bytes = p.to_bytes();
        assert_eq!(TensorPayload::from_bytes(&bytes, &Limits::default(), false).unwrap(), p);
        let err = TensorPayload::from_bytes(&bytes, &Limits::default(), true).unwrap_err();
        assert_eq!(err, WireError::NonFinite { name: "b".into(), index: 1 });
    }

    #[test]
    fn non_finite_values_are_found_at_their_index_in_every_encoding() {
        let n = 5000; // several scan blocks
        for dtype in [WireDType::F32, WireDType::Bf16, WireDType::F16, WireDType::Int8, WireDType::Sparse] {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                for at in [0, 1023, 1024, 4999] {
                    let mut values: Vec<f32> = (0..n).map(|i| (i as f32 * 0.1).sin() * 1e3).collect();
                    values[at] = bad;
                    let t = WireTensor::encode("w", &[n as u64], &values, dtype);
                    // Int8 spoils the whole block of its scale: the first value of that block.
                    let expected = if dtype == WireDType::Int8 { at / INT8_BLOCK * INT8_BLOCK } else { at };
                    assert_eq!(t.first_non_finite(), Some(expected), "{dtype} {bad} at {at}");
                }
            }
            // Each encoding's largest finite values, and tiny ones, are finite.
            let max = match dtype {
                WireDType::Bf16 => bf16::MAX.to_f32(),
                WireDType::F16 => f16::MAX.to_f32(),
                WireDType::Int8 => 1e30, // a scale times 127 must stay finite
                _ => f32::MAX,
            };
            let edge = [max, -max, 1e-40, 0.0, -0.0];
            let t = WireTensor::encode("w", &[edge.len() as u64], &edge, dtype);
            assert_eq!(t.first_non_finite(), None, "{dtype}");
        }
        assert_eq!(WireTensor::masked(&[u32::MAX, 0x7f80_0000]).first_non_finite(), None, "words are not floats");
    }

    #[test]
    fn payload_with_too_many_tensors_is_refused() {
        let p = TensorPayload {
            tensors: (0..5).map(|i| WireTensor::encode(format!("t{i}"), &[1], &[0.0], WireDType::F32)).collect(),
        };
        let limits = Limits { max_tensors: 4, ..Limits::default() };
        assert_eq!(
            TensorPayload::from_bytes(&p.to_bytes(), &limits, true),
            Err(WireError::TooManyTensors { count: 5, max: 4 })
        );
    }

    #[test]
    fn sparse_tensors_with_bad_indices_or_a_huge_shape_are_refused_naming_the_tensor() {
        let limits = Limits::default();
        let ok = WireTensor::sparse("d", &[10], &[(2, 1.0), (7, -1.0)]);
        ok.validate(&limits).unwrap();
        assert_eq!(ok.values(), vec![0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, -1.0, 0.0, 0.0]);
        for (entries, why) in [
            (vec![(7, 1.0), (2, 1.0)], "not above"),
            (vec![(3, 1.0), (3, 2.0)], "not above"),
            (vec![(10, 1.0)], "past"),
        ] {
            let err = WireTensor::sparse("d", &[10], &entries).validate(&limits).unwrap_err().to_string();
            assert!(err.contains("`d`") && err.contains(why), "{err}");
        }
        let mut torn = ok.clone();
        torn.data.truncate(torn.data.len() - 1);
        assert!(matches!(torn.validate(&limits), Err(WireError::TensorSizeMismatch { .. })));
        // Eight bytes must not decode into a petabyte of zeros.
        let huge = WireTensor::sparse("d", &[1 << 40], &[(0, 1.0)]);
        assert!(matches!(huge.validate(&limits), Err(WireError::TransferTooLarge { .. })));
    }

    #[test]
    fn int8_bytes_must_match_the_shape_block_by_block() {
        let t = WireTensor::encode("q", &[130], &[0.5; 130], WireDType::Int8);
        assert_eq!(t.data.len(), 130 + 3 * 4);
        t.validate(&Limits::default()).unwrap();
        let mut short = t.clone();
        short.data.truncate(133);
        let err = short.validate(&Limits::default()).unwrap_err().to_string();
        assert!(err.contains("142") && err.contains("133"), "{err}");
    }

    #[test]
    fn lossless_sparse_encoding_keeps_exactly_the_non_zero_values() {
        let values = [0.0, 3.5, 0.0, -1.25, 0.0];
        let t = WireTensor::encode("s", &[5], &values, WireDType::Sparse);
        assert_eq!((t.data.len(), t.values()), (2 * SPARSE_ENTRY, values.to_vec()));
    }
}
