//! What the server's half of a client-term algorithm provides (see `client_term.rs`).

use std::collections::BTreeMap;
use std::fmt::Debug;

use fedpo_wire::TensorPayload;

use crate::global_model::{GlobalModel, GlobalTensor};

/// The server's half of one client-term algorithm.
pub(crate) trait ServerHalf: Debug + Send {
    /// Settings for the plan's `strategy` map.
    fn configure(&self, strategy: &mut BTreeMap<String, f64>);
    /// The tensors the plan carries as sections.
    fn plan_sections(&self) -> Vec<(String, TensorPayload)> {
        Vec::new()
    }
    /// The section every training update must carry, if any.
    fn required_section(&self) -> Option<&'static str> {
        None
    }
    /// A training round on `global` begins.
    fn begin_round(&mut self, _global: &GlobalModel) {}
    /// Takes in the required section of an accepted update.
    fn take_section(&mut self, _payload: &TensorPayload) {}
    /// Whether [`ServerHalf::after_round`] needs the shared values from before the step.
    fn needs_previous_model(&self) -> bool {
        false
    }
    /// The round's global step `previous → global` was taken; `registered_devices` are in
    /// the job.
    fn after_round(&mut self, _previous: Option<&GlobalModel>, _global: &GlobalModel, _registered_devices: usize) {}
    /// The vector carried from round to round, to checkpoint.
    fn carried(&self) -> Option<&Vec<GlobalTensor>> {
        None
    }
    /// Restores [`ServerHalf::carried`].
    fn restore_carried(&mut self, _carried: Option<Vec<GlobalTensor>>) {}
}

/// A zero vector shaped like the shared set.
pub(super) fn zeros_like_shared(global: &GlobalModel) -> Vec<GlobalTensor> {
    global
        .shared()
        .map(|t| GlobalTensor {
            name: t.name.clone(),
            shape: t.shape.clone(),
            values: vec![0.0; t.values.len()],
            shared: true,
        })
        .collect()
}
