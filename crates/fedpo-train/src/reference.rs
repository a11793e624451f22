//! Reference log-probs: computed once per pair with the starting model, then cached.
//!
//! DPO compares the policy with a fixed reference. The reference never changes during a
//! run, so its log-probs are computed once, before the first step, and persisted keyed by
//! the reference model's hash and the data fingerprint: a restarted device reuses them, and
//! a changed model or data set never reads a stale cache.

use std::path::Path;

use fedpo_data::{collate, TokenizedPair};
use fedpo_model::Policy;
use fedpo_process::files::write_atomic;
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};
use crate::logps::{sequence_logps_values, BatchTensors};

const FORMAT: &str = "fedpo-ref-logps/1";

/// Summed response log-probs of every pair, in data order (the reference's, or any
/// policy's when scoring).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SequenceLogps {
    /// Summed log-prob of each chosen response.
    pub chosen: Vec<f64>,
    /// Summed log-prob of each rejected response.
    pub rejected: Vec<f64>,
}

#[derive(Serialize, Deserialize)]
struct CacheFile {
    format: String,
    model_hash: String,
    data_fingerprint: String,
    logps: SequenceLogps,
}

/// Summed response log-probs of `pairs` under `policy`, `batch_pairs` pairs per forward
/// pass: the reference before training, or a trained policy when scoring.
pub fn score_pairs(policy: &Policy, pairs: &[TokenizedPair], batch_pairs: usize, pad_id: u32) -> Result<SequenceLogps> {
    let mut out = SequenceLogps { chosen: Vec::with_capacity(pairs.len()), rejected: Vec::with_capacity(pairs.len()) };
    for chunk in pairs.chunks(batch_pairs.max(1)) {
        let refs: Vec<&TokenizedPair> = chunk.iter().collect();
        let batch = BatchTensors::new(&collate(&refs, pad_id), policy)?;
        let values = sequence_logps_values(policy, &batch)?;
        let (c, r) = values.split_at(chunk.len());
        out.chosen.extend_from_slice(c);
        out.rejected.extend_from_slice(r);
    }
    Ok(out)
}

/// Whether the cache at `path` holds the log-probs of `model_hash` on the data of
/// `data_fingerprint`; if not, why not.
pub fn check_cache(path: &Path, model_hash: &str, data_fingerprint: &str) -> std::result::Result<(), String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot be read ({e})"))?;
    let c: CacheFile = serde_json::from_slice(&bytes).map_err(|e| format!("is not a reference cache ({e})"))?;
    if c.format != FORMAT {
        return Err(format!("has format `{}`, not {FORMAT}", c.format));
    }
    if c.model_hash != model_hash {
        return Err(format!("is for model {}, not the reference model {model_hash}", c.model_hash));
    }
    if c.data_fingerprint != data_fingerprint {
        return Err("is for other training data than this device's".into());
    }
    Ok(())
}

/// Reads the cache at `path` if it matches `model_hash` and `data_fingerprint`, else
/// computes the log-probs and writes the cache atomically. Returns the log-probs and
/// whether they came from the cache.
pub fn load_or_score_pairs(
    path: &Path,
    model_hash: &str,
    data_fingerprint: &str,
    compute: impl FnOnce() -> Result<SequenceLogps>,
) -> Result<(SequenceLogps, bool)> {
    if let Ok(bytes) = std::fs::read(path) {
        match serde_json::from_slice::<CacheFile>(&bytes) {
            Ok(c) if c.format == FORMAT && c.model_hash == model_hash && c.data_fingerprint == data_fingerprint => {
                return Ok((c.logps, true));
            }
            Ok(_) => {
                tracing::info!(path = %path.display(), "reference cache is for another model or data set; recomputing")
            }
            Err(e) => tracing::warn!(path = %path.display(), error = %e, "unreadable reference cache; recomputing"),
        }
    }
    let logps = compute()?;
    let file = CacheFile {
        format: FORMAT.to_string(),
        model_hash: model_hash.to_string(),
        data_fingerprint: data_fingerprint.to_string(),
        logps: logps.clone(),
    };
    let bytes = serde_json::to_vec(&file).map_err(|e| TrainError::Invalid(e.to_string()))?;
    write_atomic(path, &bytes)?;
    Ok((logps, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_is_reused_only_for_the_same_model_and_data() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ref.json");
        let logps = SequenceLogps { chosen: vec![-1.5, -2.25], rejected: vec![-3.0, -4.125] };
        let (a, hit) = load_or_score_pairs(&path, "m1", "d1", || Ok(logps.clone())).unwrap();
        assert!(!hit);
        assert_eq!(a, logps);
        let (b, hit) = load_or_score_pairs(&path, "m1", "d1", || panic!("must not recompute")).unwrap();
        assert!(hit);
        assert_eq!(b, logps);
        let other = SequenceLogps { chosen: vec![0.0, 0.0], rejected: vec![0.0, 0.0] };
        let (c, hit) = load_or_score_pairs(&path, "m2", "d1", || Ok(other.clone())).unwrap();
        assert!(!hit);
        assert_eq!(c, other);
        let (_, hit) = load_or_score_pairs(&path, "m2", "d2", || Ok(other.clone())).unwrap();
        assert!(!hit, "a new data fingerprint invalidates the cache");
    }
}
