//! A device process killed mid-round: the round closes with the others, and the device
//! rejoins the next round with its adapter intact.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{binary, Wiretap};
use fedpo_transport::{BrokerUrl, EmbeddedBroker};
use fedpo_wire::{Limits, Message};

fn spawn_device(url: &BrokerUrl, k: usize, dir: &Path) -> Child {
    let id = format!("dev-{k}");
    Command::new(binary("fedpo-device"))
        .args(["run", "--broker", &url.to_string(), "--job", "kill", "--id", &id])
        .args(["--synthetic-persona", &k.to_string(), "--train-pairs", "8", "--heldout-pairs", "4", "--max-len", "64"])
        .arg("--state-dir")
        .arg(dir.join(&id))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join(format!("{id}.log"))).unwrap())
        .spawn()
        .unwrap()
}

/// Waits until the tap has heard a message matching `want`.
fn wait_for(tap: &Wiretap, within: Duration, what: &str, want: impl Fn(&Message) -> bool) {
    let deadline = Instant::now() + within;
    loop {
        let heard = tap.heard();
        if heard.iter().any(|d| Message::decode(&d.payload, &Limits::default()).is_ok_and(|m| want(&m))) {
            return;
        }
        assert!(Instant::now() < deadline, "never heard {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn killed_device_is_left_out_of_its_round_and_rejoins_the_next_with_its_adapter() {
    let dir = fedpo_tests::TestDir::new();
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let tap = Wiretap::start(&url, "fedpo/kill/#");
    let out = dir.path().join("aggregator");
    let aggregator = {
        let args =
            common::serve_args(&url, "kill", &out, &["--rounds", "3", "--local-steps", "1", "--round-deadline", "300"]);
        std::thread::spawn(move || fedpo_aggregator::run_cli(args))
    };
    let mut devices: Vec<Child> = (0..3).map(|k| spawn_device(&url, k, dir.path())).collect();

    wait_for(&tap, Duration::from_secs(300), "the round 2 plan", |m| matches!(m, Message::Plan(p) if p.round == 2));
    let adapter_path = dir.path().join("dev-2/adapter.safetensors");
    let adapter_before = std::fs::read(&adapter_path).expect("dev-2 saved its adapter in round 1");
    devices[2].kill().unwrap();
    devices[2].wait().unwrap();
    let killed_at = Instant::now();
    assert_eq!(std::fs::read(&adapter_path).unwrap(), adapter_before, "the kill left the adapter intact");

    wait_for(&tap, Duration::from_secs(300), "the round 2 result", |m| matches!(m, Message::Result(r) if r.round == 2));
    let round2_closed_after = killed_at.elapsed();
    devices[2] = spawn_device(&url, 2, dir.path());

    aggregator.join().unwrap().expect("the aggregator finishes the job");
    for (k, d) in devices.iter_mut().enumerate() {
        assert!(d.wait().unwrap().success(), "dev-{k} exits cleanly when the job ends");
    }

    let records = common::metrics_records(&out);
    let participants = |round: u64| -> Vec<String> {
        let r = records.iter().find(|r| r["round"] == round).unwrap_or_else(|| panic!("round {round} recorded"));
        serde_json::from_value(r["participants"].clone()).unwrap()
    };
    assert_eq!(participants(1), ["dev-0", "dev-1", "dev-2"]);
    assert_eq!(participants(2), ["dev-0", "dev-1"], "round 2 closed without the killed device");
    assert_eq!(participants(3), ["dev-0", "dev-1", "dev-2"], "the restarted device took part again");
    // Each device is a process of its own, so each reports its own peak memory.
    for r in records.iter().filter(|r| r["round"] == 1) {
        let peaks = r["peak_rss_mib"].as_object().unwrap_or_else(|| panic!("peaks recorded: {r}"));
        assert_eq!(peaks.keys().collect::<Vec<_>>(), ["dev-0", "dev-1", "dev-2"], "{r}");
        assert!(peaks.values().all(|v| v.as_f64().unwrap() > 10.0), "{peaks:?}");
    }
    assert!(
        round2_closed_after < Duration::from_secs(120),
        "round 2 closed {round2_closed_after:?} after the kill, well before its 300 s deadline"
    );
    let progress: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("dev-2/progress.json")).unwrap()).unwrap();
    assert!(progress["last_round"].as_u64().unwrap() >= 3, "{progress}");
    assert_ne!(std::fs::read(&adapter_path).unwrap(), adapter_before, "round 3 trained the kept adapter further");
}
