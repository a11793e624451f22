//! Server strategies, in the spirit of Flower's `Strategy`: the server asks the strategy
//! what to tell devices each round and how to fold their updates into the global model.
//! A strategy owns its state and serializes it, so `--resume` restores it exactly.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::accumulator::{apply_scaled, WeightedSum};
use crate::global_model::GlobalModel;

/// A server-side federated optimisation strategy.
pub(crate) trait Strategy: Send {
    /// Its name, for metrics.
    fn name(&self) -> &str;
    /// Named settings for the round's plan (e.g. a proximal term's μ).
    fn configure_round(&mut self, round: u64) -> BTreeMap<String, f64>;
    /// Applies the round's accepted updates to the global model. Returns the L2 norm of
    /// the applied change.
    fn aggregate(&mut self, round: u64, global: &mut GlobalModel, updates: &WeightedSum) -> Result<f64>;
    /// The strategy's state, to checkpoint.
    fn state(&self) -> Result<Vec<u8>>;
    /// Restores [`Strategy::state`].
    fn restore(&mut self, state: &[u8]) -> Result<()>;
}

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

    fn aggregate(&mut self, _round: u64, global: &mut GlobalModel, updates: &WeightedSum) -> Result<f64> {
        let names: Vec<String> = global.shared().map(|t| t.name.clone()).collect();
        let mut sq = 0.0;
        for name in names {
            let Some((sum, weight)) = updates.sum_of(&name) else { return Ok(0.0) };
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
