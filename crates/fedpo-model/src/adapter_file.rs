//! The private adapter on disk, in the two forms fedpo reads and writes: its own adapter
//! file (safetensors whose metadata records rank, alpha, targets and the hash of the base
//! it was trained against) and PEFT's LoRA directory, which transformers loads.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use serde_json::json;

use crate::error::{ModelError, Result};
use crate::lora::LoraConfig;
use crate::params::ParamKind;
use crate::policy::Policy;
use crate::tensor_files::{hash_tensors, read_safetensors, write_json, write_safetensors};
use crate::weights::TensorSource;

/// Format tag written into adapter files.
pub const ADAPTER_FORMAT: &str = "fedpo-adapter/1";

/// The prefix PEFT gives a causal LM's tensors.
const PEFT_PREFIX: &str = "base_model.model.transformer.";

/// The hash of the policy's base tensors (see [`hash_tensors`]).
pub fn base_hash(policy: &Policy) -> Result<String> {
    hash_tensors(policy.params.with_kind(ParamKind::Base).map(|p| (p.name.as_str(), p.tensor())))
}

/// Saves the adapter tensors with their rank, alpha, targets and the hash of the base
/// they were trained against.
pub fn save_adapter(policy: &Policy, path: &Path) -> Result<()> {
    let lora = policy.spec.lora.as_ref().ok_or_else(|| {
        ModelError::InvalidConfig(format!("cannot save an adapter to {}: the model has none", path.display()))
    })?;
    let tensors: Vec<(String, Tensor)> =
        policy.params.with_kind(ParamKind::Adapter).map(|p| (p.name.clone(), p.tensor().clone())).collect();
    let metadata = HashMap::from([
        ("format".to_string(), ADAPTER_FORMAT.to_string()),
        ("rank".to_string(), lora.rank.to_string()),
        ("alpha".to_string(), lora.alpha.to_string()),
        ("targets".to_string(), lora.targets.join(",")),
        ("base_hash".to_string(), base_hash(policy)?),
    ]);
    write_safetensors(path, &tensors, metadata)
}

/// Writes a loaded adapter (a fedpo file's or a PEFT directory's) as a fedpo adapter file.
pub fn write_adapter(adapter: &SavedAdapter, path: &Path) -> Result<()> {
    let mut tensors: Vec<(String, Tensor)> =
        adapter.tensors.tensors.iter().map(|(name, t)| (name.clone(), t.clone())).collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let mut metadata = HashMap::from([
        ("format".to_string(), ADAPTER_FORMAT.to_string()),
        ("rank".to_string(), adapter.lora.rank.to_string()),
        ("alpha".to_string(), adapter.lora.alpha.to_string()),
        ("targets".to_string(), adapter.lora.targets.join(",")),
    ]);
    if let Some(hash) = &adapter.base_hash {
        metadata.insert("base_hash".to_string(), hash.clone());
    }
    write_safetensors(path, &tensors, metadata)
}

/// A saved adapter: its tensors and the settings recorded with them.
pub struct SavedAdapter {
    /// `h.N.<module>.lora_{A,B}.weight` tensors.
    pub tensors: TensorSource,
    /// Rank, alpha and targets from the file's metadata.
    pub lora: LoraConfig,
    /// Hash of the base the adapter was last trained against.
    pub base_hash: Option<String>,
}

/// Reads an adapter: a fedpo adapter file with its metadata, or a PEFT LoRA directory
/// ([`load_peft_dir`]).
pub fn load_adapter(path: &Path, device: &Device) -> Result<SavedAdapter> {
    if path.is_dir() {
        return load_peft_dir(path, device);
    }
    let file = read_safetensors(path, device)?;
    let mismatch = |reason: String| ModelError::AdapterMismatch { path: path.to_path_buf(), reason };
    let meta = &file.metadata;
    if meta.get("format").map(String::as_str) != Some(ADAPTER_FORMAT) {
        return Err(mismatch(format!("not a {ADAPTER_FORMAT} file (format {:?})", meta.get("format"))));
    }
    let field = |k: &str| meta.get(k).ok_or_else(|| mismatch(format!("metadata lacks `{k}`")));
    let rank: usize = field("rank")?.parse().map_err(|_| mismatch("bad `rank`".into()))?;
    let alpha: f64 = field("alpha")?.parse().map_err(|_| mismatch("bad `alpha`".into()))?;
    let targets: Vec<&str> = field("targets")?.split(',').collect();
    let lora = LoraConfig::new(rank, alpha, &targets)?;
    Ok(SavedAdapter { tensors: file.tensors, lora, base_hash: meta.get("base_hash").cloned() })
}

/// The adapter as a PEFT directory: `adapter_config.json` (LoRA, `r`, `lora_alpha`,
/// `target_modules`, `fan_in_fan_out`, `base_model_name_or_path`) and
/// `adapter_model.safetensors` with PEFT's tensor names.
pub fn write_peft_dir(policy: &Policy, base_model: &str, dir: &Path) -> Result<()> {
    let lora =
        policy.spec.lora.as_ref().ok_or_else(|| {
            ModelError::InvalidConfig(format!("{}: the model has no adapter to export", dir.display()))
        })?;
    let config = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "target_modules": lora.targets,
        "fan_in_fan_out": true,
        "lora_dropout": 0.0,
        "bias": "none",
        "inference_mode": true,
        "modules_to_save": null,
    });
    write_json(&dir.join("adapter_config.json"), &config)?;
    let tensors: Vec<(String, Tensor)> = policy
        .params
        .with_kind(ParamKind::Adapter)
        .map(|p| (format!("{PEFT_PREFIX}{}", p.name), p.tensor().clone()))
        .collect();
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    write_safetensors(&dir.join("adapter_model.safetensors"), &tensors, metadata)
}

/// Reads a PEFT LoRA directory for GPT-2 (`adapter_config.json` and
/// `adapter_model.safetensors`, as `PeftModel.save_pretrained` writes them) as an adapter.
pub fn load_peft_dir(dir: &Path, device: &Device) -> Result<SavedAdapter> {
    let config_path = dir.join("adapter_config.json");
    let bytes = std::fs::read(&config_path).map_err(|e| ModelError::io(&config_path, e))?;
    let config: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|source| ModelError::Json { path: config_path.clone(), source })?;
    let mismatch = |reason: String| ModelError::AdapterMismatch { path: config_path.clone(), reason };
    if config["peft_type"] != "LORA" {
        return Err(mismatch(format!("peft_type {}: only LORA adapters load", config["peft_type"])));
    }
    if config["fan_in_fan_out"] != true {
        return Err(mismatch("fan_in_fan_out must be true: GPT-2's projections are Conv1D".into()));
    }
    for (key, what) in [("use_dora", "DoRA"), ("use_rslora", "rank-stabilised scaling")] {
        if config[key] == true {
            return Err(mismatch(format!("{key} is set: fedpo's LoRA has no {what}")));
        }
    }
    for key in ["rank_pattern", "alpha_pattern"] {
        if config[key].as_object().is_some_and(|m| !m.is_empty()) {
            return Err(mismatch(format!("{key} gives some modules their own settings; fedpo's adapters share one")));
        }
    }
    let rank = config["r"].as_u64().ok_or_else(|| mismatch("no integer `r`".into()))? as usize;
    let alpha = config["lora_alpha"].as_f64().ok_or_else(|| mismatch("no number `lora_alpha`".into()))?;
    let targets: Vec<String> = match &config["target_modules"] {
        serde_json::Value::Array(t) => t.iter().filter_map(|v| v.as_str().map(str::to_string)).collect(),
        serde_json::Value::String(s) => vec![s.clone()],
        other => return Err(mismatch(format!("target_modules {other}: expected a list of module names"))),
    };
    let targets: Vec<&str> = targets.iter().map(String::as_str).collect();
    let lora = LoraConfig::new(rank, alpha, &targets)?;
    let weights = dir.join("adapter_model.safetensors");
    let file = read_safetensors(&weights, device)?;
    let tensors = file
        .tensors
        .tensors
        .into_iter()
        .map(|(name, t)| {
            let short = name.strip_prefix(PEFT_PREFIX).unwrap_or(&name).replace(".default.", ".");
            (short, t)
        })
        .collect();
    Ok(SavedAdapter {
        tensors: TensorSource { tensors, description: weights.display().to_string() },
        lora,
        base_hash: None,
    })
}
