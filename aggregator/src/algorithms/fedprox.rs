//! FedProx (Li et al. 2020) on the server: only μ, in the plan. Each device adds
//! `(μ/2)·‖θ − θ_global‖²` to its local objective (`fedpo_train::algorithms::Proximal`);
//! the server aggregates as FedAvg does.

use std::collections::BTreeMap;

use fedpo_wire::keys;

use super::server_half::ServerHalf;

/// FedProx's server half.
#[derive(Debug)]
pub(super) struct FedProx {
    pub(super) mu: f64,
}

impl ServerHalf for FedProx {
    fn configure(&self, strategy: &mut BTreeMap<String, f64>) {
        strategy.insert(keys::PROXIMAL_MU.into(), self.mu);
    }
}
