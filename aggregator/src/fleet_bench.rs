//! `fedpo-aggregator bench-fleet`: aggregation at fleet scale.
//!
//! A real `fedpo-aggregator serve` runs as a child process, so its peak memory is its own,
//! against fedpo's embedded broker (in this process) or any broker URL (a local Mosquitto).
//! This process plays N devices, each its own MQTT connection with its own hello, last
//! will and upload topic. They send a synthetic update (the same small delta, encoded
//! with the round's codec) instead of training, so the rounds measure the broker and the
//! aggregator: decode, hash, check and fold N updates.
//!
//! The global model goes to one subscriber, a coordinator that hands each plan to the
//! device threads, not to N: the fan-out of the broadcast is the broker's cost and would
//! swamp the uplink being measured (N × 28 MB a round for the tiny model).
//!
//! Reported, per round: updates, seconds and updates per second; the aggregator's peak
//! RSS next to the size of the shared set; and a check that each new model moved by
//! exactly the synthetic delta (the mean of identical updates).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use fedpo_model::{ParamRole, PolicySpec};
use fedpo_transport::{BrokerUrl, EmbeddedBroker, LinkEvent, LinkOptions, MqttLink, Topics};
use fedpo_wire::{
    split_payload, DeviceBye, DeviceHello, Limits, Manifest, Message, RoundPlan, TensorPayload, ToWire, TransferChunk,
    Update, UpdateCodec, UpdateMetrics, DEFAULT_CHUNK_BYTES,
};

const JOB: &str = "fleet-bench";
/// Every value of the synthetic delta; small enough to stay a plausible update.
const DELTA: f32 = 1e-3;

/// `bench-fleet` flags.
#[derive(Debug, Args)]
pub(crate) struct FleetBenchArgs {
    /// Synthetic devices, each its own MQTT connection.
    #[arg(long, default_value_t = 1000)]
    devices: usize,
    /// Rounds, every device in each.
    #[arg(long, default_value_t = 3)]
    rounds: u64,
    /// A broker to go through (e.g. mqtt://127.0.0.1:1883 for a local Mosquitto); by
    /// embedded broker is started in this process.
    #[arg(long)]
    broker: Option<String>,
    /// The codec the synthetic updates use.
    #[arg(long, value_name = "CODEC", default_value = "f32")]
    update_codec: UpdateCodec,
    /// Output: the aggregator's files under aggregator/, its log, and fleet_bench.json.
    #[arg(long)]
    out: PathBuf,
    /// Seconds the aggregator waits for the fleet to register, and for each round.
    #[arg(long, default_value_t = 900)]
    deadline: u64,
}

/// What the coordinator hands to every device thread.
enum Order {
    Upload(Arc<Prepared>),
    Finished,
}

/// One round's synthetic update, encoded once for the whole fleet.
struct Prepared {
    plan: RoundPlan,
    manifest: Manifest,
    chunks: Vec<TransferChunk>,
}

struct Named(String, Vec<u64>, Vec<f32>);

impl ToWire for Named {
    fn wire_name(&self) -> &str {
        &self.0
    }
    fn wire_shape(&self) -> Vec<u64> {
        self.1.clone()
    }
    fn wire_values(&self) -> &[f32] {
        &self.2
    }
}

pub(crate) fn run(args: FleetBenchArgs) -> Result<()> {
    if args.devices == 0 || args.rounds == 0 {
        bail!("--devices and --rounds must be at least 1");
    }
    raise_open_file_limit(args.devices as u64 * 4 + 256);
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let (url, _embedded) = match &args.broker {
        Some(u) => (BrokerUrl::parse(u)?, None),
        None => {
            let b = EmbeddedBroker::start_on_free_port()?;
            (b.url(), Some(b))
        }
    };
    let broker_name = if args.broker.is_some() { url.to_string() } else { "embedded broker".to_string() };
    let topics = Topics::new(JOB).map_err(anyhow::Error::msg)?;
    let coordinator = MqttLink::connect(&url, &LinkOptions::new("bench-coordinator"))?;
    coordinator.subscribe(&topics.down())?;

    let aggregator_out = args.out.join("aggregator");
    let _ = std::fs::remove_dir_all(&aggregator_out);
    let mut child = spawn_aggregator(&args, &url, &aggregator_out)?;
    let started = Instant::now();
    eprintln!("bench-fleet: {} devices through {broker_name}, codec {}", args.devices, args.update_codec);

    let mut orders: Vec<Sender<Order>> = Vec::with_capacity(args.devices);
    let mut devices = Vec::with_capacity(args.devices);
    for k in 0..args.devices {
        let (tx, rx) = mpsc::channel();
        orders.push(tx);
        let (url, topics, id) = (url.clone(), topics.clone(), format!("bench-{k:04}"));
        devices.push(
            std::thread::Builder::new()
                .name(id.clone())
                .stack_size(256 * 1024)
                .spawn(move || synthetic_device(&url, &topics, &id, rx))?,
        );
    }

    let limits = Limits::default();
    let mut delta_norm = 0.0;
    loop {
        if let Some(status) = child.try_wait()? {
            if !status.success() {
                bail!("the aggregator exited with {status}; see {}", args.out.join("aggregator.log").display());
            }
        }
        let Some(LinkEvent::Message(d)) = coordinator.recv_timeout(Duration::from_millis(200))? else { continue };
        match Message::decode_shared(&d.payload, &limits) {
            Ok(Message::Plan(plan)) => {
                let prepared = prepare(plan, args.update_codec)?;
                delta_norm = prepared.1;
                let prepared = Arc::new(prepared.0);
                eprintln!(
                    "bench-fleet: round {} planned for {} devices",
                    prepared.plan.round,
                    prepared.plan.selected.len()
                );
                orders.iter().for_each(|o| drop(o.send(Order::Upload(prepared.clone()))));
            }
            Ok(Message::Result(r)) if r.finished => break,
            _ => {}
        }
    }
    orders.iter().for_each(|o| drop(o.send(Order::Finished)));
    let status = child.wait()?;
    if !status.success() {
        bail!("the aggregator exited with {status}; see {}", args.out.join("aggregator.log").display());
    }
    let failed = devices.into_iter().map(|d| d.join()).filter(|r| !matches!(r, Ok(Ok(())))).count();
    if failed > 0 {
        bail!("{failed} synthetic devices failed");
    }
    report(&args, &broker_name, &aggregator_out, delta_norm, started.elapsed())
}

/// `fedpo-aggregator serve` for the bench job, logging to OUT/aggregator.log.
fn spawn_aggregator(args: &FleetBenchArgs, url: &BrokerUrl, out: &Path) -> Result<std::process::Child> {
    let log = std::fs::File::create(args.out.join("aggregator.log"))?;
    let n = args.devices.to_string();
    let child = Command::new(std::env::current_exe()?)
        .args(["serve", "--broker", &url.to_string(), "--job", JOB, "--model", "tiny", "--freeze-embeddings"])
        .args(["--per-round", &n, "--min-devices", &n, "--rounds", &args.rounds.to_string()])
        .args(["--local-steps", "1", "--no-final-eval", "--update-codec", &args.update_codec.to_string()])
        .args(["--round-deadline", &args.deadline.to_string(), "--register-timeout", &args.deadline.to_string()])
        // The embedded broker bounds its queues itself, and disconnects a client that
        // pauses its reads for long; the embedded run goes without the budget.
        .args(["--inbound-budget-mib", if args.broker.is_some() { "64" } else { "0" }])
        .arg("--out")
        .arg(out)
        .env("RUST_LOG", std::env::var("FEDPO_BENCH_LOG").unwrap_or_else(|_| "warn".into()))
        .stdout(Stdio::inherit())
        .stderr(log)
        .spawn()
        .context("starting the aggregator")?;
    Ok(child)
}

/// The synthetic delta for a plan's shared set (every value [`DELTA`]), encoded and
/// chunked once, and the L2 norm of its decoded values.
fn prepare(plan: RoundPlan, codec: UpdateCodec) -> Result<(Prepared, f64)> {
    let spec: PolicySpec = serde_json::from_str(&plan.model_spec).context("the plan's model spec")?;
    let shared: Vec<Named> = plan
        .global_model
        .tensors
        .iter()
        .filter(|t| {
            let role = if t.name.contains("lora_") {
                spec.partition.adapter_role()
            } else {
                spec.partition.base_role(&t.name)
            };
            role == ParamRole::Shared
        })
        .map(|t| Named(t.name.clone(), t.shape.clone(), vec![DELTA; t.shape.iter().product::<u64>() as usize]))
        .collect();
    let payload = TensorPayload::compress(&shared, codec);
    // The norm of what the aggregator will decode, which a lossy codec makes smaller.
    let norm = payload.tensors.iter().flat_map(|t| t.values()).map(|v| f64::from(v).powi(2)).sum::<f64>().sqrt();
    let (manifest, chunks) = split_payload("template", &payload, DEFAULT_CHUNK_BYTES);
    Ok((Prepared { plan, manifest, chunks }, norm))
}

/// One device: hello until the first plan, then upload the prepared update once for
/// every round whose plan selects it, until the job is finished.
fn synthetic_device(url: &BrokerUrl, topics: &Topics, id: &str, orders: Receiver<Order>) -> Result<()> {
    let mut opts = LinkOptions::new(id.to_string());
    let will = Message::Bye(DeviceBye::last_will(id));
    opts.last_will = Some((topics.up(id), will.encode()));
    let link = MqttLink::connect(url, &opts)?;
    let hello = Message::Hello(DeviceHello {
        device: id.into(),
        pairs: 4,
        backend: "synthetic".into(),
        memory_mb: 0,
        instance: rand::random::<u64>().max(1),
        connection: 1,
        model: Vec::new(),
        tag: Vec::new(),
    })
    .encode();
    let mut planned = false;
    // Once per round and aggregator epoch, as real devices do: a plan resent for the
    // devices still missing does not make this device upload again (its QoS 1 upload is
    // on its way), but a plan from an aggregator that reconnected to the broker does,
    // since what was in flight to it may be lost.
    let mut uploaded = (0, 0);
    loop {
        if !planned {
            link.publish(&topics.up(id), hello.clone())?;
        }
        match orders.recv_timeout(Duration::from_secs(5)) {
            Ok(Order::Upload(p))
                if p.plan.selected.iter().any(|d| d == id)
                    && (p.plan.round, p.plan.sender_epoch) != uploaded
                    && p.plan.round >= uploaded.0 =>
            {
                planned = true;
                uploaded = (p.plan.round, p.plan.sender_epoch);
                let transfer = format!("r{}/{id}", p.plan.round);
                let metrics = UpdateMetrics {
                    train_loss: 0.5,
                    reward_acc: 0.5,
                    heldout_acc: None,
                    grad_norm: 1.0,
                    seconds: 0.0,
                    peak_rss_mib: None,
                };
                let update = Update {
                    round: p.plan.round,
                    device: id.into(),
                    pairs: 4,
                    metrics,
                    update: Manifest { transfer: transfer.clone(), ..p.manifest.clone() },
                    sections: BTreeMap::new(),
                };
                link.publish(&topics.up(id), Message::Update(update).encode())?;
                for c in &p.chunks {
                    let chunk = TransferChunk { transfer: transfer.clone(), ..c.clone() };
                    link.publish(&topics.up(id), Message::Chunk(chunk).encode())?;
                }
            }
            Ok(Order::Upload(_)) => planned = true,
            Ok(Order::Finished) | Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => {}
        }
    }
    link.flush(Duration::from_secs(30));
    link.close(Duration::from_millis(100));
    Ok(())
}

/// Prints and writes OUT/fleet_bench.json from the aggregator's records.
fn report(args: &FleetBenchArgs, broker: &str, out: &Path, delta_norm: f64, wall: Duration) -> Result<()> {
    let records = crate::plots::read_records(out)?;
    let summary: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("summary.json"))?)?;
    let peak_rss_mib = summary["peak_rss_mib"].as_f64();
    let checkpoint = crate::global_model::GlobalModel::load(&out.join("checkpoint/global.safetensors"))?;
    let shared_mib = checkpoint.shared().map(|t| t.values.len() * 4).sum::<usize>() as f64 / (1 << 20) as f64;
    let rounds: Vec<serde_json::Value> = records
        .iter()
        .map(|r| {
            serde_json::json!({
                "round": r.round,
                "updates": r.participants.len(),
                "seconds": r.seconds,
                "updates_per_second": r.participants.len() as f64 / r.seconds.max(1e-9),
                "bytes_up": r.bytes_up,
                "update_norm_gap": (r.update_norm - delta_norm).abs() / delta_norm,
            })
        })
        .collect();
    let result = serde_json::json!({
        "broker": broker,
        "devices": args.devices,
        "codec": args.update_codec.to_string(),
        "shared_set_mib": shared_mib,
        "aggregator_peak_rss_mib": peak_rss_mib,
        "wall_seconds": wall.as_secs_f64(),
        "rounds": rounds,
    });
    std::fs::write(args.out.join("fleet_bench.json"), serde_json::to_vec_pretty(&result)?)?;
    println!("{}", serde_json::to_string_pretty(&result)?);
    for r in &records {
        if r.participants.len() != args.devices {
            bail!("round {}: {} of {} updates were aggregated", r.round, r.participants.len(), args.devices);
        }
        let gap = (r.update_norm - delta_norm).abs() / delta_norm;
        if gap > 1e-3 {
            bail!(
                "round {}: the model moved by {:.6}, the synthetic delta's norm is {delta_norm:.6}",
                r.round,
                r.update_norm
            );
        }
    }
    Ok(())
}

/// Raises the soft open-file limit towards `wanted` (four sockets per device with the
/// embedded broker: two connections, both ends), up to the hard limit.
fn raise_open_file_limit(wanted: u64) {
    #[cfg(unix)]
    {
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit and setrlimit read and write only the struct passed.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < wanted as libc::rlim_t {
                limit.rlim_cur = (wanted as libc::rlim_t).min(limit.rlim_max);
                libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
            }
        }
    }
}
