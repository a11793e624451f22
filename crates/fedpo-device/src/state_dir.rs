//! A device's state directory: everything it needs to carry on after a restart.
//!
//! - `adapter.safetensors`: the private LoRA adapter (pFedDPO);
//! - `ref_train.json`, `ref_heldout.json`: reference log-probs, computed once;
//! - `reference-model.bin`: the model they were computed with (the first global model
//!   the device trained from, as received), so a damaged cache is rebuilt from the same
//!   model rather than from a later one;
//! - `progress.json`: the last round it trained, the run of the job it follows, whether
//!   it has saved an adapter, and the model its reference came from;
//! - `last_update.cbor`: the update it last sent, to send again if the aggregator
//!   restarts mid-round and asks for the same round;
//! - `residual.safetensors`: what a top-k update codec has not sent yet (error
//!   feedback), tagged with the round after which it is owed. A round's new residual is
//!   first written as `residual.next.safetensors` and renamed over the old one only once
//!   the round is recorded in `progress.json`, so a crash in between can neither drop
//!   what was owed nor count it twice;
//! - `round-start.f32`: while a round trains with its starting model on disk
//!   ([`fedpo_model::SpilledStart`]), that model's shared tensors; removed once the update
//!   is formed. It is scratch: a crash mid-round retrains the round and overwrites it.
//! - `global-model.bin`, `global-model.json`: the latest global model received (as
//!   received) and what it is (round, digest, model spec), for `fedpo-device generate`
//!   and `export` to use the model with the private adapter. The model is written first,
//!   so the description never vouches for a model that is not there;
//! - `incoming/`: where a device that takes turns with others in one process
//!   (`simulate`) keeps the round's model while it waits for its turn
//!   ([`fedpo_wire::Bundle::kept`]). Scratch: emptied when the device starts.
//!
//! Every file is written atomically (temp file, fsync, rename), but `last_update.cbor`,
//! which `progress.json` vouches for (see [`StateDir::save_last_update`]), and the scratch
//! `round-start.f32`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use fedpo_model::tensor_files::{read_safetensors, write_safetensors};
use fedpo_process::files::{rewrite_in_place_with, write_atomic};
use fedpo_wire::{Residual, TransferChunk, Update};
use serde::{Deserialize, Serialize};

use crate::error::ParticipantError;

/// JobProgress that survives a restart.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct JobProgress {
    /// Last round trained and uploaded (0: none).
    pub(crate) last_round: u64,
    /// Digest (hex) of the global model the reference log-probs were computed with. Only
    /// ever compared with itself, so a SHA-256 left by an older build stays valid.
    pub(crate) reference_model: Option<String>,
    /// The run of the job this directory follows (see `participant::admission`); `None`
    /// until its first plan.
    #[serde(default)]
    pub(crate) run: Option<u64>,
    /// Whether the private adapter has been saved: from then on a missing
    /// `adapter.safetensors` is lost personalisation, not a device that never trained.
    #[serde(default)]
    pub(crate) adapter_saved: bool,
}

/// An update as sent, for resending.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct SentUpdate {
    /// Digest (hex) of the global model it was trained from. Files from before the
    /// BLAKE3 digest hold a SHA-256 under the old name: it matches no plan, so such an
    /// update is trained again rather than resent.
    #[serde(alias = "global_sha256")]
    pub(crate) global_digest: String,
    pub(crate) update: Update,
    pub(crate) chunks: Vec<TransferChunk>,
}

pub(crate) struct StateDir {
    root: PathBuf,
}

/// Where the latest global model is kept, and its description.
const LATEST_MODEL: &str = "global-model.bin";
const LATEST_MODEL_INFO: &str = "global-model.json";

/// The latest global model a device received.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LatestModel {
    /// The round it was received for (the closing evaluation's: the job's final model).
    pub round: u64,
    /// Its digest, hex.
    pub digest: String,
    /// The job's model spec (`fedpo_model::PolicySpec`, JSON), as the plan gave it.
    pub model_spec: String,
    /// The job.
    pub job: String,
}

/// Reads the latest global model a device kept in `dir`: its description and its bytes,
/// checked against the digest. Errors name the file and what to do.
pub fn read_latest_model(dir: &Path) -> Result<(LatestModel, fedpo_wire::Bytes), ParticipantError> {
    let described = dir.join(LATEST_MODEL_INFO);
    let info: LatestModel = match std::fs::read(&described) {
        Ok(json) => serde_json::from_slice(&json).map_err(|e| io_err(&described, e))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(io_err(
                &described,
                "missing: this state directory has not received a global model yet (a device keeps one from its \
                 first round on)",
            ))
        }
        Err(e) => return Err(io_err(&described, e)),
    };
    let path = dir.join(LATEST_MODEL);
    let bytes = std::fs::read(&path).map_err(|e| io_err(&path, e))?;
    if hex::encode(fedpo_wire::digest(&bytes)) != info.digest {
        return Err(io_err(
            &path,
            format!(
                "is not the model {} describes (round {}); the next round rewrites both",
                described.display(),
                info.round
            ),
        ));
    }
    Ok((info, bytes.into()))
}

/// Where the reference model is kept.
pub(crate) const REFERENCE_MODEL: &str = "reference-model.bin";

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

    /// `incoming/`, created and emptied of what an earlier process left there.
    pub(crate) fn fresh_incoming(&self) -> Result<PathBuf, ParticipantError> {
        let dir = self.path("incoming");
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(|e| io_err(&dir, e))?;
        }
        std::fs::create_dir_all(&dir).map_err(|e| io_err(&dir, e))?;
        Ok(dir)
    }

    pub(crate) fn adapter_path(&self) -> PathBuf {
        self.path("adapter.safetensors")
    }

    /// Checks, before the device says hello, what its next round will rely on: a
    /// readable `progress.json` with a round in range, the adapter it saved (unless
    /// `reset_adapter`, which starts a fresh one), and reference caches for the reference
    /// model and this device's data (`references`: file name → data fingerprint). Nothing
    /// here is repaired silently: a reference cache cannot be rebuilt once the model it
    /// came from has moved on.
    pub(crate) fn check(
        &self,
        reset_adapter: bool,
        references: &[(&str, String)],
    ) -> Result<JobProgress, ParticipantError> {
        let mut progress = self.progress()?;
        let path = self.path("progress.json");
        if progress.last_round > fedpo_wire::MAX_ROUND {
            return Err(io_err(
                &path,
                format!(
                    "last_round {} is beyond the highest round a job may reach, {}",
                    progress.last_round,
                    fedpo_wire::MAX_ROUND
                ),
            ));
        }
        if progress.adapter_saved && !self.adapter_path().exists() {
            if !reset_adapter {
                return Err(io_err(
                    &self.adapter_path(),
                    "missing, though this device has trained it: its personalisation would be lost. Restore the file, \
                     or pass --reset-adapter to start a fresh adapter",
                ));
            }
            tracing::warn!(path = %self.adapter_path().display(), "--reset-adapter: the saved adapter is missing; a fresh one starts");
            progress.adapter_saved = false;
            self.save_progress(&progress)?;
        }
        if let Some(model) = &progress.reference_model {
            for (file, data) in references {
                let path = self.path(file);
                let Err(why) = fedpo_train::check_cache(&path, model, data) else { continue };
                if self.kept_reference_model(model)?.is_some() {
                    tracing::warn!(path = %path.display(), %why, "reference log-probs unusable; the round rebuilds them from the kept reference model");
                    match std::fs::remove_file(&path) {
                        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io_err(&path, e)),
                        _ => continue,
                    }
                }
                return Err(io_err(
                    &path,
                    format!(
                        "{why}. The reference log-probs come from the first global model this device trained \
                         from, and {REFERENCE_MODEL} does not hold it (missing, or another model), so they cannot \
                         be rebuilt: restore the files (and the data they were computed on), or start over with an \
                         empty --state-dir"
                    ),
                ));
            }
        }
        Ok(progress)
    }

    /// Keeps the model the reference log-probs are computed with: `bytes` as received,
    /// so that their digest is the plan's.
    pub(crate) fn keep_reference_model(&self, bytes: &[u8]) -> Result<(), ParticipantError> {
        let path = self.path(REFERENCE_MODEL);
        write_atomic(&path, bytes).map_err(|e| io_err(&path, e))
    }

    /// The kept reference model's bytes, when the file holds the model of `digest` (hex).
    pub(crate) fn kept_reference_model(&self, digest: &str) -> Result<Option<fedpo_wire::Bytes>, ParticipantError> {
        let path = self.path(REFERENCE_MODEL);
        match std::fs::read(&path) {
            Ok(b) if hex::encode(fedpo_wire::digest(&b)) == digest => Ok(Some(b.into())),
            Ok(_) => {
                tracing::warn!(path = %path.display(), reference = digest, "the kept reference model is another model");
                Ok(None)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err(&path, e)),
        }
    }

    /// Digest of the latest model this device kept for `job`, as its description says
    /// (checked when the model is used); empty when there is none.
    pub(crate) fn latest_model_digest(&self, job: &str) -> Vec<u8> {
        std::fs::read(self.path(LATEST_MODEL_INFO))
            .ok()
            .and_then(|json| serde_json::from_slice::<LatestModel>(&json).ok())
            .filter(|info| info.job == job)
            .and_then(|info| hex::decode(info.digest).ok())
            .filter(|d| d.len() == fedpo_wire::DIGEST_BYTES)
            .unwrap_or_default()
    }

    /// The state directory's root.
    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// Keeps `bytes`, the global model of `info.round` as received, as the latest model.
    pub(crate) fn keep_latest_model(&self, bytes: &[u8], info: &LatestModel) -> Result<(), ParticipantError> {
        let (model, described) = (self.path(LATEST_MODEL), self.path(LATEST_MODEL_INFO));
        write_atomic(&model, bytes).map_err(|e| io_err(&model, e))?;
        let json = serde_json::to_vec_pretty(info).map_err(|e| io_err(&described, e))?;
        write_atomic(&described, &json).map_err(|e| io_err(&described, e))
    }

    pub(crate) fn progress(&self) -> Result<JobProgress, ParticipantError> {
        let path = self.path("progress.json");
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| io_err(&path, e)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(JobProgress::default()),
            Err(e) => Err(io_err(&path, e)),
        }
    }

    pub(crate) fn save_progress(&self, p: &JobProgress) -> Result<(), ParticipantError> {
        let path = self.path("progress.json");
        let bytes = serde_json::to_vec_pretty(p).map_err(|e| io_err(&path, e))?;
        write_atomic(&path, &bytes).map_err(|e| io_err(&path, e))
    }

    pub(crate) fn last_update(&self) -> Option<SentUpdate> {
        let bytes = std::fs::read(self.path("last_update.cbor")).ok()?;
        serde_cbor::from_slice(&bytes).ok()
    }

    /// Saves the update for resending. Streamed, since the update is the size of the model
    /// and a second copy in memory would raise the device's peak by as much; and rewritten
    /// in place, since it is rewritten every round. That is safe because it is read only
    /// for the round `progress.json` records as sent, which is saved after this returns: a
    /// crash mid-write leaves the progress at an earlier round, which is then trained again.
    pub(crate) fn save_last_update(&self, u: &SentUpdate) -> Result<(), ParticipantError> {
        let path = self.path("last_update.cbor");
        rewrite_in_place_with(&path, |w| serde_cbor::to_writer(w, u).map_err(std::io::Error::other))
            .map_err(|e| io_err(&path, e))
    }

    /// What compression still owes after round `last_round`, the last one recorded in
    /// progress: a staged residual of that round is committed first (the crash came after
    /// the progress was saved), one of a later round is discarded (the round will be
    /// trained again). A file that cannot be read is reported and starts afresh: error
    /// feedback then forgets what was owed but the job goes on.
    pub(crate) fn residual(&self, last_round: u64) -> Result<Residual, ParticipantError> {
        let (next, current) = (self.path("residual.next.safetensors"), self.path("residual.safetensors"));
        if next.exists() {
            match read_residual(&next) {
                Ok((round, _)) if round == last_round => {
                    std::fs::rename(&next, &current).map_err(|e| io_err(&next, e))?
                }
                _ => std::fs::remove_file(&next).map_err(|e| io_err(&next, e))?,
            }
        }
        match read_residual(&current) {
            Ok((round, residual)) if round <= last_round => Ok(residual),
            Ok((round, _)) => {
                tracing::warn!(
                    round,
                    last_round,
                    "residual is from a round this device has not recorded; starting afresh"
                );
                Ok(Residual::default())
            }
            Err(_) if !current.exists() => Ok(Residual::default()),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the error-feedback residual; starting afresh");
                Ok(Residual::default())
            }
        }
    }

    /// Writes the residual owed after `round`, to be committed by
    /// [`StateDir::commit_residual`] once the round is recorded.
    pub(crate) fn stage_residual(&self, round: u64, residual: &Residual) -> Result<(), ParticipantError> {
        let path = self.path("residual.next.safetensors");
        let tensors = residual
            .tensors
            .iter()
            .map(|(name, values)| Ok((name.clone(), Tensor::from_slice(values, values.len(), &Device::Cpu)?)))
            .collect::<candle_core::Result<Vec<_>>>()
            .map_err(|e| io_err(&path, e))?;
        let metadata = HashMap::from([("round".to_string(), round.to_string())]);
        write_safetensors(&path, &tensors, metadata).map_err(|e| io_err(&path, e))
    }

    /// Makes the staged residual the current one.
    pub(crate) fn commit_residual(&self) -> Result<(), ParticipantError> {
        let next = self.path("residual.next.safetensors");
        std::fs::rename(&next, self.path("residual.safetensors")).map_err(|e| io_err(&next, e))
    }
}

/// A residual file: the round it is owed after, and its values.
fn read_residual(path: &Path) -> Result<(u64, Residual), ParticipantError> {
    let file = read_safetensors(path, &Device::Cpu).map_err(|e| io_err(path, e))?;
    let round = file
        .metadata
        .get("round")
        .and_then(|r| r.parse().ok())
        .ok_or_else(|| io_err(path, "no round in its metadata"))?;
    let mut residual = Residual::default();
    for (name, t) in &file.tensors.tensors {
        let values = t.flatten_all().and_then(|t| t.to_vec1::<f32>()).map_err(|e| io_err(path, e))?;
        residual.tensors.insert(name.clone(), values);
    }
    Ok((round, residual))
}
