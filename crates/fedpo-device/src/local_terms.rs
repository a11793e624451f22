//! Turns a round plan's algorithm settings into the local objective's terms.
//!
//! The plan names the terms in its `strategy` map (see `fedpo_wire::keys`) and carries
//! their tensors as sections: SCAFFOLD's server variate, FedGA's reference direction.
//! The device's own SCAFFOLD variate lives in its state directory.

use std::collections::{BTreeMap, HashMap};

use candle_core::{Device, Tensor};
use fedpo_model::io::{read_safetensors, write_safetensors};
use fedpo_model::{ParamRole, Policy, TensorSource};
use fedpo_train::terms::{Alignment, AlignmentMode, Grads, Granularity, LocalTerms, Proximal, Scaffold};
use fedpo_wire::{keys, RoundPlan, TensorPayload};

use crate::error::ParticipantError;
use crate::memory::StartOnDisk;
use crate::state_dir::StateDir;

fn protocol(plan: &RoundPlan, what: String) -> ParticipantError {
    ParticipantError::Protocol(format!("round {}: {what}", plan.round))
}

/// A section of the plan as named tensors, checked against the shared set.
fn section(
    plan: &RoundPlan,
    sections: &BTreeMap<String, TensorPayload>,
    name: &str,
    policy: &Policy,
    device: &Device,
) -> Result<Option<Grads>, ParticipantError> {
    let Some(payload) = sections.get(name) else { return Ok(None) };
    let source = TensorSource::from_wire(&payload.tensors, &format!("plan section `{name}`"), device)?;
    for (n, t) in &source.tensors {
        let p = policy.params.get(n).filter(|p| p.role == ParamRole::Shared);
        match p {
            Some(p) if p.tensor().dims() == t.dims() => {}
            _ => {
                return Err(protocol(plan, format!("section `{name}` holds `{n}`, not a shared tensor of this model")))
            }
        }
    }
    Ok(Some(source.tensors))
}

/// The global model's shared tensors: FedProx's anchor, FedGA's displacement origin.
pub(crate) fn shared_anchor(policy: &Policy, global: &TensorSource) -> Grads {
    policy
        .params
        .with_role(ParamRole::Shared)
        .filter_map(|p| global.tensors.get(&p.name).map(|t| (p.name.clone(), t.clone())))
        .collect()
}

/// Where a round under these strategy settings may keep the model it started from, for the
/// memory plan. FedProx and FedGA measure the distance to it at every step, so their rounds
/// keep it in memory whatever was asked ([`terms_for`] builds them from the same keys; a
/// FedGA round without a reference yet is counted as holding it, which only errs large).
pub(crate) fn start_placement(strategy: &BTreeMap<String, f64>, asked: bool) -> StartOnDisk {
    let proximal = strategy.get(keys::PROXIMAL_MU).is_some_and(|mu| *mu > 0.0);
    let alignment = strategy.contains_key(keys::FEDGA_LAMBDA);
    match (proximal || alignment, asked) {
        (true, _) => StartOnDisk::Never,
        (false, true) => StartOnDisk::Always,
        (false, false) => StartOnDisk::WhenNeeded,
    }
}

/// Builds the terms the plan asks for.
pub(crate) fn terms_for(
    plan: &RoundPlan,
    sections: &BTreeMap<String, TensorPayload>,
    policy: &Policy,
    anchor: &Grads,
    state: &StateDir,
    device: &Device,
) -> Result<LocalTerms, ParticipantError> {
    let setting = |key: &str| plan.strategy.get(key).copied();
    let mut terms = LocalTerms::default();
    if let Some(mu) = setting(keys::PROXIMAL_MU).filter(|mu| *mu > 0.0) {
        terms.proximal = Some(Proximal::new(mu, anchor.clone())?);
    }
    if setting(keys::SCAFFOLD) == Some(1.0) {
        let c = section(plan, sections, keys::SCAFFOLD_CONTROL, policy, device)?.ok_or_else(|| {
            protocol(plan, format!("SCAFFOLD is on but the plan has no `{}`", keys::SCAFFOLD_CONTROL))
        })?;
        terms.scaffold = Some(Scaffold::new(c, load_control(state, device)?)?);
    }
    if let Some(lambda) = setting(keys::FEDGA_LAMBDA) {
        // Round 1 has no reference yet: the aggregator has seen no global step.
        if let Some(reference) = section(plan, sections, keys::FEDGA_REFERENCE, policy, device)? {
            let granularity =
                if setting(keys::FEDGA_LAYER) == Some(1.0) { Granularity::Layer } else { Granularity::Full };
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
            terms.alignment = Some(Alignment::new(lambda, granularity, weights, mode, reference, anchor.clone())?);
        }
    }
    Ok(terms)
}

const CONTROL_FILE: &str = "scaffold_control.safetensors";

/// The device's SCAFFOLD variate `c_i`, if it has one.
fn load_control(state: &StateDir, device: &Device) -> Result<Option<Grads>, ParticipantError> {
    let path = state.path(CONTROL_FILE);
    if !path.exists() {
        return Ok(None);
    }
    Ok(Some(read_safetensors(&path, device)?.tensors.tensors))
}

/// Saves `c_i⁺` (atomically), before the update that reports its change is sent.
pub(crate) fn save_control(state: &StateDir, control: &HashMap<String, Tensor>) -> Result<(), ParticipantError> {
    let mut tensors: Vec<(String, Tensor)> = control.iter().map(|(n, t)| (n.clone(), t.clone())).collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let meta = HashMap::from([("format".to_string(), "fedpo-scaffold-control/1".to_string())]);
    Ok(write_safetensors(&state.path(CONTROL_FILE), &tensors, meta)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_whose_terms_hold_the_start_are_planned_with_it_in_memory() {
        let settings = |pairs: &[(&str, f64)]| pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        let plain = settings(&[]);
        assert_eq!(start_placement(&plain, false), StartOnDisk::WhenNeeded);
        assert_eq!(start_placement(&plain, true), StartOnDisk::Always);
        for held in [settings(&[(keys::PROXIMAL_MU, 0.01)]), settings(&[(keys::FEDGA_LAMBDA, 0.1)])] {
            assert_eq!(start_placement(&held, true), StartOnDisk::Never, "{held:?}");
            assert_eq!(start_placement(&held, false), StartOnDisk::Never, "{held:?}");
        }
        // FedProx with mu 0 is FedAvg; SCAFFOLD holds only its variates
        let free = settings(&[(keys::PROXIMAL_MU, 0.0), (keys::SCAFFOLD, 1.0)]);
        assert_eq!(start_placement(&free, true), StartOnDisk::Always);
    }
}
