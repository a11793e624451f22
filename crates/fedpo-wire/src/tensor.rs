//! Named tensors as they travel: dtype, shape and little-endian bytes.
//!
//! Values are `f32` on both ends; the codec only decides how they are carried. `bf16` and
//! `f16` halve the bytes of an update at a precision cost the caller chooses.

use std::fmt;

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use crate::error::{Result, WireError};
use crate::limits::Limits;

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
}

impl WireDType {
    /// Bytes per value.
    pub fn size(self) -> u64 {
        match self {
            Self::F32 | Self::U32 => 4,
            Self::Bf16 | Self::F16 => 2,
        }
    }
}

impl fmt::Display for WireDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
            Self::U32 => "u32",
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

/// The name of a secure-aggregation input's one tensor.
pub const MASKED_TENSOR: &str = "secagg.masked";

/// One named tensor on the wire. Built only from [`ToWire`] values or by decoding.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireTensor {
    name: String,
    dtype: WireDType,
    shape: Vec<u64>,
    #[serde(with = "serde_bytes")]
    data: Vec<u8>,
}

/// Bytes a shape of a dtype occupies, or `None` on overflow.
pub fn byte_len(shape: &[u64], dtype: WireDType) -> Option<u64> {
    shape.iter().try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
}

impl WireTensor {
    /// Encodes `values` (row-major, `shape`) with `dtype`.
    pub(crate) fn encode(name: impl Into<String>, shape: &[u64], values: &[f32], dtype: WireDType) -> Self {
        let mut data = Vec::with_capacity(values.len() * dtype.size() as usize);
        match dtype {
            WireDType::F32 => values.iter().for_each(|v| data.extend_from_slice(&v.to_le_bytes())),
            WireDType::Bf16 => values.iter().for_each(|v| data.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
            WireDType::F16 => values.iter().for_each(|v| data.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
            // Masked words come from `WireTensor::masked`; floats saturate to words here.
            WireDType::U32 => values.iter().for_each(|v| data.extend_from_slice(&(*v as u32).to_le_bytes())),
        }
        Self { name: name.into(), dtype, shape: shape.to_vec(), data }
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

    /// Checks that the bytes match the shape and dtype.
    pub fn validate(&self, limits: &Limits) -> Result<()> {
        if self.name.len() > limits.max_name_len {
            return Err(WireError::InvalidField {
                field: "tensor name",
                reason: format!("{} bytes exceed the limit of {}", self.name.len(), limits.max_name_len),
            });
        }
        let expected = byte_len(&self.shape, self.dtype).unwrap_or(u64::MAX);
        if expected != self.data.len() as u64 {
            return Err(WireError::TensorSizeMismatch {
                name: self.name.clone(),
                shape: self.shape.clone(),
                dtype: self.dtype.to_string(),
                expected,
                found: self.data.len() as u64,
            });
        }
        Ok(())
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.data.len() / self.dtype.size() as usize
    }

    /// Whether the tensor holds no values.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The values as f32.
    pub fn values(&self) -> Vec<f32> {
        match self.dtype {
            WireDType::F32 => self.data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            WireDType::Bf16 => self.data.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            WireDType::F16 => self.data.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            WireDType::U32 => self.words().into_iter().map(|w| w as f32).collect(),
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
        let data = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        Self { name: MASKED_TENSOR.into(), dtype: WireDType::U32, shape: vec![words.len() as u64], data }
    }

    /// The index of the first NaN or infinite value, if any (words have none).
    pub fn first_non_finite(&self) -> Option<usize> {
        if self.dtype == WireDType::U32 {
            return None;
        }
        self.values().iter().position(|v| !v.is_finite())
    }
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
        serde_cbor::to_vec(self).unwrap_or_default()
    }

    /// Decodes and validates a payload. With `require_finite`, a NaN or infinity anywhere
    /// is refused (updates must be finite; the aggregator never averages them in).
    pub fn from_bytes(bytes: &[u8], limits: &Limits, require_finite: bool) -> Result<Self> {
        if bytes.len() as u64 > limits.max_transfer_bytes {
            return Err(WireError::TransferTooLarge { size: bytes.len() as u64, max: limits.max_transfer_bytes });
        }
        let payload: Self = serde_cbor::from_slice(bytes).map_err(|e| WireError::Malformed(e.to_string()))?;
        if payload.tensors.len() > limits.max_tensors {
            return Err(WireError::TooManyTensors { count: payload.tensors.len(), max: limits.max_tensors });
        }
        for t in &payload.tensors {
            t.validate(limits)?;
            if require_finite {
                if let Some(index) = t.first_non_finite() {
                    return Err(WireError::NonFinite { name: t.name.clone(), index });
                }
            }
        }
        Ok(payload)
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
    fn shape_that_disagrees_with_bytes_is_refused_naming_the_tensor() {
        let mut t = WireTensor::encode("h.0.attn.c_attn.weight", &[2, 3], &[0.0; 6], WireDType::F32);
        t.shape = vec![3, 3];
        let err = t.validate(&Limits::default()).unwrap_err().to_string();
        assert!(err.contains("h.0.attn.c_attn.weight") && err.contains("36") && err.contains("24"), "{err}");
    }

    #[test]
    fn overflowing_shape_is_refused_without_allocating() {
        let t = WireTensor { name: "x".into(), dtype: WireDType::F32, shape: vec![u64::MAX, 4], data: vec![] };
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
}
