//! FedGA on the device: the alignment term from the plan's settings and the aggregator's
//! reference direction.

use std::collections::BTreeMap;

use candle_core::Device;
use fedpo_model::Policy;
use fedpo_train::algorithms::{Alignment, AlignmentMode, Grads, Granularity};
use fedpo_wire::{keys, RoundPlan, TensorPayload};

use super::section;
use crate::error::ParticipantError;

/// The round's alignment term with weight `lambda`; `None` in round 1, which has no
/// reference yet (the aggregator has seen no global step).
pub(super) fn term(
    plan: &RoundPlan,
    sections: &BTreeMap<String, TensorPayload>,
    lambda: f64,
    policy: &Policy,
    anchor: &Grads,
    device: &Device,
) -> Result<Option<Alignment>, ParticipantError> {
    let Some(reference) = section(plan, sections, keys::FEDGA_REFERENCE, policy, device)? else { return Ok(None) };
    let setting = |key: &str| plan.strategy.get(key).copied();
    let granularity = if setting(keys::FEDGA_LAYER) == Some(1.0) { Granularity::Layer } else { Granularity::Full };
    let mode = if setting(keys::FEDGA_DISPLACEMENT) == Some(1.0) {
        AlignmentMode::Displacement
    } else {
        AlignmentMode::FiniteDifference { rel_step: setting(keys::FEDGA_FD_STEP).unwrap_or(1e-3) }
    };
    let weights = plan
        .strategy
        .iter()
        .filter_map(|(k, w)| k.strip_prefix(keys::FEDGA_WEIGHT_PREFIX).map(|layer| (layer.to_string(), *w)))
        .collect();
    Ok(Some(Alignment::new(lambda, granularity, weights, mode, reference, anchor.clone())?))
}
