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
    /// Each device's peak resident memory after the round, MiB: only devices alone in
    /// their process report it (simulated threads would all report the whole process's).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub(crate) peak_rss_mib: BTreeMap<String, f64>,
    /// Device → seconds of local training it reported; the rest of the round's
    /// `seconds` is federation overhead (transfers, encoding, hashing, waiting).
    #[serde(default)]
    pub(crate) train_seconds: BTreeMap<String, f64>,
    /// The global gradient norm. With --diagnostics, exactly ‖mean_i ∇F_i(θ_t)‖ from the
    /// devices' full gradients at the round's model; otherwise the pseudo-gradient
    /// ‖mean update‖ / (lr · E) that local SGD followed.
    pub(crate) grad_norm: f64,
    /// The pseudo-gradient norm ‖mean update‖ / (lr · E), every training round, so that
    /// rounds with and without the --diagnostics measurement can be compared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) pseudo_grad_norm: Option<f64>,
    /// Gradient diversity mean_i ‖∇F_i(θ_t) − mean‖² (with --diagnostics).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) kappa2: Option<f64>,
    /// Mean pairwise cosine between device updates, per layer (with --diagnostics).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub(crate) layer_cos: BTreeMap<String, f64>,
    /// Of bytes_up, what the diagnostic gradients took: present exactly on the rounds that
    /// measured --diagnostics (so then `grad_norm` is the exact one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) diagnostics_bytes: Option<u64>,
    /// Norm of the change applied to the global model.
    pub(crate) update_norm: f64,
    /// Why a training round left the global model as it was (quorum not met, updates
    /// that could not be combined, or a result that was not finite).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) unchanged: Option<String>,
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
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) dp_epsilon: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The names of a struct's fields as serde sees them, from the list its derived
    /// `Deserialize` hands to `deserialize_struct`; fields skipped when empty count too.
    fn field_names<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
        struct Names(Option<&'static [&'static str]>);
        impl<'de> serde::Deserializer<'de> for &mut Names {
            type Error = serde::de::value::Error;
            fn deserialize_any<V: serde::de::Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
                Err(serde::de::Error::custom("only a struct's field names are read"))
            }
            fn deserialize_struct<V: serde::de::Visitor<'de>>(
                self,
                _name: &'static str,
                fields: &'static [&'static str],
                visitor: V,
            ) -> Result<V::Value, Self::Error> {
                self.0 = Some(fields);
                self.deserialize_any(visitor)
            }
            serde::forward_to_deserialize_any! {
                bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
                option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
                ignored_any
            }
        }
        let mut names = Names(None);
        let _ = T::deserialize(&mut names);
        names.0.expect("a struct")
    }

    /// The keys a table of `docs/metrics.md` names in its first column, under `heading`.
    fn documented_keys(heading: &str) -> Vec<String> {
        let page = include_str!("../../docs/metrics.md");
        let section = page.split("\n## ").find(|s| s.starts_with(heading)).expect("the section");
        section
            .lines()
            .filter_map(|l| l.strip_prefix("| "))
            .filter_map(|l| l.split(" |").next())
            .flat_map(|cell| cell.split(", "))
            .filter_map(|k| k.strip_prefix('`')?.strip_suffix('`').map(str::to_string))
            .collect()
    }

    #[test]
    fn every_written_key_is_in_the_metrics_reference() {
        for (heading, fields) in
            [("`metrics.jsonl`", field_names::<RoundRecord>()), ("`summary.json`", field_names::<Summary>())]
        {
            let documented = documented_keys(heading);
            let missing: Vec<_> = fields.iter().filter(|f| !documented.iter().any(|d| d == *f)).collect();
            assert!(missing.is_empty(), "docs/metrics.md's {heading} table does not name {missing:?}");
            let stale: Vec<_> = documented.iter().filter(|d| !fields.contains(&d.as_str())).collect();
            assert!(stale.is_empty(), "docs/metrics.md's {heading} table names keys never written: {stale:?}");
        }
    }

    #[test]
    fn keys_of_features_not_in_use_are_left_out_not_null() {
        let line = serde_json::to_value(RoundRecord::default()).unwrap();
        for key in
            ["kappa2", "layer_cos", "diagnostics_bytes", "pseudo_grad_norm", "dp_epsilon", "dp_delta", "peak_rss_mib"]
        {
            assert!(line.get(key).is_none(), "{key} written without its feature: {line}");
        }
        let back: RoundRecord = serde_json::from_value(line).unwrap();
        assert_eq!(back, RoundRecord::default(), "a record without them reads back");
    }
}
