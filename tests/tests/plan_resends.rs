//! A plan resent for other devices does not make a device that already sent its update
//! send it again; a plan from an aggregator that reconnected (a new epoch) does.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{participant_config, Wiretap};
use fedpo_data::synthetic::{generate_device, SyntheticSpec};
use fedpo_device::participant;
use fedpo_model::{Gpt2Config, LoraConfig, Partition, PartitionPreset, Policy, PolicySpec};
use fedpo_transport::{EmbeddedBroker, LinkOptions, MqttLink, Topics};
use fedpo_wire::{
    split_payload, Hyperparameters, Limits, Message, RoundPlan, TensorPayload, WireDType, DEFAULT_CHUNK_BYTES,
};

/// Updates from `device` heard so far.
fn updates_from(tap: &Wiretap, device: &str) -> usize {
    tap.heard()
        .iter()
        .filter(
            |d| matches!(Message::decode(&d.payload, &Limits::default()), Ok(Message::Update(u)) if u.device == device),
        )
        .count()
}

fn wait_for_updates(tap: &Wiretap, device: &str, n: usize, within: Duration) -> usize {
    let started = Instant::now();
    while updates_from(tap, device) < n && started.elapsed() < within {
        std::thread::sleep(Duration::from_millis(100));
    }
    updates_from(tap, device)
}

#[test]
fn a_plan_resent_for_others_does_not_make_a_device_upload_twice_but_a_new_epoch_does() {
    let dir = fedpo_tests::TestDir::new();
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let tap = Wiretap::start(&url, "fedpo/resend/#");
    let data =
        generate_device(&SyntheticSpec { heterogeneity: 1.0, train_pairs: 4, heldout_pairs: 2, seed: 0 }, 0).unwrap();
    let cfg = participant_config(&url, "resend", "pi-1", dir.path().join("pi-1"), (data.train, data.heldout), 64);
    let stop = cfg.stop.clone();
    let device = std::thread::spawn(move || participant::run(cfg));

    // Play the aggregator: a tiny pFedDPO model with frozen embeddings, one local step.
    let spec = PolicySpec {
        config: Gpt2Config::tiny(),
        lora: Some(LoraConfig::default()),
        partition: Partition { preset: PartitionPreset::Pfeddpo, freeze_embeddings: true },
    };
    let policy = Policy::random(spec.clone(), 3, &candle_core::Device::Cpu).unwrap();
    let payload = TensorPayload::encode(&policy.global_tensors().unwrap(), WireDType::F32);
    let (manifest, chunks) = split_payload("r1/global", &payload, DEFAULT_CHUNK_BYTES);
    let plan = |epoch: u64| RoundPlan {
        round: 1,
        // another device is still missing: the reason a plan is resent
        selected: vec!["pi-1".into(), "pi-2".into()],
        hyper: Hyperparameters { method: "pfeddpo".into(), local_steps: 1, lr: 0.01, beta: 0.2, batch_pairs: 4 },
        strategy: Default::default(),
        model_spec: serde_json::to_string(&spec).unwrap(),
        global_model: manifest.clone(),
        sections: Default::default(),
        signature: Vec::new(),
        secagg: None,
        update_codec: Default::default(),
        downlink: None,
        sender_epoch: epoch,
        job: "resend".into(),
        run: 1,
    };
    let aggregator = MqttLink::connect(&url, &LinkOptions::new("fake-aggregator")).unwrap();
    let down = Topics::new("resend").unwrap().down();
    let publish = |epoch: u64| {
        aggregator.publish(&down, Message::Plan(plan(epoch)).encode()).unwrap();
        for c in &chunks {
            aggregator.publish(&down, Message::Chunk(c.clone()).encode()).unwrap();
        }
    };

    // Until the device has its update out (it may not be listening at first).
    let started = Instant::now();
    while updates_from(&tap, "pi-1") == 0 {
        assert!(started.elapsed() < Duration::from_secs(120), "the device never sent its update");
        publish(41);
        wait_for_updates(&tap, "pi-1", 1, Duration::from_secs(3));
    }
    // The same plan, same epoch, three more times: resent for pi-2.
    for _ in 0..3 {
        publish(41);
    }
    assert_eq!(
        wait_for_updates(&tap, "pi-1", 2, Duration::from_secs(3)),
        1,
        "a resend for others made it upload again"
    );
    // The aggregator reconnected: what was in flight to it may be lost.
    publish(42);
    assert_eq!(
        wait_for_updates(&tap, "pi-1", 2, Duration::from_secs(20)),
        2,
        "a new epoch must bring the update again"
    );
    publish(42);
    assert_eq!(wait_for_updates(&tap, "pi-1", 3, Duration::from_secs(3)), 2, "one resend per epoch");

    stop.store(true, Ordering::SeqCst);
    device.join().unwrap().expect("the device stops cleanly");
    drop(tap.stop());
}
