//! How much memory a DPO training step takes, before anything is allocated.
//!
//! The model is linear in a few sizes. The activation and parameter coefficients were
//! fitted by least squares to the peak RSS that `fedpo-device bench` measured over 28
//! configurations (the tiny and DistilGPT-2 shapes, 1–8 pairs, 64–256 tokens, base
//! trainable and frozen; x86-64, glibc with freed memory kept in the heap): every bench
//! measurement lies within −14 % … +15 % of that fit.
//!
//! Real training holds more than the benchmark's fixed-shape step: micro-batches of
//! varying length, gradient accumulation, and the tied embedding's gradient path (index-add
//! into a zero table, the head's weight gradient, their sum) leave about three more
//! vocabulary-sized tables in the heap. [`EMBEDDING_GRAD_COPIES`] and the federated round's
//! copies were set from `train-local` (tiny, 1–8 pairs per pass) and from real DistilGPT-2
//! rounds (device and aggregator as separate processes): with [`SAFETY_MARGIN`] every one
//! of those measurements lies under its estimate. Long sequences and large micro-batches
//! are over-estimated (by up to a third), which errs on the side of fitting.

use fedpo_model::{Gpt2Config, LoraConfig, Partition};
use fedpo_train::OptimKind;

/// Bytes per MiB.
const MIB: f64 = 1024.0 * 1024.0;
/// Fixed cost of the process: code, thread stacks, allocator arenas.
const RUNTIME_MIB: f64 = 23.0;
/// f32 copies of every parameter: the weights themselves plus transient copies.
const PARAM_COPIES: f64 = 1.18;
/// f32 copies of every trainable parameter: its gradient and the accumulation buffer.
const TRAINABLE_COPIES: f64 = 2.09;
/// f32 values kept per token, per layer, per model dimension (activations for backward).
const ACTIVATION_FLOATS: f64 = 58.3;
/// f32 copies of each attention matrix (scores, mask, softmax and their gradients).
const ATTENTION_COPIES: f64 = 9.8;
/// f32 copies of the vocabulary logits at each response position.
const LOGIT_COPIES: f64 = 2.6;
/// The GPT-2 BPE tables and the tokenized pairs, measured on `train-local`.
const TOKENIZER_MIB: f64 = 40.0;
/// f32 copies of the token-embedding table alive while its gradient is formed, when it
/// trains (measured on real training, see the module docs).
const EMBEDDING_GRAD_COPIES: f64 = 4.0;
/// Headroom over the fit: its worst under-estimate was 15 %.
pub const SAFETY_MARGIN: f64 = 1.15;

/// Parameter counts of a model under a partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamCounts {
    /// Every tensor the device holds: base plus adapter.
    pub total: usize,
    /// Those the optimizer updates.
    pub trainable: usize,
    /// Those uploaded each round (shared and trainable).
    pub shared: usize,
}

impl ParamCounts {
    /// Counts without building the model.
    pub fn of(config: &Gpt2Config, lora: Option<&LoraConfig>, partition: Partition) -> Self {
        let d = config.n_embd;
        let embeddings = config.vocab_size * d + config.n_positions * d;
        let base = config.base_param_count();
        let adapter = match lora {
            Some(lora) if partition.uses_adapter() => {
                let per_block: usize = lora
                    .targets
                    .iter()
                    .map(|module| {
                        let (fan_in, fan_out) = module_shape(config, module);
                        lora.rank * (fan_in + fan_out)
                    })
                    .sum();
                config.n_layer * per_block
            }
            _ => 0,
        };
        let frozen_embeddings = if partition.freeze_embeddings { embeddings } else { 0 };
        let base_trainable = match partition.base_role("h.0.ln_1.weight") {
            fedpo_model::ParamRole::Frozen => 0,
            _ => base - frozen_embeddings,
        };
        let adapter_shared = partition.adapter_role() == fedpo_model::ParamRole::Shared;
        Self {
            total: base + adapter,
            trainable: base_trainable + adapter,
            shared: base_trainable + if adapter_shared { adapter } else { 0 },
        }
    }
}

/// `(fan_in, fan_out)` of a block module that can carry an adapter.
fn module_shape(config: &Gpt2Config, module: &str) -> (usize, usize) {
    let (d, inner) = (config.n_embd, config.inner_dim());
    match module {
        "attn.c_attn" => (d, 3 * d),
        "attn.c_proj" => (d, d),
        "mlp.c_fc" => (d, inner),
        "mlp.c_proj" => (inner, d),
        _ => (d, d),
    }
}

/// One training configuration, sized.
#[derive(Debug, Clone)]
pub struct Workload {
    /// The model's shape.
    pub config: Gpt2Config,
    /// Its parameter counts under the partition.
    pub params: ParamCounts,
    /// Pairs per forward pass.
    pub micro_batch_pairs: usize,
    /// Tokens of the longest sequence (every sequence of a batch is padded to it).
    pub seq_len: usize,
    /// Positions per sequence at which logits are taken (the response tokens).
    pub logit_positions: usize,
    /// The optimizer (AdamW keeps two moments per trainable parameter).
    pub optimizer: OptimKind,
    /// A federated round also holds the received global model and the delta.
    pub federated: bool,
    /// The token embedding trains (its gradient path is the largest transient).
    pub embeddings_train: bool,
}

/// An estimate, in MiB, by part.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimate {
    /// Weights, gradients, optimizer state and round copies.
    pub parameters_mib: f64,
    /// Activations of one micro-batch.
    pub activations_mib: f64,
    /// Process, tokenizer and data.
    pub fixed_mib: f64,
}

impl Estimate {
    /// The peak RSS to plan for, including [`SAFETY_MARGIN`].
    pub fn peak_mib(&self) -> f64 {
        (self.parameters_mib + self.activations_mib + self.fixed_mib) * SAFETY_MARGIN
    }
}

impl Workload {
    /// The expected peak resident memory of training this workload.
    pub fn estimate(&self) -> Estimate {
        let f32_mib = |n: f64| n * 4.0 / MIB;
        let c = &self.config;
        let p = &self.params;
        let optimizer_copies = match self.optimizer {
            OptimKind::Sgd => 0.0,
            OptimKind::Adamw => 2.0,
        };
        // The received global model (the device keeps it to form the delta) and the delta.
        let (round_total, round_shared) = if self.federated { (1.0, 1.0) } else { (0.0, 0.0) };
        let embedding_table = if self.embeddings_train { (c.vocab_size * c.n_embd) as f64 } else { 0.0 };
        let parameters_mib = f32_mib(
            (PARAM_COPIES + round_total) * p.total as f64
                + (TRAINABLE_COPIES + optimizer_copies) * p.trainable as f64
                + round_shared * p.shared as f64
                + EMBEDDING_GRAD_COPIES * embedding_table,
        );
        let sequences = 2.0 * self.micro_batch_pairs as f64;
        let t = self.seq_len as f64;
        let layers = c.n_layer as f64;
        let activations_mib = f32_mib(
            ACTIVATION_FLOATS * sequences * t * layers * c.n_embd as f64
                + ATTENTION_COPIES * sequences * layers * c.n_head as f64 * t * t
                + LOGIT_COPIES * sequences * self.logit_positions as f64 * c.vocab_size as f64,
        );
        Estimate { parameters_mib, activations_mib, fixed_mib: RUNTIME_MIB + TOKENIZER_MIB }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};
    use fedpo_model::{ParamRole, PartitionPreset, Policy, PolicySpec};

    use super::*;

    #[test]
    fn parameter_counts_match_a_built_policy_under_every_partition() {
        let config = Gpt2Config::tiny();
        let lora = LoraConfig::new(4, 8.0, &["c_attn", "mlp.c_fc", "mlp.c_proj"]).unwrap();
        for preset in PartitionPreset::ALL {
            for freeze_embeddings in [false, true] {
                let partition = Partition { preset, freeze_embeddings };
                let spec = PolicySpec { config: config.clone(), lora: Some(lora.clone()), partition };
                let policy = Policy::build(spec, None, None, 0, DType::F32, &Device::Cpu).unwrap();
                let numel = |keep: &dyn Fn(ParamRole) -> bool| -> usize {
                    policy.params.iter().filter(|p| keep(p.role)).map(|p| p.tensor().elem_count()).sum()
                };
                let counted = ParamCounts::of(&config, Some(&lora), partition);
                let built = ParamCounts {
                    total: numel(&|_| true),
                    trainable: numel(&|r| r.is_trainable()),
                    shared: numel(&|r| r == ParamRole::Shared),
                };
                assert_eq!(counted, built, "{preset} with frozen embeddings {freeze_embeddings}");
            }
        }
    }

    #[test]
    fn estimate_reproduces_a_measured_distilgpt2_step_within_the_margin() {
        // `fedpo-device bench -P 4` (64 + 64 tokens, pFedDPO, SGD) peaked at 2658 MiB.
        let config = Gpt2Config::distilgpt2();
        let params = ParamCounts::of(&config, Some(&LoraConfig::default()), Partition::new(PartitionPreset::Pfeddpo));
        let w = Workload {
            config,
            params,
            micro_batch_pairs: 4,
            seq_len: 128,
            logit_positions: 64,
            optimizer: OptimKind::Sgd,
            federated: false,
            embeddings_train: false,
        };
        let e = w.estimate();
        let unmargined = e.parameters_mib + e.activations_mib + e.fixed_mib - TOKENIZER_MIB;
        assert!((unmargined / 2658.0 - 1.0).abs() < 0.05, "fit gives {unmargined:.0} MiB");
        assert!(e.peak_mib() > 2658.0);
    }

    #[test]
    fn estimates_cover_measured_distilgpt2_federated_rounds() {
        // Peak RSS of real pFedDPO rounds (120 pairs, longest sequence 71 tokens, response
        // 55): 2737 MiB at 1 pair per pass, 2898 at 2, 2896 at 8.
        let config = Gpt2Config::distilgpt2();
        let params = ParamCounts::of(&config, Some(&LoraConfig::default()), Partition::new(PartitionPreset::Pfeddpo));
        for (micro, measured) in [(1, 2737.0), (2, 2898.0), (8, 2896.0)] {
            let w = Workload {
                config: config.clone(),
                params,
                micro_batch_pairs: micro,
                seq_len: 71,
                logit_positions: 55,
                optimizer: OptimKind::Sgd,
                federated: true,
                embeddings_train: true,
            };
            let peak = w.estimate().peak_mib();
            assert!(peak >= measured && peak < 1.7 * measured, "micro-batch {micro}: {peak:.0} vs {measured}");
        }
    }
}
