//! Low-rank adapters (LoRA, Hu et al. 2021) on GPT-2's Conv1D projections.
//!
//! An adapted projection computes `x W + b + (alpha / r) * x A^T B^T` with `A: [r, in]`
//! and `B: [out, r]`, the layout and names of PEFT (`lora_A.weight`, `lora_B.weight`), so an
//! adapter maps one-to-one onto a PEFT checkpoint. `A` starts like PEFT's Kaiming-uniform
//! (`U(-1/sqrt(in), 1/sqrt(in))`) and `B` at zero, so a fresh adapter leaves the model's
//! output exactly unchanged: the reference model of DPO and the adapted policy agree at step 0.

use std::fmt;
use std::str::FromStr;

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// The GPT-2 modules an adapter can wrap, by their path inside a block.
pub const LORA_MODULES: [&str; 4] = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"];

/// Rank, scale and placement of the adapters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    /// Rank `r` of every adapter.
    pub rank: usize,
    /// `alpha`; the update is scaled by `alpha / r`.
    pub alpha: f64,
    /// Module paths inside each block (a subset of [`LORA_MODULES`]), in a canonical order.
    pub targets: Vec<String>,
}

impl Default for LoraConfig {
    /// r 8, alpha 16 on `c_attn`: the paper's and the peer benchmark's setting.
    fn default() -> Self {
        Self { rank: 8, alpha: 16.0, targets: vec!["attn.c_attn".to_string()] }
    }
}

impl LoraConfig {
    /// Builds a config, resolving each target against [`LORA_MODULES`].
    ///
    /// A target matches a module when it equals the module path or its last components
    /// (`c_attn`, `mlp.c_proj`); `c_proj` therefore matches both projections, as in PEFT.
    /// A target that matches nothing is an error: a silently un-adapted model trains
    /// nothing and its DPO loss sits at ln 2.
    pub fn new(rank: usize, alpha: f64, targets: &[&str]) -> Result<Self> {
        if rank == 0 {
            return Err(ModelError::InvalidConfig("LoRA rank must be at least 1".into()));
        }
        if !(alpha.is_finite() && alpha > 0.0) {
            return Err(ModelError::InvalidConfig(format!("LoRA alpha must be positive, got {alpha}")));
        }
        if targets.is_empty() {
            return Err(ModelError::InvalidConfig("LoRA needs at least one target module".into()));
        }
        let mut resolved = Vec::new();
        for target in targets {
            let target = target.trim();
            let matches: Vec<&str> =
                LORA_MODULES.iter().copied().filter(|m| *m == target || m.ends_with(&format!(".{target}"))).collect();
            if matches.is_empty() {
                return Err(ModelError::UnknownLoraTarget { target: target.to_string(), valid: LORA_MODULES.to_vec() });
            }
            resolved.extend(matches);
        }
        let targets = LORA_MODULES.iter().filter(|m| resolved.contains(m)).map(|m| m.to_string()).collect();
        Ok(Self { rank, alpha, targets })
    }

    /// The factor `alpha / r` applied to the adapter's output.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// Whether a block module (e.g. `attn.c_attn`) carries an adapter.
    pub fn targets_module(&self, module: &str) -> bool {
        self.targets.iter().any(|t| t == module)
    }
}

/// A comma-separated target list, as given on the command line (`c_attn,mlp.c_fc`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraTargets(pub Vec<String>);

impl FromStr for LoraTargets {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let list: Vec<String> = s.split(',').map(str::trim).filter(|t| !t.is_empty()).map(String::from).collect();
        if list.is_empty() {
            return Err("empty LoRA target list".into());
        }
        Ok(Self(list))
    }
}

impl fmt::Display for LoraTargets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join(","))
    }
}

/// The adapter of one projection.
#[derive(Debug, Clone)]
pub(crate) struct LoraLayer {
    pub(crate) a: Tensor,
    pub(crate) b: Tensor,
    pub(crate) scale: f64,
}

impl LoraLayer {
    /// `scale * x A^T B^T` for a 2-D `x: [n, in]`. The scale applies to the rank-`r`
    /// intermediate, so no output-sized tensor is made (and kept for backward) just to scale.
    pub(crate) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (a, b) = (self.a.to_dtype(x.dtype())?, self.b.to_dtype(x.dtype())?);
        (x.matmul(&a.t()?)? * self.scale)?.matmul(&b.t()?)
    }

    /// The adapter as a weight update in the Conv1D layout, `s A^T B^T: [in, out]`, in the
    /// adapter's dtype.
    pub(crate) fn delta_weight(&self) -> candle_core::Result<Tensor> {
        (self.a.t()? * self.scale)?.matmul(&self.b.t()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_target_names_resolve_to_module_paths() {
        let cfg = LoraConfig::new(4, 8.0, &["c_attn", "mlp.c_fc"]).unwrap();
        assert_eq!(cfg.targets, vec!["attn.c_attn", "mlp.c_fc"]);
        assert_eq!(cfg.scale(), 2.0);
    }

    #[test]
    fn bare_c_proj_targets_both_projections_like_peft() {
        let cfg = LoraConfig::new(8, 16.0, &["c_proj"]).unwrap();
        assert_eq!(cfg.targets, vec!["attn.c_proj", "mlp.c_proj"]);
    }

    #[test]
    fn target_matching_no_module_is_an_error_listing_valid_ones() {
        let err = LoraConfig::new(8, 16.0, &["q_proj"]).unwrap_err().to_string();
        assert!(err.contains("q_proj") && err.contains("attn.c_attn"), "{err}");
    }

    #[test]
    fn zero_rank_is_rejected() {
        assert!(LoraConfig::new(0, 16.0, &["c_attn"]).is_err());
    }
}
