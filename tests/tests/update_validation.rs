//! `--max-update-norm`: an update over the bound is refused with its reason, recorded under
//! `rejected`, and leaves the global model exactly as it was; under a loose bound the same
//! updates count.

mod common;

use std::path::Path;

use common::Wiretap;
use fedpo_data::synthetic::{generate_device, SyntheticSpec};
use fedpo_transport::EmbeddedBroker;
use fedpo_wire::{Limits, Message};

/// Runs a one-round 3-device job; returns its round record, the round's starting model
/// digest and the final one.
fn run(dir: &Path, max_update_norm: &str) -> (serde_json::Value, String, String) {
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let tap = Wiretap::start(&url, "fedpo/#");
    let out = dir.join("aggregator");
    let extra = ["--rounds", "1", "--local-steps", "1", "--no-final-eval", "--max-update-norm", max_update_norm];
    let args = common::serve_args(&url, "bounded", &out, &extra);
    let aggregator = std::thread::spawn(move || fedpo_aggregator::run_cli(args));
    let spec = SyntheticSpec { heterogeneity: 1.0, train_pairs: 4, heldout_pairs: 4, seed: 0 };
    let shards = (0..3)
        .map(|k| {
            let d = generate_device(&spec, k).unwrap();
            (d.train, d.heldout)
        })
        .collect();
    let devices = common::start_devices(&url, "bounded", dir, shards, 48);
    aggregator.join().unwrap().expect("the aggregator finishes the job");
    devices.into_iter().for_each(|d| d.join().unwrap());
    let start = tap
        .stop()
        .iter()
        .find_map(|d| match Message::decode(&d.payload, &Limits::default()) {
            Ok(Message::Plan(p)) if p.round == 1 => Some(hex::encode(&p.global_model.digest)),
            _ => None,
        })
        .expect("the round-1 plan was heard");
    let record =
        serde_json::from_str(std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().next().unwrap())
            .unwrap();
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    (record, start, summary["global_digest"].as_str().unwrap().to_string())
}

#[test]
fn updates_over_the_norm_bound_are_refused_and_leave_the_model_unchanged() {
    let dir = fedpo_tests::TestDir::new();
    let (record, start, end) = run(dir.path(), "1e-9");
    let rejected = record["rejected"].as_object().unwrap();
    assert_eq!(rejected.len(), 3, "{rejected:?}");
    for (device, reason) in rejected {
        assert!(reason.as_str().unwrap().contains("exceeds --max-update-norm 0.000000001"), "{device}: {reason}");
    }
    assert_eq!(record["participants"], serde_json::json!([]));
    assert_eq!(start, end, "refused updates changed the global model");

    let dir = fedpo_tests::TestDir::new();
    let (record, start, end) = run(dir.path(), "1e9");
    assert!(record["rejected"].as_object().unwrap().is_empty());
    assert_eq!(record["participants"].as_array().unwrap().len(), 3);
    assert_ne!(start, end, "accepted updates moved the model");
}
