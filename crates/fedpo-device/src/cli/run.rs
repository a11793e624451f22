//! `fedpo-device run`: take part in a federated job.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use fedpo_data::partition::train_heldout_split;
use fedpo_data::synthetic::{generate_pairs, Personas, SyntheticSpec};
use fedpo_data::{load_jsonl, DataFormat};
use fedpo_device::participant::{self, ParticipantConfig};
use fedpo_model::{TrimmedVocab, GPT2_VOCAB_SIZE};
use fedpo_transport::{BrokerUrl, TlsFiles};
use fedpo_wire::TrustedKey;

use crate::cli::assemble::parse_device;

#[derive(Debug, Args)]
pub(crate) struct RunArgs {
    /// The broker: mqtt://[user[:password]@]host[:port] or mqtts://...
    #[arg(long)]
    broker: String,
    /// Job name (topics live under fedpo/{job}/).
    #[arg(long, default_value = "demo")]
    job: String,
    /// This device's id, unique in the job.
    #[arg(long)]
    id: String,
    /// Where the private adapter, reference cache and progress are kept.
    #[arg(long)]
    state_dir: PathBuf,
    /// JSONL preference pairs (TRL, HH-RLHF or SHP layout, detected per line).
    #[arg(long, conflicts_with = "synthetic_persona")]
    data: Option<PathBuf>,
    /// Force the layout of --data: trl, hh-rlhf or shp.
    #[arg(long)]
    format: Option<DataFormat>,
    /// Skip unparsable lines of --data instead of stopping.
    #[arg(long)]
    skip_bad: bool,
    /// Share of --data held out for the held-out accuracy.
    #[arg(long, default_value_t = 0.2)]
    heldout_fraction: f64,
    /// Held-out pairs from this file instead of a share of --data, which then trains whole.
    #[arg(long, value_name = "FILE", requires = "data")]
    heldout: Option<PathBuf>,
    /// Use synthetic persona K instead of a file.
    #[arg(long)]
    synthetic_persona: Option<usize>,
    /// Synthetic personas: opposed or drawn (as `fedpo-aggregator simulate --personas`).
    #[arg(long, default_value = "opposed")]
    personas: Personas,
    /// Temperature of drawn personas' labels.
    #[arg(long, default_value_t = 1.0)]
    label_temperature: f64,
    /// Synthetic heterogeneity in [0, 1]; every device of a job must use the same value.
    #[arg(long, default_value_t = 1.0)]
    heterogeneity: f64,
    /// Synthetic training pairs.
    #[arg(long, default_value_t = 120)]
    train_pairs: usize,
    /// Synthetic held-out pairs.
    #[arg(long, default_value_t = 40)]
    heldout_pairs: usize,
    /// Seed of the synthetic data (the job's seed) and of the held-out split.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Tokens per sequence after truncation.
    #[arg(long, default_value_t = 128)]
    max_len: usize,
    /// The job's trimmed vocabulary (`vocab.json` from `simulate --trim-vocab`): pairs are
    /// tokenized into it, for a job whose model has only those tokens.
    #[arg(long, value_name = "FILE")]
    vocab: Option<PathBuf>,
    /// Compute device: auto (the best backend built in: cuda, metal, then cpu), cpu,
    /// cuda[:N] or metal.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Precision of the matmuls, as `train-local --compute-dtype`: f32, bf16, f16 or auto
    /// (the uploaded delta and the private adapter stay f32).
    #[arg(long, default_value = "f32", value_parser = crate::cli::assemble::parse_compute_dtype)]
    compute_dtype: crate::cli::assemble::ComputeDtype,
    /// The aggregator's Ed25519 public key (64 hex digits, or a file holding them, e.g.
    /// security/make-certs.sh's signing.pub): plans and results that do not verify are refused.
    #[arg(long, value_name = "HEX|FILE")]
    trust_key: Option<String>,
    /// Follow a new run of the job although this state directory followed another: after
    /// the aggregator started the job afresh (not with --resume). The device's rounds count
    /// from 1 again; its adapter stays.
    #[arg(long)]
    rejoin: bool,
    /// Start this device's private adapter from an adapter (a fedpo adapter file or a
    /// PEFT directory) instead of a fresh one. Only before the device has an adapter of
    /// its own; its rank and targets must be the job's.
    #[arg(long)]
    init_adapter: Option<PathBuf>,
    /// Start a fresh private adapter if the one this device saved is missing; without
    /// it, a missing adapter stops the device before it joins, so that its personalisation
    /// is not lost unnoticed.
    #[arg(long)]
    reset_adapter: bool,
    /// Memory budget for training, MiB: each round's micro-batch is planned to fit; a job
    /// whose model cannot fit is refused before its model is downloaded.
    #[arg(long, value_name = "MB")]
    max_memory: Option<u64>,
    /// The most pairs one forward pass takes: a round's batch of more trains in several
    /// passes with gradient accumulation (the same step, less activation memory, slower);
    /// with --max-memory the plan may take fewer.
    #[arg(long, value_name = "PAIRS", value_parser = clap::value_parser!(u64).range(1..))]
    micro_batch_pairs: Option<u64>,
    /// Keep each round's starting model on disk (in --state-dir) while training, and read
    /// it back to form the update: one copy of the shared weights less in memory, for one
    /// write and one read of them per round. --max-memory turns it on when a round needs it;
    /// with both, every round's plan counts it. FedProx and FedGA rounds keep it in memory.
    #[arg(long)]
    start_on_disk: bool,
    /// CA certificate (PEM) for mqtts://.
    #[arg(long)]
    ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS.
    #[arg(long)]
    cert: Option<PathBuf>,
    /// Client key (PEM) for mutual TLS.
    #[arg(long)]
    key: Option<PathBuf>,
    /// MQTT user name (overrides the URL's).
    #[arg(long)]
    username: Option<String>,
    /// MQTT password (overrides the URL's).
    #[arg(long, env = "FEDPO_MQTT_PASSWORD", hide_env_values = true)]
    password: Option<String>,
}

pub(crate) fn run(args: RunArgs) -> Result<()> {
    let mut broker = BrokerUrl::parse(&args.broker)?;
    if let Some(u) = &args.username {
        broker.username = Some(u.clone());
    }
    if let Some(p) = &args.password {
        broker.password = Some(p.clone());
    }
    let (train, heldout) = match (&args.data, args.synthetic_persona) {
        (Some(path), _) => {
            let loaded = load_jsonl(path, args.format, args.skip_bad)?;
            if loaded.skipped > 0 {
                tracing::warn!(file = %path.display(), skipped = loaded.skipped, "skipped bad lines");
            }
            match &args.heldout {
                Some(h) => (loaded.pairs, load_jsonl(h, args.format, args.skip_bad)?.pairs),
                None => train_heldout_split(loaded.pairs, args.heldout_fraction, args.seed)?,
            }
        }
        (None, Some(k)) => {
            let spec = SyntheticSpec {
                heterogeneity: args.heterogeneity,
                train_pairs: args.train_pairs,
                heldout_pairs: args.heldout_pairs,
                seed: args.seed,
            };
            let (train, heldout, _) = generate_pairs(&spec, args.personas, args.label_temperature, k)?;
            (train, heldout)
        }
        (None, None) => bail!("give --data FILE or --synthetic-persona K"),
    };
    let vocab = match &args.vocab {
        Some(path) => Some(Arc::new(TrimmedVocab::load(path, GPT2_VOCAB_SIZE)?)),
        None => None,
    };
    if let Some(init) = &args.init_adapter {
        init_adapter(init, &args.state_dir)?;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let device = parse_device(&args.device)?;
    let cfg = ParticipantConfig {
        broker,
        tls: TlsFiles { ca: args.ca, cert: args.cert, key: args.key },
        job: args.job,
        id: args.id,
        state_dir: args.state_dir,
        train,
        heldout,
        max_len: args.max_len,
        vocab,
        compute: device.clone(),
        max_memory_mib: args.max_memory,
        max_micro_batch_pairs: args.micro_batch_pairs.map(|n| n as usize),
        start_on_disk: args.start_on_disk,
        compute_dtype: args.compute_dtype.on(&device),
        trusted_key: args.trust_key.as_deref().map(TrustedKey::parse).transpose()?,
        rejoin: args.rejoin,
        reset_adapter: args.reset_adapter,
        alone_in_process: true,
        training_slots: None,
        rewrite_update: None,
        stop,
    };
    if cfg.trusted_key.is_none() {
        tracing::warn!("no --trust-key: any client that may publish plans can direct this device");
    }
    let summary = participant::run(cfg)?;
    tracing::info!(rounds = ?summary.rounds, bytes_up = summary.bytes_up, bytes_down = summary.bytes_down, "left the job");
    Ok(())
}

/// Writes the adapter at `from` as the device's private adapter in `state_dir`, which
/// must not have one yet.
fn init_adapter(from: &std::path::Path, state_dir: &std::path::Path) -> Result<()> {
    let target = state_dir.join("adapter.safetensors");
    if target.exists() {
        bail!(
            "{} exists: --init-adapter starts a device's adapter only before it has one of its own (move the file \
             away to start over)",
            target.display()
        );
    }
    let adapter = fedpo_model::checkpoint::load_adapter(from, &candle_core::Device::Cpu)
        .with_context(|| format!("--init-adapter {}", from.display()))?;
    std::fs::create_dir_all(state_dir).with_context(|| format!("creating {}", state_dir.display()))?;
    fedpo_model::checkpoint::write_adapter(&adapter, &target)?;
    tracing::info!(from = %from.display(), rank = adapter.lora.rank, targets = ?adapter.lora.targets, "private adapter initialised");
    Ok(())
}
