//! `simulate --personas drawn`: a persona per device drawn around a shared one, labels
//! drawn from each persona's utility. The simulation records every device's held-out
//! Bayes ceiling (below 1: the labels are noisy, so the benchmark cannot saturate), the
//! same the generator gives on its own, and every device, each its own process reading
//! the same flags, trains.

mod common;

use fedpo_data::synthetic::{generate_drawn_device, SyntheticSpec};

#[test]
fn a_drawn_persona_fleet_records_each_devices_heldout_ceiling_and_trains_every_device() {
    let dir = fedpo_tests::TestDir::new();
    let out = dir.path().join("drawn");
    let args = ["fedpo-aggregator", "simulate", "--job", "drawn", "--devices", "3", "--rounds", "1"]
        .into_iter()
        .chain(["--personas", "drawn", "--label-temperature", "1", "--heterogeneity", "0.5", "--seed", "4"])
        .chain(["--train-pairs", "8", "--heldout-pairs", "60", "--local-steps", "1", "--batch-pairs", "4"])
        .chain(["--freeze-embeddings", "--no-final-eval", "--max-len", "96", "--processes", "--out"])
        .map(String::from)
        .chain([out.display().to_string()]);
    fedpo_aggregator::run_cli(args).unwrap();

    let ceilings: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("ceilings.json")).unwrap()).unwrap();
    let spec = SyntheticSpec { heterogeneity: 0.5, train_pairs: 8, heldout_pairs: 60, seed: 4 };
    for k in 0..3 {
        let recorded = ceilings[format!("dev-{k}")].as_f64().unwrap();
        assert_eq!(recorded, generate_drawn_device(&spec, 1.0, k).unwrap().heldout_ceiling);
        assert!(recorded > 0.5 && recorded < 1.0, "dev-{k}: {recorded}");
    }
    assert_eq!(common::metrics_records(&out)[0]["participants"], serde_json::json!(["dev-0", "dev-1", "dev-2"]));
}
