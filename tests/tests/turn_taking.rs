//! Devices simulated in one process take turns to train, and those waiting for their turn
//! keep the round's model on disk, not in memory: a fleet's memory then grows with the
//! turns, not with the devices (the closing evaluation selects every device at once).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Wiretap;
use fedpo_data::synthetic::{generate_device, SyntheticSpec};
use fedpo_device::participant::{self, TrainingSlots};
use fedpo_transport::EmbeddedBroker;
use fedpo_wire::{Limits, Message};

/// Sizes of the files under each device's `incoming/`.
fn incoming(dir: &std::path::Path, devices: usize) -> Vec<Vec<u64>> {
    (0..devices)
        .map(|k| {
            let Ok(entries) = std::fs::read_dir(dir.join(format!("dev-{k}/incoming"))) else { return Vec::new() };
            entries.map(|e| e.unwrap().metadata().unwrap().len()).collect()
        })
        .collect()
}

#[test]
fn devices_waiting_their_turn_keep_the_model_on_disk_and_train_from_it_when_the_turn_comes() {
    const DEVICES: usize = 3;
    let dir = fedpo_tests::TestDir::new();
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let tap = Wiretap::start(&url, "fedpo/turns/down");
    let out = dir.path().join("aggregator");
    let aggregator = {
        let args = common::serve_args(&url, "turns", &out, &["--rounds", "1", "--local-steps", "1", "--no-final-eval"]);
        std::thread::spawn(move || fedpo_aggregator::run_cli(args))
    };
    // One turn, held here until every device has its model.
    let slots = Arc::new(TrainingSlots::new(1));
    let held = slots.acquire();
    let spec = SyntheticSpec { heterogeneity: 1.0, train_pairs: 8, heldout_pairs: 2, seed: 0 };
    let devices: Vec<_> = (0..DEVICES)
        .map(|k| {
            let data = generate_device(&spec, k).unwrap();
            let id = format!("dev-{k}");
            let mut cfg =
                common::participant_config(&url, "turns", &id, dir.path().join(&id), (data.train, data.heldout), 64);
            cfg.training_slots = Some(slots.clone());
            std::thread::spawn(move || participant::run(cfg).expect("device runs to the end of the job"))
        })
        .collect();

    let started = Instant::now();
    let model_bytes = loop {
        assert!(started.elapsed() < Duration::from_secs(120), "the devices never all received the model");
        let plan = tap.heard().iter().find_map(|d| match Message::decode(&d.payload, &Limits::default()) {
            Ok(Message::Plan(p)) => Some(p.global_model.bytes),
            _ => None,
        });
        if let Some(bytes) = plan {
            if incoming(dir.path(), DEVICES).iter().all(|files| files == &[bytes]) {
                break bytes;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(model_bytes > 1 << 20, "a model of {model_bytes} bytes");
    // Nothing trains while the turn is held: no device has gone on to upload.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(incoming(dir.path(), DEVICES), vec![vec![model_bytes]; DEVICES]);

    drop(held);
    aggregator.join().unwrap().expect("the aggregator finishes the job");
    for d in devices {
        d.join().unwrap();
    }
    let records = common::metrics_records(&out);
    let round = records.iter().find(|r| r["round"] == 1).expect("round 1 recorded");
    assert_eq!(
        round["participants"].as_array().map(Vec::len),
        Some(DEVICES),
        "every device trained from the model it kept: {round}"
    );
    assert_eq!(incoming(dir.path(), DEVICES), vec![Vec::<u64>::new(); DEVICES], "read models are removed");
}
