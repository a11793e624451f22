//! `fedpo-aggregator simulate`: a whole fleet on one machine, through real MQTT.
//!
//! An embedded broker (unless --broker names one), the aggregator, and N devices on
//! synthetic personas. Each device is a real MQTT client with its own state directory:
//! a thread of this process by default, or a child `fedpo-device run` with --processes.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use candle_core::Device;
use clap::Args;
use fedpo_data::partition::{train_heldout_split, Partition};
use fedpo_data::synthetic::{generate_pairs, Personas, SyntheticSpec};
use fedpo_data::{load_jsonl_keyed, to_jsonl, DataFormat, PreferencePair};
use fedpo_device::participant::{self, ParticipantConfig, TrainingSlots};
use fedpo_model::{Gpt2Tokenizer, TrimmedVocab, GPT2_VOCAB_SIZE};
use fedpo_transport::{BrokerUrl, LinkOptions, MqttLink, TlsFiles};
use fedpo_wire::{Signer, TrustedKey};

use crate::broker_args::BrokerArgs;
use crate::job_args::JobArgs;
use crate::metrics::Summary;
use crate::partitions::Method;
use crate::server::Aggregator;

#[derive(Debug, Args)]
pub(crate) struct SimulateArgs {
    #[command(flatten)]
    pub(crate) job: JobArgs,
    #[command(flatten)]
    pub(crate) broker: BrokerArgs,
    /// Devices in the fleet (N).
    #[arg(long, default_value_t = 5)]
    pub(crate) devices: usize,
    /// Output directory: metrics.jsonl, summary.json, checkpoint/, devices/.
    #[arg(long)]
    pub(crate) out: PathBuf,
    /// Run each device as a child `fedpo-device run` process instead of a thread.
    #[arg(long)]
    pub(crate) processes: bool,
    /// In-process devices that train at once (default: this machine's cores). The rest of
    /// a round's selection waits its turn, so memory grows with this, not with
    /// --per-round. Not used with --processes.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) concurrency: Option<u64>,
    /// Pairs to deal to the devices instead of synthetic personas: JSONL in any layout
    /// `train-local` reads (TRL, HH-RLHF, SHP).
    #[arg(long, value_name = "FILE")]
    pub(crate) data: Option<PathBuf>,
    /// Force --data's layout instead of detecting it per line.
    #[arg(long, requires = "data")]
    pub(crate) format: Option<DataFormat>,
    /// Skip --data lines that cannot be read, instead of stopping at the first.
    #[arg(long, requires = "data")]
    pub(crate) skip_bad: bool,
    /// How --data is dealt to the devices: iid, dirichlet:ALPHA[:FIELD] (skewed over a
    /// record field, SHP's `domain` by default) or by-key:FIELD (whole groups per device).
    #[arg(long, default_value = "iid", requires = "data")]
    pub(crate) partition: Partition,
    /// The share of each device's --data pairs kept for held-out evaluation.
    #[arg(long, default_value_t = 0.2, requires = "data")]
    pub(crate) heldout_fraction: f64,
    /// Synthetic personas: `opposed` (two, opposite on every style axis, labels without
    /// noise: a demonstration) or `drawn` (one per device around a shared persona, labels
    /// drawn by Bradley–Terry; each device's held-out ceiling goes to OUT/ceilings.json).
    #[arg(long, default_value = "opposed")]
    pub(crate) personas: Personas,
    /// Temperature of drawn personas' labels: higher is noisier.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) label_temperature: f64,
    /// How much the personas' preferences conflict, 0 (all agree) to 1.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) heterogeneity: f64,
    /// Training pairs per device (synthetic personas).
    #[arg(long, default_value_t = 120)]
    pub(crate) train_pairs: usize,
    /// Held-out pairs per device (synthetic personas).
    #[arg(long, default_value_t = 40)]
    pub(crate) heldout_pairs: usize,
    /// Tokens per sequence after truncation.
    #[arg(long, default_value_t = 128)]
    pub(crate) max_len: usize,
    /// Shrink the model's vocabulary to the tokens the fleet's pairs use (ids renumbered,
    /// head and embedding cut to match; written to OUT/vocab.json), and its position table
    /// to --max-len, which no sequence passes. Much faster for small presets, whose GPT-2
    /// head is most of their work; log-probabilities then normalise over the kept tokens
    /// only. Preset models only.
    #[arg(long)]
    pub(crate) trim_vocab: bool,
    /// Continue the checkpoint in --out.
    #[arg(long)]
    pub(crate) resume: bool,
    /// Each device's memory budget for training, MiB (a device's `--max-memory`): its
    /// rounds are planned to fit, and a device whose model cannot fit leaves the job. The
    /// devices share this machine's memory, so N of them need about N times this.
    #[arg(long, value_name = "MB", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) device_max_memory: Option<u64>,
    /// The most pairs one forward pass takes on each device (a device's
    /// `--micro-batch-pairs`): larger batches train in several passes with gradient
    /// accumulation.
    #[arg(long, value_name = "PAIRS", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) micro_batch_pairs: Option<u64>,
    /// Make the first K devices Byzantine: they train honestly and upload a poisoned
    /// update (see --attack). For testing --aggregation.
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub(crate) attackers: usize,
    /// What attackers upload instead of Δ: sign-flip[:FACTOR] (−FACTOR·Δ, FACTOR 1 by
    /// default) or scale:FACTOR (FACTOR·Δ).
    #[arg(long, default_value = "sign-flip")]
    pub(crate) attack: Adversary,
}

/// One device's (id, training pairs, held-out pairs).
type Shard = (String, Vec<PreferencePair>, Vec<PreferencePair>);

/// Where `--trim-vocab` writes the fleet's vocabulary.
const VOCAB_FILE: &str = "vocab.json";

/// The vocabulary of every pair of the fleet, written to OUT/vocab.json.
fn trim_vocab(shards: &[Shard], out: &Path) -> Result<TrimmedVocab> {
    let texts = shards
        .iter()
        .flat_map(|(_, train, heldout)| train.iter().chain(heldout))
        .flat_map(|p| [p.prompt.as_str(), p.chosen.as_str(), p.rejected.as_str()]);
    let vocab = Gpt2Tokenizer::gpt2()?.vocabulary_of(texts)?;
    vocab.save(&out.join(VOCAB_FILE))?;
    Ok(vocab)
}

mod adversary;
mod device_processes;

pub(crate) use adversary::Adversary;

use device_processes::{DeviceProcess, ProcessFleet};

enum Fleet {
    Threads(Vec<JoinHandle<Result<participant::ParticipantSummary, participant::ParticipantError>>>, Arc<AtomicBool>),
    Processes(ProcessFleet),
}

/// The id of the one trainer under `--method centralized`.
const CENTRAL_ID: &str = "central";

fn device_id(k: usize) -> String {
    format!("dev-{k}")
}

/// The `fedpo-device` binary next to this one (or $FEDPO_DEVICE_BIN).
pub(crate) fn device_binary() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("FEDPO_DEVICE_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("no directory for the current executable")?;
    for candidate in [dir.join("fedpo-device"), dir.join("../fedpo-device")] {
        if candidate.exists() {
            return Ok(candidate);
        }
    }
    bail!(
        "--processes needs the fedpo-device binary beside {} (build it with `cargo build -p fedpo-device`) or $FEDPO_DEVICE_BIN",
        exe.display()
    )
}

impl SimulateArgs {
    fn spec(&self) -> SyntheticSpec {
        SyntheticSpec {
            heterogeneity: self.heterogeneity,
            train_pairs: self.train_pairs,
            heldout_pairs: self.heldout_pairs,
            seed: self.job.seed,
        }
    }

    /// Each device's (id, train, held-out) pairs: dealt from --data, or its synthetic
    /// persona's.
    fn shards(&self) -> Result<Vec<Shard>> {
        let Some(path) = &self.data else {
            let spec = self.spec();
            let mut ceilings = serde_json::Map::new();
            let mut shards = Vec::with_capacity(self.devices);
            for k in 0..self.devices {
                let (train, heldout, ceiling) = generate_pairs(&spec, self.personas, self.label_temperature, k)?;
                ceilings.insert(device_id(k), ceiling.into());
                shards.push((device_id(k), train, heldout));
            }
            if self.personas == Personas::Drawn {
                let listed: Vec<String> = ceilings.iter().map(|(id, c)| format!("{id} {c:.3}")).collect();
                println!("held-out Bayes ceilings (accuracy of each persona's true utility): {}", listed.join(", "));
                std::fs::write(self.out.join("ceilings.json"), serde_json::to_vec_pretty(&ceilings)?)?;
            }
            return Ok(shards);
        };
        let loaded = load_jsonl_keyed(path, self.format, self.skip_bad, self.partition.key())?;
        if loaded.skipped > 0 {
            tracing::warn!(file = %path.display(), skipped = loaded.skipped, "skipped bad lines");
        }
        let total = loaded.pairs.len();
        let shares = self
            .partition
            .split(loaded.pairs, loaded.keys, self.devices, self.job.seed)
            .with_context(|| format!("dealing {} ({total} pairs) to {} devices", path.display(), self.devices))?;
        let mut shards = Vec::with_capacity(shares.len());
        for (k, share) in shares.into_iter().enumerate() {
            let n = share.len();
            let (train, heldout) = train_heldout_split(share, self.heldout_fraction, self.job.seed ^ k as u64)?;
            if train.is_empty() {
                bail!(
                    "{}: --partition {} gives {} only {n} pair(s), none left to train on; use fewer devices or \
                     another partition",
                    path.display(),
                    self.partition,
                    device_id(k)
                );
            }
            shards.push((device_id(k), train, heldout));
        }
        let sizes: Vec<String> = shards.iter().map(|(id, t, h)| format!("{id} {}+{}", t.len(), h.len())).collect();
        println!("{total} pairs from {}, --partition {}: {}", path.display(), self.partition, sizes.join(", "));
        Ok(shards)
    }

    fn spawn_fleet(
        &self,
        url: &BrokerUrl,
        tls: &TlsFiles,
        mut shards: Vec<Shard>,
        vocab: Option<Arc<TrimmedVocab>>,
    ) -> Result<Fleet> {
        let devices_dir = self.out.join("devices");
        std::fs::create_dir_all(&devices_dir)?;
        // With --signing-key every simulated device pins the matching public key.
        let trusted_key = match &self.job.signing_key {
            Some(path) => Some(Signer::from_pem_file(path)?.public_key_hex()),
            None => None,
        };
        if self.processes {
            let bin = device_binary()?;
            let mut children = Vec::with_capacity(self.devices);
            for (k, (id, train, heldout)) in shards.iter().enumerate() {
                let log_path = devices_dir.join(format!("{id}.log"));
                let log = std::fs::File::create(&log_path)?;
                let mut cmd = Command::new(&bin);
                cmd.args(["run", "--broker", &url.to_string(), "--job", &self.job.job, "--id", id]);
                if self.data.is_some() {
                    // The device reads its share from files of its own, as a real one would.
                    let (train_file, heldout_file) = (
                        devices_dir.join(format!("{id}.train.jsonl")),
                        devices_dir.join(format!("{id}.heldout.jsonl")),
                    );
                    std::fs::write(&train_file, to_jsonl(train))?;
                    cmd.arg("--data").arg(&train_file);
                    if heldout.is_empty() {
                        // A file without pairs is an error to the device; hold none out.
                        cmd.args(["--heldout-fraction", "0"]);
                    } else {
                        std::fs::write(&heldout_file, to_jsonl(heldout))?;
                        cmd.arg("--heldout").arg(&heldout_file);
                    }
                } else {
                    cmd.args(["--synthetic-persona", &k.to_string()])
                        .args(["--personas", &self.personas.to_string()])
                        .args(["--label-temperature", &self.label_temperature.to_string()])
                        .args(["--heterogeneity", &self.heterogeneity.to_string()])
                        .args(["--train-pairs", &self.train_pairs.to_string()])
                        .args(["--heldout-pairs", &self.heldout_pairs.to_string()]);
                }
                if vocab.is_some() {
                    cmd.arg("--vocab").arg(self.out.join(VOCAB_FILE));
                }
                cmd.args(["--max-len", &self.max_len.to_string(), "--seed", &self.job.seed.to_string()])
                    .arg("--state-dir")
                    .arg(devices_dir.join(id))
                    .args(trusted_key.iter().flat_map(|k| ["--trust-key", k.as_str()]))
                    .args(self.device_max_memory.iter().flat_map(|mb| ["--max-memory".to_string(), mb.to_string()]))
                    .args(
                        self.micro_batch_pairs.iter().flat_map(|n| ["--micro-batch-pairs".to_string(), n.to_string()]),
                    )
                    .stdout(Stdio::null())
                    .stderr(log);
                if let Some(p) = &url.password {
                    cmd.env("FEDPO_MQTT_PASSWORD", p);
                }
                let child = cmd.spawn().with_context(|| format!("starting {}", bin.display()))?;
                children.push(DeviceProcess { id: id.clone(), child, log: log_path });
            }
            return Ok(Fleet::Processes(ProcessFleet::watch(children)));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let slots = self.concurrency.map_or(cores, |n| n as usize);
        let training_slots = Some(Arc::new(TrainingSlots::new(slots)));
        if self.job.method == Method::Centralized {
            // One trainer holding every persona's pairs.
            let (train, heldout) = shards.drain(..).fold((Vec::new(), Vec::new()), |(mut t, mut h), (_, dt, dh)| {
                t.extend(dt);
                h.extend(dh);
                (t, h)
            });
            shards.push((CENTRAL_ID.to_string(), train, heldout));
        }
        let mut handles = Vec::with_capacity(shards.len());
        for (k, (id, train, heldout)) in shards.into_iter().enumerate() {
            let cfg = ParticipantConfig {
                broker: url.clone(),
                tls: tls.clone(),
                job: self.job.job.clone(),
                id: id.clone(),
                state_dir: devices_dir.join(&id),
                train,
                heldout,
                max_len: self.max_len,
                vocab: vocab.clone(),
                compute: Device::Cpu,
                max_memory_mib: self.device_max_memory,
                max_micro_batch_pairs: self.micro_batch_pairs.map(|n| n as usize),
                start_on_disk: false,
                compute_dtype: candle_core::DType::F32,
                trusted_key: trusted_key.as_deref().map(TrustedKey::parse).transpose()?,
                rejoin: false,
                reset_adapter: false,
                alone_in_process: false,
                training_slots: training_slots.clone(),
                rewrite_update: (k < self.attackers).then(|| {
                    let attack = self.attack;
                    Arc::new(move |update: &fedpo_wire::TensorPayload| attack.apply(update))
                        as participant::UpdateRewrite
                }),
                stop: stop.clone(),
            };
            handles.push(std::thread::Builder::new().name(id).spawn(move || participant::run(cfg))?);
        }
        Ok(Fleet::Threads(handles, stop))
    }
}

pub(crate) fn run(args: SimulateArgs) -> Result<Summary> {
    if args.devices == 0 {
        bail!("--devices must be at least 1");
    }
    if args.attackers > args.devices {
        bail!("--attackers {} exceeds --devices {}", args.attackers, args.devices);
    }
    if args.attackers > 0 && (args.processes || args.job.method == Method::Centralized) {
        bail!("--attackers runs in-process devices of a federated method; drop --processes or --method centralized");
    }
    let mut job = args.job.clone();
    if job.method == Method::Centralized {
        if args.processes {
            bail!("--method centralized runs its one trainer in-process; drop --processes");
        }
        // One trainer sees as many pairs per round as the whole fleet would.
        job.local_steps = job.local_steps.saturating_mul(args.devices as u32);
        job.min_devices = Some(1);
        job.per_round = 1;
    }
    job.min_devices = Some(job.min_devices.unwrap_or(args.devices));
    job.per_round = job.per_round.min(args.devices);
    job.quorum = job.quorum.min(job.per_round);
    job.validate()?;
    crate::server::check_out_dir(&args.out, args.resume)?;
    let (url, broker) = args.broker.resolve(true)?;
    let tls = args.broker.tls();
    std::fs::create_dir_all(&args.out)?;
    let shards = args.shards()?;
    let vocab = if args.trim_vocab {
        let vocab = trim_vocab(&shards, &args.out)?;
        // The preset's position table shrinks to the pairs' length, never grows.
        let positions =
            fedpo_model::Gpt2Config::preset(&job.model).map_or(args.max_len, |c| args.max_len.min(c.n_positions));
        println!(
            "--trim-vocab: the fleet's pairs use {} of GPT-2's {GPT2_VOCAB_SIZE} tokens; the model keeps those ({}) \
             and {} positions",
            vocab.len(),
            args.out.join(VOCAB_FILE).display(),
            positions
        );
        job.trimmed = Some((vocab.len(), args.max_len));
        Some(Arc::new(vocab))
    } else {
        None
    };
    let mut opts = LinkOptions::new(format!("fedpo-{}-aggregator", job.job));
    opts.tls = tls.clone();
    let link = MqttLink::connect(&url, &opts)?;
    let mut server = Aggregator::new(link, job.clone(), &args.out, args.resume)?;
    if let Some(broker) = &broker {
        broker.fit_transfer(usize::try_from(server.global().wire_bytes_bound()).unwrap_or(usize::MAX));
    }
    server.close_fleet(if job.method == Method::Centralized { 1 } else { args.devices });
    println!(
        "simulating {} devices ({} per round) for {} rounds of {} on {} via {url}",
        args.devices, job.per_round, job.rounds, job.method, job.model
    );
    if args.attackers > 0 {
        println!(
            "dev-0 to dev-{} attack ({}); aggregation {}",
            args.attackers - 1,
            args.attack,
            job.aggregation.aggregation.name()
        );
    }
    let fleet = args.spawn_fleet(&url, &tls, shards, vocab)?;
    let result = server.run();
    let failed = match &fleet {
        Fleet::Processes(p) => p.failures(),
        Fleet::Threads(..) => Vec::new(),
    };
    finish_fleet(fleet, Duration::from_secs(60));
    let summary = match result {
        Err(e) if !failed.is_empty() => {
            return Err(e.context(format!("device processes failed: {}", failed.join("; "))))
        }
        r => r?,
    };
    print_table(&summary, &args.out);
    Ok(summary)
}

fn finish_fleet(fleet: Fleet, grace: Duration) {
    match fleet {
        Fleet::Threads(handles, stop) => {
            let deadline = Instant::now() + grace;
            while handles.iter().any(|h| !h.is_finished()) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
            for h in handles {
                match h.join() {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => tracing::warn!(error = %e, "a device stopped with an error"),
                    Err(_) => tracing::warn!("a device thread panicked"),
                }
            }
        }
        Fleet::Processes(processes) => processes.finish(grace),
    }
}

fn print_table(s: &Summary, out: &Path) {
    println!();
    println!("{:<10} {:>10} {:>13}", "device", "train acc", "held-out acc");
    for (device, acc) in &s.reward_acc {
        let held = s.heldout_acc.get(device).map_or("-".to_string(), |v| format!("{v:.3}"));
        println!("{device:<10} {acc:>10.3} {held:>13}");
    }
    println!("{:<10} {:>10.3} {:>13.3}", "mean", s.reward_acc_mean, s.heldout_acc_mean);
    println!(
        "\n{} rounds of {} in {:.0} s; {:.1} MB up, {:.1} MB down; results in {}",
        s.rounds,
        s.method,
        s.seconds,
        s.bytes_up_total as f64 / 1e6,
        s.bytes_down_total as f64 / 1e6,
        out.display()
    );
}
