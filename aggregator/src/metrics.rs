//! What each round measured, as one JSON object per line in `metrics.jsonl`, and the
//! job's `summary.json`.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// One round's record. Fields added later default when reading older logs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub(crate) struct RoundRecord {
    pub(crate) round: u64,
    pub(crate) method: String,
    /// True for the closing evaluation-only round.
    pub(crate) evaluation: bool,
    pub(crate) selected: Vec<String>,
    /// Devices whose updates were aggregated.
    pub(crate) participants: Vec<String>,
    /// Pair-weighted mean of the participants' mean local DPO loss.
    pub(crate) train_loss: f64,
    /// Reward accuracy on each device's training pairs: over the batches of its local
    /// steps in a training round, over all of them in the evaluation round.
    pub(crate) reward_acc: BTreeMap<String, f64>,
    /// Reward accuracy on each device's held-out pairs, at the round's start model.
    pub(crate) heldout_acc: BTreeMap<String, f64>,
    /// Each device's peak resident memory after the round, MiB. Devices simulated in one
    /// process share that process's number.
    pub(crate) peak_rss_mib: BTreeMap<String, f64>,
    /// Device → seconds of local training it reported; the rest of the round's
    /// `seconds` is federation overhead (transfers, encoding, hashing, waiting).
    #[serde(default)]
    pub(crate) train_seconds: BTreeMap<String, f64>,
    /// The global gradient norm. With --diagnostics, exactly ‖mean_i ∇F_i(θ_t)‖ from the
    /// devices' full gradients at the round's model; otherwise the pseudo-gradient
    /// ‖mean update‖ / (lr · E) that local SGD followed.
    pub(crate) grad_norm: f64,
    /// Gradient diversity mean_i ‖∇F_i(θ_t) − mean‖² (with --diagnostics).
    pub(crate) kappa2: Option<f64>,
    /// Mean pairwise cosine between device updates, per layer (with --diagnostics).
    pub(crate) layer_cos: BTreeMap<String, f64>,
    /// Of bytes_up, what the diagnostic gradients took.
    pub(crate) diagnostics_bytes: u64,
    /// Norm of the change applied to the global model.
    pub(crate) update_norm: f64,
    /// Pair-weighted mean of the devices' first-step gradient norms.
    pub(crate) device_grad_norm: f64,
    /// Update bytes received.
    pub(crate) bytes_up: u64,
    /// Of bytes_up, each device's (its update and sections, duplicates not counted): what
    /// one device's uplink carried this round, by which the update codecs are compared.
    #[serde(default)]
    pub(crate) bytes_up_by_device: BTreeMap<String, u64>,
    /// Global-model bytes published (once per publish; the broker fans them out).
    pub(crate) bytes_down: u64,
    pub(crate) seconds: f64,
    /// Updates refused, with the reason.
    pub(crate) rejected: BTreeMap<String, String>,
    /// Updates scaled down to --clip-norm.
    pub(crate) clipped: usize,
    /// With --dp-noise-multiplier: ε spent so far at `dp_delta`, by the RDP accountant.
    pub(crate) dp_epsilon: Option<f64>,
    pub(crate) dp_delta: Option<f64>,
}

/// The job's outcome.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Summary {
    pub(crate) method: String,
    pub(crate) rounds: u64,
    pub(crate) devices: usize,
    pub(crate) reward_acc_mean: f64,
    pub(crate) heldout_acc_mean: f64,
    pub(crate) reward_acc: BTreeMap<String, f64>,
    pub(crate) heldout_acc: BTreeMap<String, f64>,
    pub(crate) final_train_loss: f64,
    pub(crate) bytes_up_total: u64,
    pub(crate) bytes_down_total: u64,
    pub(crate) seconds: f64,
    pub(crate) global_digest: String,
    /// The aggregator process's peak resident memory, MiB.
    #[serde(default)]
    pub(crate) peak_rss_mib: f64,
}

/// Appends records to `metrics.jsonl`, flushing each line (a crash loses nothing written).
pub(crate) struct MetricsLog {
    file: File,
    path: PathBuf,
}

impl MetricsLog {
    pub(crate) fn open(out: &Path) -> Result<Self> {
        let path = out.join("metrics.jsonl");
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(Self { file, path })
    }

    pub(crate) fn append(&mut self, record: &RoundRecord) -> Result<()> {
        let mut line = serde_json::to_vec(record)?;
        line.push(b'\n');
        self.file
            .write_all(&line)
            .and_then(|_| self.file.sync_data())
            .with_context(|| format!("writing {}", self.path.display()))
    }
}

/// Mean of a map's values (0 when empty).
pub(crate) fn mean(values: &BTreeMap<String, f64>) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.values().sum::<f64>() / values.len() as f64
    }
}
