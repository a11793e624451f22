//! A device's state directory: everything it needs to carry on after a restart.
//!
//! - `adapter.safetensors`: the private LoRA adapter (pFedDPO);
//! - `ref_train.json`, `ref_heldout.json`: reference log-probs, computed once;
//! - `progress.json`: the last round it trained and the model its reference came from;
//! - `last_update.cbor`: the update it last sent, to send again if the aggregator
//!   restarts mid-round and asks for the same round.
//!
//! Every file is written atomically (temp file, fsync, rename).

use std::path::{Path, PathBuf};

use fedpo_model::io::write_atomic;
use fedpo_wire::{TransferChunk, Update};
use serde::{Deserialize, Serialize};

use crate::participant::ParticipantError;

/// Progress that survives a restart.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Progress {
    /// Last round trained and uploaded (0: none).
    pub(crate) last_round: u64,
    /// SHA-256 (hex) of the global model the reference log-probs were computed with.
    pub(crate) reference_model: Option<String>,
}

/// An update as sent, for resending.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SentUpdate {
    /// SHA-256 (hex) of the global model it was trained from.
    pub(crate) global_sha256: String,
    pub(crate) update: Update,
    pub(crate) chunks: Vec<TransferChunk>,
}

pub(crate) struct StateDir {
    root: PathBuf,
}

fn io_err(path: &Path, e: impl std::fmt::Display) -> ParticipantError {
    ParticipantError::State(format!("{}: {e}", path.display()))
}

impl StateDir {
    pub(crate) fn open(root: &Path) -> Result<Self, ParticipantError> {
        std::fs::create_dir_all(root).map_err(|e| io_err(root, e))?;
        Ok(Self { root: root.to_path_buf() })
    }

    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    pub(crate) fn adapter_path(&self) -> PathBuf {
        self.path("adapter.safetensors")
    }

    pub(crate) fn progress(&self) -> Result<Progress, ParticipantError> {
        let path = self.path("progress.json");
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| io_err(&path, e)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Progress::default()),
            Err(e) => Err(io_err(&path, e)),
        }
    }

    pub(crate) fn save_progress(&self, p: &Progress) -> Result<(), ParticipantError> {
        let path = self.path("progress.json");
        let bytes = serde_json::to_vec_pretty(p).map_err(|e| io_err(&path, e))?;
        write_atomic(&path, &bytes).map_err(|e| io_err(&path, e))
    }

    pub(crate) fn last_update(&self) -> Option<SentUpdate> {
        let bytes = std::fs::read(self.path("last_update.cbor")).ok()?;
        serde_cbor::from_slice(&bytes).ok()
    }

    pub(crate) fn save_last_update(&self, u: &SentUpdate) -> Result<(), ParticipantError> {
        let path = self.path("last_update.cbor");
        let bytes = serde_cbor::to_vec(u).map_err(|e| io_err(&path, e))?;
        write_atomic(&path, &bytes).map_err(|e| io_err(&path, e))
    }
}
