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

/// A registered device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct DeviceRecord {
    /// Training pairs (FedAvg weight).
    pub(crate) pairs: u64,
    /// Compute backend it reported.
    pub(crate) backend: String,
    /// Whether it is connected, as far as the aggregator knows.
    pub(crate) online: bool,
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
