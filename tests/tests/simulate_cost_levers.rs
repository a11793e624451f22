//! The levers that make the paper's grid affordable on two cores, each doing what it says
//! and no more: `--trim-vocab` shrinks the model to the fleet's tokens (in-process devices
//! and device processes alike), `--diagnostics-every` and `--heldout-every` measure only
//! their rounds (plus the first and last).

use std::path::Path;

mod common;

fn simulate(out: &Path, extra: &[&str]) {
    let mut args: Vec<String> = ["fedpo-aggregator", "simulate", "--devices", "2", "--local-steps", "1"]
        .into_iter()
        .chain(["--batch-pairs", "2", "--train-pairs", "4", "--heldout-pairs", "4", "--max-len", "48"])
        .map(String::from)
        .collect();
    args.extend(["--out".into(), out.display().to_string()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    fedpo_aggregator::run_cli(args).unwrap_or_else(|e| panic!("simulate {extra:?}: {e:#}"));
}

#[test]
fn a_trimmed_vocabulary_trains_in_process_and_in_device_processes() {
    let dir = fedpo_tests::TestDir::new();
    for (name, mode) in [("threads", None), ("processes", Some("--processes"))] {
        let out = dir.path().join(name);
        let mut extra = vec!["--rounds", "1", "--trim-vocab", "--no-final-eval", "--round-deadline", "120"];
        extra.extend(mode);
        simulate(&out, &extra);
        let vocab: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("vocab.json")).unwrap()).unwrap();
        let ids: Vec<u64> = vocab["gpt2_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        assert!(ids.len() > 20 && ids.len() < 2_000, "{name}: {} tokens kept", ids.len());
        assert_eq!(ids.last(), Some(&50_256), "{name}: <|endoftext|> is kept");
        let round = &common::metrics_records(&out)[0];
        assert_eq!(round["participants"], serde_json::json!(["dev-0", "dev-1"]), "{name}: both devices trained");
        assert_eq!(round["heldout_acc"].as_object().unwrap().len(), 2, "{name}");
        // The untrimmed tiny model alone is 27.8 MB on the wire.
        let down = round["bytes_down"].as_u64().unwrap();
        assert!(down < 3_000_000, "{name}: {down} bytes went down for a trimmed model");
    }
}

#[test]
fn diagnostics_and_heldout_accuracy_every_k_rounds_measure_only_those_rounds() {
    let dir = fedpo_tests::TestDir::new();
    let out = dir.path().join("every");
    simulate(
        &out,
        &["--rounds", "5", "--trim-vocab", "--diagnostics", "--diagnostics-every", "2", "--heldout-every", "3"],
    );
    let records = common::metrics_records(&out);
    let training: Vec<&serde_json::Value> = records.iter().filter(|r| r["evaluation"] == false).collect();
    assert_eq!(training.len(), 5);
    let measured = |key: &str| -> Vec<u64> {
        training
            .iter()
            .filter(|r| r.get(key).is_some_and(|v| !v.is_null() && v.as_object().is_none_or(|o| !o.is_empty())))
            .map(|r| r["round"].as_u64().unwrap())
            .collect()
    };
    assert_eq!(measured("diagnostics_bytes"), [1, 2, 4, 5], "diagnostics: first, every 2nd, last");
    assert_eq!(measured("kappa2"), [1, 2, 4, 5]);
    assert_eq!(measured("heldout_acc"), [1, 3, 5], "held-out: first, every 3rd, last");
    assert_eq!(measured("pseudo_grad_norm"), [1, 2, 3, 4, 5], "the pseudo-gradient every round");
    let last = records.last().unwrap();
    assert_eq!(last["evaluation"], true);
    assert_eq!(last["heldout_acc"].as_object().unwrap().len(), 2, "the closing evaluation measures held-out");
}
