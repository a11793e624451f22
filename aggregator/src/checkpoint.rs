//! Round checkpoints: the global model as safetensors plus the server state as CBOR.
//!
//! The model is written first, then the state naming the model's SHA-256; both writes are
//! atomic, and the model they replace stays beside them as `global.prev.safetensors`
//! until the next round's. A crash between the two writes leaves the previous state with
//! the previous model: resume finds the state's hash in the kept file, puts it back, and
//! continues from the last round that completed. Rounds are never mixed: a model is only
//! used with the state that names its hash.

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

    /// The model the last save replaced: what the state names if a crash came between
    /// writing the model and writing the state.
    pub(crate) fn previous_model_path(&self) -> PathBuf {
        self.dir.join("global.prev.safetensors")
    }

    pub(crate) fn state_path(&self) -> PathBuf {
        self.dir.join("state.cbor")
    }

    pub(crate) fn exists(&self) -> bool {
        self.state_path().exists()
    }

    pub(crate) fn save(&self, model: &GlobalModel, state: &ServerState) -> Result<()> {
        std::fs::create_dir_all(&self.dir).with_context(|| format!("creating {}", self.dir.display()))?;
        let (path, previous) = (self.model_path(), self.previous_model_path());
        let keep_previous = |_: &Path| match std::fs::rename(&path, &previous) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()), // the first round
            Err(e) => Err(e),
        };
        model.save_replacing(&path, keep_previous)?;
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
        let (current, previous) = (self.model_path(), self.previous_model_path());
        let model = GlobalModel::load(&current).ok().filter(|m| m.sha256_hex() == state.global_sha256);
        if let Some(model) = model {
            return Ok((model, state));
        }
        // Interrupted between the model and the state: the state's model is the kept one.
        // Put it back, so that the next save keeps it again rather than the torn round.
        let kept = previous.exists().then(|| GlobalModel::load(&previous)).transpose()?;
        match kept {
            Some(model) if model.sha256_hex() == state.global_sha256 => {
                tracing::warn!(
                    round = state.round,
                    "the last checkpoint was interrupted before its state was written; resuming from round {}",
                    state.round
                );
                std::fs::rename(&previous, &current)
                    .with_context(|| format!("restoring {} as {}", previous.display(), current.display()))?;
                Ok((model, state))
            }
            _ => bail!(
                "neither {} nor {} is the model {} expects (SHA-256 {}): the checkpoint is damaged",
                current.display(),
                previous.display(),
                path.display(),
                state.global_sha256
            ),
        }
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

    /// A crash after round 4's model replaced round 3's but before round 4's state.
    fn crash_between_model_and_state(ckpt: &CheckpointDir) {
        let path = ckpt.model_path();
        model(0.75).save_replacing(&path, |p| std::fs::rename(p, ckpt.previous_model_path())).unwrap();
    }

    #[test]
    fn crash_between_the_model_and_the_state_resumes_from_the_last_complete_round() {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = CheckpointDir::new(dir.path());
        let (round2, round3) = (model(0.25), model(0.5));
        ckpt.save(&round2, &state(&round2, 2)).unwrap();
        ckpt.save(&round3, &state(&round3, 3)).unwrap();
        crash_between_model_and_state(&ckpt);
        let (back, st) = ckpt.load().unwrap();
        assert_eq!((back.tensors, st.round), (round3.tensors.clone(), 3), "round 3, as its state says");
        // Restored in place: the next round's save keeps round 3, and a crash in it again
        // still leaves a checkpoint to resume from.
        assert_eq!(GlobalModel::load(&ckpt.model_path()).unwrap().sha256_hex(), round3.sha256_hex());
        crash_between_model_and_state(&ckpt);
        assert_eq!(ckpt.load().unwrap().1.round, 3);
    }

    #[test]
    fn model_files_that_neither_match_the_state_are_refused_naming_both() {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = CheckpointDir::new(dir.path());
        let m = model(0.5);
        ckpt.save(&m, &state(&m, 3)).unwrap();
        crash_between_model_and_state(&ckpt);
        model(0.9).save(&ckpt.previous_model_path()).unwrap(); // and the kept one lost too
        let err = ckpt.load().unwrap_err().to_string();
        assert!(err.contains("global.safetensors") && err.contains("global.prev.safetensors"), "{err}");
        assert!(err.contains(&m.sha256_hex()) && err.contains("damaged"), "{err}");
    }
}
