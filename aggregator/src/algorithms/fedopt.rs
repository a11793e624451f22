//! FedAdam and FedYogi (Reddi et al., "Adaptive Federated Optimization", ICLR 2021): the
//! server treats the pair-weighted mean update Δ as a pseudo-gradient and applies an
//! adaptive step to the global model.
//!
//! ```text
//! m ← β1·m + (1 − β1)·Δ
//! v ← β2·v + (1 − β2)·Δ²                      (Adam)
//! v ← v − (1 − β2)·Δ²·sign(v − Δ²)            (Yogi: v grows more slowly)
//! θ ← θ + η·m / (√v + τ)
//! ```
//!
//! As in the paper, v starts at τ² and there is no bias correction. m and v live in the
//! strategy state, so `--resume` continues with them.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::strategy::Strategy;
use crate::combined_update::CombinedUpdate;
use crate::global_model::GlobalModel;

/// Which second-moment rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Adaptivity {
    /// FedAdam.
    Adam,
    /// FedYogi.
    Yogi,
}

/// Server-side Adam or Yogi.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct FedAdaptive {
    pub(crate) kind: Adaptivity,
    /// η.
    pub(crate) lr: f64,
    pub(crate) beta1: f64,
    pub(crate) beta2: f64,
    /// τ: the adaptivity floor.
    pub(crate) tau: f64,
    m: BTreeMap<String, Vec<f32>>,
    v: BTreeMap<String, Vec<f32>>,
}

impl FedAdaptive {
    pub(crate) fn new(kind: Adaptivity, lr: f64, beta1: f64, beta2: f64, tau: f64) -> Self {
        Self { kind, lr, beta1, beta2, tau, m: BTreeMap::new(), v: BTreeMap::new() }
    }
}

impl Strategy for FedAdaptive {
    fn name(&self) -> &str {
        match self.kind {
            Adaptivity::Adam => "fedadam",
            Adaptivity::Yogi => "fedyogi",
        }
    }

    fn configure_round(&mut self, _round: u64) -> BTreeMap<String, f64> {
        BTreeMap::from([
            ("server_lr".to_string(), self.lr),
            ("server_beta1".to_string(), self.beta1),
            ("server_beta2".to_string(), self.beta2),
            ("server_tau".to_string(), self.tau),
        ])
    }

    fn aggregate(&mut self, _round: u64, global: &mut GlobalModel, updates: &CombinedUpdate) -> Result<f64> {
        let names: Vec<String> = global.shared().map(|t| t.name.clone()).collect();
        let (b1, b2, tau, lr) = (self.beta1, self.beta2, self.tau, self.lr);
        let mut sq = 0.0;
        for name in names {
            let Some(mean) = updates.mean(&name) else { return Ok(0.0) };
            let t = global.get_mut(&name).expect("shared tensor");
            let m = self.m.entry(name.clone()).or_insert_with(|| vec![0.0; t.values.len()]);
            let v = self.v.entry(name).or_insert_with(|| vec![(tau * tau) as f32; t.values.len()]);
            for (((theta, d), m), v) in t.values.iter_mut().zip(mean).zip(m.iter_mut()).zip(v.iter_mut()) {
                let (mi, vi) = (f64::from(*m), f64::from(*v));
                let new_m = b1 * mi + (1.0 - b1) * d;
                let d2 = d * d;
                let new_v = match self.kind {
                    Adaptivity::Adam => b2 * vi + (1.0 - b2) * d2,
                    Adaptivity::Yogi => vi - (1.0 - b2) * d2 * (vi - d2).signum(),
                };
                let step = lr * new_m / (new_v.max(0.0).sqrt() + tau);
                *m = new_m as f32;
                *v = new_v as f32;
                *theta = (f64::from(*theta) + step) as f32;
                sq += step * step;
            }
        }
        Ok(sq.sqrt())
    }

    fn state(&self) -> Result<Vec<u8>> {
        serde_cbor::to_vec(self).context("encoding adaptive server state")
    }

    fn restore(&mut self, state: &[u8]) -> Result<()> {
        let restored: Self = serde_cbor::from_slice(state).context("decoding adaptive server state")?;
        if restored.kind != self.kind {
            anyhow::bail!("the checkpoint's strategy is {:?}, not {:?}", restored.kind, self.kind);
        }
        *self = restored;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use fedpo_model::{Gpt2Config, Partition, PartitionPreset, PolicySpec};
    use fedpo_wire::{TensorPayload, WireDType};

    use super::*;
    use crate::global_model::GlobalTensor;

    fn model() -> GlobalModel {
        let spec =
            PolicySpec { config: Gpt2Config::tiny(), lora: None, partition: Partition::new(PartitionPreset::Feddpo) };
        GlobalModel::new(
            spec,
            vec![GlobalTensor { name: "a".into(), shape: vec![2], values: vec![1.0, 1.0], shared: true }],
        )
    }

    fn sum_of(global: &GlobalModel, delta: [f32; 2]) -> CombinedUpdate {
        let mut s = crate::weighted_sum::WeightedSum::new(global);
        let t = GlobalTensor { name: "a".into(), shape: vec![2], values: delta.to_vec(), shared: true };
        s.add(&TensorPayload::encode(&[t], WireDType::F32), 3.0);
        s.into()
    }

    #[test]
    fn first_fedadam_step_matches_the_update_rule_by_hand() {
        let (lr, b1, b2, tau) = (0.01, 0.9, 0.99, 1e-3);
        let mut global = model();
        let mut s = FedAdaptive::new(Adaptivity::Adam, lr, b1, b2, tau);
        let sum = sum_of(&global, [0.5, -0.2]);
        s.aggregate(1, &mut global, &sum).unwrap();
        for (theta, d) in global.get("a").unwrap().values.iter().zip([0.5f64, -0.2]) {
            let m = (1.0 - b1) * d;
            let v = b2 * tau * tau + (1.0 - b2) * d * d;
            let expected = 1.0 + lr * m / (v.sqrt() + tau);
            assert!((f64::from(*theta) - expected).abs() < 1e-6, "{theta} vs {expected}");
        }
    }

    #[test]
    fn yogi_second_moment_grows_more_slowly_than_adam_after_a_large_update() {
        let run = |kind| {
            let mut global = model();
            let mut s = FedAdaptive::new(kind, 0.01, 0.9, 0.99, 1e-3);
            let sum = sum_of(&global, [0.5, 0.5]);
            s.aggregate(1, &mut global, &sum).unwrap();
            let sum = sum_of(&global, [0.5, 0.5]);
            s.aggregate(2, &mut global, &sum).unwrap();
            (s.v["a"][0], global.get("a").unwrap().values[0])
        };
        let (v_adam, theta_adam) = run(Adaptivity::Adam);
        let (v_yogi, theta_yogi) = run(Adaptivity::Yogi);
        // Yogi's v moves by (1-β2)·Δ² each step, Adam's also decays its τ² start.
        assert!((f64::from(v_yogi) - (1e-6 + 2.0 * 0.01 * 0.25)).abs() < 1e-7, "{v_yogi}");
        assert!(v_adam < v_yogi && theta_adam > theta_yogi, "adam {v_adam} {theta_adam}, yogi {v_yogi} {theta_yogi}");
    }

    #[test]
    fn restored_state_continues_with_the_same_moments() {
        let mut global_a = model();
        let mut a = FedAdaptive::new(Adaptivity::Yogi, 0.01, 0.9, 0.99, 1e-3);
        let sum = sum_of(&global_a, [0.3, -0.1]);
        a.aggregate(1, &mut global_a, &sum).unwrap();
        let mut b = FedAdaptive::new(Adaptivity::Yogi, 0.5, 0.0, 0.0, 1.0);
        b.restore(&a.state().unwrap()).unwrap();
        assert_eq!(a, b);
        let mut global_b = global_a.clone();
        let sum = sum_of(&global_a, [0.2, 0.2]);
        a.aggregate(2, &mut global_a, &sum).unwrap();
        let sum = sum_of(&global_b, [0.2, 0.2]);
        b.aggregate(2, &mut global_b, &sum).unwrap();
        assert_eq!(global_a.tensors, global_b.tensors);
        let mut adam = FedAdaptive::new(Adaptivity::Adam, 0.01, 0.9, 0.99, 1e-3);
        assert!(adam.restore(&a.state().unwrap()).is_err(), "a FedYogi checkpoint is not resumed as FedAdam");
    }
}
