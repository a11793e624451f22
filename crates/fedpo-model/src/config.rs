//! GPT-2 family hyper-parameters, read from a Hugging Face `config.json`.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// Hyper-parameters of a GPT-2 family model, under the field names of HF's `GPT2Config`
/// so that a checkpoint's `config.json` deserialises directly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gpt2Config {
    /// Number of transformer blocks.
    pub n_layer: usize,
    /// Hidden width.
    pub n_embd: usize,
    /// Attention heads per block.
    pub n_head: usize,
    /// Vocabulary size (50257 for the GPT-2 BPE).
    pub vocab_size: usize,
    /// Length of the learned position table.
    pub n_positions: usize,
    /// Epsilon of every layer norm.
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    /// MLP activation; only GPT-2's `gelu_new` (the tanh approximation) is supported.
    #[serde(default = "default_activation")]
    pub activation_function: String,
    /// Inner MLP width; `None` means `4 * n_embd`, as in HF.
    #[serde(default)]
    pub n_inner: Option<usize>,
}

fn default_eps() -> f64 {
    1e-5
}

fn default_activation() -> String {
    "gelu_new".to_string()
}

/// The GPT-2 BPE vocabulary size, shared by every preset.
pub const GPT2_VOCAB_SIZE: usize = 50257;

impl Gpt2Config {
    /// DistilGPT-2: 6 layers, 768 wide, 12 heads, the GPT-2 vocabulary and 1024 positions.
    pub fn distilgpt2() -> Self {
        Self {
            n_layer: 6,
            n_embd: 768,
            n_head: 12,
            vocab_size: GPT2_VOCAB_SIZE,
            n_positions: 1024,
            layer_norm_epsilon: 1e-5,
            activation_function: default_activation(),
            n_inner: None,
        }
    }

    /// `tiny`: 2 layers, 128 wide, 4 heads, with the real GPT-2 vocabulary and positions.
    ///
    /// It is the shape of the peer benchmark's `--tiny` and the model of demos and tests:
    /// small enough to train in minutes on two cores, while it tokenizes exactly like
    /// DistilGPT-2 so data, batching and scoring paths are the production ones.
    pub fn tiny() -> Self {
        Self { n_layer: 2, n_embd: 128, n_head: 4, ..Self::distilgpt2() }
    }

    /// A named preset: `distilgpt2` or `tiny`.
    pub fn preset(name: &str) -> Option<Self> {
        match name {
            "distilgpt2" => Some(Self::distilgpt2()),
            "tiny" => Some(Self::tiny()),
            _ => None,
        }
    }

    /// Reads and validates an HF `config.json`.
    pub fn from_json_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        let cfg: Self =
            serde_json::from_str(&text).map_err(|source| ModelError::Json { path: path.to_path_buf(), source })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the invariants the model relies on.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(ModelError::InvalidConfig(msg));
        if self.n_layer == 0 || self.n_embd == 0 || self.n_head == 0 {
            return bad(format!(
                "n_layer ({}), n_embd ({}) and n_head ({}) must be positive",
                self.n_layer, self.n_embd, self.n_head
            ));
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return bad(format!("n_embd {} is not divisible by n_head {}", self.n_embd, self.n_head));
        }
        if self.vocab_size == 0 || self.n_positions == 0 {
            return bad("vocab_size and n_positions must be positive".to_string());
        }
        if !matches!(self.activation_function.as_str(), "gelu_new" | "gelu_pytorch_tanh") {
            return bad(format!("activation_function `{}` is not supported (only gelu_new)", self.activation_function));
        }
        Ok(())
    }

    /// Width of the MLP's hidden layer.
    pub fn inner_dim(&self) -> usize {
        self.n_inner.unwrap_or(4 * self.n_embd)
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Parameter count of the base model (lm_head tied to wte, so counted once).
    pub fn base_param_count(&self) -> usize {
        let d = self.n_embd;
        let inner = self.inner_dim();
        let per_block = 2 * 2 * d // ln_1, ln_2
            + d * 3 * d + 3 * d // c_attn
            + d * d + d // attn.c_proj
            + d * inner + inner // c_fc
            + inner * d + d; // mlp.c_proj
        self.vocab_size * d + self.n_positions * d + self.n_layer * per_block + 2 * d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distilgpt2_preset_has_82m_parameters_like_the_hub_model() {
        // DistilGPT-2 on the hub reports 81,912,576 parameters (tied head).
        assert_eq!(Gpt2Config::distilgpt2().base_param_count(), 81_912_576);
    }

    #[test]
    fn hf_config_json_with_extra_fields_deserialises() {
        let json = r#"{"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 100,
            "n_positions": 32, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
            "model_type": "gpt2", "resid_pdrop": 0.1, "n_ctx": 32}"#;
        let cfg: Gpt2Config = serde_json::from_str(json).unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.head_dim(), 16);
        assert_eq!(cfg.inner_dim(), 256);
    }

    #[test]
    fn config_with_heads_not_dividing_width_is_rejected_naming_both() {
        let cfg = Gpt2Config { n_head: 5, ..Gpt2Config::tiny() };
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("128") && err.contains('5'), "{err}");
    }
}
