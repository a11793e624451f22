//! The aggregator killed (SIGKILL) in the middle of round 2, after its devices have sent
//! their updates, and restarted with `--resume`: it publishes the round's plan and model
//! again, and every device resends its update while that model is still reaching it.
//! Each client's uploads and deliveries travel on separate connections, so neither side
//! of the broker waits on the other: the resumed round counts every resent update, and
//! closes in seconds rather than at its deadline.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::binary;
use common::fake_device::FakeDevice;
use fedpo_data::synthetic::{generate_device, SyntheticSpec};
use fedpo_device::participant;
use fedpo_transport::{BrokerUrl, EmbeddedBroker};

const JOB: &str = "midround";

fn spawn_aggregator(url: &BrokerUrl, out: &std::path::Path, resume: bool) -> Child {
    let mut cmd = Command::new(binary("fedpo-aggregator"));
    cmd.args(["serve", "--broker", &url.to_string(), "--job", JOB, "--freeze-embeddings", "--rounds", "2"])
        .args(["--per-round", "4", "--min-devices", "4", "--local-steps", "1", "--batch-pairs", "4"])
        .args(["--no-final-eval", "--round-deadline", "120", "--out"])
        .arg(out)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(out.with_extension(if resume { "resumed.log" } else { "log" })).unwrap());
    if resume {
        cmd.arg("--resume");
    }
    cmd.spawn().unwrap()
}

#[test]
fn updates_resent_to_a_resumed_aggregator_while_the_model_goes_out_again_all_count() {
    let dir = fedpo_tests::TestDir::new();
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let out = dir.path().join("aggregator");
    std::fs::create_dir_all(&out).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let spec = SyntheticSpec { heterogeneity: 1.0, train_pairs: 4, heldout_pairs: 2, seed: 0 };
    let devices: Vec<_> = (0..3)
        .map(|k| {
            let data = generate_device(&spec, k).unwrap();
            let id = format!("dev-{k}");
            let mut cfg =
                common::participant_config(&url, JOB, &id, dir.path().join(&id), (data.train, data.heldout), 48);
            cfg.stop = stop.clone();
            std::thread::spawn(move || participant::run(cfg))
        })
        .collect();
    // The fourth device reports round 1 at once, then holds round 2 open until the test
    // lets it report.
    let straggler = {
        let url = url.clone();
        std::thread::spawn(move || {
            let device = FakeDevice::join(&url, JOB, "dev-3");
            let plan = device.plan();
            device.send(&plan, 1, 0.0, false);
            let plan = device.plan();
            assert_eq!(plan.round, 2);
            device
        })
    };

    let mut first = spawn_aggregator(&url, &out, false);
    let deadline = Instant::now() + Duration::from_secs(300);
    let uploaded = |k: usize| {
        std::fs::read(dir.path().join(format!("dev-{k}/progress.json")))
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .is_some_and(|p| p["last_round"] == 2)
    };
    while !(0..3).all(uploaded) {
        assert!(Instant::now() < deadline, "the devices never sent round 2's updates");
        assert!(first.try_wait().unwrap().is_none(), "the aggregator exited early");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_secs(2)); // the chunks reach it
    first.kill().unwrap();
    first.wait().unwrap();
    let straggler = straggler.join().unwrap();

    let resumed_at = Instant::now();
    let mut resumed = spawn_aggregator(&url, &out, true);
    let plan = straggler.plan();
    assert_eq!(plan.round, 2, "the resumed aggregator plans round 2 again");
    straggler.send(&plan, 2, 0.0, false);
    let status = loop {
        if let Some(status) = resumed.try_wait().unwrap() {
            break status;
        }
        if resumed_at.elapsed() > Duration::from_secs(150) {
            resumed.kill().unwrap();
            panic!("the resumed round never closed");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "the resumed aggregator finishes the job");
    stop.store(true, Ordering::SeqCst);
    for d in devices {
        d.join().unwrap().expect("the devices run to the end of the job");
    }

    let records = common::metrics_records(&out);
    let record = records.iter().find(|r| r["round"] == 2).expect("round 2 recorded");
    assert_eq!(record["participants"], serde_json::json!(["dev-0", "dev-1", "dev-2", "dev-3"]), "{record}");
    let seconds = record["seconds"].as_f64().unwrap();
    assert!(seconds < 30.0, "the resumed round took {seconds:.0} s: resent updates stalled");
}
