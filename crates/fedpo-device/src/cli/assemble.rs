//! Turning command-line arguments into a device, a policy, a tokenizer and data.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use clap::Args;
use fedpo_data::partition::train_heldout_split;
use fedpo_data::synthetic::{generate_device, SyntheticSpec};
use fedpo_data::{load_jsonl, tokenize_pairs, DataFormat, PreferencePair, TokenizedPair};
use fedpo_model::checkpoint::{load_adapter, load_hf_dir};
use fedpo_model::{Gpt2Config, Gpt2Tokenizer, LoraConfig, LoraTargets, Partition, PartitionPreset, Policy, PolicySpec};

/// Which model and adapter to build.
#[derive(Debug, Args, Clone)]
pub(crate) struct ModelArgs {
    /// `tiny` or `distilgpt2` (GPT-2 initialised from --seed), or an HF directory with
    /// config.json, model.safetensors and optionally tokenizer.json.
    #[arg(long, default_value = "tiny")]
    pub(crate) model: String,
    /// Start from a saved adapter instead of a fresh one; its rank, alpha and targets
    /// then come from the file, not from --rank/--alpha/--targets.
    #[arg(long)]
    pub(crate) adapter: Option<PathBuf>,
    /// LoRA rank.
    #[arg(long, default_value_t = 8)]
    pub(crate) rank: usize,
    /// LoRA alpha (the update is scaled by alpha / rank).
    #[arg(long, default_value_t = 16.0)]
    pub(crate) alpha: f64,
    /// LoRA target modules, comma separated: c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj, c_proj.
    #[arg(long, default_value = "c_attn")]
    pub(crate) targets: LoraTargets,
    /// Which parameters train: pfeddpo (base + adapter), feddpo (base only),
    /// shared-lora (adapter only, frozen base).
    #[arg(long, default_value = "pfeddpo")]
    pub(crate) partition: PartitionPreset,
    /// Keep the token and position embeddings frozen.
    #[arg(long)]
    pub(crate) freeze_embeddings: bool,
    /// Compute device: auto (the best backend built in: cuda, metal, then cpu), cpu,
    /// cuda[:N] or metal.
    #[arg(long, default_value = "auto")]
    pub(crate) device: String,
    /// Seed of the model's random initialisation and of the data order.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Precision of the matmuls: f32; bf16 or f16 (on the CPU: the matmuls' operands
    /// rounded, f32 accumulation and activations; elsewhere half-precision activations
    /// too); or auto, bf16 where the CPU multiplies bf16 natively (AMX or AVX512-BF16),
    /// else f32. f16 runs on FP16 arithmetic on aarch64 CPUs that have it (Cortex-A76,
    /// A78), elsewhere emulated at f32's speed; auto does not pick it. Parameters,
    /// gradients, layer norms, softmax and logits stay f32 throughout.
    #[arg(long, default_value = "f32", value_parser = parse_compute_dtype)]
    pub(crate) compute_dtype: ComputeDtype,
}

/// `--compute-dtype`: a precision, or `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ComputeDtype {
    /// The fastest precision the CPU supports (see [`ComputeDtype::on`]).
    Auto,
    /// This one.
    Fixed(DType),
}

impl ComputeDtype {
    /// The dtype a model on `device` computes in. `auto` takes bf16 on a CPU with AMX or
    /// AVX512-BF16, where its step is faster than f32's and the accuracy guards bound its
    /// error; f32 on other CPUs, where bf16 would be emulated at f32 speed, and on GPUs,
    /// where bf16 has not been measured against f32. Never f16: its kernel for aarch64's
    /// FP16 arithmetic is tested for correctness under emulation, but its speed on a board
    /// has not been measured.
    pub(crate) fn on(self, device: &Device) -> DType {
        match self {
            Self::Fixed(dtype) => dtype,
            Self::Auto => {
                let engine = fedpo_model::ops::Bf16Engine::detect();
                let dtype = if device.is_cpu() && engine.is_native() { DType::BF16 } else { DType::F32 };
                let f16_engine = fedpo_model::ops::F16Engine::detect();
                tracing::info!(chose = ?dtype, bf16_engine = ?engine, ?f16_engine, cpu = device.is_cpu(), "--compute-dtype auto");
                dtype
            }
        }
    }
}

/// Parses `--compute-dtype`: f32, bf16, f16 or auto.
pub(crate) fn parse_compute_dtype(s: &str) -> std::result::Result<ComputeDtype, String> {
    match s {
        "f32" => Ok(ComputeDtype::Fixed(DType::F32)),
        "bf16" => Ok(ComputeDtype::Fixed(DType::BF16)),
        "f16" => Ok(ComputeDtype::Fixed(DType::F16)),
        "auto" => Ok(ComputeDtype::Auto),
        other => Err(format!("`{other}` is not a compute dtype; expected f32, bf16, f16 or auto")),
    }
}

/// Parses `--device`: `auto`, `cpu`, `cuda[:N]` or `metal[:N]`.
pub(crate) fn parse_device(spec: &str) -> Result<Device> {
    if spec == "auto" {
        return Ok(best_device());
    }
    let (kind, ordinal) = match spec.split_once(':') {
        Some((k, n)) => (k, n.parse::<usize>().with_context(|| format!("bad device ordinal in `{spec}`"))?),
        None => (spec, 0),
    };
    match kind {
        "cpu" => Ok(Device::Cpu),
        "cuda" if cfg!(feature = "cuda") => Device::new_cuda(ordinal).map_err(|e| gpu_error(spec, e)),
        "metal" if cfg!(feature = "metal") => Device::new_metal(ordinal).map_err(|e| gpu_error(spec, e)),
        "cuda" | "metal" => {
            bail!("this fedpo-device was built without `{kind}` support; rebuild with `--features {kind}`")
        }
        _ => bail!("unknown device `{spec}`; expected auto, cpu, cuda[:N] or metal"),
    }
}

/// A GPU that did not open, named, without the backtrace candle attaches to its errors.
fn gpu_error(spec: &str, e: candle_core::Error) -> anyhow::Error {
    let reason = match e {
        candle_core::Error::WithBacktrace { inner, .. } => inner.to_string(),
        other => other.to_string(),
    };
    anyhow::anyhow!("--device {spec}: the GPU did not open ({reason}); `--device auto` falls back to the CPU")
}

/// The fastest backend this binary was built with that answers on this machine: CUDA,
/// then Metal, then the CPU. A GPU that fails to open is logged and skipped.
fn best_device() -> Device {
    #[cfg(feature = "cuda")]
    match Device::new_cuda(0) {
        Ok(d) => return d,
        Err(e) => tracing::warn!(error = %e, "built with CUDA but no GPU opened; trying the next backend"),
    }
    #[cfg(feature = "metal")]
    match Device::new_metal(0) {
        Ok(d) => return d,
        Err(e) => tracing::warn!(error = %e, "built with Metal but no GPU opened; trying the next backend"),
    }
    Device::Cpu
}

impl ModelArgs {
    /// The model's shape, without loading its weights.
    pub(crate) fn config(&self) -> Result<Gpt2Config> {
        match Gpt2Config::preset(&self.model) {
            Some(config) => Ok(config),
            None => {
                let path = Path::new(&self.model).join("config.json");
                Gpt2Config::from_json_file(&path).with_context(|| {
                    format!("--model `{}` is neither a preset (tiny, distilgpt2) nor an HF directory", self.model)
                })
            }
        }
    }

    /// The tokenizer [`Self::build`] will use: an HF directory's own, else GPT-2's BPE.
    pub(crate) fn tokenizer(&self) -> Result<Gpt2Tokenizer> {
        let own = Path::new(&self.model).join("tokenizer.json");
        if Gpt2Config::preset(&self.model).is_none() && own.is_file() {
            Ok(Gpt2Tokenizer::from_file(&own)?)
        } else {
            Ok(Gpt2Tokenizer::gpt2()?)
        }
    }

    /// The adapter the policy will carry, if its partition has one (from --adapter's file
    /// when given, else from --rank/--alpha/--targets).
    pub(crate) fn adapter_config(&self, device: &Device) -> Result<Option<LoraConfig>> {
        let partition = Partition { preset: self.partition, freeze_embeddings: self.freeze_embeddings };
        if !partition.uses_adapter() {
            return Ok(None);
        }
        match &self.adapter {
            Some(path) => Ok(Some(load_adapter(path, device)?.lora)),
            None => Ok(Some(self.lora()?)),
        }
    }

    fn lora(&self) -> Result<LoraConfig> {
        let targets: Vec<&str> = self.targets.0.iter().map(String::as_str).collect();
        Ok(LoraConfig::new(self.rank, self.alpha, &targets)?)
    }

    /// Builds the policy and its tokenizer.
    pub(crate) fn build(&self, device: &Device) -> Result<(Policy, Gpt2Tokenizer)> {
        let partition = Partition { preset: self.partition, freeze_embeddings: self.freeze_embeddings };
        if self.adapter.is_some() && !partition.uses_adapter() {
            bail!("--adapter was given but --partition {} has no adapter; use pfeddpo or shared-lora", self.partition);
        }
        let adapter = match &self.adapter {
            Some(path) => {
                Some(load_adapter(path, device).with_context(|| format!("loading adapter {}", path.display()))?)
            }
            None => None,
        };
        let lora = match &adapter {
            Some(a) => a.lora.clone(),
            None => self.lora()?,
        };
        let (config, base, tokenizer) = match Gpt2Config::preset(&self.model) {
            Some(config) => (config, None, Gpt2Tokenizer::gpt2()?),
            None => {
                let dir = Path::new(&self.model);
                let ckpt = load_hf_dir(dir, device).with_context(|| {
                    format!(
                        "--model `{}` is neither a preset (tiny, distilgpt2) nor a loadable HF directory",
                        self.model
                    )
                })?;
                let tokenizer = match &ckpt.tokenizer_path {
                    Some(p) => Gpt2Tokenizer::from_file(p)?,
                    None => {
                        tracing::warn!(dir = %dir.display(), "no tokenizer.json; using the built-in GPT-2 BPE");
                        Gpt2Tokenizer::gpt2()?
                    }
                };
                (ckpt.config, Some(ckpt.base), tokenizer)
            }
        };
        if tokenizer.vocab_size() > config.vocab_size {
            bail!("the tokenizer has {} tokens but the model only {}", tokenizer.vocab_size(), config.vocab_size);
        }
        let spec = PolicySpec { config, lora: Some(lora), partition };
        let mut policy =
            Policy::build(spec, base.as_ref(), adapter.as_ref().map(|a| &a.tensors), self.seed, DType::F32, device)?;
        policy.set_compute_dtype(self.compute_dtype.on(device))?;
        Ok((policy, tokenizer))
    }
}

/// Where the preference pairs come from.
#[derive(Debug, Args, Clone)]
pub(crate) struct DataArgs {
    /// JSONL preference pairs (TRL, HH-RLHF or SHP layout, detected per line).
    #[arg(long, conflicts_with = "synthetic")]
    pub(crate) data: Option<PathBuf>,
    /// Use the built-in synthetic persona data instead of a file.
    #[arg(long)]
    pub(crate) synthetic: bool,
    /// Force the layout of --data: trl, hh-rlhf or shp.
    #[arg(long)]
    pub(crate) format: Option<DataFormat>,
    /// Skip unparsable lines of --data (and report how many) instead of stopping.
    #[arg(long)]
    pub(crate) skip_bad: bool,
    /// Held-out pairs from a file; otherwise --heldout-fraction of --data is held out.
    #[arg(long)]
    pub(crate) heldout: Option<PathBuf>,
    /// Share of --data held out when no --heldout file is given.
    #[arg(long, default_value_t = 0.2)]
    pub(crate) heldout_fraction: f64,
    /// Synthetic persona (device index) to generate.
    #[arg(long, default_value_t = 0)]
    pub(crate) persona: usize,
    /// Synthetic heterogeneity in [0, 1] (matters only across personas).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) heterogeneity: f64,
    /// Synthetic training pairs.
    #[arg(long, default_value_t = 120)]
    pub(crate) train_pairs: usize,
    /// Synthetic held-out pairs.
    #[arg(long, default_value_t = 40)]
    pub(crate) heldout_pairs: usize,
    /// Tokens per sequence (prompt + response) after truncation.
    #[arg(long, default_value_t = 128)]
    pub(crate) max_len: usize,
}

/// Training and held-out pairs.
pub(crate) struct LoadedData {
    pub(crate) train: Vec<PreferencePair>,
    pub(crate) heldout: Vec<PreferencePair>,
}

impl DataArgs {
    /// Reads or generates the pairs.
    pub(crate) fn load(&self, seed: u64) -> Result<LoadedData> {
        if let Some(path) = &self.data {
            let loaded = load_jsonl(path, self.format, self.skip_bad)?;
            if loaded.skipped > 0 {
                tracing::warn!(file = %path.display(), skipped = loaded.skipped, "skipped bad lines");
            }
            let (train, heldout) = match &self.heldout {
                Some(h) => (loaded.pairs, load_jsonl(h, self.format, self.skip_bad)?.pairs),
                None => train_heldout_split(loaded.pairs, self.heldout_fraction, seed)?,
            };
            Ok(LoadedData { train, heldout })
        } else if self.synthetic {
            let spec = SyntheticSpec {
                heterogeneity: self.heterogeneity,
                train_pairs: self.train_pairs,
                heldout_pairs: self.heldout_pairs,
                seed,
            };
            let d = generate_device(&spec, self.persona)?;
            Ok(LoadedData { train: d.train, heldout: d.heldout })
        } else {
            bail!("give --data FILE or --synthetic")
        }
    }
}

/// Tokenizes pairs for the policy's context.
pub(crate) fn tokenize(
    pairs: &[PreferencePair],
    tokenizer: &Gpt2Tokenizer,
    max_len: usize,
    n_positions: usize,
) -> Result<Vec<TokenizedPair>> {
    if max_len > n_positions {
        bail!("--max-len {max_len} exceeds the model's {n_positions} positions");
    }
    Ok(tokenize_pairs(pairs, |s| tokenizer.encode(s), max_len, tokenizer.eos_id())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(not(any(feature = "cuda", feature = "metal")))]
    fn auto_device_is_the_cpu_in_a_build_without_gpu_backends() {
        assert!(parse_device("auto").unwrap().is_cpu());
        assert!(parse_device("cpu").unwrap().is_cpu());
    }

    #[test]
    fn unknown_device_lists_the_accepted_spellings() {
        let err = parse_device("tpu").unwrap_err().to_string();
        assert!(err.contains("auto, cpu, cuda[:N] or metal"), "{err}");
        let err = parse_device("cuda:x").unwrap_err().to_string();
        assert!(err.contains("cuda:x"), "{err}");
    }
}
