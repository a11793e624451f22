//! The three parameter sets the rest of fedpo reasons about.
//!
//! Every tensor of a model belongs to exactly one set:
//! - **shared**: trained locally and sent to the aggregator (the base under pFedDPO);
//! - **private**: trained locally and never leaves the device (the adapter under pFedDPO);
//! - **frozen**: not trained at all.
//!
//! A [`Partition`] decides the set of every tensor by name, so one model file serves
//! pFedDPO, FedDPO and shared-LoRA alike.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use candle_core::{Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::error::Result;

/// Which set a parameter belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ParamRole {
    /// Trained and uploaded.
    Shared,
    /// Trained and kept on the device.
    Private,
    /// Not trained.
    Frozen,
}

impl ParamRole {
    /// Whether the optimizer updates parameters of this role.
    pub fn is_trainable(self) -> bool {
        !matches!(self, Self::Frozen)
    }
}

/// The named partitions of the fedpo methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PartitionPreset {
    /// pFedDPO: the base is shared, a private LoRA adapter personalises each device.
    Pfeddpo,
    /// Vanilla FedDPO: the whole base is shared and there is no adapter.
    Feddpo,
    /// Shared LoRA: the base is frozen and the adapter is shared.
    SharedLora,
}

impl PartitionPreset {
    /// All presets, in a stable order.
    pub const ALL: [Self; 3] = [Self::Pfeddpo, Self::Feddpo, Self::SharedLora];

    /// The CLI spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::Pfeddpo => "pfeddpo",
            Self::Feddpo => "feddpo",
            Self::SharedLora => "shared-lora",
        }
    }
}

impl fmt::Display for PartitionPreset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PartitionPreset {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown partition `{s}`; expected one of pfeddpo, feddpo, shared-lora"))
    }
}

/// A preset plus the option to freeze the token and position embeddings.
///
/// Freezing `wte`/`wpe` matters on small devices: with the GPT-2 vocabulary they hold
/// 39.4 M of DistilGPT-2's 81.9 M parameters (48 %), so freezing them nearly halves the
/// upload, the gradients and the optimizer state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Partition {
    /// The method's preset.
    pub preset: PartitionPreset,
    /// Keep `wte` and `wpe` frozen whatever the preset says.
    pub freeze_embeddings: bool,
}

impl Partition {
    /// A preset with trainable embeddings.
    pub fn new(preset: PartitionPreset) -> Self {
        Self { preset, freeze_embeddings: false }
    }

    /// Whether the model carries a LoRA adapter under this partition.
    pub fn uses_adapter(&self) -> bool {
        !matches!(self.preset, PartitionPreset::Feddpo)
    }

    /// The role of a base-model tensor, by checkpoint name (`wte.weight`, `h.0.ln_1.bias`, ...).
    pub fn base_role(&self, name: &str) -> ParamRole {
        let is_embedding = name.starts_with("wte.") || name.starts_with("wpe.");
        if self.freeze_embeddings && is_embedding {
            return ParamRole::Frozen;
        }
        match self.preset {
            PartitionPreset::Pfeddpo | PartitionPreset::Feddpo => ParamRole::Shared,
            PartitionPreset::SharedLora => ParamRole::Frozen,
        }
    }

    /// The role of an adapter tensor.
    pub fn adapter_role(&self) -> ParamRole {
        match self.preset {
            PartitionPreset::Pfeddpo => ParamRole::Private,
            PartitionPreset::SharedLora => ParamRole::Shared,
            // No adapter exists under FedDPO; if one is forced in, it must not leave.
            PartitionPreset::Feddpo => ParamRole::Private,
        }
    }
}

/// Whether a tensor is part of the base model or of the LoRA adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParamKind {
    /// A checkpoint tensor of the GPT-2 base.
    Base,
    /// A LoRA `A` or `B` matrix.
    Adapter,
}

/// One named parameter.
#[derive(Debug, Clone)]
pub struct Param {
    /// Checkpoint-style name, e.g. `h.0.attn.c_attn.lora_A.weight`.
    pub name: String,
    /// Its set.
    pub role: ParamRole,
    /// Base or adapter.
    pub kind: ParamKind,
    /// The variable, for trainable parameters; frozen ones are plain tensors.
    var: Option<Var>,
    tensor: Tensor,
}

impl Param {
    /// The current value (a view that the model's forward uses).
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// The variable the optimizer updates, if the parameter is trainable.
    pub fn var(&self) -> Option<&Var> {
        self.var.as_ref()
    }
}

/// Every parameter of a model, in construction order, with lookup by name.
#[derive(Debug, Clone, Default)]
pub struct ParamStore {
    params: Vec<Param>,
    index: HashMap<String, usize>,
}

impl ParamStore {
    /// Registers a tensor; trainable roles turn it into a [`Var`].
    /// Returns the tensor the model should use in its forward pass.
    pub(crate) fn register(&mut self, name: String, role: ParamRole, kind: ParamKind, value: Tensor) -> Result<Tensor> {
        let (var, tensor) = if role.is_trainable() {
            let var = Var::from_tensor(&value.contiguous()?)?;
            let tensor = var.as_tensor().clone();
            (Some(var), tensor)
        } else {
            (None, value.detach())
        };
        self.index.insert(name.clone(), self.params.len());
        self.params.push(Param { name, role, kind, var, tensor: tensor.clone() });
        Ok(tensor)
    }

    /// All parameters in construction order.
    pub fn iter(&self) -> impl Iterator<Item = &Param> {
        self.params.iter()
    }

    /// A parameter by name.
    pub fn get(&self, name: &str) -> Option<&Param> {
        self.index.get(name).map(|&i| &self.params[i])
    }

    /// Parameters the optimizer updates.
    pub fn trainable(&self) -> impl Iterator<Item = &Param> {
        self.params.iter().filter(|p| p.var.is_some())
    }

    /// Parameters of one role.
    pub fn with_role(&self, role: ParamRole) -> impl Iterator<Item = &Param> {
        self.params.iter().filter(move |p| p.role == role)
    }

    /// Parameters of one kind.
    pub fn with_kind(&self, kind: ParamKind) -> impl Iterator<Item = &Param> {
        self.params.iter().filter(move |p| p.kind == kind)
    }

    /// Number of scalar values in the parameters of one role.
    pub fn numel(&self, role: ParamRole) -> usize {
        self.with_role(role).map(|p| p.tensor.elem_count()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pfeddpo_shares_base_and_keeps_adapter_private() {
        let p = Partition::new(PartitionPreset::Pfeddpo);
        assert_eq!(p.base_role("h.0.attn.c_attn.weight"), ParamRole::Shared);
        assert_eq!(p.adapter_role(), ParamRole::Private);
        assert!(p.uses_adapter());
    }

    #[test]
    fn shared_lora_freezes_base_and_shares_adapter() {
        let p = Partition::new(PartitionPreset::SharedLora);
        assert_eq!(p.base_role("wte.weight"), ParamRole::Frozen);
        assert_eq!(p.adapter_role(), ParamRole::Shared);
    }

    #[test]
    fn feddpo_has_no_adapter() {
        assert!(!Partition::new(PartitionPreset::Feddpo).uses_adapter());
    }

    #[test]
    fn frozen_embeddings_override_any_preset() {
        for preset in PartitionPreset::ALL {
            let p = Partition { preset, freeze_embeddings: true };
            assert_eq!(p.base_role("wte.weight"), ParamRole::Frozen);
            assert_eq!(p.base_role("wpe.weight"), ParamRole::Frozen);
        }
        let p = Partition { preset: PartitionPreset::Feddpo, freeze_embeddings: true };
        assert_eq!(p.base_role("h.1.mlp.c_fc.weight"), ParamRole::Shared);
    }

    #[test]
    fn preset_names_round_trip_and_unknown_names_list_the_choices() {
        for p in PartitionPreset::ALL {
            assert_eq!(p.name().parse::<PartitionPreset>().unwrap(), p);
        }
        let err = "fedavg".parse::<PartitionPreset>().unwrap_err();
        assert!(err.contains("pfeddpo") && err.contains("fedavg"));
    }
}
