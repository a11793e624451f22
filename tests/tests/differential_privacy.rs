//! Client-level differential privacy end to end: every update is clipped, the aggregate is
//! noised, and each round's metrics carry the (ε, δ) spent so far, matching Google's
//! dp_accounting for the same mechanism; a checkpoint keeps the accountant, so a resumed
//! job cannot quietly change the noise or drop it.

use std::path::Path;

/// ε after one round of the Gaussian mechanism with σ = 1, every device selected (q = 1),
/// δ = 1e-5: `fixtures/golden/rdp.json`, from dp_accounting.
const EPSILON_ONE_ROUND: f64 = 4.752728336819822;

fn simulate(out: &Path, extra: &[&str]) -> Result<(), String> {
    let mut args: Vec<String> = [
        "fedpo-aggregator",
        "simulate",
        "--job",
        "private",
        "--devices",
        "3",
        "--method",
        "pfeddpo",
        "--train-pairs",
        "8",
        "--heldout-pairs",
        "4",
        "--local-steps",
        "1",
        "--batch-pairs",
        "4",
        "--freeze-embeddings",
        "--no-final-eval",
        "--clip-norm",
        "0.01",
        "--out",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.push(out.to_str().unwrap().to_string());
    args.extend(extra.iter().map(|s| s.to_string()));
    fedpo_aggregator::run_cli(args).map_err(|e| format!("{e:#}"))
}

#[test]
fn each_round_reports_the_privacy_spent_and_a_resume_cannot_change_the_noise() {
    let dir = fedpo_tests::TestDir::new();
    let out = dir.path().join("job");
    simulate(&out, &["--rounds", "2", "--dp-noise-multiplier", "1"]).unwrap();
    let records: Vec<serde_json::Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(records.len(), 2);
    for r in &records {
        assert_eq!(r["clipped"], 3, "a 0.01 bound clips every update: {r}");
        assert_eq!(r["dp_delta"], 1e-5);
    }
    let eps: Vec<f64> = records.iter().map(|r| r["dp_epsilon"].as_f64().unwrap()).collect();
    assert!((eps[0] - EPSILON_ONE_ROUND).abs() < 1e-9, "round 1: ε {}", eps[0]);
    assert!(eps[1] > eps[0], "privacy spent only grows: {eps:?}");

    let err = simulate(&out, &["--rounds", "3", "--resume", "--dp-noise-multiplier", "2"]).unwrap_err();
    assert!(err.contains("used --dp-noise-multiplier 1, not 2"), "{err}");
    let err = simulate(&out, &["--rounds", "3", "--resume"]).unwrap_err();
    assert!(err.contains("ran with --dp-noise-multiplier"), "{err}");
}

#[test]
fn dp_refuses_settings_whose_outputs_it_would_not_cover() {
    let dir = fedpo_tests::TestDir::new();
    let err =
        simulate(&dir.path().join("a"), &["--rounds", "1", "--dp-noise-multiplier", "1", "--diagnostics"]).unwrap_err();
    assert!(err.contains("--diagnostics"), "{err}");
    let args = ["--rounds", "1", "--dp-noise-multiplier", "1", "--client-term", "scaffold"];
    let err = simulate(&dir.path().join("b"), &args).unwrap_err();
    assert!(err.contains("scaffold"), "{err}");
}
