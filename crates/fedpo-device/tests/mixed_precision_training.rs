//! The accuracy guard of half-precision training, as a user runs it: `train-local` on the
//! synthetic persona for 200 steps with `--compute-dtype bf16`, and with `f16`, ends within
//! 1 point of the f32 run's reward accuracies and within 2 % of its loss.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// Runs 200 steps of `train-local` on the synthetic persona in `dtype`; returns its summary.
fn train(dtype: &str, out: &Path) -> Value {
    let o = Command::new(env!("CARGO_BIN_EXE_fedpo-device"))
        .args(["train-local", "--synthetic", "--model", "tiny", "--steps", "200"])
        .args(["--train-pairs", "64", "--heldout-pairs", "24", "--compute-dtype", dtype])
        .arg("--out")
        .arg(out)
        .env("RUST_LOG", "warn")
        .output()
        .expect("runs");
    assert!(o.status.success(), "{dtype}: {}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap()
}

#[test]
fn two_hundred_bf16_or_f16_steps_end_within_a_point_of_f32_accuracy_and_two_percent_of_its_loss() {
    let dir = tempfile::tempdir().unwrap();
    let full = train("f32", &dir.path().join("f32"));
    let value = |s: &Value, key: &str| s[key].as_f64().unwrap_or_else(|| panic!("summary lacks `{key}`"));
    let initial = full["initial"]["loss"].as_f64().unwrap();
    let f = value(&full, "final_loss");
    assert!(f < 0.5 * initial, "the f32 run learned: loss {initial} -> {f}");
    for dtype in ["bf16", "f16"] {
        let half = train(dtype, &dir.path().join(dtype));
        for key in ["reward_acc", "heldout_acc"] {
            let (f, h) = (value(&full, key), value(&half, key));
            eprintln!("{key}: f32 {f:.4}, {dtype} {h:.4}");
            assert!((f - h).abs() <= 0.01, "{key}: {dtype} {h} is more than a point from f32's {f}");
        }
        let h = value(&half, "final_loss");
        eprintln!("final_loss: f32 {f:.6e}, {dtype} {h:.6e}");
        assert!((f - h).abs() <= 0.02 * f.abs(), "final loss: {dtype} {h} is more than 2 % from f32's {f}");
        assert_ne!(f, h, "the {dtype} run computed in {dtype}");
    }
}
