//! The streaming weighted sum of device updates.
//!
//! Each update is folded in as soon as it is complete and verified, then dropped, so the
//! aggregator holds one running sum the size of the shared set (in f64, so that the order
//! updates arrive in does not change the result beyond f32 rounding), whatever the number
//! of devices.

use std::collections::HashMap;

use anyhow::{bail, Result};
use fedpo_wire::{TensorPayload, WireDType};

use crate::global_model::GlobalModel;

/// Σ_i w_i · Δ_i over the accepted updates of a round, and Σ_i w_i.
#[derive(Debug)]
pub(crate) struct WeightedSum {
    sums: HashMap<String, Vec<f64>>,
    weight: f64,
    count: usize,
}

impl WeightedSum {
    /// An empty sum shaped like the model's shared set.
    pub(crate) fn new(model: &GlobalModel) -> Self {
        let sums = model.shared().map(|t| (t.name.clone(), vec![0.0; t.values.len()])).collect();
        Self { sums, weight: 0.0, count: 0 }
    }

    /// An empty sum shaped like the model's shared set, in `spent`'s buffers when they fit:
    /// the sum is twice the size of the shared set (f64), and zeroing memory the last round
    /// used costs a fraction of faulting in fresh pages every round.
    pub(crate) fn reusing(spent: Option<Self>, model: &GlobalModel) -> Self {
        let fits = |s: &Self| {
            s.sums.len() == model.shared().count()
                && model.shared().all(|t| s.sums.get(&t.name).is_some_and(|v| v.len() == t.values.len()))
        };
        match spent.filter(fits) {
            Some(mut s) => {
                s.sums.values_mut().for_each(|v| v.fill(0.0));
                s.weight = 0.0;
                s.count = 0;
                s
            }
            None => Self::new(model),
        }
    }

    /// Checks an update against the shared set: exactly its tensors, with its shapes.
    /// An empty payload (an evaluation-only round) passes.
    pub(crate) fn check(model: &GlobalModel, update: &TensorPayload) -> Result<()> {
        if update.tensors.is_empty() {
            return Ok(());
        }
        let expected = model.shared().count();
        if update.tensors.len() != expected {
            bail!("update holds {} tensors, the shared set has {expected}", update.tensors.len());
        }
        for t in &update.tensors {
            let Some(g) = model.get(t.name()).filter(|g| g.shared) else {
                bail!("update holds `{}`, which is not a shared tensor of this job", t.name());
            };
            if t.dtype() == WireDType::U32 {
                bail!("update tensor `{}` holds u32 words, not values (secure aggregation is off)", t.name());
            }
            let shape: Vec<u64> = g.shape.iter().map(|&d| d as u64).collect();
            if t.shape() != shape.as_slice() {
                bail!("update tensor `{}` has shape {:?}, the global model {:?}", t.name(), t.shape(), shape);
            }
        }
        Ok(())
    }

    /// Adds `weight · update` (call [`WeightedSum::check`] first).
    pub(crate) fn add(&mut self, update: &TensorPayload, weight: f64) {
        self.add_scaled(update, weight, 1.0);
    }

    /// Adds `weight · scale · update`, counting `weight` toward the mean's denominator (a
    /// clipped update keeps its weight).
    pub(crate) fn add_scaled(&mut self, update: &TensorPayload, weight: f64, scale: f64) {
        if update.tensors.is_empty() {
            return;
        }
        let factor = weight * scale;
        for t in &update.tensors {
            let Some(sum) = self.sums.get_mut(t.name()) else { continue };
            if t.dtype() == WireDType::F32 {
                // Straight from the bytes, value by value independent: this loop vectorises.
                for (s, b) in sum.iter_mut().zip(t.data().chunks_exact(4)) {
                    *s += factor * f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                }
            } else {
                let mut sums = sum.iter_mut();
                t.for_each_value(|v| {
                    if let Some(s) = sums.next() {
                        *s += factor * f64::from(v);
                    }
                });
            }
        }
        self.weight += weight;
        self.count += 1;
    }

    /// Adds `draw()` to every coordinate of the sum (DP noise, before the division).
    pub(crate) fn perturb(&mut self, mut draw: impl FnMut() -> f64) {
        if self.count == 0 {
            return; // nothing is released without an update
        }
        self.sums.values_mut().flatten().for_each(|s| *s += draw());
    }

    /// Updates folded in so far (empty ones excluded).
    pub(crate) fn count(&self) -> usize {
        self.count
    }

    /// ‖Σ w_i Δ_i / Σ w_i‖ over every tensor (0 with no update).
    pub(crate) fn mean_norm(&self) -> f64 {
        if self.weight <= 0.0 {
            return 0.0;
        }
        self.sums.values().map(|s| sum_of_squares(s)).sum::<f64>().sqrt() / self.weight
    }

    /// One tensor's sum and the total weight, if any update was added.
    pub(crate) fn sum_of(&self, name: &str) -> Option<(&[f64], f64)> {
        if self.weight <= 0.0 {
            return None;
        }
        self.sums.get(name).map(|s| (s.as_slice(), self.weight))
    }

    /// The weighted mean of one tensor's updates, if any update was added.
    pub(crate) fn mean(&self, name: &str) -> Option<impl Iterator<Item = f64> + '_> {
        if self.weight <= 0.0 {
            return None;
        }
        let w = self.weight;
        self.sums.get(name).map(move |s| s.iter().map(move |v| v / w))
    }
}

/// Σ x² in eight independent partial sums. One chained sum waits on every add: over
/// DistilGPT-2's 82 M values that alone took about a tenth of a second each round.
pub(crate) fn sum_of_squares(values: &[f64]) -> f64 {
    let mut lanes = [0.0f64; 8];
    let mut chunks = values.chunks_exact(8);
    for c in &mut chunks {
        for (lane, x) in lanes.iter_mut().zip(c) {
            *lane += x * x;
        }
    }
    lanes.iter().sum::<f64>() + chunks.remainder().iter().map(|x| x * x).sum::<f64>()
}

/// `values += scale · sums` (rounded to f32), returning Σ (scale · sum)², the squared norm
/// of the step, in independent partial sums like [`sum_of_squares`].
pub(crate) fn apply_scaled(values: &mut [f32], sums: &[f64], scale: f64) -> f64 {
    let mut lanes = [0.0f64; 8];
    let step = |v: &mut f32, s: f64| {
        let d = scale * s;
        *v = (f64::from(*v) + d) as f32;
        d * d
    };
    let mut values_8 = values.chunks_exact_mut(8);
    let mut sums_8 = sums.chunks_exact(8);
    for (vs, ss) in (&mut values_8).zip(&mut sums_8) {
        for ((lane, v), s) in lanes.iter_mut().zip(vs).zip(ss) {
            *lane += step(v, *s);
        }
    }
    let rest: f64 = values_8.into_remainder().iter_mut().zip(sums_8.remainder()).map(|(v, s)| step(v, *s)).sum();
    lanes.iter().sum::<f64>() + rest
}

#[cfg(test)]
mod tests {
    use fedpo_model::{Gpt2Config, Partition, PartitionPreset, PolicySpec};
    use fedpo_wire::WireTensor;

    use super::*;
    use crate::algorithms::fedavg::FedAvg;
    use crate::algorithms::strategy::Strategy;
    use crate::global_model::GlobalTensor;

    fn tensor(name: &str, values: Vec<f32>, shared: bool) -> GlobalTensor {
        GlobalTensor { name: name.into(), shape: vec![values.len()], values, shared }
    }

    fn model() -> GlobalModel {
        let spec =
            PolicySpec { config: Gpt2Config::tiny(), lora: None, partition: Partition::new(PartitionPreset::Feddpo) };
        GlobalModel::new(spec, vec![tensor("a", vec![1.0, 2.0], true), tensor("wte.weight", vec![5.0], false)])
    }

    fn update(a: [f32; 2]) -> TensorPayload {
        TensorPayload::encode(&[tensor("a", a.to_vec(), true)], WireDType::F32)
    }

    #[test]
    fn fedavg_applies_the_server_lr_times_the_pair_weighted_mean_and_leaves_frozen_tensors() {
        let mut global = model();
        let mut sum = WeightedSum::new(&global);
        for (delta, pairs) in [([1.0, -1.0], 10.0), ([4.0, 2.0], 30.0)] {
            let u = update(delta);
            WeightedSum::check(&global, &u).unwrap();
            sum.add(&u, pairs);
        }
        // mean delta = (10·[1,-1] + 30·[4,2]) / 40 = [3.25, 1.25]; half of it is applied.
        assert!((sum.mean_norm() - (3.25f64.powi(2) + 1.25f64.powi(2)).sqrt()).abs() < 1e-12);
        let norm = FedAvg::new(0.5).aggregate(1, &mut global, &sum.into()).unwrap();
        assert_eq!(global.get("a").unwrap().values, vec![1.0 + 1.625, 2.0 + 0.625]);
        assert_eq!(global.get("wte.weight").unwrap().values, vec![5.0]);
        assert!((norm - (1.625f64.powi(2) + 0.625f64.powi(2)).sqrt()).abs() < 1e-12);
    }

    #[test]
    fn updates_with_unknown_frozen_or_misshaped_tensors_are_refused_by_name() {
        let global = model();
        let frozen = TensorPayload::encode(&[tensor("wte.weight", vec![0.0], false)], WireDType::F32);
        let err = WeightedSum::check(&global, &frozen).unwrap_err().to_string();
        assert!(err.contains("wte.weight") && err.contains("not a shared tensor"), "{err}");
        let short = TensorPayload::encode(&[tensor("a", vec![0.0], true)], WireDType::F32);
        let err = WeightedSum::check(&global, &short).unwrap_err().to_string();
        assert!(err.contains("`a`") && err.contains("[1]") && err.contains("[2]"), "{err}");
        assert!(WeightedSum::check(&global, &TensorPayload::default()).is_ok(), "evaluation rounds send nothing");
        // Words under a shared tensor's name and shape, as a hostile device could send.
        let words: WireTensor =
            serde_json::from_str(r#"{"name":"a","dtype":"u32","shape":[2],"data":[1,0,0,0,2,0,0,0]}"#).unwrap();
        let err = WeightedSum::check(&global, &TensorPayload { tensors: vec![words] }).unwrap_err().to_string();
        assert!(err.contains("u32 words"), "{err}");
    }

    #[test]
    fn a_reused_sum_starts_empty_and_adds_like_a_new_one() {
        let global = model();
        let mut spent = WeightedSum::new(&global);
        spent.add(&update([3.0, 4.0]), 5.0);
        let mut reused = WeightedSum::reusing(Some(spent), &global);
        assert_eq!((reused.count(), reused.weight), (0, 0.0));
        reused.add(&update([1.0, -2.0]), 2.0);
        let mut fresh = WeightedSum::new(&global);
        fresh.add(&update([1.0, -2.0]), 2.0);
        assert_eq!(reused.sums, fresh.sums);
        let spec = global.spec.clone();
        let wider = GlobalModel::new(spec, vec![tensor("a", vec![0.0; 3], true)]);
        assert_eq!(WeightedSum::reusing(Some(reused), &wider).sums["a"], vec![0.0; 3], "a misfit is replaced");
    }

    #[test]
    fn lane_sums_match_a_plain_sum_at_every_length() {
        for n in [0, 1, 7, 8, 9, 100, 1001] {
            let sums: Vec<f64> = (0..n).map(|i| (i as f64 * 0.37).sin() * 3.0).collect();
            let plain: f64 = sums.iter().map(|x| x * x).sum();
            assert!((sum_of_squares(&sums) - plain).abs() <= 1e-12 * plain.max(1.0), "n = {n}");
            let mut values: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let expected: Vec<f32> = values.iter().zip(&sums).map(|(v, s)| (f64::from(*v) + 0.5 * s) as f32).collect();
            let sq = apply_scaled(&mut values, &sums, 0.5);
            assert_eq!(values, expected, "n = {n}: every value moves, the tail included");
            assert!((sq - 0.25 * plain).abs() <= 1e-12 * plain.max(1.0), "n = {n}");
        }
    }

    #[test]
    fn no_update_leaves_the_model_unchanged() {
        let mut global = model();
        let sum = WeightedSum::new(&global);
        assert_eq!(FedAvg::new(1.0).aggregate(1, &mut global, &sum.into()).unwrap(), 0.0);
        assert_eq!(global.get("a").unwrap().values, vec![1.0, 2.0]);
    }
}
