//! SCAFFOLD on the device: the server's variate `c` from the plan, the device's own `c_i`
//! in its state directory, and `Δc_i` back with the update.

use std::collections::{BTreeMap, HashMap};

use candle_core::{Device, Tensor};
use fedpo_model::tensor_files::{read_safetensors, write_safetensors};
use fedpo_model::{Policy, SharedTensor};
use fedpo_train::algorithms::{Grads, Scaffold};
use fedpo_wire::{keys, RoundPlan, TensorPayload};

use super::{protocol, section};
use crate::error::ParticipantError;
use crate::state_dir::StateDir;

const CONTROL_FILE: &str = "scaffold_control.safetensors";

/// The round's SCAFFOLD term: the plan's `c` and this device's `c_i`.
pub(super) fn term(
    plan: &RoundPlan,
    sections: &BTreeMap<String, TensorPayload>,
    policy: &Policy,
    state: &StateDir,
    device: &Device,
) -> Result<Scaffold, ParticipantError> {
    let c = section(plan, sections, keys::SCAFFOLD_CONTROL, policy, device)?
        .ok_or_else(|| protocol(plan, format!("SCAFFOLD is on but the plan has no `{}`", keys::SCAFFOLD_CONTROL)))?;
    Ok(Scaffold::new(c, load_control(state, device)?)?)
}

/// After training: saves `c_i⁺` and returns `Δc_i` as the update's section.
pub(super) fn upload_section(
    scaffold: &Scaffold,
    policy: &Policy,
    state: &StateDir,
) -> Result<Option<(String, Vec<SharedTensor>)>, ParticipantError> {
    let Some((control, change)) = scaffold.finish()? else { return Ok(None) };
    save_control(state, &control)?;
    Ok(Some((keys::SCAFFOLD_CONTROL_DELTA.to_string(), policy.shared_values(&change)?)))
}

/// The device's SCAFFOLD variate `c_i`, if it has one.
fn load_control(state: &StateDir, device: &Device) -> Result<Option<Grads>, ParticipantError> {
    let path = state.path(CONTROL_FILE);
    if !path.exists() {
        return Ok(None);
    }
    Ok(Some(read_safetensors(&path, device)?.tensors.tensors))
}

/// Saves `c_i⁺` (atomically), before the update that reports its change is sent.
fn save_control(state: &StateDir, control: &HashMap<String, Tensor>) -> Result<(), ParticipantError> {
    let mut tensors: Vec<(String, Tensor)> = control.iter().map(|(n, t)| (n.clone(), t.clone())).collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let meta = HashMap::from([("format".to_string(), "fedpo-scaffold-control/1".to_string())]);
    Ok(write_safetensors(&state.path(CONTROL_FILE), &tensors, meta)?)
}
