//! The streaming weighted sum of device updates.
//!
//! Each update is folded in as soon as it is complete and verified, then dropped, so the
//! aggregator holds one running sum the size of the shared set (in f64, so that the order
//! updates arrive in does not change the result beyond f32 rounding), whatever the number
//! of devices.

use std::collections::HashMap;

use anyhow::{bail, Result};
use fedpo_wire::TensorPayload;

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
            let shape: Vec<u64> = g.shape.iter().map(|&d| d as u64).collect();
            if t.shape() != shape.as_slice() {
                bail!("update tensor `{}` has shape {:?}, the global model {:?}", t.name(), t.shape(), shape);
            }
        }
        Ok(())
    }

    /// Adds `weight · update` (call [`WeightedSum::check`] first).
    pub(crate) fn add(&mut self, update: &TensorPayload, weight: f64) {
        if update.tensors.is_empty() {
            return;
        }
        for t in &update.tensors {
            if let Some(sum) = self.sums.get_mut(t.name()) {
                for (s, v) in sum.iter_mut().zip(t.values()) {
                    *s += weight * f64::from(v);
                }
            }
        }
        self.weight += weight;
        self.count += 1;
    }

    /// Updates folded in so far (empty ones excluded).
    pub(crate) fn count(&self) -> usize {
        self.count
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
