//! The settings of a federated job, shared by `serve` and `simulate`.

use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::Device;
use clap::Args;
use fedpo_model::checkpoint::load_hf_dir;
use fedpo_model::{Gpt2Config, LoraConfig, LoraTargets, Partition, Policy, PolicySpec};

use crate::algorithms::client_term::{ClientTerm, ClientTermKind};
use crate::algorithms::fedavg::FedAvg;
use crate::algorithms::fedga::{resolve_layer_weights, FedgaSettings};
use crate::algorithms::fedopt::{Adaptivity, FedAdaptive};
use crate::algorithms::strategy::Strategy;
use crate::combine::AggregationArgs;
use crate::global_model::GlobalModel;
use crate::partitions::Method;

/// How rounds run.
#[derive(Debug, Args, Clone)]
pub(crate) struct JobArgs {
    /// Job name: every topic lives under fedpo/{job}/.
    #[arg(long, default_value = "demo")]
    pub(crate) job: String,
    /// pfeddpo (shared base, private adapters), feddpo (shared base, no adapter),
    /// shared-lora (frozen base, averaged adapters) or centralized (one trainer, all data).
    #[arg(long, default_value = "pfeddpo")]
    pub(crate) method: Method,
    /// `tiny` or `distilgpt2` (GPT-2 initialised from --seed), or an HF directory.
    #[arg(long, default_value = "tiny")]
    pub(crate) model: String,
    /// Keep the token and position embeddings frozen (and out of every update).
    #[arg(long)]
    pub(crate) freeze_embeddings: bool,
    /// LoRA rank.
    #[arg(long, default_value_t = 8)]
    pub(crate) rank: usize,
    /// LoRA alpha.
    #[arg(long, default_value_t = 16.0)]
    pub(crate) alpha: f64,
    /// LoRA targets.
    #[arg(long, default_value = "c_attn")]
    pub(crate) targets: LoraTargets,
    /// Training rounds.
    #[arg(long, default_value_t = 20)]
    pub(crate) rounds: u64,
    /// Devices selected per round (S).
    #[arg(long, default_value_t = 5)]
    pub(crate) per_round: usize,
    /// Local optimizer steps per round (E).
    #[arg(long, default_value_t = 4)]
    pub(crate) local_steps: u32,
    /// Local SGD learning rate.
    #[arg(long, default_value_t = 0.1)]
    pub(crate) lr: f64,
    /// DPO beta.
    #[arg(long, default_value_t = 0.2)]
    pub(crate) beta: f64,
    /// Pairs per local step.
    #[arg(long, default_value_t = 8)]
    pub(crate) batch_pairs: u32,
    /// Server optimizer: fedavg, fedadam or fedyogi (Reddi et al. 2021).
    #[arg(long, default_value = "fedavg", value_parser = ["fedavg", "fedadam", "fedyogi"])]
    pub(crate) strategy: String,
    /// Server learning rate η applied to the averaged update [default: 1.0 for fedavg,
    /// 0.01 for fedadam and fedyogi].
    #[arg(long)]
    pub(crate) server_lr: Option<f64>,
    /// FedAdam/FedYogi first-moment decay β1.
    #[arg(long, default_value_t = 0.9)]
    pub(crate) server_beta1: f64,
    /// FedAdam/FedYogi second-moment decay β2.
    #[arg(long, default_value_t = 0.99)]
    pub(crate) server_beta2: f64,
    /// FedAdam/FedYogi adaptivity floor τ.
    #[arg(long, default_value_t = 1e-3)]
    pub(crate) server_tau: f64,
    /// Term every device adds to its local objective: none, fedprox (μ/2·‖θ − θ_global‖²),
    /// scaffold (control variates) or fedga (gradient alignment with the global direction).
    #[arg(long, value_enum, default_value = "none")]
    pub(crate) client_term: ClientTermKind,
    /// FedProx's μ.
    #[arg(long, default_value_t = 0.01)]
    pub(crate) prox_mu: f64,
    /// FedGA's λ: weight of the alignment penalty.
    #[arg(long, default_value_t = 0.1)]
    pub(crate) fedga_lambda: f64,
    /// FedGA's β: EMA decay of the reference direction.
    #[arg(long, default_value_t = 0.9)]
    pub(crate) fedga_beta: f64,
    /// FedGA's reference: `ema` of the global update direction (each round weighs by the
    /// size of its step, as FedGA defines it) or `unit-ema` of unit steps (every round
    /// weighs alike).
    #[arg(long, default_value = "ema", value_parser = ["ema", "unit-ema"])]
    pub(crate) fedga_reference: String,
    /// FedGA's cosine over the whole shared model (`full`) or per layer (`layer`).
    #[arg(long, default_value = "full", value_parser = ["full", "layer"])]
    pub(crate) fedga_granularity: String,
    /// Per-layer FedGA weights, e.g. 'h.*.attn=1,wte=0' (later patterns win; layers not
    /// named weigh 1). Needs --fedga-granularity layer.
    #[arg(long, default_value = "")]
    pub(crate) fedga_layer_weights: String,
    /// FedGA gradient: `hvp` (finite-difference Hessian-vector product, two extra
    /// backward passes per step) or `displacement` (first order, no extra pass).
    #[arg(long, default_value = "hvp", value_parser = ["hvp", "displacement"])]
    pub(crate) fedga_mode: String,
    /// FedGA's finite-difference step, relative to the norm of the shared parameters.
    #[arg(long, default_value_t = 1e-3)]
    pub(crate) fedga_fd_step: f64,
    /// Devices upload their full local gradient at the received model each round, for the
    /// exact global gradient norm and the gradient diversity κ² (one more shared-set-sized
    /// upload per device and round, reported as diagnostics_bytes).
    #[arg(long)]
    pub(crate) diagnostics: bool,
    /// With --diagnostics, measure only every K-th training round (and the first and
    /// last): the full-data gradient costs more than a round's local steps.
    #[arg(long, value_name = "K", default_value_t = 1, requires = "diagnostics",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) diagnostics_every: u64,
    /// Devices measure held-out accuracy only every K-th training round (and the first,
    /// the last and the closing evaluation): it costs a forward pass over every held-out
    /// pair.
    #[arg(long, value_name = "K", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) heldout_every: u64,
    /// Set by `simulate --trim-vocab`: the preset's (vocabulary size, positions) shrink
    /// to these.
    #[arg(skip)]
    pub(crate) trimmed: Option<(usize, usize)>,
    /// Ed25519 private key (PEM PKCS#8, e.g. security/make-certs.sh's signing.key): every
    /// plan is signed with it, and devices that pin its public key (`--trust-key`) refuse
    /// plans and models that do not verify.
    #[arg(long, value_name = "FILE")]
    pub(crate) signing_key: Option<std::path::PathBuf>,
    /// Refuse an update whose L2 norm exceeds this (a bound on how far one device can move
    /// the model; refused updates are logged and recorded under `rejected`).
    #[arg(long, value_name = "NORM")]
    pub(crate) max_update_norm: Option<f64>,
    #[command(flatten)]
    pub(crate) aggregation: AggregationArgs,
    /// How devices encode their update: f32, bf16, f16, int8 (per-block absmax, 0.27x the
    /// bytes) or topk:F (the largest fraction F of each tensor's entries; what is left out
    /// is kept on the device and sent in later rounds).
    #[arg(long, value_name = "CODEC", default_value = "f32")]
    pub(crate) update_codec: fedpo_wire::UpdateCodec,
    /// How the global model goes down: `full` (the whole model in f32 every round), or a
    /// codec (f32, bf16, f16, int8, topk:F with F at most 0.5): each round a delta of the
    /// shared tensors against the model the devices hold, with the aggregator's own error
    /// feedback; frozen tensors go down once [default: the update codec; full with
    /// --update-codec f32 or a top-k above 0.5].
    #[arg(long, value_name = "CODEC")]
    pub(crate) downlink_codec: Option<crate::downlink::DownlinkCodec>,
    /// Secure aggregation (pairwise masking, Bonawitz et al. 2017): devices upload masked
    /// fixed-point updates and the aggregator learns only their pair-weighted sum, even
    /// if devices drop out after the key exchange.
    #[arg(long)]
    pub(crate) secure_aggregation: bool,
    /// Shares needed to rebuild a device's secrets, and the fewest inputs the aggregator
    /// may unmask [default: a majority of the round's devices].
    #[arg(long, value_name = "T")]
    pub(crate) secagg_threshold: Option<usize>,
    /// The largest magnitude of any value of a device's update under secure aggregation;
    /// larger values are clamped (and logged) before masking. Sets the fixed-point scale.
    #[arg(long, value_name = "R", default_value_t = 1.0)]
    pub(crate) secagg_range: f32,
    /// Seed of the model init and of device selection.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Start once this many devices have said hello.
    #[arg(long)]
    pub(crate) min_devices: Option<usize>,
    /// Give up waiting for --min-devices after this many seconds.
    #[arg(long, default_value_t = 300)]
    pub(crate) register_timeout: u64,
    /// The devices that may join: a file with one device id per line (`#` comments).
    /// Hellos from other ids are ignored. Without it, the users of --broker-passwords, or
    /// anyone.
    #[arg(long, value_name = "FILE")]
    pub(crate) devices_file: Option<std::path::PathBuf>,
    /// Most devices that may register: hellos from new ids beyond it are ignored, so that
    /// a flood of made-up ids cannot grow the aggregator's state.
    #[arg(long, default_value_t = 10_000)]
    pub(crate) max_devices: usize,
    /// A round closes this many seconds after its plan, with whatever arrived.
    #[arg(long, default_value_t = 600)]
    pub(crate) round_deadline: u64,
    /// Fewest updates a round needs to change the global model.
    #[arg(long, default_value_t = 1)]
    pub(crate) quorum: usize,
    /// Skip the closing evaluation-only round in which every device reports its final
    /// training and held-out accuracy.
    #[arg(long)]
    pub(crate) no_final_eval: bool,
}

impl JobArgs {
    /// The plan signer from `--signing-key`, if given.
    pub(crate) fn signer(&self) -> Result<Option<fedpo_wire::Signer>> {
        match &self.signing_key {
            Some(path) => {
                let signer = fedpo_wire::Signer::from_pem_file(path)?;
                tracing::info!(public_key = %signer.public_key_hex(), "signing every plan");
                Ok(Some(signer))
            }
            None => Ok(None),
        }
    }

    /// The downlink's delta codec; `None`: the whole model every round.
    pub(crate) fn downlink(&self) -> Option<fedpo_wire::UpdateCodec> {
        use crate::downlink::DownlinkCodec;
        match self.downlink_codec {
            Some(DownlinkCodec::Full) => None,
            Some(DownlinkCodec::Delta(codec)) => Some(codec),
            None => match self.update_codec {
                fedpo_wire::UpdateCodec::F32 => None,
                fedpo_wire::UpdateCodec::TopK(f) if f > crate::downlink::MAX_TOPK_FRACTION => None,
                codec => Some(codec),
            },
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if let Some(crate::downlink::DownlinkCodec::Delta(fedpo_wire::UpdateCodec::TopK(f))) = self.downlink_codec {
            if f > crate::downlink::MAX_TOPK_FRACTION {
                bail!(
                    "--downlink-codec topk:{f}: a delta of more than topk:{} takes more bytes than the whole model; use full or int8",
                    crate::downlink::MAX_TOPK_FRACTION
                );
            }
        }
        if self.rounds == 0 {
            bail!("--rounds must be at least 1: a job trains, then evaluates the model it trained");
        }
        if self.rounds >= fedpo_wire::MAX_ROUND {
            bail!(
                "--rounds {} is beyond the limit of {} (devices refuse higher rounds)",
                self.rounds,
                fedpo_wire::MAX_ROUND - 1
            );
        }
        if self.max_devices == 0 {
            bail!("--max-devices must be at least 1");
        }
        if let Some(min) = self.min_devices.filter(|&m| m > self.max_devices) {
            bail!("--min-devices {min} can never register with --max-devices {}", self.max_devices);
        }
        if self.per_round == 0 {
            bail!("--per-round must be at least 1");
        }
        if self.quorum == 0 {
            bail!("--quorum must be at least 1");
        }
        if self.quorum > self.per_round {
            bail!("--quorum {} can never be met with --per-round {}", self.quorum, self.per_round);
        }
        for (flag, v) in [
            ("--lr", self.lr),
            ("--server-lr", self.server_lr()),
            ("--beta", self.beta),
            ("--server-tau", self.server_tau),
        ] {
            if !(v.is_finite() && v > 0.0) {
                bail!("{flag} must be a positive number, got {v}");
            }
        }
        if self.batch_pairs == 0 {
            bail!("--batch-pairs must be at least 1");
        }
        for (flag, v) in [("--prox-mu", self.prox_mu), ("--fedga-lambda", self.fedga_lambda)] {
            if !(v.is_finite() && v >= 0.0) {
                bail!("{flag} must be a non-negative number, got {v}");
            }
        }
        if let Some(v) = self.max_update_norm {
            if !(v.is_finite() && v > 0.0) {
                bail!("--max-update-norm must be a positive number, got {v}");
            }
        }
        if !(self.fedga_fd_step.is_finite() && self.fedga_fd_step > 0.0) {
            bail!("--fedga-fd-step must be a positive number, got {}", self.fedga_fd_step);
        }
        if !(0.0..1.0).contains(&self.fedga_beta) {
            bail!("--fedga-beta must be in [0, 1), got {}", self.fedga_beta);
        }
        if !self.fedga_layer_weights.is_empty() && self.fedga_granularity != "layer" {
            bail!("--fedga-layer-weights needs --fedga-granularity layer");
        }
        for (flag, v) in [("--server-beta1", self.server_beta1), ("--server-beta2", self.server_beta2)] {
            if !(0.0..1.0).contains(&v) {
                bail!("{flag} must be in [0, 1), got {v}");
            }
        }
        self.aggregation.validate(self.per_round)?;
        if self.secure_aggregation {
            self.validate_secure()?;
        }
        if self.aggregation.private() {
            if self.diagnostics {
                bail!("--diagnostics publishes per-device gradient statistics that --dp-noise-multiplier does not cover; drop one");
            }
            if self.client_term == ClientTermKind::Scaffold {
                bail!("SCAFFOLD averages control variates without noise, outside the DP guarantee; --dp-noise-multiplier refuses --client-term scaffold");
            }
        }
        Ok(())
    }

    /// What secure aggregation cannot be combined with: anything that needs a device's
    /// own update or gradient at the aggregator.
    fn validate_secure(&self) -> Result<()> {
        let hidden = "secure aggregation hides individual updates";
        if self.aggregation.aggregation != crate::algorithms::robust::AggregationRule::Mean {
            bail!(
                "--aggregation {} needs every device's own update, and {hidden}; use the mean with --secure-aggregation",
                self.aggregation.aggregation.name()
            );
        }
        if self.aggregation.clip_norm.is_some() || self.aggregation.private() {
            bail!("--clip-norm and --dp-noise-multiplier clip each device's update at the aggregator, and {hidden}");
        }
        if self.max_update_norm.is_some() {
            bail!("--max-update-norm checks each device's update, and {hidden}");
        }
        if self.update_codec != fedpo_wire::UpdateCodec::F32 {
            bail!(
                "--update-codec {} cannot apply: secure aggregation uploads masked fixed-point words of its own; drop --update-codec",
                self.update_codec
            );
        }
        if self.diagnostics {
            bail!("--diagnostics uploads each device's gradient in clear, which secure aggregation exists to prevent");
        }
        if self.client_term == ClientTermKind::Scaffold {
            bail!("SCAFFOLD uploads each device's control variate in clear; --secure-aggregation refuses it");
        }
        if self.method == Method::Centralized {
            bail!("--method centralized has one trainer: there is nothing to aggregate securely");
        }
        if self.per_round < 2 {
            bail!("--secure-aggregation needs at least 2 devices per round, got --per-round {}", self.per_round);
        }
        if let Some(t) = self.secagg_threshold {
            if !(2..=self.per_round.min(fedpo_secagg::MAX_PARTIES)).contains(&t) {
                bail!("--secagg-threshold {t} must be between 2 and --per-round {}", self.per_round);
            }
        }
        if self.per_round > fedpo_secagg::MAX_PARTIES {
            bail!("--secure-aggregation handles at most {} devices per round", fedpo_secagg::MAX_PARTIES);
        }
        if !(self.secagg_range.is_finite() && self.secagg_range > 0.0) {
            bail!("--secagg-range must be a positive number, got {}", self.secagg_range);
        }
        Ok(())
    }

    /// η: the flag, or the strategy's usual value.
    pub(crate) fn server_lr(&self) -> f64 {
        self.server_lr.unwrap_or(if self.strategy == "fedavg" { 1.0 } else { 0.01 })
    }

    /// The server strategy the flags describe.
    pub(crate) fn build_strategy(&self) -> Box<dyn Strategy> {
        let adaptive = |kind| {
            Box::new(FedAdaptive::new(kind, self.server_lr(), self.server_beta1, self.server_beta2, self.server_tau))
        };
        match self.strategy.as_str() {
            "fedadam" => adaptive(Adaptivity::Adam),
            "fedyogi" => adaptive(Adaptivity::Yogi),
            _ => Box::new(FedAvg::new(self.server_lr())),
        }
    }

    /// The client-side term the flags describe, for a job on `global`.
    pub(crate) fn build_client_term(&self, global: &GlobalModel) -> Result<ClientTerm> {
        let fedga = FedgaSettings {
            lambda: self.fedga_lambda,
            beta: self.fedga_beta,
            layer: self.fedga_granularity == "layer",
            displacement: self.fedga_mode == "displacement",
            fd_step: self.fedga_fd_step,
            weights: resolve_layer_weights(&self.fedga_layer_weights, global)?,
            unit_steps: self.fedga_reference == "unit-ema",
        };
        Ok(ClientTerm::new(self.client_term, self.prox_mu, fedga, global))
    }

    /// Whether training round `round` carries the --diagnostics measurement.
    pub(crate) fn diagnoses(&self, round: u64) -> bool {
        self.diagnostics && (round == 1 || round == self.rounds || round.is_multiple_of(self.diagnostics_every))
    }

    /// Whether training round `round`'s devices measure held-out accuracy.
    pub(crate) fn evaluates_heldout(&self, round: u64) -> bool {
        round == 1 || round == self.rounds || round.is_multiple_of(self.heldout_every)
    }

    /// The round-0 global model: a preset initialised from --seed, or an HF checkpoint.
    pub(crate) fn initial_model(&self) -> Result<GlobalModel> {
        let targets: Vec<&str> = self.targets.0.iter().map(String::as_str).collect();
        let lora = LoraConfig::new(self.rank, self.alpha, &targets)?;
        let partition = Partition { preset: self.method.partition(), freeze_embeddings: self.freeze_embeddings };
        let (config, base) = match Gpt2Config::preset(&self.model) {
            Some(c) => {
                let (vocab_size, n_positions) = self.trimmed.unwrap_or((c.vocab_size, c.n_positions));
                (Gpt2Config { vocab_size, n_positions: n_positions.min(c.n_positions), ..c }, None)
            }
            None if self.trimmed.is_some() => {
                bail!("a trimmed vocabulary needs a preset model (tiny, distilgpt2), not `{}`", self.model)
            }
            None => {
                let ckpt = load_hf_dir(Path::new(&self.model), &Device::Cpu).with_context(|| {
                    format!(
                        "--model `{}` is neither a preset (tiny, distilgpt2) nor a loadable HF directory",
                        self.model
                    )
                })?;
                (ckpt.config, Some(ckpt.base))
            }
        };
        let spec = PolicySpec { config, lora: Some(lora), partition };
        let policy = Policy::build(spec, base.as_ref(), None, self.seed, candle_core::DType::F32, &Device::Cpu)?;
        GlobalModel::from_policy(&policy)
    }
}

/// Reads --devices-file: one device id per line; blank lines and `#` comments skipped.
pub(crate) fn read_devices_file(path: &std::path::Path) -> Result<std::collections::BTreeSet<String>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading --devices-file {}", path.display()))?;
    let ids: std::collections::BTreeSet<String> =
        text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(String::from).collect();
    if ids.is_empty() {
        bail!("--devices-file {} lists no device: no one could join", path.display());
    }
    Ok(ids)
}
