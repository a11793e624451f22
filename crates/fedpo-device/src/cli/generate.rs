//! `fedpo-device generate`: a completion from the personalized model, streamed to stdout.
//!
//! The model is a device's own (`--state-dir`: the latest global model it received and its
//! private adapter) or any model directory with an optional adapter. `--compare` prints the
//! global base's completion beside the personalized one, with the same seed, so that what
//! differs is what the adapter learned.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use clap::Args;
use fedpo_device::memory::generation_estimate;
use fedpo_model::checkpoint::load_adapter;
use fedpo_model::{
    fit_prompt, generate, GenerateSettings, Gpt2, Gpt2Tokenizer, ParamRole, Partition, PartitionPreset, Policy,
    PolicySpec, Sampling, StopReason, TensorSource, TrimmedVocab, GPT2_VOCAB_SIZE,
};
use fedpo_wire::{Limits, TensorPayload};

use crate::cli::assemble::{parse_device, ModelArgs};

#[derive(Debug, Args)]
pub(crate) struct GenerateArgs {
    /// A device's state directory: its latest global model and private adapter.
    #[arg(long, conflicts_with_all = ["model", "adapter"])]
    state_dir: Option<PathBuf>,
    /// `tiny`, `distilgpt2` (random weights from --seed) or an HF model directory.
    #[arg(long)]
    model: Option<String>,
    /// A saved adapter to apply to --model.
    #[arg(long, requires = "model")]
    adapter: Option<PathBuf>,
    /// The job's trimmed vocabulary (`simulate --trim-vocab` writes `OUT/vocab.json`).
    #[arg(long)]
    vocab: Option<PathBuf>,
    /// The prompt; read from standard input when absent.
    #[arg(long)]
    prompt: Option<String>,
    /// The most tokens to generate.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Sample among the k most likely tokens.
    #[arg(long, default_value_t = 50)]
    top_k: usize,
    /// Sample among the fewest most likely tokens whose probabilities reach p.
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    /// Seed of the sampler (and of a preset model's random weights).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop before this text; may be given more than once.
    #[arg(long)]
    stop: Vec<String>,
    /// Take the most likely token at every step (no sampling).
    #[arg(long)]
    greedy: bool,
    /// Print the global base's completion, then the personalized one.
    #[arg(long)]
    compare: bool,
    /// Compute device: auto, cpu, cuda[:N] or metal.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Weights in f32 or bf16 (half the memory and the bytes each token reads); activations,
    /// the cache and the logits stay f32.
    #[arg(long, default_value = "f32", value_parser = parse_dtype)]
    dtype: DType,
    /// Memory budget, MiB: refuse a generation whose weights, cache and activations would
    /// not fit.
    #[arg(long)]
    max_memory: Option<u64>,
}

fn parse_dtype(s: &str) -> std::result::Result<DType, String> {
    match s {
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        other => Err(format!("`{other}` is not a generation dtype; expected f32 or bf16")),
    }
}

/// A model ready to generate, with the tokenizer its ids belong to.
pub(crate) struct Loaded {
    pub(crate) policy: Policy,
    pub(crate) tokenizer: Gpt2Tokenizer,
    /// Whether the policy carries an adapter that changes its output.
    pub(crate) adapted: bool,
    /// What was loaded, for the log.
    pub(crate) source: String,
}

/// The latest global model of a device's state directory with its private adapter.
pub(crate) fn load_state_dir(dir: &Path, dtype: DType, device: &Device) -> Result<Loaded> {
    let (latest, bytes) = fedpo_device::read_latest_model(dir)?;
    let spec: PolicySpec = serde_json::from_str(&latest.model_spec)
        .with_context(|| format!("{}: unreadable model spec", dir.join("global-model.json").display()))?;
    let payload = TensorPayload::from_shared(bytes, &Limits::default(), true)?;
    let global = TensorSource::from_wire(&payload.tensors, "the latest global model", device)?;
    drop(payload);
    let private = spec.partition.uses_adapter() && spec.partition.adapter_role() == ParamRole::Private;
    let adapter_path = dir.join("adapter.safetensors");
    let saved = if private {
        if !adapter_path.exists() {
            bail!("{} is missing: this device has not trained a private adapter yet", adapter_path.display());
        }
        Some(load_adapter(&adapter_path, device)?)
    } else {
        None
    };
    let adapter = match (&saved, private) {
        (Some(a), _) => Some(&a.tensors),
        (None, _) if spec.lora.is_some() => Some(&global),
        _ => None,
    };
    // Nothing trains: every tensor frozen.
    let frozen = PolicySpec { partition: Partition::new(PartitionPreset::SharedLora), ..spec.clone() };
    let adapted = spec.lora.is_some() && spec.partition.uses_adapter();
    let frozen = if adapted { frozen } else { PolicySpec { lora: None, ..frozen } };
    let mut policy = Policy::build(frozen, Some(&global), adapter, 0, dtype, device)?;
    // bf16 weights, f32 activations (see `fedpo_model::KvCache`).
    policy.model.set_compute_dtype(DType::F32);
    let source = format!(
        "{}: job `{}`, the global model of round {}{}",
        dir.display(),
        latest.job,
        latest.round,
        if private { " and this device's private adapter" } else { "" }
    );
    Ok(Loaded { policy, tokenizer: Gpt2Tokenizer::gpt2()?, adapted: private, source })
}

fn loaded_from(model: &str) -> String {
    format!("--model {model}")
}

/// `--model` with `--adapter`.
fn load_model(args: &GenerateArgs, model: &str, device: &Device) -> Result<Loaded> {
    let model_args = ModelArgs {
        model: model.to_string(),
        adapter: args.adapter.clone(),
        rank: 8,
        alpha: 16.0,
        targets: "c_attn".parse().map_err(|e: String| anyhow::anyhow!(e))?,
        partition: PartitionPreset::SharedLora,
        freeze_embeddings: true,
        device: args.device.clone(),
        seed: args.seed,
        compute_dtype: crate::cli::assemble::ComputeDtype::Fixed(DType::F32),
    };
    let (policy, tokenizer) = model_args.build(device)?;
    let policy = if args.dtype == DType::F32 {
        policy
    } else {
        // Rebuilt in the requested dtype from the f32 one's tensors.
        let tensors = TensorSource {
            tensors: policy.params.iter().map(|p| (p.name.clone(), p.tensor().clone())).collect(),
            description: loaded_from(model),
        };
        let mut half =
            Policy::build(policy.spec.clone(), Some(&tensors), Some(&tensors), args.seed, args.dtype, device)?;
        half.model.set_compute_dtype(DType::F32);
        half
    };
    let adapted = args.adapter.is_some();
    let source = match &args.adapter {
        Some(a) => format!("{model} with the adapter {}", a.display()),
        None => model.to_string(),
    };
    Ok(Loaded { policy, tokenizer, adapted, source })
}

pub(crate) fn run(args: GenerateArgs) -> Result<()> {
    let device = parse_device(&args.device)?;
    let mut loaded = match (&args.state_dir, &args.model) {
        (Some(dir), _) => load_state_dir(dir, args.dtype, &device)?,
        (None, Some(model)) => load_model(&args, model, &device)?,
        (None, None) => bail!("say which model: --state-dir DIR (a device's), or --model DIR|tiny|distilgpt2"),
    };
    if let Some(path) = &args.vocab {
        let vocab = TrimmedVocab::load(path, GPT2_VOCAB_SIZE)?;
        loaded.tokenizer = loaded.tokenizer.with_trimmed_vocab(Arc::new(vocab))?;
    }
    let config = &loaded.policy.spec.config;
    if loaded.tokenizer.vocab_size() > config.vocab_size {
        bail!(
            "the model has {} tokens and the tokenizer {}: a model trained on a trimmed vocabulary needs the job's \
             --vocab FILE",
            config.vocab_size,
            loaded.tokenizer.vocab_size()
        );
    }
    if args.compare && !loaded.adapted {
        bail!("--compare needs an adapter to compare against: a --state-dir of a pFedDPO device, or --adapter FILE");
    }
    let prompt = match &args.prompt {
        Some(p) => p.clone(),
        None => {
            let mut text = String::new();
            std::io::stdin().read_to_string(&mut text).context("reading the prompt from standard input")?;
            text
        }
    };
    let ids = loaded.tokenizer.encode(&prompt)?;
    let (fitted, dropped) = fit_prompt(&ids, args.max_new_tokens, config.n_positions)?;
    if dropped > 0 {
        tracing::warn!(
            prompt_tokens = ids.len(),
            kept = fitted.len(),
            "the prompt and --max-new-tokens {} exceed the model's {} positions: its first {dropped} tokens are dropped",
            args.max_new_tokens,
            config.n_positions
        );
    }
    let estimate = generation_estimate(
        config,
        loaded.policy.params.iter().map(|p| p.tensor().elem_count()).sum(),
        args.dtype,
        fitted.len(),
        args.max_new_tokens,
    );
    tracing::info!(source = %loaded.source, prompt_tokens = fitted.len(), plan = %estimate, "generating");
    if let Some(budget) = args.max_memory {
        if estimate.total_mib() > budget as f64 {
            bail!(
                "--max-memory {budget} MiB: this generation needs about {estimate}; lower --max-new-tokens or the \
                 prompt, or use --dtype bf16"
            );
        }
    }
    let sampling = Sampling {
        temperature: if args.greedy { 0.0 } else { args.temperature },
        top_k: Some(args.top_k).filter(|&k| k > 0),
        top_p: Some(args.top_p).filter(|&p| p < 1.0),
        seed: args.seed,
    };
    let settings = GenerateSettings {
        max_new_tokens: args.max_new_tokens,
        sampling,
        end_of_text: Some(loaded.tokenizer.eos_id()),
    };
    let mut out = std::io::stdout().lock();
    if args.compare {
        writeln!(out, "── global model alone ──")?;
        complete(&loaded.policy.model.base_only(), &loaded.tokenizer, fitted, &settings, &args.stop, &mut out)?;
        writeln!(out, "\n── with your adapter ──")?;
    }
    complete(&loaded.policy.model, &loaded.tokenizer, fitted, &settings, &args.stop, &mut out)?;
    writeln!(out)?;
    Ok(())
}

/// Generates and streams one completion: each token's text is written as soon as it is
/// whole (a token may end inside a multi-byte character), and a stop string ends it before
/// the string is written.
fn complete(
    model: &Gpt2,
    tokenizer: &Gpt2Tokenizer,
    prompt: &[u32],
    settings: &GenerateSettings,
    stops: &[String],
    out: &mut impl Write,
) -> Result<()> {
    let mut ids = Vec::new();
    let mut written = 0; // bytes of the decoded completion already written
    let mut failure = None;
    let generated = generate(model, prompt, settings, |id| {
        ids.push(id);
        let text = match tokenizer.decode(&ids) {
            Ok(t) => t,
            Err(e) => {
                failure = Some(anyhow::Error::from(e));
                return false;
            }
        };
        if let Some(at) = stops.iter().filter_map(|s| text.find(s.as_str())).min() {
            let _ = out.write_all(text.as_bytes().get(written..at).unwrap_or_default());
            written = at;
            return false;
        }
        // Hold back a partial character (decoded as U+FFFD) and any text a stop string
        // could still begin with.
        let mut end = text.trim_end_matches('\u{FFFD}').len();
        for stop in stops {
            for k in (1..stop.len()).rev() {
                if stop.is_char_boundary(k) && text[..end].ends_with(&stop[..k]) {
                    end = end.min(text[..end].len() - k);
                    break;
                }
            }
        }
        if end > written {
            let ok = out.write_all(&text.as_bytes()[written..end]).and_then(|()| out.flush());
            if let Err(e) = ok {
                failure = Some(e.into());
                return false;
            }
            written = end;
        }
        true
    })?;
    if let Some(e) = failure {
        return Err(e);
    }
    if generated.stop != StopReason::Caller {
        let text = tokenizer.decode(&generated.ids)?;
        out.write_all(text.as_bytes().get(written..).unwrap_or_default())?;
    }
    out.flush()?;
    let tokens = generated.ids.len().max(1);
    tracing::info!(
        tokens = generated.ids.len(),
        stop = ?generated.stop,
        prefill_tokens_per_s = format_args!("{:.1}", prompt.len() as f64 / generated.prefill.as_secs_f64()),
        tokens_per_s = format_args!("{:.1}", tokens as f64 / generated.decode.as_secs_f64().max(1e-9)),
        "generated"
    );
    Ok(())
}
