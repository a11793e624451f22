//! `fedpo-device train-local`: centralized DPO on one device's pairs.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::PathBuf;

use anyhow::{Context, Result};
use candle_core::Device;
use clap::Args;
use fedpo_data::fingerprint;
use fedpo_device::memory::{self, longest, PlanRequest, StepKernels};
use fedpo_model::checkpoint::save_adapter;
use fedpo_model::export::{write_dir_atomically, write_peft_dir, write_transformers_dir};
use fedpo_model::tensor_files::hash_tensors;
use fedpo_model::{ParamKind, ParamRole, Partition, Policy};
use fedpo_process::files::write_atomic;
use fedpo_process::usage::peak_rss_mib;
use fedpo_train::{
    evaluate, load_or_score_pairs, score_pairs, DpoSettings, EvalMetrics, LocalTrainer, LossKind, OptimConfig,
    OptimKind, PreferenceSet,
};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use crate::cli::assemble::{parse_device, tokenize, ComputeDtype, DataArgs, LoadedData, ModelArgs};

/// Loss and optimizer flags shared by every training command.
#[derive(Debug, Args, Clone)]
pub(crate) struct DpoArgs {
    /// DPO beta.
    #[arg(long, default_value_t = 0.2)]
    pub(crate) beta: f64,
    /// Preference loss: sigmoid (DPO) or ipo.
    #[arg(long, default_value = "sigmoid", value_parser = ["sigmoid", "ipo"])]
    pub(crate) loss: String,
    /// cDPO label smoothing for the sigmoid loss.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) label_smoothing: f64,
    /// Optimizer: sgd or adamw.
    #[arg(long, default_value = "sgd")]
    pub(crate) optim: OptimKind,
    /// Learning rate.
    #[arg(long, default_value_t = 0.1)]
    pub(crate) lr: f64,
    /// AdamW weight decay.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) weight_decay: f64,
    /// Clip the global gradient norm.
    #[arg(long)]
    pub(crate) max_grad_norm: Option<f64>,
    /// Pairs per optimizer step.
    #[arg(long, default_value_t = 8)]
    pub(crate) batch_pairs: usize,
    /// Pairs per forward pass (gradient accumulation); defaults to --batch-pairs.
    #[arg(long)]
    pub(crate) micro_batch_pairs: Option<usize>,
}

impl DpoArgs {
    pub(crate) fn settings(&self, pad_id: u32) -> DpoSettings {
        let loss = match self.loss.as_str() {
            "ipo" => LossKind::Ipo,
            _ => LossKind::Sigmoid { label_smoothing: self.label_smoothing },
        };
        DpoSettings {
            beta: self.beta,
            loss,
            batch_pairs: self.batch_pairs,
            micro_batch_pairs: self.micro_batch_pairs.unwrap_or(self.batch_pairs),
            pad_id,
        }
    }

    pub(crate) fn optim(&self) -> OptimConfig {
        OptimConfig {
            weight_decay: self.weight_decay,
            max_grad_norm: self.max_grad_norm,
            ..OptimConfig::new(self.optim, self.lr)
        }
    }
}

#[derive(Debug, Args)]
pub(crate) struct TrainLocalArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    #[command(flatten)]
    pub(crate) data: DataArgs,
    #[command(flatten)]
    pub(crate) dpo: DpoArgs,
    /// Optimizer steps.
    #[arg(long, default_value_t = 200)]
    pub(crate) steps: u64,
    /// Write a metrics line every N steps.
    #[arg(long, default_value_t = 1)]
    pub(crate) log_every: u64,
    /// Output directory: metrics.jsonl, summary.json, the adapter and/or model.
    #[arg(long, default_value = "runs/train-local")]
    pub(crate) out: PathBuf,
    /// Memory budget in MiB: picks the micro-batch, and if need be freezes the embeddings
    /// and shortens sequences, so that training fits; refuses a budget nothing fits.
    #[arg(long, value_name = "MB")]
    pub(crate) max_memory: Option<u64>,
}

/// Fits training into `--max-memory`: adjusts the model and data flags in place.
fn fit_to_memory(args: &mut TrainLocalArgs, budget: memory::Budget, data: &LoadedData, device: &Device) -> Result<()> {
    // resolved once, here, so that `auto` chooses (and says so) once
    let compute_dtype = args.model.compute_dtype.on(device);
    args.model.compute_dtype = ComputeDtype::Fixed(compute_dtype);
    let config = args.model.config()?;
    let tokenizer = args.model.tokenizer()?;
    let tokens = tokenize(&data.train, &tokenizer, args.data.max_len, config.n_positions)?;
    let (seq_len, response_len) = longest(&tokens);
    let request = PlanRequest {
        lora: args.model.adapter_config(device)?,
        partition: Partition { preset: args.model.partition, freeze_embeddings: args.model.freeze_embeddings },
        optimizer: args.dpo.optim,
        batch_pairs: args.dpo.batch_pairs,
        max_micro_batch_pairs: args.dpo.micro_batch_pairs.unwrap_or(args.dpo.batch_pairs),
        seq_len,
        response_len,
        federated: false,
        start_on_disk: memory::StartOnDisk::Never,
        may_freeze_embeddings: true,
        may_shorten: true,
        kernels: StepKernels::for_run(device, compute_dtype),
        config,
    };
    let plan = memory::plan(&request, budget)?;
    tracing::info!(budget_mib = budget.mib, plan = %plan, longest_sequence = seq_len, longest_response = response_len, "memory plan");
    args.dpo.micro_batch_pairs = Some(plan.micro_batch_pairs);
    args.model.freeze_embeddings |= plan.freeze_embeddings;
    if let Some(len) = plan.max_len {
        args.data.max_len = len;
    }
    Ok(())
}

fn reference_set(
    policy: &Policy,
    model_hash: &str,
    pairs: Vec<fedpo_data::TokenizedPair>,
    cache: PathBuf,
    settings: &DpoSettings,
) -> Result<PreferenceSet> {
    let fp = fingerprint(&pairs);
    let (reference, hit) = load_or_score_pairs(&cache, model_hash, &fp, || {
        score_pairs(policy, &pairs, settings.micro_batch_pairs, settings.pad_id)
    })?;
    tracing::info!(pairs = pairs.len(), cached = hit, file = %cache.display(), "reference log-probs ready");
    Ok(PreferenceSet { pairs, reference })
}

pub(crate) fn run(mut args: TrainLocalArgs) -> Result<()> {
    let device = parse_device(&args.model.device)?;
    let data = args.data.load(args.model.seed)?;
    if let Some(budget) = memory::training_budget(&device, args.max_memory) {
        fit_to_memory(&mut args, budget, &data, &device)?;
    }
    let (policy, tokenizer) = args.model.build(&device)?;
    tracing::debug!(peak_rss_mib = peak_rss_mib(), "model built");
    let n_positions = policy.spec.config.n_positions;
    let train_tokens = tokenize(&data.train, &tokenizer, args.data.max_len, n_positions)?;
    let heldout_tokens = tokenize(&data.heldout, &tokenizer, args.data.max_len, n_positions)?;
    let settings = args.dpo.settings(tokenizer.eos_id());
    fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;

    let trainable = policy.params.trainable().count();
    tracing::info!(
        model = %args.model.model,
        partition = %policy.spec.partition.preset,
        trainable_tensors = trainable,
        trainable_params = policy.params.trainable().map(|p| p.tensor().elem_count()).sum::<usize>(),
        train_pairs = train_tokens.len(),
        heldout_pairs = heldout_tokens.len(),
        "starting local DPO"
    );
    let model_hash = hash_tensors(policy.params.iter().map(|p| (p.name.as_str(), p.tensor())))?;
    let train = reference_set(&policy, &model_hash, train_tokens, args.out.join("ref_train.json"), &settings)?;
    let heldout = reference_set(&policy, &model_hash, heldout_tokens, args.out.join("ref_heldout.json"), &settings)?;

    tracing::debug!(peak_rss_mib = peak_rss_mib(), "reference log-probs scored");
    let before_train = evaluate(&policy, &train, &settings)?;
    let before_heldout = evaluate(&policy, &heldout, &settings)?;
    let mut trainer = LocalTrainer::new(settings, args.dpo.optim(), args.model.seed)?;
    let metrics_path = args.out.join("metrics.jsonl");
    let mut metrics =
        BufWriter::new(File::create(&metrics_path).with_context(|| format!("creating {}", metrics_path.display()))?);
    let bar = ProgressBar::new(args.steps);
    bar.set_style(ProgressStyle::with_template("{bar:30} {pos}/{len} steps [{elapsed_precise}<{eta_precise}] {msg}")?);
    for _ in 0..args.steps {
        let m = trainer.step(&policy, &train)?;
        if m.step % args.log_every.max(1) == 0 || m.step == args.steps {
            serde_json::to_writer(&mut metrics, &m)?;
            metrics.write_all(b"\n")?;
            metrics.flush()?;
        }
        bar.set_message(format!("loss {:.4} acc {:.2} |g| {:.3}", m.loss, m.reward_acc, m.grad_norm));
        bar.inc(1);
        if m.step % 20 == 0 && bar.is_hidden() {
            tracing::info!(step = m.step, loss = m.loss, reward_acc = m.reward_acc, grad_norm = m.grad_norm, "train");
        }
    }
    bar.finish_and_clear();
    tracing::debug!(peak_rss_mib = peak_rss_mib(), "trained");

    // Optimizer state of the private parameters: what a device keeps between rounds.
    let private: Vec<&str> = policy.params.with_role(ParamRole::Private).map(|p| p.name.as_str()).collect();
    if args.dpo.optim == OptimKind::Adamw && !private.is_empty() {
        trainer.optimizer_mut().save_state(&args.out.join("optimizer.safetensors"), &private)?;
    }

    let after_train = evaluate(&policy, &train, &settings)?;
    let after_heldout = evaluate(&policy, &heldout, &settings)?;
    tracing::debug!(peak_rss_mib = peak_rss_mib(), "evaluated");
    save_outputs(&policy, &tokenizer, &args, &before_train, &before_heldout, &after_train, &after_heldout)?;
    println!(
        "reward accuracy  train {:.3} -> {:.3}   held-out {:.3} -> {:.3}   (loss {:.4} -> {:.4})",
        before_train.reward_acc,
        after_train.reward_acc,
        before_heldout.reward_acc,
        after_heldout.reward_acc,
        before_train.loss,
        after_train.loss
    );
    println!("wrote {}", args.out.display());
    Ok(())
}

fn policy_micro_batch(args: &TrainLocalArgs) -> usize {
    args.dpo.micro_batch_pairs.unwrap_or(args.dpo.batch_pairs)
}

fn save_outputs(
    policy: &Policy,
    tokenizer: &fedpo_model::Gpt2Tokenizer,
    args: &TrainLocalArgs,
    before_train: &EvalMetrics,
    before_heldout: &EvalMetrics,
    after_train: &EvalMetrics,
    after_heldout: &EvalMetrics,
) -> Result<()> {
    let mut saved = Vec::new();
    let base_trained = policy.params.trainable().any(|p| p.kind == ParamKind::Base);
    if base_trained {
        // A transformers directory, tokenizer and generation settings included.
        let dir = args.out.join("model");
        write_dir_atomically(&dir, true, |d| write_transformers_dir(policy, Some(tokenizer), false, d))?;
        saved.push("model/");
    }
    if policy.spec.lora.is_some() {
        save_adapter(policy, &args.out.join("adapter.safetensors"))?;
        saved.push("adapter.safetensors");
        // The same adapter as a PEFT directory, over the model it was trained with.
        let base = if base_trained { "../model".to_string() } else { args.model.model.clone() };
        write_dir_atomically(&args.out.join("adapter"), true, |d| write_peft_dir(policy, &base, d))?;
        saved.push("adapter/");
    }
    let summary = json!({
        "final_loss": after_train.loss,
        "reward_acc": after_train.reward_acc,
        "heldout_acc": after_heldout.reward_acc,
        "heldout_loss": after_heldout.loss,
        "margin": after_train.margin,
        "initial": { "loss": before_train.loss, "reward_acc": before_train.reward_acc, "heldout_acc": before_heldout.reward_acc },
        "train_pairs": after_train.pairs,
        "heldout_pairs": after_heldout.pairs,
        "steps": args.steps,
        "model": args.model.model,
        "partition": policy.spec.partition.preset.name(),
        "lora": policy.spec.lora,
        "dpo": { "beta": args.dpo.beta, "loss": args.dpo.loss, "lr": args.dpo.lr, "optim": args.dpo.optim, "batch_pairs": args.dpo.batch_pairs },
        "saved": saved,
        "micro_batch_pairs": policy_micro_batch(args),
        "max_len": args.data.max_len,
        "freeze_embeddings": args.model.freeze_embeddings,
        "peak_rss_mib": peak_rss_mib(),
    });
    write_atomic(&args.out.join("summary.json"), &serde_json::to_vec_pretty(&summary)?)?;
    Ok(())
}
