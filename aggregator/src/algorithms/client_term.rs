//! The server's half of the algorithms that add a term to the devices' local objective
//! (FedProx, SCAFFOLD, FedGA): what each plan tells devices, the tensors it sends along,
//! what it takes from each update, and the state it keeps between rounds.
//!
//! Each algorithm implements [`ServerHalf`] in its own file; [`ClientTerm`] holds the
//! job's one term and its checkpoint. The round's code asks the term, and never names an
//! algorithm. The vector a term carries between rounds (SCAFFOLD's `c`, FedGA's `r`) is
//! part of the checkpointed state, so `--resume` continues it exactly.

use std::collections::BTreeMap;
use std::fmt::Debug;

use anyhow::{bail, Context, Result};
use fedpo_wire::TensorPayload;
use serde::{Deserialize, Serialize};

use super::fedga::{FedGa, FedgaSettings};
use super::fedprox::FedProx;
use super::scaffold::Scaffold;
use super::server_half::ServerHalf;
use crate::global_model::{GlobalModel, GlobalTensor};

/// Which term devices add to their local objective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub(crate) enum ClientTermKind {
    /// Plain local DPO.
    None,
    /// FedProx's proximal term.
    Fedprox,
    /// SCAFFOLD's control variates.
    Scaffold,
    /// FedGA's gradient alignment.
    Fedga,
}

impl ClientTermKind {
    /// The CLI spelling.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Fedprox => "fedprox",
            Self::Scaffold => "scaffold",
            Self::Fedga => "fedga",
        }
    }
}

/// Plain local DPO: no term.
#[derive(Debug)]
struct NoTerm;

impl ServerHalf for NoTerm {
    fn configure(&self, _strategy: &mut BTreeMap<String, f64>) {}
}

/// The job's client term and its server-side state.
#[derive(Debug)]
pub(crate) struct ClientTerm {
    kind: ClientTermKind,
    /// The job's settings, written with the checkpoint (whose format predates the split
    /// into one file per algorithm).
    mu: f64,
    fedga: FedgaSettings,
    half: Box<dyn ServerHalf>,
}

/// The checkpointed state: every field, whichever term runs.
#[derive(Serialize, Deserialize)]
struct Saved {
    kind: ClientTermKind,
    mu: f64,
    fedga: FedgaSettings,
    /// SCAFFOLD's `c`.
    control: Option<Vec<GlobalTensor>>,
    /// FedGA's `r` (none before the first global step).
    reference: Option<Vec<GlobalTensor>>,
}

impl ClientTerm {
    pub(crate) fn new(kind: ClientTermKind, mu: f64, fedga: FedgaSettings, global: &GlobalModel) -> Self {
        let half: Box<dyn ServerHalf> = match kind {
            ClientTermKind::None => Box::new(NoTerm),
            ClientTermKind::Fedprox => Box::new(FedProx { mu }),
            ClientTermKind::Scaffold => Box::new(Scaffold::new(global)),
            ClientTermKind::Fedga => Box::new(FedGa::new(fedga.clone())),
        };
        Self { kind, mu, fedga, half }
    }

    pub(crate) fn kind(&self) -> ClientTermKind {
        self.kind
    }

    /// Settings for the plan's `strategy` map.
    pub(crate) fn configure(&self, strategy: &mut BTreeMap<String, f64>) {
        self.half.configure(strategy);
    }

    /// The tensors the plan carries as sections.
    pub(crate) fn plan_sections(&self) -> Vec<(String, TensorPayload)> {
        self.half.plan_sections()
    }

    /// The section every training update must carry, if any.
    pub(crate) fn required_section(&self) -> Option<&'static str> {
        self.half.required_section()
    }

    /// A training round on `global` begins.
    pub(crate) fn begin_round(&mut self, global: &GlobalModel) {
        self.half.begin_round(global);
    }

    /// Takes in section `name` of an accepted update; returns whether it was the term's.
    pub(crate) fn take_section(&mut self, name: &str, payload: &TensorPayload) -> bool {
        if self.half.required_section() != Some(name) {
            return false;
        }
        self.half.take_section(payload);
        true
    }

    /// Whether [`ClientTerm::after_round`] needs the shared values from before the step.
    pub(crate) fn needs_previous_model(&self) -> bool {
        self.half.needs_previous_model()
    }

    /// The round's global step `previous → global` was taken.
    pub(crate) fn after_round(
        &mut self,
        previous: Option<&GlobalModel>,
        global: &GlobalModel,
        registered_devices: usize,
    ) {
        self.half.after_round(previous, global, registered_devices);
    }

    pub(crate) fn state(&self) -> Result<Vec<u8>> {
        let carried = self.half.carried().cloned();
        let saved = Saved {
            kind: self.kind,
            mu: self.mu,
            fedga: self.fedga.clone(),
            control: carried.clone().filter(|_| self.kind == ClientTermKind::Scaffold),
            reference: carried.filter(|_| self.kind == ClientTermKind::Fedga),
        };
        serde_cbor::to_vec(&saved).context("encoding the client-term state")
    }

    pub(crate) fn restore(&mut self, state: &[u8]) -> Result<()> {
        let saved: Saved = serde_cbor::from_slice(state).context("decoding the client-term state")?;
        if saved.kind != self.kind {
            bail!("the checkpoint was made with --client-term {}, not {}", saved.kind.name(), self.kind.name());
        }
        // The flags of this run stay; only the vectors carry over.
        self.half.restore_carried(saved.control.or(saved.reference));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use fedpo_model::{Gpt2Config, Partition, PartitionPreset, PolicySpec};

    use super::*;

    fn vector(values: Vec<f32>) -> GlobalTensor {
        GlobalTensor { name: "w".into(), shape: vec![2], values, shared: true }
    }

    #[test]
    fn restored_state_keeps_the_vectors_and_this_runs_flags_and_refuses_another_term() {
        let spec =
            PolicySpec { config: Gpt2Config::tiny(), lora: None, partition: Partition::new(PartitionPreset::Feddpo) };
        let before = GlobalModel::new(spec.clone(), vec![vector(vec![0.0, 0.0])]);
        let after = GlobalModel::new(spec, vec![vector(vec![1.0, 0.0])]);
        let fedga = |lambda| FedgaSettings {
            lambda,
            beta: 0.5,
            layer: false,
            displacement: false,
            fd_step: 1e-3,
            weights: BTreeMap::new(),
            unit_steps: false,
        };
        let mut saved = ClientTerm::new(ClientTermKind::Fedga, 0.0, fedga(0.1), &before);
        saved.after_round(Some(&before), &after, 1);
        let mut resumed = ClientTerm::new(ClientTermKind::Fedga, 0.0, fedga(0.7), &before);
        resumed.restore(&saved.state().unwrap()).unwrap();
        assert_eq!(resumed.plan_sections(), saved.plan_sections(), "r carries over");
        assert_eq!(resumed.fedga.lambda, 0.7, "the flags of the resumed run apply");
        let mut other = ClientTerm::new(ClientTermKind::Scaffold, 0.0, fedga(0.1), &before);
        let err = other.restore(&saved.state().unwrap()).unwrap_err().to_string();
        assert!(err.contains("--client-term fedga, not scaffold"), "{err}");
    }
}
