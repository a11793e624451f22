//! Hugging Face checkpoints in, fedpo models out. The adapter's own files (fedpo's and
//! PEFT's) are read and written in `adapter_file.rs`, re-exported here.
//!
//! An HF GPT-2 directory holds `config.json`, `model.safetensors` and (optionally here)
//! `tokenizer.json`. Its tensor names come in two layouts: `GPT2LMHeadModel` saves
//! `transformer.h.0...` and `GPT2Model` saves `h.0...`; both load. The head is tied to
//! `wte`, so `lm_head.weight` is usually absent and ignored when present. The attention
//! buffers `attn.bias` / `attn.masked_bias` (the causal mask) are skipped, never the
//! parameter `attn.c_attn.bias`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use crate::config::Gpt2Config;
use crate::error::{ModelError, Result};
use fedpo_process::files::write_atomic;

pub use crate::adapter_file::{base_hash, load_adapter, save_adapter, write_adapter, SavedAdapter, ADAPTER_FORMAT};
use crate::params::{ParamKind, ParamRole};
use crate::policy::Policy;
use crate::tensor_files::{read_safetensors, write_safetensors};
use crate::weights::TensorSource;

/// A loaded HF checkpoint directory.
pub struct HfCheckpoint {
    /// From `config.json`.
    pub config: Gpt2Config,
    /// Base tensors under normalised names (no `transformer.` prefix).
    pub base: TensorSource,
    /// `tokenizer.json`, when the directory has one.
    pub tokenizer_path: Option<PathBuf>,
}

/// Whether a checkpoint name is one of GPT-2's non-parameter attention buffers.
fn is_attention_buffer(name: &str) -> bool {
    let mut parts = name.rsplit('.');
    let last = parts.next();
    let module = parts.next();
    module == Some("attn") && matches!(last, Some("bias" | "masked_bias"))
}

/// Maps checkpoint names onto the model's names, dropping buffers and the tied head.
pub fn normalize_gpt2_names(raw: HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    raw.into_iter()
        .filter_map(|(name, t)| {
            let name = name.strip_prefix("transformer.").unwrap_or(&name).to_string();
            if is_attention_buffer(&name) || name == "lm_head.weight" {
                tracing::debug!(tensor = %name, "skipping buffer or tied head");
                None
            } else {
                Some((name, t))
            }
        })
        .collect()
}

/// Loads `config.json` and `model.safetensors` from an HF GPT-2 directory.
pub fn load_hf_dir(dir: &Path, device: &Device) -> Result<HfCheckpoint> {
    if !dir.is_dir() {
        return Err(ModelError::io(
            dir,
            std::io::Error::new(std::io::ErrorKind::NotFound, "model directory not found"),
        ));
    }
    let config = Gpt2Config::from_json_file(&dir.join("config.json"))?;
    let weights_path = dir.join("model.safetensors");
    let file = read_safetensors(&weights_path, device)?;
    let base = TensorSource {
        tensors: normalize_gpt2_names(file.tensors.tensors),
        description: weights_path.display().to_string(),
    };
    let tokenizer_path = Some(dir.join("tokenizer.json")).filter(|p| p.is_file());
    Ok(HfCheckpoint { config, base, tokenizer_path })
}

/// Saves the base model as an HF directory (`config.json` + `model.safetensors`, names
/// without prefix, tied head omitted) that `load_hf_dir` and transformers both read.
pub fn save_model_dir(policy: &Policy, dir: &Path) -> Result<()> {
    let config = serde_json::to_vec_pretty(&serde_json::json!({
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": policy.spec.config.n_layer,
        "n_embd": policy.spec.config.n_embd,
        "n_head": policy.spec.config.n_head,
        "n_inner": policy.spec.config.n_inner,
        "vocab_size": policy.spec.config.vocab_size,
        "n_positions": policy.spec.config.n_positions,
        "n_ctx": policy.spec.config.n_positions,
        "layer_norm_epsilon": policy.spec.config.layer_norm_epsilon,
        "activation_function": policy.spec.config.activation_function,
        "tie_word_embeddings": true,
    }))
    .map_err(|source| ModelError::Json { path: dir.join("config.json"), source })?;
    write_atomic(&dir.join("config.json"), &config)?;
    let tensors: Vec<(String, Tensor)> =
        policy.params.with_kind(ParamKind::Base).map(|p| (p.name.clone(), p.tensor().clone())).collect();
    let metadata =
        HashMap::from([("format".to_string(), "pt".to_string()), ("fedpo_base_hash".to_string(), base_hash(policy)?)]);
    write_safetensors(&dir.join("model.safetensors"), &tensors, metadata)
}

/// The tensors of one role, e.g. what a device would upload (`Shared`).
pub fn tensors_with_role(policy: &Policy, role: ParamRole) -> Vec<(String, Tensor)> {
    policy.params.with_role(role).map(|p| (p.name.clone(), p.tensor().clone())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_buffers_are_skipped_but_c_attn_bias_is_kept() {
        assert!(is_attention_buffer("h.0.attn.bias"));
        assert!(is_attention_buffer("h.11.attn.masked_bias"));
        assert!(!is_attention_buffer("h.0.attn.c_attn.bias"));
        assert!(!is_attention_buffer("h.0.attn.c_proj.bias"));
        assert!(!is_attention_buffer("h.0.ln_1.bias"));
    }

    #[test]
    fn prefixed_names_and_tied_head_are_normalised() {
        let t = Tensor::zeros(1, candle_core::DType::F32, &Device::Cpu).unwrap();
        let raw = HashMap::from([
            ("transformer.wte.weight".to_string(), t.clone()),
            ("transformer.h.0.attn.bias".to_string(), t.clone()),
            ("transformer.h.0.attn.c_attn.bias".to_string(), t.clone()),
            ("lm_head.weight".to_string(), t.clone()),
            ("ln_f.weight".to_string(), t),
        ]);
        let mut names: Vec<_> = normalize_gpt2_names(raw).into_keys().collect();
        names.sort();
        assert_eq!(names, vec!["h.0.attn.c_attn.bias", "ln_f.weight", "wte.weight"]);
    }
}
