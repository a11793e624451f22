//! The aggregator's command line refuses impossible settings with a message naming them.

use std::process::Command;

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fedpo-aggregator")).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn quorum_above_participation_is_refused_before_anything_starts() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, err) = run(&[
        "serve",
        "--embedded-broker",
        "127.0.0.1:0",
        "--per-round",
        "2",
        "--quorum",
        "3",
        "--out",
        dir.path().to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(err.contains("--quorum 3") && err.contains("--per-round 2"), "{err}");
}

#[test]
fn serve_without_a_broker_says_which_flags_give_one() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, err) = run(&["serve", "--out", dir.path().to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("--broker") && err.contains("--embedded-broker"), "{err}");
}

#[test]
fn bad_broker_url_is_named_in_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, err) = run(&["serve", "--broker", "http://x", "--out", dir.path().to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("http://x") && err.contains("mqtt://"), "{err}");
}

#[test]
fn existing_checkpoint_is_not_overwritten_without_resume() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("checkpoint")).unwrap();
    std::fs::write(dir.path().join("checkpoint/state.cbor"), b"x").unwrap();
    let (ok, err) = run(&["serve", "--embedded-broker", "127.0.0.1:0", "--out", dir.path().to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("--resume"), "{err}");
}

/// Every simulated device refuses the job under a budget too small for the tiny model:
/// the simulation fails at once with their reason, instead of waiting out
/// --register-timeout for devices that will not come back.
#[test]
fn a_fleet_that_cannot_fit_its_budget_ends_the_simulation_with_the_devices_reason() {
    let dir = tempfile::tempdir().unwrap();
    let started = std::time::Instant::now();
    let (ok, err) = run(&[
        "simulate",
        "--devices",
        "2",
        "--rounds",
        "2",
        "--model",
        "tiny",
        "--train-pairs",
        "8",
        "--heldout-pairs",
        "4",
        "--device-max-memory",
        "40",
        "--out",
        dir.path().to_str().unwrap(),
    ]);
    assert!(!ok, "the simulation cannot succeed");
    assert!(err.contains("all 2 devices left the job"), "{err}");
    assert!(err.contains("dev-0, dev-1") && err.contains("--max-memory 40 MiB cannot hold"), "{err}");
    assert!(started.elapsed().as_secs() < 120, "it waited {:?} for devices that had left", started.elapsed());
}

#[test]
fn simulate_refuses_a_zero_memory_budget_or_micro_batch() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().to_str().unwrap();
    for flag in ["--device-max-memory", "--micro-batch-pairs"] {
        let (ok, err) = run(&["simulate", flag, "0", "--out", out]);
        assert!(!ok && err.contains(flag) && err.contains('0'), "{flag}: {err}");
    }
}

/// A failure is one plain line naming the flag and its limit: no backtrace even where
/// `RUST_BACKTRACE` is set for panics, no colour codes in a redirected stream.
#[test]
fn zero_rounds_are_refused_in_one_plain_line_even_with_rust_backtrace_set() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_fedpo-aggregator"))
        .args(["simulate", "--rounds", "0", "--out", dir.path().to_str().unwrap()])
        .env("RUST_BACKTRACE", "1")
        .env_remove("RUST_LIB_BACKTRACE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.starts_with("error: --rounds must be at least 1"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(!dir.path().join("metrics.jsonl").exists(), "nothing ran");
}

/// The demo's output: the round table and the final table on stdout, and on stderr
/// nothing at all when all goes well (no info lines, no warning about a plan key the
/// simulation itself controls, no broker errors for devices hanging up). `-v` adds the
/// rounds' events, as plain text when stderr is not a terminal.
#[test]
fn a_simulation_prints_its_tables_and_logs_nothing_else_unless_asked() {
    let dir = tempfile::tempdir().unwrap();
    let simulate = |out: &str, extra: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_fedpo-aggregator"));
        cmd.args(["simulate", "--devices", "2", "--rounds", "2", "--per-round", "2", "--local-steps", "1"])
            .args(["--model", "tiny", "--train-pairs", "8", "--heldout-pairs", "4", "--max-len", "64", "--out", out])
            .args(extra)
            .env_remove("RUST_LOG")
            .env_remove("NO_COLOR");
        let output = cmd.output().unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        (String::from_utf8(output.stdout).unwrap(), String::from_utf8(output.stderr).unwrap())
    };

    let (stdout, stderr) = simulate(dir.path().join("quiet").to_str().unwrap(), &[]);
    for line in ["round   1/2  devices 2/2", "round   2/2  devices 2/2", "final eval  devices 2/2", "mean "] {
        assert!(stdout.contains(line), "stdout lacks `{line}`:\n{stdout}");
    }
    assert_eq!(stderr, "", "a quiet run logs nothing");

    let (_, verbose) = simulate(dir.path().join("verbose").to_str().unwrap(), &["-v"]);
    assert!(verbose.contains(" INFO ") && verbose.contains("update accepted"), "{verbose}");
    assert!(!verbose.contains('\u{1b}'), "colour codes in a redirected log:\n{verbose}");
    assert!(!verbose.contains("ERROR") && !verbose.contains("trust"), "{verbose}");
}

#[test]
fn an_embedded_broker_without_logins_is_refused_beyond_loopback_with_the_fix_named() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, err) = run(&["serve", "--embedded-broker", "0.0.0.0:0", "--out", dir.path().to_str().unwrap()]);
    assert!(!ok);
    assert!(err.contains("loopback only") && err.contains("--broker-passwords FILE"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}
