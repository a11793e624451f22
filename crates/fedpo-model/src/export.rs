//! A policy in the directories the Hugging Face tools read: the model as transformers
//! writes it (`GPT2LMHeadModel.save_pretrained`), the adapter as PEFT writes it
//! (`PeftModel.save_pretrained`). And PEFT adapter directories read back.
//!
//! Each directory is written whole into a temporary sibling and renamed into place, so a
//! crash leaves either the old directory or the new one, never half of either.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::Tensor;
use serde_json::json;

use crate::adapter_file::base_hash;
pub use crate::adapter_file::{load_peft_dir, write_peft_dir};
use crate::error::{ModelError, Result};

use crate::params::ParamKind;
use crate::policy::Policy;
use crate::tensor_files::{write_json, write_safetensors};
use crate::tokenizer::Gpt2Tokenizer;

/// GPT-2's `<|endoftext|>`, its begin and end of text.
const END_OF_TEXT: u32 = 50_256;
/// Writes `dir` by filling a fresh temporary sibling with `fill` and renaming it into
/// place. An existing `dir` is refused unless `force`, and then replaced only once the
/// new one is complete.
pub fn write_dir_atomically(dir: &Path, force: bool, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let exists = dir.exists();
    if exists && !force {
        return Err(ModelError::io(
            dir,
            std::io::Error::new(std::io::ErrorKind::AlreadyExists, "exists; pass --force to replace it"),
        ));
    }
    let name =
        dir.file_name().ok_or_else(|| ModelError::InvalidConfig(format!("{} names no directory", dir.display())))?;
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| ModelError::io(parent, e))?;
    let sibling =
        |what: &str| -> PathBuf { parent.join(format!(".{}.{what}-{}", name.to_string_lossy(), std::process::id())) };
    let staging = sibling("partial");
    if staging.exists() {
        std::fs::remove_dir_all(&staging).map_err(|e| ModelError::io(&staging, e))?;
    }
    std::fs::create_dir(&staging).map_err(|e| ModelError::io(&staging, e))?;
    if let Err(e) = fill(&staging) {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(e);
    }
    if exists {
        let old = sibling("replaced");
        std::fs::rename(dir, &old).map_err(|e| ModelError::io(dir, e))?;
        std::fs::rename(&staging, dir).map_err(|e| ModelError::io(dir, e))?;
        std::fs::remove_dir_all(&old).map_err(|e| ModelError::io(&old, e))?;
    } else {
        std::fs::rename(&staging, dir).map_err(|e| ModelError::io(dir, e))?;
    }
    Ok(())
}

/// The base model as a transformers directory: `config.json`, `model.safetensors`
/// (`transformer.*` names, the tied head left out, as `save_pretrained` writes them),
/// `generation_config.json` and, given a tokenizer, `tokenizer.json`. With `merged`, each
/// adapted projection holds `W + (alpha / r) A^T B^T`: the personalized model, no PEFT
/// needed. Written into `dir` itself (created if missing); see [`write_dir_atomically`] for a whole directory.
pub fn write_transformers_dir(
    policy: &Policy,
    tokenizer: Option<&Gpt2Tokenizer>,
    merged: bool,
    dir: &Path,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let c = &policy.spec.config;
    let config = json!({
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "n_layer": c.n_layer,
        "n_embd": c.n_embd,
        "n_head": c.n_head,
        "n_inner": c.n_inner,
        "vocab_size": c.vocab_size,
        "n_positions": c.n_positions,
        "n_ctx": c.n_positions,
        "layer_norm_epsilon": c.layer_norm_epsilon,
        "activation_function": c.activation_function,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": END_OF_TEXT,
        "eos_token_id": END_OF_TEXT,
        "tie_word_embeddings": true,
        "torch_dtype": "float32",
    });
    write_json(&dir.join("config.json"), &config)?;
    let generation = json!({ "bos_token_id": END_OF_TEXT, "eos_token_id": END_OF_TEXT, "pad_token_id": END_OF_TEXT });
    write_json(&dir.join("generation_config.json"), &generation)?;
    let mut tensors = Vec::new();
    for p in policy.params.with_kind(ParamKind::Base) {
        let value = match (merged, adapter_delta(policy, &p.name)?) {
            (true, Some(delta)) => (p.tensor() + delta)?,
            _ => p.tensor().clone(),
        };
        tensors.push((format!("transformer.{}", p.name), value));
    }
    let metadata = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        ("fedpo_base_hash".to_string(), base_hash(policy)?),
        ("fedpo_merged_adapter".to_string(), merged.to_string()),
    ]);
    write_safetensors(&dir.join("model.safetensors"), &tensors, metadata)?;
    if let Some(tokenizer) = tokenizer {
        tokenizer.save(&dir.join("tokenizer.json"))?;
    }
    Ok(())
}

/// `(alpha / r) A^T B^T` in the Conv1D layout for the base weight `name`, if an adapter
/// sits on it.
fn adapter_delta(policy: &Policy, name: &str) -> Result<Option<Tensor>> {
    let (Some(module), Some(lora)) = (name.strip_suffix(".weight"), policy.spec.lora.as_ref()) else {
        return Ok(None);
    };
    let (Some(a), Some(b)) =
        (policy.params.get(&format!("{module}.lora_A.weight")), policy.params.get(&format!("{module}.lora_B.weight")))
    else {
        return Ok(None);
    };
    Ok(Some((a.tensor().t()?.matmul(&b.tensor().t()?)? * lora.scale())?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use fedpo_process::files::write_atomic;

    #[test]
    fn a_directory_is_replaced_only_with_force_and_only_once_the_new_one_is_whole() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("out");
        write_dir_atomically(&dir, false, |d| Ok(write_atomic(&d.join("a"), b"1")?)).unwrap();
        let err = write_dir_atomically(&dir, false, |d| Ok(write_atomic(&d.join("a"), b"2")?)).unwrap_err().to_string();
        assert!(err.contains("--force"), "{err}");
        // A fill that fails leaves the old directory as it was, and no staging behind.
        let failed = write_dir_atomically(&dir, true, |d| {
            write_atomic(&d.join("a"), b"3")?;
            Err(ModelError::InvalidConfig("disk full".into()))
        });
        assert!(failed.is_err());
        assert_eq!(std::fs::read(dir.join("a")).unwrap(), b"1");
        write_dir_atomically(&dir, true, |d| Ok(write_atomic(&d.join("b"), b"4")?)).unwrap();
        assert!(!dir.join("a").exists() && dir.join("b").exists());
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 1, "only `out` is left");
    }
}
