//! FedAvg, the default server strategy.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::strategy::Strategy;
use crate::combined_update::CombinedUpdate;
use crate::global_model::GlobalModel;
use crate::weighted_sum::apply_scaled;

/// FedAvg (McMahan et al.) with a server learning rate: θ ← θ + η_s · Σ w_i Δ_i / Σ w_i,
/// weights = each device's number of training pairs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct FedAvg {
    pub(crate) server_lr: f64,
    /// Rounds aggregated, for the record.
    pub(crate) rounds: u64,
}

impl FedAvg {
    pub(crate) fn new(server_lr: f64) -> Self {
        Self { server_lr, rounds: 0 }
    }
}

impl Strategy for FedAvg {
    fn name(&self) -> &str {
        "fedavg"
    }

    fn configure_round(&mut self, _round: u64) -> BTreeMap<String, f64> {
        BTreeMap::from([("server_lr".to_string(), self.server_lr)])
    }

    fn aggregate(&mut self, _round: u64, global: &mut GlobalModel, updates: &CombinedUpdate) -> Result<f64> {
        let names: Vec<String> = global.shared().map(|t| t.name.clone()).collect();
        let mut sq = 0.0;
        for name in names {
            let Some((sum, weight)) = updates.scaled(&name) else { return Ok(0.0) };
            let t = global.get_mut(&name).expect("shared tensor");
            sq += apply_scaled(&mut t.values, sum, self.server_lr / weight);
        }
        self.rounds += 1;
        Ok(sq.sqrt())
    }

    fn state(&self) -> Result<Vec<u8>> {
        serde_cbor::to_vec(self).context("encoding FedAvg state")
    }

    fn restore(&mut self, state: &[u8]) -> Result<()> {
        *self = serde_cbor::from_slice(state).context("decoding FedAvg state")?;
        Ok(())
    }
}
