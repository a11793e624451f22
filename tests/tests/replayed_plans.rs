//! An attacker who can publish on the job's down topic replays what the aggregator signed
//! in an earlier run of the same job: a plan for a later round with its model, and the
//! result that finished that run; and forges an unsigned `finished` result for the current
//! run. Devices that pin the aggregator's key follow the run they joined: they neither
//! train on the old run's model nor leave, and the current run's next round counts all of
//! them.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::fake_device::FakeDevice;
use common::Wiretap;
use fedpo_data::synthetic::{generate_device, SyntheticSpec};
use fedpo_device::participant;
use fedpo_transport::{BrokerUrl, Delivery, EmbeddedBroker, LinkOptions, MqttLink, Topics};
use fedpo_wire::{Limits, Message, RoundResult, TrustedKey};

const JOB: &str = "replayed";

fn serve(url: &BrokerUrl, out: &Path, key: &Path, extra: &[&str]) -> JoinHandle<Result<(), impl std::fmt::Debug>> {
    let mut extra: Vec<&str> = extra.to_vec();
    extra.extend(["--local-steps", "1", "--no-final-eval", "--round-deadline", "60", "--signing-key"]);
    extra.push(key.to_str().unwrap());
    let args = common::serve_args(url, JOB, out, &extra);
    std::thread::spawn(move || fedpo_aggregator::run_cli(args))
}

/// The job's three devices, pinned to `public`, state under `dir`.
fn start_devices(url: &BrokerUrl, dir: &Path, public: &str, stop: &Arc<AtomicBool>) -> Vec<JoinHandle<()>> {
    let spec = SyntheticSpec { heterogeneity: 1.0, train_pairs: 4, heldout_pairs: 2, seed: 0 };
    (0..3)
        .map(|k| {
            let data = generate_device(&spec, k).unwrap();
            let id = format!("dev-{k}");
            let mut cfg = common::participant_config(url, JOB, &id, dir.join(&id), (data.train, data.heldout), 48);
            cfg.trusted_key = Some(TrustedKey::parse(public).unwrap());
            cfg.stop = stop.clone();
            std::thread::spawn(move || {
                participant::run(cfg).expect("the device runs until the job ends");
            })
        })
        .collect()
}

/// The run a checkpoint's state names.
fn checkpoint_run(out: &Path) -> u64 {
    let state: serde_cbor::Value =
        serde_cbor::from_slice(&std::fs::read(out.join("checkpoint/state.cbor")).unwrap()).unwrap();
    let serde_cbor::Value::Map(fields) = state else { panic!("the state is a map") };
    let serde_cbor::Value::Integer(run) = fields[&serde_cbor::Value::Text("run".into())] else { panic!("run") };
    run as u64
}

#[test]
fn plans_and_results_replayed_from_an_earlier_run_or_forged_unsigned_are_refused_by_pinned_devices() {
    let dir = fedpo_tests::TestDir::new();
    let (key, public) = common::signing_key(&dir.path().join("keys"));
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let down = Topics::new(JOB).unwrap().down();

    // Run 1, recorded: three rounds with stand-in devices.
    let tap = Wiretap::start(&url, &down);
    let first_out = dir.path().join("first-run");
    let first = serve(&url, &first_out, &key, &["--rounds", "3"]);
    let fakes = FakeDevice::join_all(&url, JOB, ["dev-0", "dev-1", "dev-2"]);
    for (fake, plan) in &fakes {
        fake.send(plan, 1, 0.0, false);
    }
    for round in 2..=3 {
        for (fake, _) in &fakes {
            let plan = fake.plan();
            assert_eq!(plan.round, round);
            fake.send(&plan, round, 0.0, false);
        }
    }
    first.join().unwrap().expect("run 1 finishes");
    drop(fakes);
    let recorded = tap.stop();
    let decoded = |d: &Delivery| Message::decode(&d.payload, &Limits::default()).unwrap();
    let from = recorded.iter().position(|d| matches!(decoded(d), Message::Plan(p) if p.round == 3)).unwrap();
    let replay: Vec<Delivery> = recorded[from..].to_vec();
    assert!(replay.iter().any(|d| matches!(decoded(d), Message::Result(r) if r.finished)), "run 1's end recorded");

    // Run 2, round 1: the real devices join it.
    let out = dir.path().join("second-run");
    let stop = Arc::new(AtomicBool::new(false));
    let second = serve(&url, &out, &key, &["--rounds", "1"]);
    for d in start_devices(&url, dir.path(), &public, &stop) {
        d.join().unwrap();
    }
    second.join().unwrap().expect("run 2's first round finishes");
    let run = checkpoint_run(&out);

    // The devices come back, and before the aggregator does, the attacker speaks.
    let hellos = Wiretap::start(&url, &Topics::new(JOB).unwrap().up_all());
    let devices = start_devices(&url, dir.path(), &public, &stop);
    let deadline = Instant::now() + Duration::from_secs(60);
    while hellos.heard().len() < 3 {
        assert!(Instant::now() < deadline, "the devices never said hello");
        std::thread::sleep(Duration::from_millis(50));
    }
    let attacker = MqttLink::connect(&url, &LinkOptions::new("attacker")).unwrap();
    for d in &replay {
        attacker.publish(&down, d.payload.to_vec()).unwrap();
    }
    let forged = RoundResult { round: 1, finished: true, job: JOB.into(), run, ..RoundResult::default() };
    attacker.publish(&down, Message::Result(forged).encode()).unwrap();
    assert!(attacker.flush(Duration::from_secs(30)));
    std::thread::sleep(Duration::from_secs(2));

    // Run 2 resumes for its second round.
    let resumed = serve(&url, &out, &key, &["--rounds", "2", "--resume"]);
    let deadline = Instant::now() + Duration::from_secs(120);
    while !resumed.is_finished() {
        assert!(Instant::now() < deadline, "run 2's second round never closed");
        std::thread::sleep(Duration::from_millis(100));
    }
    resumed.join().unwrap().expect("run 2 finishes");
    stop.store(true, Ordering::SeqCst);
    for d in devices {
        d.join().unwrap();
    }
    drop(hellos);

    let records = common::metrics_records(&out);
    let second_round = records.iter().find(|r| r["round"] == 2).expect("round 2 recorded");
    assert_eq!(
        second_round["participants"],
        serde_json::json!(["dev-0", "dev-1", "dev-2"]),
        "every device stayed in run 2: {second_round}"
    );
    assert!(
        second_round["seconds"].as_f64().unwrap() < 55.0,
        "the round did not wait out its deadline: {second_round}"
    );
    for k in 0..3 {
        let progress: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.path().join(format!("dev-{k}/progress.json"))).unwrap()).unwrap();
        assert_eq!(progress["last_round"], 2, "dev-{k} trained run 2's rounds only: {progress}");
        assert_eq!(progress["run"], run, "dev-{k} follows run 2");
    }
}
