//! How much memory a generation takes, before anything is allocated: the weights, the
//! key/value cache for every position, and the prefill's activations (the largest pass).

use candle_core::DType;
use fedpo_model::{Gpt2Config, KvCache};

use super::footprint::TOKENIZER_MIB;

const MIB: f64 = 1024.0 * 1024.0;

/// What a generation holds at its peak, in MiB.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GenerationEstimate {
    /// Every parameter, in the generation's dtype.
    pub weights_mib: f64,
    /// Keys and values of the prompt and every new token.
    pub cache_mib: f64,
    /// The prefill's activations: the block's widest rows, the attention scores and the
    /// logits of one position.
    pub activations_mib: f64,
    /// The tokenizer's tables and the runtime.
    pub fixed_mib: f64,
}

impl GenerationEstimate {
    /// The sum.
    pub fn total_mib(&self) -> f64 {
        self.weights_mib + self.cache_mib + self.activations_mib + self.fixed_mib
    }
}

impl std::fmt::Display for GenerationEstimate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.0} MiB (weights {:.0}, cache {:.1}, activations {:.1}, tokenizer and runtime {:.0})",
            self.total_mib(),
            self.weights_mib,
            self.cache_mib,
            self.activations_mib,
            self.fixed_mib
        )
    }
}

/// The estimate for `params` parameters of `config` stored in `dtype`, a prompt of
/// `prompt_tokens` and `max_new_tokens` more. Activations and the cache are f32 whatever
/// the weights are.
pub fn generation_estimate(
    config: &Gpt2Config,
    params: usize,
    dtype: DType,
    prompt_tokens: usize,
    max_new_tokens: usize,
) -> GenerationEstimate {
    let (size, f32_size) = (dtype.size_in_bytes() as f64, 4.0);
    let positions = prompt_tokens + max_new_tokens;
    let (n, d) = (prompt_tokens as f64, config.n_embd as f64);
    // The prefill's widest moment: the residual stream, the fused projection and the MLP's
    // inner rows, plus the f32 attention scores and their softmax for one layer.
    let rows = n * (d + 3.0 * d + config.inner_dim() as f64) * f32_size;
    let scores = 2.0 * config.n_head as f64 * n * n * 4.0;
    let logits = config.vocab_size as f64 * 4.0 * 2.0;
    GenerationEstimate {
        weights_mib: params as f64 * size / MIB,
        cache_mib: KvCache::bytes(config, positions, DType::F32) as f64 / MIB,
        activations_mib: (rows + scores + logits) / MIB,
        fixed_mib: TOKENIZER_MIB + 20.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_grows_with_positions_and_bf16_halves_the_weights_only() {
        let config = Gpt2Config::distilgpt2();
        let params = config.base_param_count();
        let short = generation_estimate(&config, params, DType::F32, 64, 128);
        let long = generation_estimate(&config, params, DType::F32, 64, 960);
        // 2 (keys, values) x 6 layers x 768 x 4 bytes per position
        let per_position = 2.0 * 6.0 * 768.0 * 4.0 / MIB;
        assert!((long.cache_mib - short.cache_mib - 832.0 * per_position).abs() < 1e-9);
        let half = generation_estimate(&config, params, DType::BF16, 64, 128);
        assert_eq!(half.cache_mib, short.cache_mib);
        assert!((half.weights_mib * 2.0 - short.weights_mib).abs() < 1e-9);
        assert!(short.weights_mib > 300.0 && short.weights_mib < 340.0, "{short}");
    }
}
