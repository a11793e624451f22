//! A device whose memory budget cannot hold the job's model leaves before downloading it,
//! and says why; a device that fits reports its peak memory every round.

mod common;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Device;
use common::Wiretap;
use fedpo_data::synthetic::{generate_device, SyntheticSpec};
use fedpo_device::participant::{self, ParticipantConfig, ParticipantError};
use fedpo_model::{Gpt2Config, LoraConfig, Partition, PartitionPreset, PolicySpec};
use fedpo_transport::{EmbeddedBroker, LinkOptions, MqttLink, Topics};
use fedpo_wire::{split_payload, Hyperparameters, Limits, Message, RoundPlan, TensorPayload, DEFAULT_CHUNK_BYTES};

#[test]
fn device_over_its_memory_budget_leaves_the_job_before_downloading_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let tap = Wiretap::start(&url, "fedpo/mem/#");
    let data =
        generate_device(&SyntheticSpec { heterogeneity: 1.0, train_pairs: 8, heldout_pairs: 4, seed: 0 }, 0).unwrap();
    let cfg = ParticipantConfig {
        broker: url.clone(),
        tls: Default::default(),
        job: "mem".into(),
        id: "pi-4".into(),
        state_dir: dir.path().join("pi-4"),
        train: data.train,
        heldout: data.heldout,
        max_len: 128,
        compute: Device::Cpu,
        max_memory_mib: Some(1000),
        max_micro_batch_pairs: None,
        start_on_disk: false,
        compute_dtype: candle_core::DType::F32,
        trusted_key: None,
        adversary: None,
        stop: Arc::new(AtomicBool::new(false)),
    };
    let device = std::thread::spawn(move || participant::run(cfg));

    // Play the aggregator: announce a DistilGPT-2 pFedDPO round, and never send its model.
    let spec = PolicySpec {
        config: Gpt2Config::distilgpt2(),
        lora: Some(LoraConfig::default()),
        partition: Partition::new(PartitionPreset::Pfeddpo),
    };
    let (manifest, _chunks) = split_payload("r1", &TensorPayload { tensors: Vec::new() }, DEFAULT_CHUNK_BYTES);
    let plan = Message::Plan(RoundPlan {
        round: 1,
        selected: vec!["pi-4".into()],
        hyper: Hyperparameters { method: "pfeddpo".into(), local_steps: 1, lr: 0.1, beta: 0.2, batch_pairs: 8 },
        strategy: Default::default(),
        model_spec: serde_json::to_string(&spec).unwrap(),
        global_model: manifest,
        sections: Default::default(),
        signature: Vec::new(),
        secagg: None,
        update_codec: Default::default(),
        sender_epoch: 0,
    });
    let aggregator = MqttLink::connect(&url, &LinkOptions::new("fake-aggregator")).unwrap();
    let down = Topics::new("mem").unwrap().down();
    let started = Instant::now();
    while !device.is_finished() {
        assert!(started.elapsed() < Duration::from_secs(60), "the device never left");
        aggregator.publish(&down, plan.encode()).unwrap();
        std::thread::sleep(Duration::from_millis(200));
    }

    let err = device.join().unwrap().expect_err("the device refuses the job");
    assert!(matches!(err, ParticipantError::Memory { round: 1, .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains("--max-memory 1000 MiB cannot hold"), "{text}");
    let byes: Vec<String> = tap
        .stop()
        .iter()
        .filter_map(|d| match Message::decode(&d.payload, &Limits::default()) {
            Ok(Message::Bye(b)) if b.device == "pi-4" => Some(b.reason),
            _ => None,
        })
        .collect();
    assert!(byes.iter().any(|r| r.contains("cannot hold")), "the aggregator is told why: {byes:?}");
    assert!(!dir.path().join("pi-4/adapter.safetensors").exists(), "nothing trained");
}
