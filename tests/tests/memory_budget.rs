//! A device whose memory budget cannot hold the job's model leaves before downloading it,
//! and says why; a device that fits reports its peak memory every round.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use common::Wiretap;
use fedpo_data::synthetic::{generate_device, SyntheticSpec};
use fedpo_data::{tokenize_pairs, PreferencePair};
use fedpo_device::memory::{self, longest, PlanRequest, StartOnDisk, StepKernels};
use fedpo_device::participant::{self, ParticipantError};
use fedpo_model::{Gpt2Config, Gpt2Tokenizer, LoraConfig, Partition, PartitionPreset, PolicySpec};
use fedpo_transport::{EmbeddedBroker, LinkOptions, MqttLink, Topics};
use fedpo_wire::{
    keys, split_payload, Hyperparameters, Limits, Message, RoundPlan, TensorPayload, DEFAULT_CHUNK_BYTES,
};

const MAX_LEN: usize = 128;

/// How a device that left ended.
struct Departure {
    /// What its participant returned.
    ended: Result<participant::ParticipantSummary, ParticipantError>,
    /// The reasons it gave the aggregator.
    byes: Vec<String>,
    /// Its state dir's parent.
    dir: fedpo_tests::TestDir,
}

/// Plays the aggregator towards one device, `pi-4`, with `budget_mib`: announces round 1
/// of `spec` with `strategy` and never sends its model, until the device leaves.
fn announce_until_the_device_leaves(
    job: &str,
    (train, heldout): (Vec<PreferencePair>, Vec<PreferencePair>),
    budget_mib: u64,
    spec: &PolicySpec,
    strategy: BTreeMap<String, f64>,
) -> Departure {
    let dir = fedpo_tests::TestDir::new();
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let tap = Wiretap::start(&url, &format!("fedpo/{job}/#"));
    let mut cfg = common::participant_config(&url, job, "pi-4", dir.path().join("pi-4"), (train, heldout), MAX_LEN);
    cfg.max_memory_mib = Some(budget_mib);
    let device = std::thread::spawn(move || participant::run(cfg));

    let (manifest, _chunks) = split_payload("r1", &TensorPayload { tensors: Vec::new() }, DEFAULT_CHUNK_BYTES);
    let plan = Message::Plan(RoundPlan {
        round: 1,
        selected: vec!["pi-4".into()],
        hyper: Hyperparameters { method: "pfeddpo".into(), local_steps: 1, lr: 0.1, beta: 0.2, batch_pairs: 8 },
        strategy,
        model_spec: serde_json::to_string(spec).unwrap(),
        global_model: manifest,
        sections: Default::default(),
        signature: Vec::new(),
        secagg: None,
        update_codec: Default::default(),
        downlink: None,
        sender_epoch: 0,
        job: job.into(),
        run: 1,
    });
    let aggregator = MqttLink::connect(&url, &LinkOptions::new("fake-aggregator")).unwrap();
    let down = Topics::new(job).unwrap().down();
    let started = Instant::now();
    while !device.is_finished() {
        assert!(started.elapsed() < Duration::from_secs(60), "the device never left");
        aggregator.publish(&down, plan.encode()).unwrap();
        std::thread::sleep(Duration::from_millis(200));
    }
    let byes = tap
        .stop()
        .iter()
        .filter_map(|d| match Message::decode(&d.payload, &Limits::default()) {
            Ok(Message::Bye(b)) if b.device == "pi-4" => Some(b.reason),
            _ => None,
        })
        .collect();
    Departure { ended: device.join().unwrap(), byes, dir }
}

/// A pFedDPO job's model of this shape.
fn pfeddpo_spec(config: Gpt2Config) -> PolicySpec {
    PolicySpec { config, lora: Some(LoraConfig::default()), partition: Partition::new(PartitionPreset::Pfeddpo) }
}

/// The device refused round 1 for memory, naming `budget_mib`, told the aggregator why,
/// and trained nothing; returns the refusal's text.
fn assert_left_over_memory(Departure { ended, byes, dir }: Departure, budget_mib: u64) -> String {
    let err = ended.expect_err("the device refuses the round");
    assert!(matches!(err, ParticipantError::Memory { round: 1, .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains(&format!("--max-memory {budget_mib} MiB cannot hold")), "{text}");
    assert!(byes.iter().any(|r| r.contains("cannot hold")), "the aggregator is told why: {byes:?}");
    assert!(!dir.path().join("pi-4/adapter.safetensors").exists(), "nothing trained");
    text
}

fn synthetic_pairs() -> (Vec<PreferencePair>, Vec<PreferencePair>) {
    let data =
        generate_device(&SyntheticSpec { heterogeneity: 1.0, train_pairs: 8, heldout_pairs: 4, seed: 0 }, 0).unwrap();
    (data.train, data.heldout)
}

#[test]
fn device_over_its_memory_budget_leaves_the_job_before_downloading_the_model() {
    let spec = pfeddpo_spec(Gpt2Config::distilgpt2());
    let departure = announce_until_the_device_leaves("mem", synthetic_pairs(), 1000, &spec, BTreeMap::new());
    assert_left_over_memory(departure, 1000);
}

/// A FedProx round pulls every step towards the model it started from, so it holds that
/// start in memory: a device may not plan to keep it on disk to meet its budget. At the
/// smallest budget the disk would meet, a FedProx device leaves, where a plain round would
/// be planned with its start on disk.
#[test]
fn fedprox_device_whose_budget_only_the_start_on_disk_would_meet_leaves_before_downloading() {
    let spec = pfeddpo_spec(Gpt2Config::tiny());
    let pairs = synthetic_pairs();

    // The request the device makes of its planner, at its own token counts.
    let tokenizer = Gpt2Tokenizer::gpt2().unwrap();
    let tokenize = |p: &[PreferencePair]| tokenize_pairs(p, |s| tokenizer.encode(s), MAX_LEN, tokenizer.eos_id());
    let (train_len, heldout_len) = (longest(&tokenize(&pairs.0).unwrap()), longest(&tokenize(&pairs.1).unwrap()));
    let request = |start_on_disk| PlanRequest {
        config: spec.config.clone(),
        lora: spec.lora.clone(),
        partition: spec.partition,
        optimizer: fedpo_train::OptimKind::Sgd,
        batch_pairs: 8,
        max_micro_batch_pairs: 8,
        seq_len: train_len.0.max(heldout_len.0),
        response_len: train_len.1.max(heldout_len.1),
        federated: true,
        start_on_disk,
        may_freeze_embeddings: false,
        may_shorten: false,
        kernels: StepKernels::for_run(&Device::Cpu, DType::F32),
    };
    let budget = (1..100_000)
        .find(|&mib| memory::plan(&request(StartOnDisk::WhenNeeded), mib).is_ok())
        .expect("some budget fits the tiny model");
    let plain = memory::plan(&request(StartOnDisk::WhenNeeded), budget).unwrap();
    assert!(plain.start_on_disk, "at {budget} MiB a plain round fits only with its start on disk: {plain}");
    assert!(memory::plan(&request(StartOnDisk::Never), budget).is_err(), "nor in memory at {budget} MiB");

    let fedprox = BTreeMap::from([(keys::PROXIMAL_MU.to_string(), 0.01)]);
    let departure = announce_until_the_device_leaves("prox", pairs, budget, &spec, fedprox);
    let refusal = assert_left_over_memory(departure, budget);
    assert!(!refusal.contains("on disk"), "its smallest plan keeps the start in memory: {refusal}");
}
