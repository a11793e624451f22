//! The device's half of each federated algorithm: turning a round plan's settings into
//! the local objective's terms, and what the terms send back.
//!
//! The plan names the terms in its `strategy` map (see `fedpo_wire::keys`) and carries
//! their tensors as sections: SCAFFOLD's server variate, FedGA's reference direction.
//! Each algorithm has one home of the same name in each crate: here, in
//! `fedpo_train::algorithms` (the terms themselves) and in the aggregator's `algorithms`
//! (the server's half). FedProx needs only its μ and the anchor, so it has no file here.

use std::collections::BTreeMap;

use candle_core::Device;
use fedpo_model::{ParamRole, Policy, SharedTensor, TensorSource};
use fedpo_train::algorithms::{Grads, LocalTerms, Proximal};
use fedpo_wire::{keys, RoundPlan, TensorPayload};

use crate::error::ParticipantError;
use crate::memory::StartOnDisk;
use crate::state_dir::StateDir;

mod fedga;
mod scaffold;

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
        terms.scaffold = Some(scaffold::term(plan, sections, policy, state, device)?);
    }
    if let Some(lambda) = setting(keys::FEDGA_LAMBDA) {
        terms.alignment = fedga::term(plan, sections, lambda, policy, anchor, device)?;
    }
    Ok(terms)
}

/// The sections the round's terms send back with the update: SCAFFOLD's `Δc_i` (its
/// new `c_i` saved first).
pub(crate) fn upload_sections(
    terms: &LocalTerms,
    policy: &Policy,
    state: &StateDir,
) -> Result<Vec<(String, Vec<SharedTensor>)>, ParticipantError> {
    let mut sections = Vec::new();
    if let Some(s) = &terms.scaffold {
        sections.extend(scaffold::upload_section(s, policy, state)?);
    }
    Ok(sections)
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
