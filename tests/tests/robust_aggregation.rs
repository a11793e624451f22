//! Robust aggregation against Byzantine devices, end to end: one of five devices trains
//! honestly and then uploads a poisoned update. Under the plain mean a sign-flipped
//! update costs the fleet most of what it learned; under the coordinate-wise median or
//! trimmed mean the global held-out accuracy stays within [`MARGIN`] of the attack-free
//! run.
//!
//! The personas agree (heterogeneity 0), so the attack-free fleet learns the task within
//! a round or two and any loss of accuracy is the attacker's doing.

use std::path::Path;

/// How far below the attack-free run a robust rule's held-out accuracy may fall.
const MARGIN: f64 = 0.1;

/// Runs a 5-device, 3-round FedDPO simulation with `extra` flags; returns the mean held-out
/// accuracy of the final model over every device's held-out pairs.
fn heldout_accuracy(dir: &Path, name: &str, extra: &[&str]) -> f64 {
    let out = dir.join(name);
    let mut args: Vec<String> = [
        "fedpo-aggregator",
        "simulate",
        "--job",
        name,
        "--devices",
        "5",
        "--method",
        "feddpo",
        "--heterogeneity",
        "0",
        "--train-pairs",
        "16",
        "--heldout-pairs",
        "16",
        "--rounds",
        "3",
        "--local-steps",
        "2",
        "--batch-pairs",
        "8",
        "--freeze-embeddings",
        "--out",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.push(out.to_str().unwrap().to_string());
    args.extend(extra.iter().map(|s| s.to_string()));
    fedpo_aggregator::run_cli(args).unwrap_or_else(|e| panic!("{name}: {e:#}"));
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    summary["heldout_acc_mean"].as_f64().unwrap()
}

#[test]
fn median_and_trimmed_mean_keep_accuracy_near_the_attack_free_run_where_the_mean_loses_it() {
    let dir = fedpo_tests::TestDir::new();
    let clean = heldout_accuracy(dir.path(), "clean", &[]);
    assert!(clean >= 0.9, "the attack-free fleet must learn the task for this test to mean anything: {clean}");

    let flip = ["--attackers", "1", "--attack", "sign-flip:4"];
    let broken = heldout_accuracy(dir.path(), "flip-mean", &flip);
    assert!(broken < clean - 2.0 * MARGIN, "the sign-flip attack must hurt the mean: {broken} vs {clean}");

    let median = heldout_accuracy(
        dir.path(),
        "flip-median",
        &[&flip[..], &["--aggregation", "median", "--byzantine", "1"]].concat(),
    );
    assert!(median >= clean - MARGIN, "median under sign-flip: {median} vs attack-free {clean}");

    let scale = ["--attackers", "1", "--attack", "scale:20", "--aggregation", "trimmed-mean", "--byzantine", "1"];
    let trimmed = heldout_accuracy(dir.path(), "scale-trimmed", &scale);
    assert!(trimmed >= clean - MARGIN, "trimmed mean under a ×20 update: {trimmed} vs attack-free {clean}");
}

#[test]
fn a_rule_that_cannot_tolerate_the_byzantine_count_is_refused_before_any_round() {
    let dir = fedpo_tests::TestDir::new();
    let out = dir.path().join("krum");
    let args = [
        "fedpo-aggregator",
        "simulate",
        "--devices",
        "4",
        "--aggregation",
        "krum",
        "--byzantine",
        "1",
        "--out",
        out.to_str().unwrap(),
    ];
    let err = format!("{:#}", fedpo_aggregator::run_cli(args).unwrap_err());
    assert!(err.contains("--per-round 4") && err.contains("n > 2f + 2"), "{err}");
    assert!(!out.join("metrics.jsonl").exists(), "no round may run");
}
