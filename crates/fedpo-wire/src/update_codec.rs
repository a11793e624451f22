//! Update codecs: how a device's shared delta is compressed for the uplink.
//!
//! Edge links are thin and an f32 DistilGPT-2 delta is 330 MB, so the aggregator names a
//! codec in every round plan and devices encode their delta with it:
//!
//! - `f32`: exact;
//! - `bf16`, `f16`: half the bytes, a relative error of 2⁻⁸ and 2⁻¹¹;
//! - `int8`: blocks of [`crate::INT8_BLOCK`] values, each an f32 absmax scale and one signed
//!   byte per value (0.27× the bytes, an error of at most absmax/254 in its block);
//! - `topk:F`: only the largest fraction F of each tensor's entries by magnitude, as
//!   (index, value) pairs. What it leaves out is not dropped: the device keeps it as a
//!   [`Residual`] and adds it to its next update (error feedback), so every coordinate
//!   reaches the global model eventually.
//!
//! Decoding is [`crate::WireTensor::values`], whatever the codec; the aggregator needs no
//! per-codec code.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::wire_tensor::{TensorPayload, ToWire, WireDType, WireTensor};

/// How devices encode their update; chosen by the aggregator, carried in the round plan.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UpdateCodec {
    /// Exact f32.
    #[default]
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    F16,
    /// Per-block absmax int8.
    Int8,
    /// The largest fraction (0 < F ≤ 1) of each tensor's entries, with error feedback.
    TopK(f32),
}

impl UpdateCodec {
    /// The dtype its tensors carry on the wire.
    pub fn dtype(self) -> WireDType {
        match self {
            Self::F32 => WireDType::F32,
            Self::Bf16 => WireDType::Bf16,
            Self::F16 => WireDType::F16,
            Self::Int8 => WireDType::Int8,
            Self::TopK(_) => WireDType::Sparse,
        }
    }

    /// Whether a device must keep what the codec left out and send it later: top-k drops
    /// most of every update, which without feedback would never be sent at all.
    pub fn uses_error_feedback(self) -> bool {
        matches!(self, Self::TopK(_))
    }

    /// Encodes one tensor.
    pub fn encode(self, name: &str, shape: &[u64], values: &[f32]) -> WireTensor {
        match self {
            Self::TopK(fraction) => WireTensor::sparse(name, shape, &top_k(values, fraction)),
            _ => WireTensor::encode(name, shape, values, self.dtype()),
        }
    }
}

impl fmt::Display for UpdateCodec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TopK(fraction) => write!(f, "topk:{fraction}"),
            other => write!(f, "{}", other.dtype()),
        }
    }
}

impl FromStr for UpdateCodec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            "f16" => Ok(Self::F16),
            "int8" => Ok(Self::Int8),
            _ => {
                let Some(fraction) = s.strip_prefix("topk:") else {
                    return Err(format!("unknown update codec `{s}` (expected f32, bf16, f16, int8 or topk:F)"));
                };
                match fraction.parse::<f32>() {
                    Ok(f) if f > 0.0 && f <= 1.0 => Ok(Self::TopK(f)),
                    _ => Err(format!("top-k fraction `{fraction}` must be a number in (0, 1], e.g. topk:0.01")),
                }
            }
        }
    }
}

/// The `ceil(fraction · n)` entries of largest magnitude (at least one), in index order.
fn top_k(values: &[f32], fraction: f32) -> Vec<(u32, f32)> {
    let n = values.len();
    // The fraction arrives as an f32 (0.05 is 0.0500000007): shave that off before the
    // ceiling so 5 % of 200 is 10 entries, not 11.
    let k = ((f64::from(fraction) * n as f64 * (1.0 - 1e-7)).ceil() as usize).clamp(1.min(n), n);
    let mut order: Vec<u32> = (0..n as u32).collect();
    if k < n {
        order.select_nth_unstable_by(k, |&a, &b| values[b as usize].abs().total_cmp(&values[a as usize].abs()));
        order.truncate(k);
        order.sort_unstable();
    }
    order.into_iter().map(|i| (i, values[i as usize])).collect()
}

impl TensorPayload {
    /// Encodes tensors that may leave the device with an update codec, without error
    /// feedback (see [`Residual`] for the codecs that need it).
    pub fn compress<'a, T: ToWire + 'a>(tensors: impl IntoIterator<Item = &'a T>, codec: UpdateCodec) -> Self {
        let encode = |t: &T| codec.encode(t.wire_name(), &t.wire_shape(), t.wire_values());
        Self { tensors: tensors.into_iter().map(encode).collect() }
    }
}

/// What a lossy codec has not yet sent, per tensor: error feedback's memory.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Residual {
    /// Tensor name → values not yet sent (the tensor's flat length).
    pub tensors: BTreeMap<String, Vec<f32>>,
}

impl Residual {
    /// Encodes `tensors + residual` with `codec` and keeps, as the new residual, what the
    /// encoding lost. A residual entry whose length does not match its tensor (another
    /// model) is dropped rather than added.
    pub fn compress<'a, T: ToWire + 'a>(
        &mut self,
        tensors: impl IntoIterator<Item = &'a T>,
        codec: UpdateCodec,
    ) -> TensorPayload {
        let mut previous = std::mem::take(&mut self.tensors);
        let encoded = tensors
            .into_iter()
            .map(|t| {
                let mut owed = t.wire_values().to_vec();
                if let Some(r) = previous.remove(t.wire_name()).filter(|r| r.len() == owed.len()) {
                    owed.iter_mut().zip(r).for_each(|(o, r)| *o += r);
                }
                let wire = codec.encode(t.wire_name(), &t.wire_shape(), &owed);
                owed.iter_mut().zip(wire.values()).for_each(|(o, sent)| *o -= sent);
                self.tensors.insert(t.wire_name().to_string(), owed);
                wire
            })
            .collect();
        TensorPayload { tensors: encoded }
    }

    /// L2 norm of everything still owed.
    pub fn norm(&self) -> f64 {
        self.tensors.values().flatten().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packed::{sparse_entries, INT8_BLOCK, SPARSE_ENTRY};

    struct T(&'static str, Vec<f32>);
    impl ToWire for T {
        fn wire_name(&self) -> &str {
            self.0
        }
        fn wire_shape(&self) -> Vec<u64> {
            vec![self.1.len() as u64]
        }
        fn wire_values(&self) -> &[f32] {
            &self.1
        }
    }

    fn wave(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i as f32) * 0.37).sin() * (1.0 + (i % 7) as f32)).collect()
    }

    #[test]
    fn codec_names_parse_and_print_back() {
        for name in ["f32", "bf16", "f16", "int8", "topk:0.01", "topk:1"] {
            assert_eq!(name.parse::<UpdateCodec>().unwrap().to_string(), name);
        }
        for bad in ["int4", "topk:0", "topk:1.5", "topk:x", "topk:"] {
            let err = bad.parse::<UpdateCodec>().unwrap_err();
            assert!(err.contains(bad.trim_start_matches("topk:")), "{err}");
        }
    }

    #[test]
    fn int8_blocks_stay_within_half_a_step_of_their_own_absmax() {
        let mut values = wave(1000);
        values[70] = 400.0; // one outlier coarsens only its own block
        let t = UpdateCodec::Int8.encode("w", &[1000], &values);
        assert_eq!(t.data().len(), 1000 + 4 * 16);
        let decoded = t.values();
        for (b, (got, want)) in decoded.chunks(INT8_BLOCK).zip(values.chunks(INT8_BLOCK)).enumerate() {
            let absmax = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (g, w) in got.iter().zip(want) {
                assert!((g - w).abs() <= absmax / 254.0 * 1.0001, "block {b}: {g} vs {w}");
            }
        }
        assert!((decoded[3] - values[3]).abs() < 0.05, "a block without the outlier keeps its precision");
    }

    #[test]
    fn int8_of_a_non_finite_block_decodes_to_nan_and_zeros_to_zeros() {
        let t = UpdateCodec::Int8.encode("w", &[3], &[1.0, f32::INFINITY, 0.0]);
        assert!(t.values().iter().all(|v| v.is_nan()));
        assert_eq!(UpdateCodec::Int8.encode("w", &[2], &[0.0, 0.0]).values(), vec![0.0, 0.0]);
    }

    #[test]
    fn top_k_keeps_exactly_the_largest_magnitudes_in_index_order() {
        let values = vec![0.1, -5.0, 0.3, 4.0, -0.2, 0.0, 3.0, -0.05];
        let t = UpdateCodec::TopK(0.3).encode("w", &[8], &values);
        assert_eq!(sparse_entries(t.data()).collect::<Vec<_>>(), vec![(1, -5.0), (3, 4.0), (6, 3.0)]);
        assert_eq!(t.values(), vec![0.0, -5.0, 0.0, 4.0, 0.0, 0.0, 3.0, 0.0]);
        assert_eq!(UpdateCodec::TopK(1.0).encode("w", &[8], &values).values(), values);
        assert_eq!(UpdateCodec::TopK(1e-9).encode("w", &[8], &values).data().len(), SPARSE_ENTRY);
    }

    #[test]
    fn error_feedback_sends_every_coordinate_eventually_and_loses_nothing() {
        // Magnitudes from 0.5 to 1.5 with both signs; 5 % a round means each coordinate
        // must wait about 20 rounds for its turn.
        let delta = T(
            "w",
            (0..200).map(|i| (1.0 + 0.5 * (i as f32 * 0.7).sin()) * if i % 3 == 0 { -1.0 } else { 1.0 }).collect(),
        );
        let mut residual = Residual::default();
        let mut sent = vec![0f64; 200];
        let rounds = 100;
        for _ in 0..rounds {
            let payload = residual.compress([&delta], UpdateCodec::TopK(0.05));
            assert_eq!(payload.tensors[0].data().len(), 10 * SPARSE_ENTRY);
            sent.iter_mut().zip(payload.tensors[0].values()).for_each(|(s, v)| *s += f64::from(v));
        }
        // Sent plus still owed is exactly what was produced: nothing is lost.
        for (i, (s, r)) in sent.iter().zip(&residual.tensors["w"]).enumerate() {
            let produced = rounds as f64 * f64::from(delta.1[i]);
            assert!((s + f64::from(*r) - produced).abs() < 1e-2, "coordinate {i}");
        }
        assert!(sent.iter().all(|&s| s != 0.0), "every coordinate was sent");
        // What is owed stays near n/k rounds' worth instead of growing with the rounds.
        let per_round: f64 = delta.1.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
        assert!(residual.norm() < 40.0 * per_round, "{} vs {per_round}", residual.norm());
    }

    #[test]
    fn a_residual_from_another_shape_is_dropped_not_added() {
        let mut residual = Residual { tensors: [("w".to_string(), vec![9.0; 5])].into() };
        let payload = residual.compress([&T("w", vec![1.0, 2.0])], UpdateCodec::F32);
        assert_eq!(payload.tensors[0].values(), vec![1.0, 2.0]);
        assert_eq!(residual.tensors["w"], vec![0.0, 0.0]);
    }
}
