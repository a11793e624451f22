//! `fedpo-device generate` and `export` on a device's own state after a federated job: the
//! latest global model it kept and its private adapter, streamed, with stop strings,
//! exported to transformers and PEFT directories and read back, and the refusals a user
//! meets.

use std::path::Path;
use std::process::Command;

mod common;

fn generate(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(common::binary("fedpo-device")).arg("generate").args(args).output().unwrap();
    (out.status.success(), String::from_utf8(out.stdout).unwrap(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn job(out: &Path) {
    let args: Vec<String> = ["fedpo-aggregator", "simulate", "--devices", "2", "--rounds", "2", "--local-steps", "2"]
        .into_iter()
        .chain(["--batch-pairs", "2", "--train-pairs", "4", "--heldout-pairs", "2", "--max-len", "48"])
        .chain(["--method", "pfeddpo", "--out", out.to_str().unwrap()])
        .map(String::from)
        .collect();
    fedpo_aggregator::run_cli(args).expect("the job runs");
}

#[test]
fn a_device_generates_from_the_final_global_model_and_its_adapter_and_stops_where_asked() {
    let dir = fedpo_tests::TestDir::new();
    let out = dir.path().join("job");
    job(&out);
    let state = out.join("devices/dev-0");
    // The closing evaluation's model is the one kept: round 3, after 2 training rounds.
    let latest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(state.join("global-model.json")).unwrap()).unwrap();
    assert_eq!(latest["round"], 3, "{latest}");
    let state = state.to_str().unwrap();

    let greedy = ["--state-dir", state, "--prompt", "Explain how tides work", "--greedy", "--max-new-tokens", "24"];
    let (ok, compared, err) = generate(&[&greedy[..], &["--compare"]].concat());
    assert!(ok, "{err}");
    let (base, adapted) = compared.split_once("── with your adapter ──").expect("two completions");
    assert!(base.starts_with("── global model alone ──"), "{compared}");
    // Greedy is deterministic, and the personalized completion is the plain one.
    let (ok, plain, err) = generate(&greedy);
    assert!(ok, "{err}");
    assert_eq!(
        plain.trim_end(),
        adapted.trim_start_matches('\n').trim_end(),
        "--compare's second completion is the personalized model's"
    );
    assert!(err.contains("round 3") && err.contains("private adapter"), "the log names the source: {err}");

    // A stop string ends the completion before it (sampled, for a varied text).
    let sampled = ["--state-dir", state, "--prompt", "Explain how tides work", "--temperature", "1", "--seed", "5"];
    let (ok, plain, err) = generate(&sampled);
    assert!(ok, "{err}");
    let text = plain.trim_end();
    let cut = text.char_indices().map(|(i, _)| i).nth(text.chars().count() / 2).unwrap();
    let stop: String = text[cut..].chars().take(3).collect();
    let (ok, stopped, err) = generate(&[&sampled[..], &["--stop", &stop]].concat());
    assert!(ok, "{err}");
    let expected = &text[..text.find(&stop).unwrap()];
    assert_eq!(stopped.trim_end_matches('\n'), expected, "stop string {stop:?}");

    // Exported as transformers + PEFT directories, the model and adapter generate the same
    // completion through --model and --adapter DIR; a second export needs --force.
    let exported = dir.path().join("export");
    let export = |extra: &[&str]| {
        let out = Command::new(common::binary("fedpo-device"))
            .args(["export", "--state-dir", state, "--out", exported.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (ok, err) = export(&[]);
    assert!(ok, "{err}");
    for file in ["model/config.json", "model/model.safetensors", "model/tokenizer.json", "adapter/adapter_config.json"]
    {
        assert!(exported.join(file).is_file(), "{file}");
    }
    let model = exported.join("model");
    let adapter = exported.join("adapter");
    let from_export = [
        "--model",
        model.to_str().unwrap(),
        "--adapter",
        adapter.to_str().unwrap(),
        "--prompt",
        "Explain how tides work",
        "--greedy",
        "--max-new-tokens",
        "24",
    ];
    let (ok, again, err) = generate(&from_export);
    assert!(ok, "{err}");
    let (_, direct, _) = generate(&greedy);
    assert_eq!(again, direct, "the exported model and adapter generate what the state directory does");
    let (ok, err) = export(&[]);
    assert!(!ok && err.contains("--force"), "{err}");
    let (ok, err) = export(&["--force", "--merged"]);
    assert!(ok, "{err}");
    assert!(!exported.join("adapter").exists(), "a merged export has no adapter directory");
    let (ok, merged, err) = generate(&[
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "Explain how tides work",
        "--greedy",
        "--max-new-tokens",
        "24",
    ]);
    assert!(ok, "{err}");
    assert_eq!(merged, direct, "the merged model generates what the model with its adapter does");

    // Refusals name what is wrong.
    let empty = dir.path().join("never-trained");
    std::fs::create_dir_all(&empty).unwrap();
    let (ok, _, err) = generate(&["--state-dir", empty.to_str().unwrap(), "--prompt", "x"]);
    assert!(!ok && err.contains("global-model.json") && err.contains("not received"), "{err}");
    let (ok, _, err) = generate(&[&sampled[..], &["--max-new-tokens", "5000"]].concat());
    assert!(!ok && err.contains("5000 new tokens") && err.contains("1024"), "{err}");
    let (ok, _, err) = generate(&[&greedy[..], &["--max-memory", "10"]].concat());
    assert!(!ok && err.contains("--max-memory 10 MiB"), "{err}");
}

#[test]
fn a_peft_adapter_starts_a_devices_private_adapter_once() {
    let dir = fedpo_tests::TestDir::new();
    let state = dir.path().join("state");
    let peft = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/golden/peft-adapter");
    // No broker answers on port 1: the device writes its adapter, then tries to connect
    // until it is stopped.
    let run = || {
        let mut child = Command::new(common::binary("fedpo-device"))
            .args(["run", "--broker", "mqtt://127.0.0.1:1", "--id", "pi-1", "--synthetic-persona", "0"])
            .arg("--state-dir")
            .arg(&state)
            .arg("--init-adapter")
            .arg(&peft)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let started = std::time::Instant::now();
        let existed = state.join("adapter.safetensors").exists();
        while child.try_wait().unwrap().is_none() && started.elapsed() < std::time::Duration::from_secs(20) {
            if !existed && state.join("adapter.safetensors").exists() {
                std::thread::sleep(std::time::Duration::from_millis(300));
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let _ = child.kill();
        child.wait_with_output().unwrap()
    };
    let before = std::time::Instant::now();
    run();
    assert!(before.elapsed() < std::time::Duration::from_secs(20), "the adapter was never written");
    let written = fedpo_model::checkpoint::load_adapter(&state.join("adapter.safetensors"), &candle_core::Device::Cpu);
    let written = written.expect("a fedpo adapter file");
    let original = fedpo_model::checkpoint::load_adapter(&peft, &candle_core::Device::Cpu).unwrap();
    assert_eq!(written.lora, original.lora);
    assert_eq!(written.tensors.tensors.len(), original.tensors.tensors.len());
    for (name, t) in &original.tensors.tensors {
        let w = &written.tensors.tensors[name];
        let gap: f32 = (w - t).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap();
        assert_eq!(gap, 0.0, "{name}");
    }
    let again = run();
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(!again.status.success() && err.contains("--init-adapter starts"), "{err}");
}
