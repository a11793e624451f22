//! How a round's accepted updates become the one update the strategy applies: optional
//! clipping of each update, the combination rule, and optional Gaussian noise.
//!
//! The mean streams (one running sum, whatever the number of devices); the robust rules
//! hold every update of the round, since a median needs all values of a coordinate at
//! once. Clipping happens as each update arrives, so a single huge update never enters a
//! sum at full size.

use anyhow::{bail, Result};
use clap::Args;
use fedpo_wire::TensorPayload;

use crate::algorithms::dp::GaussianNoise;
use crate::algorithms::robust::AggregationRule;
use crate::combined_update::CombinedUpdate;
use crate::global_model::GlobalModel;
use crate::weighted_sum::WeightedSum;

/// Robust aggregation, clipping and client-level differential privacy.
#[derive(Debug, Args, Clone, Default)]
pub(crate) struct AggregationArgs {
    /// How updates are combined: mean (pair-weighted, FedAvg), median or trimmed-mean
    /// (coordinate-wise) or krum. The robust rules ignore pair counts and hold every update
    /// of a round in memory.
    #[arg(long, value_enum, default_value = "mean")]
    pub(crate) aggregation: AggregationRule,
    /// Byzantine devices to tolerate per round (f): trimmed-mean drops f values at each end,
    /// and the start-up check refuses a --per-round too small for the rule (krum n > 2f+2,
    /// median and trimmed-mean n > 2f).
    #[arg(long, value_name = "F", default_value_t = 0)]
    pub(crate) byzantine: usize,
    /// Scale every update down to this L2 norm if it is longer (applied before combining;
    /// the count of clipped updates goes into metrics.jsonl as `clipped`).
    #[arg(long, value_name = "C")]
    pub(crate) clip_norm: Option<f64>,
    /// Client-level DP: add Gaussian noise with std σ·C to the sum of the clipped updates
    /// (equal weights), then divide by the participants. Needs --clip-norm; an RDP
    /// accountant writes (ε, δ) to metrics.jsonl after every round.
    #[arg(long, value_name = "SIGMA")]
    pub(crate) dp_noise_multiplier: Option<f64>,
    /// The δ at which ε is reported.
    #[arg(long, default_value_t = 1e-5)]
    pub(crate) dp_delta: f64,
}

impl AggregationArgs {
    /// Start-up checks against `per_round` updates per round.
    pub(crate) fn validate(&self, per_round: usize) -> Result<()> {
        self.aggregation
            .check(per_round, self.byzantine)
            .map_err(|e| anyhow::anyhow!("--per-round {per_round}: {e}"))?;
        if let Some(c) = self.clip_norm {
            if !(c.is_finite() && c > 0.0) {
                bail!("--clip-norm must be a positive number, got {c}");
            }
        }
        if let Some(sigma) = self.dp_noise_multiplier {
            if !(sigma.is_finite() && sigma > 0.0) {
                bail!("--dp-noise-multiplier must be a positive number, got {sigma}");
            }
            if self.clip_norm.is_none() {
                bail!("--dp-noise-multiplier needs --clip-norm: the noise is calibrated to the clipped updates' norm");
            }
            if self.aggregation != AggregationRule::Mean {
                bail!(
                    "--dp-noise-multiplier calibrates noise to the sum of clipped updates; --aggregation {} has another sensitivity",
                    self.aggregation.name()
                );
            }
            if !(self.dp_delta > 0.0 && self.dp_delta < 1.0) {
                bail!("--dp-delta must be in (0, 1), got {}", self.dp_delta);
            }
        }
        Ok(())
    }

    pub(crate) fn private(&self) -> bool {
        self.dp_noise_multiplier.is_some()
    }
}

/// One round's accepted updates on their way to a single mean update.
pub(crate) struct RoundUpdates {
    rule: AggregationRule,
    byzantine: usize,
    clip_norm: Option<f64>,
    /// With DP, every update weighs 1 and noise joins the sum.
    noise_std: Option<f64>,
    /// The mean: a streaming sum.
    sum: WeightedSum,
    /// The robust rules: every update, flattened in the shared set's order.
    held: Vec<Vec<f32>>,
    held_weights: Vec<f64>,
    layout: Vec<String>,
    clipped: usize,
}

impl RoundUpdates {
    /// Collects a round's updates; a mean sums into the buffers of `spent` (the last
    /// round's sum) when they fit.
    pub(crate) fn new(model: &GlobalModel, args: &AggregationArgs, spent: Option<WeightedSum>) -> Self {
        Self {
            rule: args.aggregation,
            byzantine: args.byzantine,
            clip_norm: args.clip_norm,
            noise_std: args.dp_noise_multiplier.zip(args.clip_norm).map(|(sigma, c)| sigma * c),
            sum: WeightedSum::reusing(spent, model),
            held: Vec::new(),
            held_weights: Vec::new(),
            layout: model.shared().map(|t| t.name.clone()).collect(),
            clipped: 0,
        }
    }

    /// Folds in one verified update from a device with `pairs` training pairs. An empty
    /// update (an evaluation round) changes nothing.
    pub(crate) fn add(&mut self, update: &TensorPayload, pairs: f64) {
        if update.tensors.is_empty() {
            return;
        }
        let scale = match self.clip_norm {
            Some(c) => {
                let norm = update.tensors.iter().map(|t| t.sum_of_squares()).sum::<f64>().sqrt();
                if norm > c {
                    self.clipped += 1;
                    c / norm
                } else {
                    1.0
                }
            }
            None => 1.0,
        };
        let weight = if self.noise_std.is_some() { 1.0 } else { pairs };
        if !self.rule.holds_updates() {
            self.sum.add_scaled(update, weight, scale);
            return;
        }
        let mut flat = Vec::new();
        for name in &self.layout {
            if let Some(t) = update.tensors.iter().find(|t| t.name() == name) {
                flat.extend(t.values().into_iter().map(|v| (f64::from(v) * scale) as f32));
            }
        }
        self.held.push(flat);
        self.held_weights.push(weight);
    }

    /// Updates folded in so far.
    pub(crate) fn count(&self) -> usize {
        if self.rule.holds_updates() {
            self.held.len()
        } else {
            self.sum.count()
        }
    }

    /// Updates scaled down to --clip-norm this round.
    pub(crate) fn clipped(&self) -> usize {
        self.clipped
    }

    /// The round's single update: the rule's combination, with DP noise when configured.
    /// Fails when too few updates arrived for the rule to tolerate --byzantine.
    pub(crate) fn finish(self, model: &GlobalModel) -> Result<CombinedUpdate> {
        if !self.rule.holds_updates() {
            let mut sum = self.sum;
            if let Some(std) = self.noise_std {
                let mut noise = GaussianNoise::new(std)?;
                sum.perturb(|| noise.sample());
            }
            return Ok(sum.into());
        }
        let combined = self.rule.combine(&self.held, &self.held_weights, self.byzantine)?;
        Ok(CombinedUpdate::values(model, &combined, self.held.len()))
    }
}

#[cfg(test)]
mod tests {
    use fedpo_model::{Gpt2Config, Partition, PartitionPreset, PolicySpec};
    use fedpo_wire::WireDType;

    use super::*;
    use crate::global_model::GlobalTensor;

    fn model() -> GlobalModel {
        let spec =
            PolicySpec { config: Gpt2Config::tiny(), lora: None, partition: Partition::new(PartitionPreset::Feddpo) };
        let t = |name: &str, n| GlobalTensor { name: name.into(), shape: vec![n], values: vec![0.0; n], shared: true };
        GlobalModel::new(spec, vec![t("a", 2), t("b", 1)])
    }

    fn update(a: [f32; 2], b: f32) -> TensorPayload {
        let t = |name: &str, values: Vec<f32>| GlobalTensor {
            name: name.into(),
            shape: vec![values.len()],
            values,
            shared: true,
        };
        // Deliberately in the other order than the model's: flattening goes by name.
        TensorPayload::encode(&[t("b", vec![b]), t("a", a.to_vec())], WireDType::F32)
    }

    fn mean_of(sum: &CombinedUpdate) -> Vec<f64> {
        ["a", "b"].iter().flat_map(|n| sum.mean(n).unwrap().collect::<Vec<_>>()).collect()
    }

    #[test]
    fn clipping_scales_long_updates_to_the_bound_and_leaves_short_ones() {
        let args = AggregationArgs { clip_norm: Some(1.0), ..Default::default() };
        let mut r = RoundUpdates::new(&model(), &args, None);
        r.add(&update([3.0, 0.0], 4.0), 1.0); // norm 5 → scaled by 1/5
        r.add(&update([0.5, 0.0], 0.0), 1.0); // norm 0.5, kept
        assert_eq!(r.clipped(), 1);
        let mean = mean_of(&r.finish(&model()).unwrap());
        let expected = [(0.6 + 0.5) / 2.0, 0.0, 0.8 / 2.0];
        for (g, e) in mean.iter().zip(expected) {
            assert!((g - e).abs() < 1e-7, "{mean:?}");
        }
    }

    #[test]
    fn the_median_rule_holds_updates_by_name_and_ignores_pair_counts() {
        let args = AggregationArgs { aggregation: AggregationRule::Median, byzantine: 1, ..Default::default() };
        let mut r = RoundUpdates::new(&model(), &args, None);
        r.add(&update([1.0, 2.0], 3.0), 1.0);
        r.add(&update([1.2, 2.2], 3.2), 1.0);
        r.add(&update([-50.0, 90.0], -70.0), 1e9);
        assert_eq!(r.count(), 3);
        let mean = mean_of(&r.finish(&model()).unwrap());
        assert_eq!(mean, vec![1.0, f64::from(2.2f32), 3.0]);
    }

    #[test]
    fn too_few_updates_for_the_rule_fail_the_round_with_the_bound() {
        let args = AggregationArgs { aggregation: AggregationRule::Krum, byzantine: 1, ..Default::default() };
        let mut r = RoundUpdates::new(&model(), &args, None);
        r.add(&update([1.0, 2.0], 3.0), 1.0);
        let err = r.finish(&model()).unwrap_err().to_string();
        assert!(err.contains("n > 2f + 2"), "{err}");
    }

    #[test]
    fn dp_noise_has_std_sigma_c_over_the_participants_and_weights_are_equal() {
        // Many zero-update coordinates make the noise's spread measurable.
        let spec =
            PolicySpec { config: Gpt2Config::tiny(), lora: None, partition: Partition::new(PartitionPreset::Feddpo) };
        let n = 100_000;
        let big = GlobalModel::new(
            spec,
            vec![GlobalTensor { name: "w".into(), shape: vec![n], values: vec![0.0; n], shared: true }],
        );
        let args = AggregationArgs { clip_norm: Some(2.0), dp_noise_multiplier: Some(0.5), ..Default::default() };
        let mut r = RoundUpdates::new(&big, &args, None);
        let zero = TensorPayload::encode(&big.tensors, WireDType::F32);
        for pairs in [1.0, 1000.0, 7.0, 3.0] {
            r.add(&zero, pairs);
        }
        let sum = r.finish(&big).unwrap();
        let values: Vec<f64> = sum.mean("w").unwrap().collect();
        let std = (values.iter().map(|v| v * v).sum::<f64>() / n as f64).sqrt();
        // σ·C / participants = 0.5 · 2 / 4.
        assert!((std - 0.25).abs() < 0.005, "noise std {std}");
    }

    #[test]
    fn dp_settings_are_refused_without_clipping_or_with_a_robust_rule() {
        let dp = AggregationArgs { dp_noise_multiplier: Some(1.0), ..Default::default() };
        assert!(dp.validate(5).unwrap_err().to_string().contains("needs --clip-norm"));
        let robust = AggregationArgs {
            aggregation: AggregationRule::Median,
            clip_norm: Some(1.0),
            dp_noise_multiplier: Some(1.0),
            ..Default::default()
        };
        assert!(robust.validate(5).unwrap_err().to_string().contains("median"));
        let krum = AggregationArgs { aggregation: AggregationRule::Krum, byzantine: 1, ..Default::default() };
        let err = krum.validate(4).unwrap_err().to_string();
        assert!(err.contains("--per-round 4") && err.contains("n > 2f + 2"), "{err}");
        assert!(krum.validate(5).is_ok());
    }
}
