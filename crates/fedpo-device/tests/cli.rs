//! The `fedpo-device` binary as a user runs it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn fedpo_device(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fedpo-device")).args(args).env("RUST_LOG", "warn").output().expect("runs")
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name)
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `fedpo-device train-local <args> --steps 1 --out <a fresh folder>`, which must fail;
/// returns what it printed to stderr.
fn train_local_error(args: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().to_str().unwrap();
    let o = fedpo_device(&[&["train-local"], args, &["--steps", "1", "--out", out]].concat());
    assert!(!o.status.success(), "train-local {args:?} should have failed");
    stderr(&o)
}

#[test]
fn train_local_on_synthetic_data_learns_the_persona_and_writes_its_outputs() {
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap();
    let o = fedpo_device(&[
        "train-local",
        "--synthetic",
        "--model",
        "tiny",
        "--steps",
        "40",
        "--train-pairs",
        "64",
        "--heldout-pairs",
        "24",
        "--out",
        dir,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let printed = String::from_utf8_lossy(&o.stdout);
    assert!(printed.contains("train") && printed.contains("held-out"), "{printed}");

    let summary = read_json(&out.path().join("summary.json"));
    let (train, heldout) = (summary["reward_acc"].as_f64().unwrap(), summary["heldout_acc"].as_f64().unwrap());
    assert!(train >= 0.9 && heldout >= 0.8, "train {train}, held-out {heldout}");
    assert!(summary["final_loss"].as_f64().unwrap() < summary["initial"]["loss"].as_f64().unwrap());

    let metrics = std::fs::read_to_string(out.path().join("metrics.jsonl")).unwrap();
    let lines: Vec<Value> = metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 40);
    for key in ["step", "loss", "reward_acc", "margin", "grad_norm", "seconds"] {
        assert!(lines[0].get(key).is_some(), "metrics lack `{key}`");
    }
    assert!(out.path().join("adapter.safetensors").is_file());
    assert!(out.path().join("model/model.safetensors").is_file());
    assert!(out.path().join("model/tokenizer.json").is_file());
}

#[test]
fn score_writes_one_row_per_pair_in_input_order_and_applies_the_adapter() {
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().to_str().unwrap();
    let o = fedpo_device(&[
        "train-local",
        "--synthetic",
        "--model",
        "tiny",
        "--steps",
        "25",
        "--train-pairs",
        "48",
        "--heldout-pairs",
        "8",
        "--out",
        dir,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    // Score the same synthetic persona's pairs through a data file.
    let pairs = out.path().join("pairs.jsonl");
    let heldout = r#"{"prompt": "User: How do I brew a cup of tea?\nAssistant:", "chosen": " Certainly.\n1. Boil fresh water.\n2. Steep the leaves for three minutes.\n3. Strain and add milk if you like. Taking each step carefully gives the most reliable result.\nI hope this is helpful.", "rejected": " Sure thing! First, search online for a guide. Then, ask someone who has done it. Finally, try whatever seems right. Don't rush it, it's totally worth it."}"#;
    std::fs::write(&pairs, format!("{heldout}\n{heldout}\n")).unwrap();
    let scores = out.path().join("scores.jsonl");
    let model_dir = out.path().join("model");
    let adapter = out.path().join("adapter.safetensors");
    let o = fedpo_device(&[
        "score",
        "--model",
        model_dir.to_str().unwrap(),
        "--adapter",
        adapter.to_str().unwrap(),
        "--data",
        pairs.to_str().unwrap(),
        "--out",
        scores.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rows: Vec<Value> =
        std::fs::read_to_string(&scores).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 2);
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r["index"], i);
        let (c, rj) = (r["chosen_logp"].as_f64().unwrap(), r["rejected_logp"].as_f64().unwrap());
        assert!(c < 0.0 && rj < 0.0);
    }
    assert_eq!(rows[0]["chosen_logp"], rows[1]["chosen_logp"], "identical pairs score identically");

    // The PEFT directory train-local wrote beside the file scores the same.
    let peft = out.path().join("adapter");
    let o = fedpo_device(&[
        "score",
        "--model",
        model_dir.to_str().unwrap(),
        "--adapter",
        peft.to_str().unwrap(),
        "--data",
        pairs.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let first: Value = serde_json::from_str(String::from_utf8_lossy(&o.stdout).lines().next().unwrap()).unwrap();
    assert_eq!(first["chosen_logp"], rows[0]["chosen_logp"], "the PEFT directory is the same adapter");
    let config = read_json(&peft.join("adapter_config.json"));
    assert_eq!(
        (config["base_model_name_or_path"].as_str(), config["fan_in_fan_out"].as_bool()),
        (Some("../model"), Some(true))
    );

    // The same base without the trained adapter scores differently: the adapter is applied.
    let o = fedpo_device(&["score", "--model", model_dir.to_str().unwrap(), "--data", pairs.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let first: Value = serde_json::from_str(String::from_utf8_lossy(&o.stdout).lines().next().unwrap()).unwrap();
    assert_ne!(first["chosen_logp"], rows[0]["chosen_logp"]);
}

#[test]
fn score_reads_hh_rlhf_and_shp_files() {
    for file in ["data/hh-rlhf-sample.jsonl", "data/shp-sample.jsonl"] {
        let o = fedpo_device(&["score", "--model", "tiny", "--data", fixture(file).to_str().unwrap()]);
        assert!(o.status.success(), "{file}: {}", stderr(&o));
        let n = String::from_utf8_lossy(&o.stdout).lines().count();
        assert_eq!(n, 4, "{file}");
    }
}

#[test]
fn bad_data_line_fails_with_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("bad.jsonl");
    std::fs::write(&data, "{\"prompt\": \"a\", \"chosen\": \"b\", \"rejected\": \"c\"}\n{\"prompt\": 1}\n").unwrap();
    let err = train_local_error(&["--data", data.to_str().unwrap()]);
    assert!(err.contains(&format!("{}:2", data.display())), "{err}");
}

#[test]
fn unknown_lora_target_is_refused_with_the_valid_ones() {
    let err = train_local_error(&["--synthetic", "--targets", "q_proj"]);
    assert!(err.contains("q_proj") && err.contains("attn.c_attn"), "{err}");
}

#[test]
fn missing_backend_names_the_feature_to_build_with() {
    let err = train_local_error(&["--synthetic", "--device", "cuda"]);
    assert!(err.contains("--features cuda"), "{err}");
}

/// A bench small enough for a test: the tiny model, one pair of 8 + 8 tokens.
const SMALL_BENCH: &[&str] = &["bench", "--tiny", "--pairs", "1", "--prompt-len", "8", "--resp-len", "8"];

#[test]
fn bench_prints_the_peer_keys_on_stdout_and_its_progress_on_stderr() {
    let args = [SMALL_BENCH, &["--steps", "2", "--warmup", "1"]].concat();
    let o = Command::new(env!("CARGO_BIN_EXE_fedpo-device")).args(args).env("RUST_LOG", "info").output().expect("runs");
    assert!(o.status.success(), "{}", stderr(&o));
    let report: Value = serde_json::from_slice(&o.stdout).unwrap();
    for key in ["seconds_per_step_median", "pairs_per_second", "peak_rss_mb"] {
        assert!(report[key].as_f64().unwrap() > 0.0, "{key}");
    }
    assert_eq!(report["base_trainable"], true);
    // threads busy: CPU time over wall time, at most every thread (and scheduler rounding)
    let (busy, threads) = (report["threads_busy"].as_f64().unwrap(), report["threads"].as_f64().unwrap());
    assert!(busy > 0.0 && busy <= threads + 0.25, "{busy} of {threads} threads busy");
    // progress on stderr, the JSON alone on stdout
    let log = stderr(&o);
    assert!(log.contains("warm-up step 1/1") && log.contains("timed step 2/2"), "{log}");
}

#[test]
fn compute_dtype_auto_takes_bf16_exactly_where_the_cpu_multiplies_it_natively() {
    let args = [SMALL_BENCH, &["--steps", "1", "--warmup", "0", "--compute-dtype", "auto"]].concat();
    let o = Command::new(env!("CARGO_BIN_EXE_fedpo-device")).args(args).env("RUST_LOG", "info").output().expect("runs");
    assert!(o.status.success(), "{}", stderr(&o));
    let report: Value = serde_json::from_slice(&o.stdout).unwrap();
    let engine = fedpo_model::ops::Bf16Engine::detect();
    let expected = if engine.is_native() { "bf16" } else { "f32" };
    assert_eq!(report["compute_dtype"], expected, "engine {engine:?}");
    assert_eq!(report["bf16_engine"], format!("{engine:?}"));
    assert_eq!(report["f16_engine"], format!("{:?}", fedpo_model::ops::F16Engine::detect()));
    assert!(stderr(&o).contains("--compute-dtype auto"), "the choice is logged: {}", stderr(&o));
}

#[test]
fn bench_with_gemm_reports_the_matmul_speed_and_the_compute_bound_fraction() {
    let o = fedpo_device(&[SMALL_BENCH, &["--gemm", "--steps", "1", "--warmup", "0"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let report: Value = serde_json::from_slice(&o.stdout).unwrap();
    let gemm = report["gemm"].as_array().expect("gemm list");
    // 2048^3, then c_attn, c_fc and the head at 2 x (8 + 8) tokens of the tiny model
    let shapes: Vec<(u64, u64, u64)> =
        gemm.iter().map(|g| (g["m"].as_u64().unwrap(), g["k"].as_u64().unwrap(), g["n"].as_u64().unwrap())).collect();
    assert_eq!(shapes, [(2048, 2048, 2048), (32, 128, 384), (32, 128, 512), (32, 128, 50257)]);
    for g in gemm {
        let (candle, ours) = (g["candle_gflops_best"].as_f64().unwrap(), g["fedpo_gflops_best"].as_f64().unwrap());
        assert!(candle > 0.0 && ours > 0.0, "{g}");
        assert_eq!(g["gflops_best"].as_f64().unwrap(), candle.max(ours), "the bound takes the faster matmul: {g}");
    }
    let peak = gemm[0]["gflops_best"].as_f64().unwrap();
    let bound = report["lower_bound_seconds_per_step_at_2048_sgemm"].as_f64().unwrap();
    let flops = report["flops_per_step"].as_f64().unwrap();
    assert!((bound - flops / (peak * 1e9)).abs() <= 1e-9 * bound.max(1.0));
    let median = report["seconds_per_step_median"].as_f64().unwrap();
    assert!((report["fraction_of_sgemm_bound"].as_f64().unwrap() - bound / median).abs() < 1e-12);

    // the bound at each shape's own speed, recomputed from the report's parts and speeds
    let part = |k: &str| report["flops_detail"][k].as_f64().unwrap();
    let (linear, small, head) = (part("linear"), part("attention") + part("lora"), part("lm_head"));
    assert!((linear + small + head - flops).abs() <= 1e-9 * flops, "the parts must add up to the step's FLOPs");
    let speed = |i: usize| gemm[i]["gflops_best"].as_f64().unwrap() * 1e9;
    let expected = linear * (1.0 / 3.0 / speed(1) + 2.0 / 3.0 / speed(2)) + small / speed(1) + head / speed(3);
    let shape_bound = report["lower_bound_seconds_per_step_at_shape_sgemm"].as_f64().unwrap();
    assert!((shape_bound - expected).abs() <= 1e-9 * expected, "{shape_bound} vs {expected}");
    assert!((report["fraction_of_shape_bound"].as_f64().unwrap() - shape_bound / median).abs() < 1e-12);

    // every matmul of the step at its own shape: the pair shares its prompt, so the blocks
    // run one sequence of 8 + 8 + 8 tokens, and the head the 2 x 8 response tokens
    assert_eq!(report["shared_prompt"], true);
    assert_eq!(report["model_tokens_per_step"], 24);
    let step = report["gemm_step_shapes"].as_array().expect("step shapes");
    assert_eq!(step.len(), 15, "forward, input and weight gradient of 4 projections and the head");
    let dims = |g: &Value| (g["m"].as_u64().unwrap(), g["k"].as_u64().unwrap(), g["n"].as_u64().unwrap());
    assert_eq!(dims(&step[0]), (24, 128, 384));
    assert_eq!(dims(&step[2]), (128, 24, 384), "c_attn's weight gradient");
    assert_eq!(dims(&step[14]), (50257, 16, 128), "the embedding's gradient from the head");
    let at_shapes: f64 = step
        .iter()
        .map(|g| {
            let (m, k, n) = dims(g);
            2.0 * (m * k * n) as f64 * g["per_step"].as_f64().unwrap() / (g["gflops_best"].as_f64().unwrap() * 1e9)
        })
        .sum();
    let expected = at_shapes + small / (step[0]["gflops_best"].as_f64().unwrap() * 1e9);
    let step_bound = report["lower_bound_seconds_per_step_at_step_shapes"].as_f64().unwrap();
    assert!((step_bound - expected).abs() <= 1e-9 * expected, "{step_bound} vs {expected}");
    assert!((report["fraction_of_step_shape_bound"].as_f64().unwrap() - step_bound / median).abs() < 1e-12);
}

#[test]
fn adapter_with_a_partition_that_has_none_is_refused() {
    let err = train_local_error(&["--synthetic", "--partition", "feddpo", "--adapter", "a.safetensors"]);
    assert!(err.contains("has no adapter"), "{err}");
}

#[test]
fn unknown_compute_dtype_is_refused_with_the_accepted_ones() {
    let err = train_local_error(&["--synthetic", "--compute-dtype", "f8"]);
    assert!(err.contains("`f8` is not a compute dtype; expected f32, bf16, f16 or auto"), "{err}");
}
