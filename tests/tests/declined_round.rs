//! A selected device whose round fails says so, and the aggregator closes the round on
//! the updates it has instead of waiting out the round's deadline.

mod common;

use std::time::{Duration, Instant};

use common::fake_device::FakeDevice;
use fedpo_transport::EmbeddedBroker;

const JOB: &str = "declined";

#[test]
fn a_declined_round_closes_without_waiting_for_its_deadline() {
    let dir = fedpo_tests::TestDir::new();
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let out = dir.path().join("aggregator");
    let started = Instant::now();
    let aggregator = {
        let extra = ["--rounds", "2", "--local-steps", "1", "--no-final-eval", "--round-deadline", "300"];
        let args = common::serve_args(&url, JOB, &out, &extra);
        std::thread::spawn(move || fedpo_aggregator::run_cli(args))
    };
    // Each device waits for its own plans (saying hello meanwhile), as real ones do.
    let device = |id: &'static str, fails: bool| {
        let url = url.clone();
        std::thread::spawn(move || {
            let fake = FakeDevice::join(&url, JOB, id);
            for round in 1..=2 {
                let plan = fake.plan();
                assert_eq!(plan.round, round);
                if fails {
                    fake.decline(&plan, "training: non-finite loss at step 1");
                } else {
                    fake.send(&plan, round, 0.5, false);
                }
            }
            assert!(fake.flush());
        })
    };
    let devices = [device("dev-a", false), device("dev-b", false), device("dev-nan", true)];
    devices.into_iter().for_each(|d| d.join().unwrap());
    aggregator.join().unwrap().expect("the aggregator finishes the job");
    let took = started.elapsed();
    assert!(took < Duration::from_secs(120), "two rounds took {took:?}: the aggregator waited for a deadline");

    let records = common::metrics_records(&out);
    assert_eq!(records.len(), 2);
    for r in &records {
        assert_eq!(r["participants"], serde_json::json!(["dev-a", "dev-b"]), "round {}", r["round"]);
        let reason = r["rejected"]["dev-nan"].as_str().expect("the decline is in the round's record");
        assert!(reason.contains("declined") && reason.contains("non-finite loss"), "{reason}");
    }
}
