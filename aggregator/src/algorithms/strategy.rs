//! Server strategies, in the spirit of Flower's `Strategy`: the server asks the strategy
//! what to tell devices each round and how to fold their updates into the global model.
//! A strategy owns its state and serializes it, so `--resume` restores it exactly.

use std::collections::BTreeMap;

use anyhow::Result;

use crate::combined_update::CombinedUpdate;
use crate::global_model::GlobalModel;

/// A server-side federated optimisation strategy.
pub(crate) trait Strategy: Send {
    /// Its name, for metrics.
    fn name(&self) -> &str;
    /// Named settings for the round's plan (e.g. a proximal term's μ).
    fn configure_round(&mut self, round: u64) -> BTreeMap<String, f64>;
    /// Applies the round's accepted updates to the global model. Returns the L2 norm of
    /// the applied change.
    fn aggregate(&mut self, round: u64, global: &mut GlobalModel, updates: &CombinedUpdate) -> Result<f64>;
    /// The strategy's state, to checkpoint.
    fn state(&self) -> Result<Vec<u8>>;
    /// Restores [`Strategy::state`].
    fn restore(&mut self, state: &[u8]) -> Result<()>;
}
