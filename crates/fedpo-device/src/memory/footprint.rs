//! How much memory a DPO training step takes, before anything is allocated.
//!
//! The peak is linear in a few sizes, with coefficients measured on x86-64 with glibc
//! keeping freed memory in the heap (as `fedpo-device` sets it). Which coefficients apply
//! depends on the kernels the step runs on ([`StepKernels`]):
//!
//! - **Fused** (f32 on the CPU, the default): fitted by least squares to the peak RSS of
//!   `fedpo-device bench` over 64 configurations (tiny and DistilGPT-2, 1–8 pairs, 32 + 32
//!   to 128 + 128 and 32 + 160 tokens, base trainable and frozen), every one close to the
//!   fit. What real training holds beyond the benchmark's step was
//!   measured on it: what a batch split into passes holds beyond one pass (about 0.45
//!   trainable copies, since the passes add into the model's own gradient buffers),
//!   AdamW's moments, and in a federated round whose embedding trains about 1.25
//!   embedding tables more than local training holds. Most of that is the received model,
//!   kept to form the update: rounds that kept it on disk instead peaked lower, and the
//!   estimate for them drops that term.
//!   `scripts/measure_footprint.sh` makes every measurement, and the test
//!   `estimates_cover_every_measured_peak` holds the estimate (with [`SAFETY_MARGIN`])
//!   above each of them and within 1.7 times it.
//! - **Composed** (candle's ops one by one: half precision, other devices): the fit made
//!   before the fused kernels existed, when attention kept its probabilities for backward
//!   and every op its own gradient buffers. It still covers the composed path's measured
//!   peaks, with about twice their size, and errs far on the side of fitting.

use candle_core::{DType, Device};
use fedpo_model::{Gpt2Config, LoraConfig, Partition};
use fedpo_train::OptimKind;

/// Bytes per MiB.
const MIB: f64 = 1024.0 * 1024.0;
/// The GPT-2 BPE tables and the tokenized pairs, measured on `train-local`.
pub const TOKENIZER_MIB: f64 = 40.0;
/// Headroom over the fit: its worst under-estimate of a measured step was 10 %.
pub const SAFETY_MARGIN: f64 = 1.15;

/// The kernels a training step runs on: they keep very different amounts for backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKernels {
    /// One op per block, the head fused with its log-softmax, attention keeping nothing
    /// for backward: f32 (or f64) on the CPU, and bf16 and f16 there too (f32 activations,
    /// half-precision matmul operands packed per product).
    Fused,
    /// candle's ops one by one: every device but the CPU.
    Composed,
}

impl StepKernels {
    /// The kernels a model on `device` computing in `compute_dtype` trains with (the
    /// condition `fedpo_model`'s fused block checks; see `Gpt2::set_compute_dtype`).
    pub fn for_run(device: &Device, compute_dtype: DType) -> Self {
        if device.is_cpu() && matches!(compute_dtype, DType::F32 | DType::F64 | DType::BF16 | DType::F16) {
            Self::Fused
        } else {
            Self::Composed
        }
    }

    fn coefficients(self) -> &'static Coefficients {
        match self {
            Self::Fused => &FUSED,
            Self::Composed => &COMPOSED,
        }
    }
}

/// The footprint model's coefficients: f32 copies of each size alive at the peak.
#[derive(Debug)]
struct Coefficients {
    /// Fixed cost of the process: code, thread stacks, allocator arenas.
    runtime_mib: f64,
    /// Per parameter: the weights themselves plus transient copies.
    params: f64,
    /// Per trainable parameter: its gradient.
    gradients: f64,
    /// Per trainable parameter, when a batch takes several passes: what the passes hold
    /// beyond one pass's gradients (the trainer's sums of the gradients outside the model's
    /// buffers, and transients of the adding).
    accumulation: f64,
    /// Per token row, layer and model dimension: activations kept for backward.
    activations: f64,
    /// Per sequence, layer, head and square of its length: attention kept for backward.
    attention: f64,
    /// Per logit at each response position.
    logits: f64,
    /// Per value of the token-embedding table, when it trains.
    embedding_gradient: f64,
    /// Per value of the token-embedding table, when it trains in a federated round.
    round_embedding: f64,
    /// Per parameter in a federated round (the received model kept for the delta).
    round_params: f64,
    /// Per shared parameter in a federated round (the delta).
    round_shared: f64,
    /// Fixed cost of a federated round: the link, the transfers' buffers.
    round_mib: f64,
    /// Token rows per pair: the forked prompt layout's (prompt once), or always two.
    shared_prompt_rows: bool,
}

/// Fitted to `fedpo-device bench` over 64 configurations, with real training's extras
/// measured on `train-local` and on federated rounds (see the module docs).
const FUSED: Coefficients = Coefficients {
    runtime_mib: 16.0,
    params: 1.05,
    gradients: 0.95,
    accumulation: 0.45,
    activations: 15.9,
    attention: 0.0,
    logits: 1.02,
    embedding_gradient: 0.0,
    round_embedding: 1.25,
    round_params: 0.0,
    round_shared: 0.0,
    round_mib: 40.0,
    shared_prompt_rows: true,
};

/// The fit from before the fused kernels (28 bench configurations, two rows per pair),
/// raised to cover real rounds of that time.
const COMPOSED: Coefficients = Coefficients {
    runtime_mib: 23.0,
    params: 1.18,
    gradients: 2.09,
    accumulation: 0.0,
    activations: 58.3,
    attention: 9.8,
    logits: 2.6,
    embedding_gradient: 4.0,
    round_embedding: 0.0,
    round_params: 1.0,
    round_shared: 1.0,
    round_mib: 0.0,
    shared_prompt_rows: false,
};

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
    /// Pairs per optimizer step: more than a pass takes means a gradient accumulation buffer.
    pub batch_pairs: usize,
    /// Tokens of the longest sequence (every sequence of a batch is padded to it).
    pub seq_len: usize,
    /// Positions per sequence at which logits are taken (the response tokens).
    pub logit_positions: usize,
    /// The optimizer (AdamW keeps two moments per trainable parameter).
    pub optimizer: OptimKind,
    /// A federated round also holds the received global model and the delta.
    pub federated: bool,
    /// The round keeps the model it started from on disk ([`fedpo_model::SpilledStart`]),
    /// not beside its gradients.
    pub start_on_disk: bool,
    /// The token embedding trains (its gradient path is the largest transient).
    pub embeddings_train: bool,
    /// The kernels the step runs on.
    pub kernels: StepKernels,
    /// A pair's prompt runs once, before both responses ([`fedpo_train::logps::shares_prompts`]).
    pub shared_prompt: bool,
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
    /// Token rows of one pass through the blocks: with a shared prompt, one sequence per
    /// pair (`prompt ++ chosen ++ rejected`, at most `seq_len + logit_positions` tokens),
    /// otherwise two rows; the composed kernels' fit counted two rows either way.
    fn rows(&self, coefficients: &Coefficients) -> f64 {
        let pairs = self.micro_batch_pairs as f64;
        if coefficients.shared_prompt_rows && self.shared_prompt {
            pairs * (self.seq_len + self.logit_positions.min(self.seq_len)) as f64
        } else {
            2.0 * pairs * self.seq_len as f64
        }
    }

    /// The expected peak resident memory of training this workload.
    pub fn estimate(&self) -> Estimate {
        let k = self.kernels.coefficients();
        let f32_mib = |n: f64| n * 4.0 / MIB;
        let (c, p) = (&self.config, &self.params);
        let (total, trainable, shared) = (p.total as f64, p.trainable as f64, p.shared as f64);
        let optimizer_copies = match self.optimizer {
            OptimKind::Sgd => 0.0,
            OptimKind::Adamw => 2.0,
        };
        let accumulation = if self.micro_batch_pairs < self.batch_pairs { k.accumulation } else { 0.0 };
        let embedding_table = if self.embeddings_train { (c.vocab_size * c.n_embd) as f64 } else { 0.0 };
        let mut parameters = k.params * total
            + (k.gradients + accumulation + optimizer_copies) * trainable
            + k.embedding_gradient * embedding_table;
        let mut round_mib = 0.0;
        if self.federated {
            // On disk, the received model's shared tensors are not held: the fused fit's
            // 1.25 embedding tables (which removing the model was measured to more than
            // cover), the composed fit's shared copy.
            let (held_params, held_embedding) =
                if self.start_on_disk { (total - shared, 0.0) } else { (total, embedding_table) };
            parameters += k.round_params * held_params + k.round_shared * shared + k.round_embedding * held_embedding;
            round_mib = k.round_mib;
        }
        let layers = c.n_layer as f64;
        let sequences = 2.0 * self.micro_batch_pairs as f64;
        let t = self.seq_len as f64;
        let activations = k.activations * self.rows(k) * layers * c.n_embd as f64
            + k.attention * sequences * layers * c.n_head as f64 * t * t
            + k.logits * sequences * self.logit_positions as f64 * c.vocab_size as f64;
        Estimate {
            parameters_mib: f32_mib(parameters) + round_mib,
            activations_mib: f32_mib(activations),
            fixed_mib: k.runtime_mib + TOKENIZER_MIB,
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};
    use fedpo_model::{ParamRole, PartitionPreset, Policy, PolicySpec};

    use super::*;

    #[test]
    fn a_start_on_disk_drops_the_received_models_share_and_nothing_else() {
        let config = Gpt2Config::distilgpt2();
        let lora = LoraConfig::default();
        let workload = |preset, freeze_embeddings, kernels, federated, start_on_disk| {
            let partition = Partition { preset, freeze_embeddings };
            Workload {
                params: ParamCounts::of(&config, Some(&lora), partition),
                micro_batch_pairs: 1,
                batch_pairs: 8,
                seq_len: 71,
                logit_positions: 55,
                optimizer: OptimKind::Sgd,
                federated,
                start_on_disk,
                embeddings_train: partition.base_role("wte.weight").is_trainable(),
                kernels,
                shared_prompt: true,
                config: config.clone(),
            }
            .estimate()
            .parameters_mib
        };
        let mib = |values: usize| values as f64 * 4.0 / MIB;
        let table = config.vocab_size * config.n_embd;
        let saved = |preset, freeze, kernels| {
            workload(preset, freeze, kernels, true, false) - workload(preset, freeze, kernels, true, true)
        };
        let (pfeddpo, fused, composed) = (PartitionPreset::Pfeddpo, StepKernels::Fused, StepKernels::Composed);
        assert!((saved(pfeddpo, false, fused) - 1.25 * mib(table)).abs() < 1e-6);
        assert_eq!(saved(pfeddpo, true, fused), 0.0, "the fused fit holds no more with frozen embeddings");
        let shared = ParamCounts::of(&config, Some(&lora), Partition::new(pfeddpo)).shared;
        assert!((saved(pfeddpo, false, composed) - mib(shared)).abs() < 1e-6);
        for kernels in [fused, composed] {
            let local = |on_disk| workload(pfeddpo, false, kernels, false, on_disk);
            assert_eq!(local(true), local(false), "{kernels:?}: local training has no round start");
        }
    }

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
}
