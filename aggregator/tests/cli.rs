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
