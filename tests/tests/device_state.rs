//! A device's state directory damaged between two runs of `fedpo-device`: the adapter it
//! trained deleted, `progress.json` garbled or holding a round no job reaches, a reference
//! cache garbled. The device stops before it says hello, with an error naming the file,
//! instead of starting over silently (losing the personalisation, or changing the DPO
//! reference) or being counted into the job and then failing; `--reset-adapter` is the
//! operator's way to start a fresh adapter on purpose.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{binary, Wiretap};
use fedpo_transport::{BrokerUrl, EmbeddedBroker};

const JOB: &str = "state";

/// What one start of the device did within a few seconds: its exit (None: still
/// running, then killed), its stderr, and how many hellos the broker carried.
struct Outcome {
    exit: Option<std::process::ExitStatus>,
    stderr: String,
    hellos: usize,
}

fn start(url: &BrokerUrl, state: &Path, extra: &[&str]) -> Outcome {
    let tap = Wiretap::start(url, &format!("fedpo/{JOB}/up/#"));
    let log = state.with_extension("log");
    let mut child = Command::new(binary("fedpo-device"))
        .args(["run", "--broker", &url.to_string(), "--job", JOB, "--id", "dev-0"])
        .args(["--synthetic-persona", "0", "--train-pairs", "4", "--heldout-pairs", "2", "--max-len", "48"])
        .arg("--state-dir")
        .arg(state)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let exit = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline || !tap.heard().is_empty() {
            std::thread::sleep(Duration::from_millis(300));
            child.kill().unwrap();
            child.wait().unwrap();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Outcome { exit, stderr: std::fs::read_to_string(log).unwrap(), hellos: tap.stop().len() }
}

fn write(state: &Path, file: &str, contents: &str) {
    std::fs::create_dir_all(state).unwrap();
    std::fs::write(state.join(file), contents).unwrap();
}

/// Asserts the device refused to start, before any hello, naming `file` and `words`.
fn refused(outcome: &Outcome, file: &str, words: &str) {
    let status = outcome.exit.unwrap_or_else(|| panic!("the device kept running: {}", outcome.stderr));
    assert!(!status.success(), "{}", outcome.stderr);
    assert_eq!(outcome.hellos, 0, "the device said hello first: {}", outcome.stderr);
    assert!(outcome.stderr.contains(file) && outcome.stderr.contains(words), "{}", outcome.stderr);
}

#[test]
fn damaged_device_state_stops_the_device_before_its_hello_with_the_file_named() {
    let dir = fedpo_tests::TestDir::new();
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();

    // The adapter this device trained is gone.
    let lost = dir.path().join("adapter-lost");
    write(&lost, "progress.json", r#"{"last_round":3,"reference_model":null,"run":7,"adapter_saved":true}"#);
    refused(&start(&url, &lost, &[]), "adapter.safetensors", "--reset-adapter");
    // On purpose, a fresh one: the device joins.
    let reset = start(&url, &lost, &["--reset-adapter"]);
    assert!(reset.exit.is_none() && reset.hellos > 0, "--reset-adapter lets the device join: {}", reset.stderr);
    assert!(reset.stderr.contains("a fresh one starts"), "{}", reset.stderr);

    // progress.json garbled, or at a round no job reaches.
    let garbled = dir.path().join("progress-garbled");
    write(&garbled, "progress.json", "{\"last_round\": 3, \"refer");
    refused(&start(&url, &garbled, &[]), "progress.json", "EOF");
    let far = dir.path().join("progress-far");
    write(&far, "progress.json", r#"{"last_round":1000000000000000000,"reference_model":null}"#);
    refused(&start(&url, &far, &[]), "progress.json", "beyond the highest round");

    // A reference cache garbled after the reference model has moved on.
    let reference = dir.path().join("reference-garbled");
    write(&reference, "progress.json", r#"{"last_round":2,"reference_model":"00ff","run":7}"#);
    write(&reference, "ref_train.json", "not a cache");
    refused(&start(&url, &reference, &[]), "ref_train.json", "cannot be rebuilt");
    assert_eq!(std::fs::read_to_string(reference.join("ref_train.json")).unwrap(), "not a cache", "left as it was");
}

/// Runs `fedpo-device` for dev-0 until it exits (its job finished), returning whether
/// it succeeded and its stderr.
fn run_to_the_end(url: &BrokerUrl, state: &Path) -> (bool, String) {
    let log = state.with_extension("log");
    let mut child = Command::new(binary("fedpo-device"))
        .args(["run", "--broker", &url.to_string(), "--job", JOB, "--id", "dev-0"])
        .args(["--synthetic-persona", "0", "--train-pairs", "4", "--heldout-pairs", "2", "--max-len", "48"])
        .arg("--state-dir")
        .arg(state)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(180);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("the device never finished: {}", std::fs::read_to_string(&log).unwrap());
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    (status.success(), std::fs::read_to_string(log).unwrap())
}

/// A one-device job of `rounds` rounds through `url`, in this process.
fn serve(
    url: &BrokerUrl,
    out: &Path,
    rounds: u32,
    resume: bool,
) -> std::thread::JoinHandle<Result<(), impl std::fmt::Debug>> {
    let mut args: Vec<String> = ["fedpo-aggregator", "serve", "--broker", &url.to_string(), "--job", JOB]
        .into_iter()
        .chain(["--freeze-embeddings", "--per-round", "1", "--min-devices", "1", "--batch-pairs", "4"])
        .chain(["--local-steps", "1", "--no-final-eval", "--round-deadline", "120"])
        .map(String::from)
        .collect();
    args.extend(["--rounds".to_string(), rounds.to_string(), "--out".into(), out.to_str().unwrap().into()]);
    if resume {
        args.push("--resume".into());
    }
    std::thread::spawn(move || fedpo_aggregator::run_cli(args))
}

fn reference_logps(state: &Path) -> serde_json::Value {
    let cache: serde_json::Value =
        serde_json::from_slice(&std::fs::read(state.join("ref_train.json")).unwrap()).unwrap();
    cache["logps"].clone()
}

#[test]
fn a_garbled_reference_cache_is_rebuilt_from_the_kept_reference_model_to_the_same_values() {
    let dir = fedpo_tests::TestDir::new();
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let (state, out) = (dir.path().join("device"), dir.path().join("aggregator"));

    // Two rounds: the reference comes from round 1's model, round 2 moves on.
    let job = serve(&url, &out, 2, false);
    let (ok, log) = run_to_the_end(&url, &state);
    assert!(ok, "{log}");
    job.join().unwrap().unwrap();
    assert!(state.join("reference-model.bin").exists(), "the reference model was not kept");
    let original = reference_logps(&state);

    // The cache garbled; the job goes on for a third round, from a model that is not the
    // reference: the device rebuilds the cache from the model it kept.
    std::fs::write(state.join("ref_train.json"), "not a cache").unwrap();
    let job = serve(&url, &out, 3, true);
    let (ok, log) = run_to_the_end(&url, &state);
    assert!(ok, "{log}");
    job.join().unwrap().unwrap();
    assert!(log.contains("rebuilds them from the kept reference model"), "{log}");
    assert_eq!(reference_logps(&state), original, "the rebuilt reference log-probs differ");
    let records = common::metrics_records(&out);
    assert_eq!(records.last().unwrap()["participants"], serde_json::json!(["dev-0"]));

    // Without the kept model the device refuses, before its hello.
    std::fs::write(state.join("ref_train.json"), "not a cache").unwrap();
    std::fs::remove_file(state.join("reference-model.bin")).unwrap();
    refused(&start(&url, &state, &[]), "ref_train.json", "reference-model.bin does not hold it");
}
