//! Round checkpoints: the global model as safetensors plus the server state as CBOR.
//!
//! The model is written first, then the state naming the model's SHA-256; both writes are
//! atomic. A crash between the two leaves the previous state, whose hash no longer
//! matches the model file, and resume refuses it rather than mixing rounds.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use fedpo_model::io::write_atomic;
use serde::{Deserialize, Serialize};

use crate::global_model::GlobalModel;
use crate::privacy::RdpAccountant;

/// A registered device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct DeviceRecord {
    /// Training pairs (FedAvg weight).
    pub(crate) pairs: u64,
    /// Compute backend it reported.
    pub(crate) backend: String,
    /// Whether it is connected, as far as the aggregator knows.
    pub(crate) online: bool,
    /// The connection number of its last hello.
    #[serde(default)]
    pub(crate) connection: u32,
}

/// Everything but the model needed to continue a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ServerState {
    pub(crate) format: String,
    pub(crate) job: String,
    pub(crate) method: String,
    /// Last round whose aggregate is in the model file.
    pub(crate) round: u64,
    /// SHA-256 (hex) of the model's wire payload.
    pub(crate) global_sha256: String,
    pub(crate) devices: BTreeMap<String, DeviceRecord>,
    pub(crate) strategy: String,
    #[serde(with = "serde_bytes")]
    pub(crate) strategy_state: Vec<u8>,
    pub(crate) bytes_up: u64,
    pub(crate) bytes_down: u64,
    /// The client term's state (SCAFFOLD's c, FedGA's r).
    #[serde(default, with = "serde_bytes")]
    pub(crate) client_term_state: Vec<u8>,
    /// The privacy accountant, with --dp-noise-multiplier.
    #[serde(default)]
    pub(crate) privacy: Option<RdpAccountant>,
}

pub(crate) const STATE_FORMAT: &str = "fedpo-server-state/1";

/// Paths of a checkpoint directory.
pub(crate) struct CheckpointDir {
    dir: PathBuf,
}

impl CheckpointDir {
    pub(crate) fn new(out: &Path) -> Self {
        Self { dir: out.join("checkpoint") }
    }

    pub(crate) fn model_path(&self) -> PathBuf {
        self.dir.join("global.safetensors")
    }

    pub(crate) fn state_path(&self) -> PathBuf {
        self.dir.join("state.cbor")
    }

    pub(crate) fn exists(&self) -> bool {
        self.state_path().exists()
    }

    pub(crate) fn save(&self, model: &GlobalModel, state: &ServerState) -> Result<()> {
        std::fs::create_dir_all(&self.dir).with_context(|| format!("creating {}", self.dir.display()))?;
        model.save(&self.model_path())?;
        let bytes = serde_cbor::to_vec(state).context("encoding server state")?;
        write_atomic(&self.state_path(), &bytes).with_context(|| format!("writing {}", self.state_path().display()))
    }

    pub(crate) fn load(&self) -> Result<(GlobalModel, ServerState)> {
        let path = self.state_path();
        let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        let state: ServerState =
            serde_cbor::from_slice(&bytes).with_context(|| format!("{}: not a fedpo server state", path.display()))?;
        if state.format != STATE_FORMAT {
            bail!("{}: format `{}`, expected `{STATE_FORMAT}`", path.display(), state.format);
        }
        let model = GlobalModel::load(&self.model_path())?;
        let sha = model.sha256_hex();
        if sha != state.global_sha256 {
            bail!(
                "{} does not match {} (model {sha}, state expects {}): the last checkpoint was interrupted",
                self.model_path().display(),
                path.display(),
                state.global_sha256
            );
        }
        Ok((model, state))
    }
}

#[cfg(test)]
mod tests {
    use fedpo_model::{Gpt2Config, Partition, PartitionPreset, PolicySpec};

    use super::*;
    use crate::global_model::GlobalTensor;

    fn model(v: f32) -> GlobalModel {
        let spec =
            PolicySpec { config: Gpt2Config::tiny(), lora: None, partition: Partition::new(PartitionPreset::Feddpo) };
        let t = |name: &str, shared| GlobalTensor { name: name.into(), shape: vec![2], values: vec![v, -v], shared };
        GlobalModel::new(spec, vec![t("z.weight", true), t("a.bias", false)])
    }

    fn state(model: &GlobalModel, round: u64) -> ServerState {
        ServerState {
            format: STATE_FORMAT.into(),
            job: "j".into(),
            method: "feddpo".into(),
            round,
            global_sha256: model.sha256_hex(),
            devices: BTreeMap::from([(
                "dev-0".into(),
                DeviceRecord { pairs: 7, backend: "cpu".into(), online: true, connection: 2 },
            )]),
            strategy: "fedavg".into(),
            strategy_state: vec![1, 2, 3],
            bytes_up: 10,
            bytes_down: 20,
            client_term_state: vec![4, 5],
            privacy: None,
        }
    }

    #[test]
    fn checkpoint_round_trips_model_order_roles_and_state() {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = CheckpointDir::new(dir.path());
        let m = model(0.5);
        ckpt.save(&m, &state(&m, 3)).unwrap();
        let (back, st) = ckpt.load().unwrap();
        assert_eq!(back.tensors, m.tensors, "values, shapes, roles and payload order survive");
        assert_eq!(back.sha256_hex(), m.sha256_hex());
        assert_eq!(st, state(&m, 3));
    }

    #[test]
    fn model_file_from_another_round_than_the_state_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = CheckpointDir::new(dir.path());
        let old = model(0.5);
        ckpt.save(&old, &state(&old, 3)).unwrap();
        // A crash after writing round 4's model but before its state.
        model(0.75).save(&ckpt.model_path()).unwrap();
        let err = ckpt.load().unwrap_err().to_string();
        assert!(err.contains("interrupted") && err.contains("global.safetensors"), "{err}");
    }
}
