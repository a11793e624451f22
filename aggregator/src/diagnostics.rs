//! The round's gradient diagnostics, from what devices upload.
//!
//! With `--diagnostics`, every device also uploads its full-data gradient at the
//! received model, `g_i = ∇F_i(θ_t)`, before its local steps. From those:
//!
//! - the global gradient norm `‖ḡ‖`, `ḡ = mean_i g_i`;
//! - the gradient diversity `κ² = mean_i ‖g_i − ḡ‖² = mean_i ‖g_i‖² − ‖ḡ‖²`.
//!
//! and from the updates themselves, per layer, the mean pairwise cosine between device
//! updates: with unit vectors `u_i = Δ_i/‖Δ_i‖`, `Σ_{i≠j} u_i·u_j = ‖Σ u_i‖² − n`.
//! Everything streams: the aggregator keeps sums (f64), never the devices' vectors.

use std::collections::{BTreeMap, HashMap};

use fedpo_train::algorithms::layer_of;
use fedpo_wire::{keys, TensorPayload};

use crate::global_model::GlobalModel;

/// Sums over one round's gradients and updates.
pub(crate) struct Diagnostics {
    gradient_sum: HashMap<String, Vec<f64>>,
    squared_norms: f64,
    gradients: usize,
    unit_sums: HashMap<String, Vec<f64>>,
    /// Updates with a non-zero component, per layer.
    unit_counts: BTreeMap<String, usize>,
}

/// What the diagnostics measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct DiagnosticsReport {
    /// `‖mean_i g_i‖`, if any gradient arrived.
    pub(crate) grad_norm: Option<f64>,
    /// `mean_i ‖g_i − ḡ‖²`, if two gradients or more arrived.
    pub(crate) kappa2: Option<f64>,
    /// Mean pairwise cosine of device updates, per layer with two updates or more.
    pub(crate) layer_cos: BTreeMap<String, f64>,
}

/// The update section that carries a device's gradient at the received model.
pub(crate) const SECTION: &str = keys::DIAGNOSTIC_GRADIENT;

impl Diagnostics {
    /// Whether `transfer` carries an update's diagnostic gradient, whose bytes are
    /// counted apart.
    pub(crate) fn carries(transfer: &str) -> bool {
        transfer.strip_suffix(SECTION).is_some_and(|rest| rest.ends_with('/'))
    }

    /// Takes in section `name` of an accepted update; returns whether it was the
    /// diagnostic gradient.
    pub(crate) fn take_section(&mut self, name: &str, payload: &TensorPayload) -> bool {
        if name != SECTION {
            return false;
        }
        self.add_gradient(payload);
        true
    }

    pub(crate) fn new(model: &GlobalModel) -> Self {
        let zeros = || model.shared().map(|t| (t.name.clone(), vec![0.0; t.values.len()])).collect();
        Self {
            gradient_sum: zeros(),
            squared_norms: 0.0,
            gradients: 0,
            unit_sums: zeros(),
            unit_counts: BTreeMap::new(),
        }
    }

    /// Adds a device's gradient (checked against the shared set beforehand).
    pub(crate) fn add_gradient(&mut self, gradient: &TensorPayload) {
        // The device's own ‖g_i‖² first, then one addition: the total does not depend on
        // the order devices report in beyond the rounding of that one sum.
        let mut squared_norm = 0.0;
        for t in &gradient.tensors {
            if let Some(sum) = self.gradient_sum.get_mut(t.name()) {
                for (s, v) in sum.iter_mut().zip(t.values()) {
                    let v = f64::from(v);
                    *s += v;
                    squared_norm += v * v;
                }
            }
        }
        self.squared_norms += squared_norm;
        self.gradients += 1;
    }

    /// Adds a device's update, one unit vector per layer.
    pub(crate) fn add_update(&mut self, update: &TensorPayload) {
        let tensors: Vec<(&str, String, Vec<f32>)> =
            update.tensors.iter().map(|t| (t.name(), layer_of(t.name()), t.values())).collect();
        let mut layer_sq: BTreeMap<&str, f64> = BTreeMap::new();
        for (_, layer, values) in &tensors {
            *layer_sq.entry(layer).or_default() += values.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>();
        }
        for (name, layer, values) in &tensors {
            let norm = layer_sq[layer.as_str()].sqrt();
            if norm == 0.0 {
                continue;
            }
            if let Some(sum) = self.unit_sums.get_mut(*name) {
                for (s, v) in sum.iter_mut().zip(values) {
                    *s += f64::from(*v) / norm;
                }
            }
        }
        for (layer, sq) in layer_sq {
            if sq > 0.0 {
                *self.unit_counts.entry(layer.to_string()).or_default() += 1;
            }
        }
    }

    pub(crate) fn report(&self) -> DiagnosticsReport {
        let mut report = DiagnosticsReport::default();
        if self.gradients > 0 {
            let n = self.gradients as f64;
            let mean_sq: f64 = self.gradient_sum.values().flatten().map(|s| (s / n) * (s / n)).sum();
            report.grad_norm = Some(mean_sq.sqrt());
            // One participant has no diversity to measure (only rounding would show).
            if self.gradients >= 2 {
                report.kappa2 = Some((self.squared_norms / n - mean_sq).max(0.0));
            }
        }
        let mut layer_sq: BTreeMap<String, f64> = BTreeMap::new();
        for (name, sum) in &self.unit_sums {
            *layer_sq.entry(layer_of(name)).or_default() += sum.iter().map(|s| s * s).sum::<f64>();
        }
        for (layer, count) in &self.unit_counts {
            if *count >= 2 {
                let n = *count as f64;
                let sq = layer_sq.get(layer).copied().unwrap_or_default();
                report.layer_cos.insert(layer.clone(), (sq - n) / (n * (n - 1.0)));
            }
        }
        report
    }
}

#[cfg(test)]
mod tests {
    use fedpo_model::{Gpt2Config, Partition, PartitionPreset, PolicySpec};
    use fedpo_wire::WireDType;

    use super::*;
    use crate::global_model::GlobalTensor;

    fn tensor(name: &str, values: Vec<f32>) -> GlobalTensor {
        GlobalTensor { name: name.into(), shape: vec![values.len()], values, shared: true }
    }

    fn model() -> GlobalModel {
        let spec =
            PolicySpec { config: Gpt2Config::tiny(), lora: None, partition: Partition::new(PartitionPreset::Feddpo) };
        GlobalModel::new(spec, vec![tensor("h.0.attn.c_attn.weight", vec![0.0; 2]), tensor("wte.weight", vec![0.0])])
    }

    fn payload(attn: [f32; 2], wte: f32) -> TensorPayload {
        TensorPayload::encode(
            &[tensor("h.0.attn.c_attn.weight", attn.to_vec()), tensor("wte.weight", vec![wte])],
            WireDType::F32,
        )
    }

    #[test]
    fn kappa2_and_grad_norm_match_the_definition() {
        let mut d = Diagnostics::new(&model());
        let grads = [([1.0f32, 2.0], 3.0f32), ([3.0, 0.0], -1.0), ([2.0, 1.0], 1.0)];
        for (a, w) in grads {
            d.add_gradient(&payload(a, w));
        }
        // mean = [2, 1, 1]; deviations [-1,1,2], [1,-1,-2], [0,0,0] → κ² = (6 + 6 + 0) / 3.
        let r = d.report();
        assert!((r.grad_norm.unwrap() - 6f64.sqrt()).abs() < 1e-12);
        assert!((r.kappa2.unwrap() - 4.0).abs() < 1e-12);
    }

    #[test]
    fn identical_gradients_have_zero_diversity_and_aligned_updates_cosine_one() {
        let mut d = Diagnostics::new(&model());
        for _ in 0..4 {
            d.add_gradient(&payload([0.1, -0.7], 0.3));
            d.add_update(&payload([0.5, 0.5], 2.0));
        }
        let r = d.report();
        assert!(r.kappa2.unwrap().abs() < 1e-12, "{r:?}");
        assert!((r.layer_cos["h.0.attn"] - 1.0).abs() < 1e-12 && (r.layer_cos["wte"] - 1.0).abs() < 1e-12);
    }

    #[test]
    fn opposed_updates_have_cosine_minus_one_per_layer() {
        let mut d = Diagnostics::new(&model());
        d.add_update(&payload([1.0, 0.0], 1.0));
        d.add_update(&payload([-2.0, 0.0], 5.0));
        let r = d.report();
        assert!((r.layer_cos["h.0.attn"] + 1.0).abs() < 1e-12, "{r:?}");
        assert!((r.layer_cos["wte"] - 1.0).abs() < 1e-12, "{r:?}");
        assert_eq!(r.kappa2, None);
    }
}
