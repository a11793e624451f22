//! Helpers for fleet scenarios: a wiretap on the broker, decoding what it heard, and
//! finding the workspace's binaries.

#![allow(dead_code, unreachable_pub)]

pub mod fake_device;
pub mod gated_proxy;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use candle_core::Device;
use fedpo_data::PreferencePair;
use fedpo_device::participant::{self, ParticipantConfig};
use fedpo_transport::{BrokerUrl, Delivery, LinkEvent, LinkOptions, MqttLink};
use fedpo_wire::{Limits, Manifest, Message, Reassembler, ReassemblyProgress, RoundPlan, TensorPayload, Update};

/// Records every message published under a topic filter.
pub struct Wiretap {
    heard: Arc<Mutex<Vec<Delivery>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Wiretap {
    pub fn start(url: &BrokerUrl, filter: &str) -> Self {
        Self::start_with(url, filter, &LinkOptions::new("wiretap"))
    }

    /// A wiretap with its own client options (TLS identity, client id).
    pub fn start_with(url: &BrokerUrl, filter: &str, opts: &LinkOptions) -> Self {
        let link = MqttLink::connect(url, opts).expect("wiretap connects");
        link.subscribe(filter).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let heard = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (heard, stop) = (heard.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    if let Ok(Some(LinkEvent::Message(d))) = link.recv_timeout(Duration::from_millis(100)) {
                        heard.lock().unwrap().push(d);
                    }
                }
            })
        };
        Self { heard, stop, thread: Some(thread) }
    }

    /// Everything heard so far.
    pub fn heard(&self) -> Vec<Delivery> {
        self.heard.lock().unwrap().clone()
    }

    /// Stops and returns everything heard.
    pub fn stop(mut self) -> Vec<Delivery> {
        std::thread::sleep(Duration::from_millis(500));
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
        self.heard()
    }
}

/// A round as the wire saw it.
#[derive(Default)]
pub struct RoundOnWire {
    pub plans: Vec<RoundPlan>,
    pub global: Option<TensorPayload>,
    /// Device → (pairs, delta payload).
    pub updates: BTreeMap<String, (u64, TensorPayload)>,
}

/// Decodes a tap: every plan, the global model of each round and every complete, intact
/// update.
pub fn decode_rounds(heard: &[Delivery]) -> BTreeMap<u64, RoundOnWire> {
    let limits = Limits::default();
    let mut rounds: BTreeMap<u64, RoundOnWire> = BTreeMap::new();
    let mut transfers: BTreeMap<String, (u64, Option<Update>, Reassembler)> = BTreeMap::new();
    let start = |m: &Manifest| Reassembler::new(m.clone(), &limits).unwrap();
    for d in heard {
        match Message::decode(&d.payload, &limits).expect("everything on the wire decodes") {
            Message::Plan(p) => {
                transfers.insert(p.global_model.transfer.clone(), (p.round, None, start(&p.global_model)));
                rounds.entry(p.round).or_default().plans.push(p);
            }
            Message::Update(u) => {
                transfers.insert(u.update.transfer.clone(), (u.round, Some(u.clone()), start(&u.update)));
            }
            Message::Chunk(c) => {
                let Some((round, update, r)) = transfers.get_mut(&c.transfer) else { continue };
                // A transfer corrupted on purpose never completes.
                if let Ok(ReassemblyProgress::Complete(bytes)) = r.accept(c) {
                    let payload = TensorPayload::from_bytes(&bytes, &limits, false).unwrap();
                    let entry = rounds.entry(*round).or_default();
                    match update {
                        Some(u) => {
                            entry.updates.insert(u.device.clone(), (u.pairs, payload));
                        }
                        None => entry.global = Some(payload),
                    }
                }
            }
            _ => {}
        }
    }
    rounds
}

/// A workspace binary (built by `cargo test --workspace`, which builds every package's
/// binaries for its integration tests).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let path = dir.join(name);
    assert!(path.exists(), "{} is missing; build it first (cargo build -p {name})", path.display());
    path
}

/// Values of a tensor in a payload.
pub fn tensor_values(p: &TensorPayload, name: &str) -> Vec<f32> {
    p.tensors.iter().find(|t| t.name() == name).unwrap_or_else(|| panic!("`{name}` in payload")).values()
}

/// Every round record an aggregator wrote to `out/metrics.jsonl`, in order.
pub fn metrics_records(out: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// `fedpo-aggregator serve` against `url` for a small job: `--freeze-embeddings`, 3
/// devices per round, 4 pairs per step, plus `extra`.
pub fn serve_args(url: &BrokerUrl, job: &str, out: &std::path::Path, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = ["fedpo-aggregator", "serve", "--broker", &url.to_string(), "--job", job]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(
        ["--freeze-embeddings", "--per-round", "3", "--min-devices", "3", "--batch-pairs", "4", "--out"]
            .iter()
            .map(|s| s.to_string()),
    );
    args.push(out.to_str().unwrap().to_string());
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// A plain-MQTT, CPU, f32 participant with no memory budget and no pinned key.
pub fn participant_config(
    url: &BrokerUrl,
    job: &str,
    id: &str,
    state_dir: std::path::PathBuf,
    (train, heldout): (Vec<PreferencePair>, Vec<PreferencePair>),
    max_len: usize,
) -> ParticipantConfig {
    ParticipantConfig {
        vocab: None,
        broker: url.clone(),
        tls: Default::default(),
        job: job.into(),
        id: id.into(),
        state_dir,
        train,
        heldout,
        max_len,
        compute: Device::Cpu,
        max_memory_mib: None,
        max_micro_batch_pairs: None,
        start_on_disk: false,
        compute_dtype: candle_core::DType::F32,
        trusted_key: None,
        rejoin: false,
        reset_adapter: false,
        alone_in_process: false,
        training_slots: None,
        rewrite_update: None,
        stop: Arc::new(AtomicBool::new(false)),
    }
}

/// Starts one in-process device per `(train, heldout)` shard, ids `dev-0`, `dev-1`, …,
/// state under `dir/dev-K`; each thread panics if its participant fails.
pub fn start_devices(
    url: &BrokerUrl,
    job: &str,
    dir: &std::path::Path,
    shards: Vec<(Vec<PreferencePair>, Vec<PreferencePair>)>,
    max_len: usize,
) -> Vec<JoinHandle<()>> {
    shards
        .into_iter()
        .enumerate()
        .map(|(k, shard)| {
            let id = format!("dev-{k}");
            let cfg = participant_config(url, job, &id, dir.join(&id), shard, max_len);
            std::thread::spawn(move || {
                participant::run(cfg).expect("device runs to the end of the job");
            })
        })
        .collect()
}

/// The largest gap between `actual(name)`, the model after a round, and the pair-weighted
/// mean of (global + delta) over `updates`, recomputed in f64 for every tensor the updates
/// hold.
pub fn gap_from_weighted_mean(
    global: &TensorPayload,
    updates: &[&(u64, TensorPayload)],
    actual: impl Fn(&str) -> Vec<f32>,
) -> f64 {
    let total: f64 = updates.iter().map(|(p, _)| *p as f64).sum();
    let mut worst = 0.0f64;
    for t in &updates[0].1.tensors {
        let name = t.name();
        let g = tensor_values(global, name);
        let mut expected = vec![0.0f64; g.len()];
        for (pairs, delta) in updates {
            for ((e, gv), dv) in expected.iter_mut().zip(&g).zip(tensor_values(delta, name)) {
                *e += *pairs as f64 * (f64::from(*gv) + f64::from(dv)) / total;
            }
        }
        for (e, a) in expected.iter().zip(&actual(name)) {
            worst = worst.max((e - f64::from(*a)).abs());
        }
    }
    worst
}

/// security/make-certs.sh's signing key pair in `dir`: (private key file, public hex).
pub fn signing_key(dir: &std::path::Path) -> (PathBuf, String) {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../security/make-certs.sh");
    let made = std::process::Command::new("bash").arg(script).arg(dir).output().expect("make-certs.sh runs");
    assert!(made.status.success(), "make-certs.sh: {}", String::from_utf8_lossy(&made.stderr));
    (dir.join("signing.key"), std::fs::read_to_string(dir.join("signing.pub")).unwrap().trim().to_string())
}

/// Debian's `mosquitto` (`scripts/test.sh` installs it).
pub fn mosquitto_binary() -> PathBuf {
    let candidates = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).map(|d| d.join("mosquitto")).collect::<Vec<_>>())
        .unwrap_or_default();
    candidates
        .into_iter()
        .chain([PathBuf::from("/usr/sbin/mosquitto")])
        .find(|p| p.is_file())
        .expect("mosquitto is not installed: scripts/test.sh installs it (or apt-get install mosquitto)")
}
