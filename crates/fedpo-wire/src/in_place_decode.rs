//! Decoding a payload in place: its tensors are slices of the buffer it arrived in.
//!
//! A received DistilGPT-2 model or update is 328 MB of verified bytes, and decoding it
//! into owned tensors copied every one of them into fresh allocations, paid by each device for the model and by the aggregator for
//! every update, on the round's critical path, with a second model-sized buffer alive
//! while it ran. [`TensorPayload::from_shared`] parses the CBOR with its byte strings
//! borrowed and keeps each tensor's data as a reference-counted slice of the buffer, so
//! decoding costs the parse and the checks only.

use bytes::Bytes;
use serde::Deserialize;

use crate::error::{Result, WireError};
use crate::limits::Limits;
use crate::wire_tensor::{TensorPayload, WireDType, WireTensor};

/// [`TensorPayload`]'s fields with the tensor bytes borrowed from the input.
#[derive(Deserialize)]
struct PayloadView<'a> {
    #[serde(borrow)]
    tensors: Vec<TensorView<'a>>,
}

/// [`WireTensor`]'s fields, names and order alike, with `data` borrowed.
#[derive(Deserialize)]
struct TensorView<'a> {
    name: String,
    dtype: WireDType,
    shape: Vec<u64>,
    #[serde(borrow)]
    data: &'a [u8],
}

impl TensorPayload {
    /// Decodes and validates a payload. With `require_finite`, a NaN or infinity anywhere
    /// is refused (updates must be finite; the aggregator never averages them in).
    ///
    /// The tensors share one copy of `bytes`; [`TensorPayload::from_shared`] avoids even
    /// that when the caller owns the buffer.
    pub fn from_bytes(bytes: &[u8], limits: &Limits, require_finite: bool) -> Result<Self> {
        Self::check_size(bytes.len(), limits)?;
        Self::from_shared(Bytes::copy_from_slice(bytes), limits, require_finite)
    }

    /// [`TensorPayload::from_bytes`] without copying: each tensor's data is a slice of
    /// `bytes`, which stays alive (once) for as long as any of them does.
    pub fn from_shared(bytes: Bytes, limits: &Limits, require_finite: bool) -> Result<Self> {
        Self::check_size(bytes.len(), limits)?;
        let tensors = match serde_cbor::from_slice::<PayloadView<'_>>(&bytes) {
            Ok(view) => {
                check_count(view.tensors.len(), limits)?;
                view.tensors
                    .into_iter()
                    .map(|t| WireTensor::from_parts(t.name, t.dtype, t.shape, bytes.slice_ref(t.data)))
                    .collect()
            }
            // Byte strings that cannot be borrowed (CBOR's indefinite-length form, which no
            // fedpo encoder writes) still decode, by copying; so does every error message.
            Err(_) => {
                let owned: Self = serde_cbor::from_slice(&bytes).map_err(|e| WireError::Malformed(e.to_string()))?;
                check_count(owned.tensors.len(), limits)?;
                owned.tensors
            }
        };
        for t in &tensors {
            t.validate(limits)?;
            if require_finite {
                if let Some(index) = t.first_non_finite() {
                    return Err(WireError::NonFinite { name: t.name().to_string(), index });
                }
            }
        }
        Ok(Self { tensors })
    }

    fn check_size(len: usize, limits: &Limits) -> Result<()> {
        if len as u64 > limits.max_transfer_bytes {
            return Err(WireError::TransferTooLarge { size: len as u64, max: limits.max_transfer_bytes });
        }
        Ok(())
    }
}

/// One tensor of an f32 payload in place: name, shape, and the byte range of its values.
pub(crate) type F32Range = (String, Vec<u64>, std::ops::Range<usize>);

/// Where each tensor of an all-f32 payload keeps its values in `bytes`: name, shape and
/// byte range, checked against `limits` and against each tensor's shape. What a downlink
/// delta is added onto in place ([`crate::apply_delta`]).
pub(crate) fn f32_ranges(bytes: &[u8], limits: &Limits) -> Result<Vec<F32Range>> {
    TensorPayload::check_size(bytes.len(), limits)?;
    let view: PayloadView<'_> = serde_cbor::from_slice(bytes).map_err(|e| WireError::Malformed(e.to_string()))?;
    check_count(view.tensors.len(), limits)?;
    let start = bytes.as_ptr() as usize;
    view.tensors
        .into_iter()
        .map(|t| {
            if t.dtype != WireDType::F32 {
                return Err(WireError::Malformed(format!("tensor `{}` is {}, not f32", t.name, t.dtype)));
            }
            if crate::wire_tensor::byte_bounds(&t.shape, WireDType::F32)
                != Some((t.data.len() as u64, t.data.len() as u64))
            {
                return Err(WireError::Malformed(format!(
                    "tensor `{}` holds {} bytes, which its shape {:?} does not account for",
                    t.name,
                    t.data.len(),
                    t.shape
                )));
            }
            let offset = t.data.as_ptr() as usize - start;
            Ok((t.name, t.shape, offset..offset + t.data.len()))
        })
        .collect()
}

fn check_count(count: usize, limits: &Limits) -> Result<()> {
    if count > limits.max_tensors {
        return Err(WireError::TooManyTensors { count, max: limits.max_tensors });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload() -> TensorPayload {
        TensorPayload {
            tensors: vec![
                WireTensor::encode("h.0.mlp.c_fc.weight", &[3, 4], &[0.5; 12], WireDType::F32),
                WireTensor::encode("ln_f.bias", &[4], &[1.0, -2.0, 3.0, 0.25], WireDType::Bf16),
                WireTensor::encode("empty", &[0], &[], WireDType::F32),
            ],
        }
    }

    #[test]
    fn a_received_payload_decodes_into_slices_of_its_own_buffer() {
        let bytes = Bytes::from(payload().to_bytes());
        let range = bytes.as_ptr_range();
        let decoded = TensorPayload::from_shared(bytes.clone(), &Limits::default(), true).unwrap();
        assert_eq!(decoded, payload());
        for t in decoded.tensors.iter().filter(|t| !t.data().is_empty()) {
            let data = t.data().as_ptr_range();
            assert!(range.start <= data.start && data.end <= range.end, "`{}` was copied out of the buffer", t.name());
        }
    }

    #[test]
    fn indefinite_length_byte_strings_decode_by_copying_with_the_same_values() {
        // The first tensor's data as an indefinite-length byte string: 0x5f, one chunk
        // per half, 0xff. A borrowed parse cannot take it; the owned one must.
        let p = TensorPayload { tensors: vec![WireTensor::encode("w", &[2], &[1.5, -3.0], WireDType::F32)] };
        let definite = p.to_bytes();
        let data = p.tensors[0].data();
        let at = definite.windows(data.len()).position(|w| w == data).expect("the data bytes");
        let mut indefinite = definite[..at - 1].to_vec(); // drop the 0x48 header
        indefinite.push(0x5f);
        indefinite.extend([0x44].iter().chain(&data[..4]).chain(&[0x44]).chain(&data[4..]));
        indefinite.push(0xff);
        indefinite.extend_from_slice(&definite[at + data.len()..]);
        assert_eq!(TensorPayload::from_shared(indefinite.into(), &Limits::default(), true).unwrap(), p);
    }

    #[test]
    fn shared_decoding_refuses_what_copying_decoding_refuses() {
        let limits = Limits { max_tensors: 2, ..Limits::default() };
        let bytes = payload().to_bytes();
        assert_eq!(
            TensorPayload::from_shared(bytes.clone().into(), &limits, true),
            Err(WireError::TooManyTensors { count: 3, max: 2 })
        );
        let small = Limits { max_transfer_bytes: 10, ..Limits::default() };
        assert!(matches!(TensorPayload::from_bytes(&bytes, &small, true), Err(WireError::TransferTooLarge { .. })));
        assert!(matches!(
            TensorPayload::from_shared(Bytes::from_static(b"\xa1\x67tensors\x01"), &Limits::default(), true),
            Err(WireError::Malformed(_))
        ));
        let nan = TensorPayload { tensors: vec![WireTensor::encode("b", &[2], &[1.0, f32::NAN], WireDType::F32)] };
        assert_eq!(
            TensorPayload::from_shared(nan.to_bytes().into(), &Limits::default(), true),
            Err(WireError::NonFinite { name: "b".into(), index: 1 })
        );
    }
}
