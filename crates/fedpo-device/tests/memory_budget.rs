//! `--max-memory` end to end: the planned configuration keeps a real training process under
//! its budget, and a budget nothing fits is refused before training starts.

use std::path::Path;
use std::process::{Command, Output};

fn train_local(out: &Path, budget_mib: u64) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fedpo-device"))
        .args(["train-local", "--synthetic", "--model", "tiny", "--train-pairs", "16", "--heldout-pairs", "8"])
        .args(["--steps", "3", "--batch-pairs", "8", "--max-len", "128", "--max-memory", &budget_mib.to_string()])
        .arg("--out")
        .arg(out)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("fedpo-device runs")
}

#[test]
fn a_feasible_budget_is_met_by_the_measured_peak_of_a_training_process() {
    let dir = tempfile::tempdir().unwrap();
    // A whole 8-pair batch of the synthetic pairs (at most 64 tokens) peaks near 190 MiB
    // with the tiny model, its 50k-entry vocabulary dominating, and is planned at about
    // 320 MiB; a 280 MiB budget leaves room for 4 pairs per pass.
    let budget = 280;
    let run = train_local(dir.path(), budget);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("summary.json")).unwrap()).unwrap();
    let micro = summary["micro_batch_pairs"].as_u64().unwrap();
    let peak = summary["peak_rss_mib"].as_f64().unwrap();
    assert!((1..8).contains(&micro), "the planner split the batch: micro-batch {micro}");
    assert!(peak > 50.0 && peak <= budget as f64, "measured peak {peak:.0} MiB against a {budget} MiB budget");
}

#[test]
fn an_impossible_budget_is_refused_before_training_with_what_it_would_take() {
    let dir = tempfile::tempdir().unwrap();
    let run = train_local(dir.path(), 60);
    assert!(!run.status.success());
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("--max-memory 60 MiB cannot hold this training"), "{stderr}");
    assert!(stderr.contains("needs about"), "{stderr}");
    assert!(!dir.path().join("metrics.jsonl").exists(), "nothing trained");
}
