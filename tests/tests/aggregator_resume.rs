//! An aggregator killed mid-job and restarted with `--resume` carries on at the right
//! round with the same global model, counting no update twice.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{binary, decode_rounds, Wiretap};
use fedpo_data::synthetic::{generate_device, SyntheticSpec};
use fedpo_device::participant;
use fedpo_transport::EmbeddedBroker;

fn spawn_aggregator(url: &str, out: &std::path::Path, resume: bool, extra: &[&str]) -> Child {
    let mut cmd = Command::new(binary("fedpo-aggregator"));
    cmd.args(["serve", "--broker", url, "--job", "resume", "--freeze-embeddings", "--rounds", "3"])
        .args(["--per-round", "3", "--min-devices", "3", "--local-steps", "1", "--batch-pairs", "4", "--out"])
        .arg(out)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(out.with_extension(if resume { "resumed.log" } else { "log" })).unwrap());
    if resume {
        cmd.arg("--resume");
    }
    cmd.spawn().unwrap()
}

fn metric_rounds(out: &std::path::Path) -> Vec<u64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["round"].as_u64().unwrap())
        .collect()
}

/// Three devices of job `resume`, state under `dir`, until `stop` is set.
fn start_devices(
    url: &fedpo_transport::BrokerUrl,
    dir: &std::path::Path,
    stop: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<Result<participant::ParticipantSummary, participant::ParticipantError>>> {
    let spec = SyntheticSpec { heterogeneity: 1.0, train_pairs: 8, heldout_pairs: 4, seed: 0 };
    (0..3)
        .map(|k| {
            let data = generate_device(&spec, k).unwrap();
            let id = format!("dev-{k}");
            let mut cfg = common::participant_config(url, "resume", &id, dir.join(&id), (data.train, data.heldout), 64);
            cfg.stop = stop.clone();
            std::thread::spawn(move || participant::run(cfg))
        })
        .collect()
}

/// Kills the aggregator once round 1 is in its metrics.
fn kill_after_round_one(aggregator: &mut Child, out: &std::path::Path) {
    let deadline = Instant::now() + Duration::from_secs(300);
    while metric_rounds(out).is_empty() {
        assert!(Instant::now() < deadline, "round 1 never finished");
        assert!(aggregator.try_wait().unwrap().is_none(), "the aggregator exited early");
        std::thread::sleep(Duration::from_millis(20));
    }
    aggregator.kill().unwrap();
    aggregator.wait().unwrap();
}

#[test]
fn aggregator_restarted_with_resume_continues_at_the_next_round_from_the_checkpointed_model() {
    let dir = fedpo_tests::TestDir::new();
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let tap = Wiretap::start(&url, "fedpo/resume/#");
    let out = dir.path().join("aggregator");
    std::fs::create_dir_all(&out).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let devices = start_devices(&url, dir.path(), &stop);

    let mut first = spawn_aggregator(&url.to_string(), &out, false, &[]);
    kill_after_round_one(&mut first, &out);
    let heard_before_restart = tap.heard().len();
    let state: serde_cbor::Value =
        serde_cbor::from_slice(&std::fs::read(out.join("checkpoint/state.cbor")).unwrap()).unwrap();
    let field = |name: &str| match &state {
        serde_cbor::Value::Map(m) => m[&serde_cbor::Value::Text(name.into())].clone(),
        _ => panic!("state is a map"),
    };
    let serde_cbor::Value::Integer(checkpoint_round) = field("round") else { panic!("round") };
    let serde_cbor::Value::Text(checkpoint_digest) = field("global_digest") else { panic!("digest") };
    let checkpoint_round = checkpoint_round as u64;

    let mut second = spawn_aggregator(&url.to_string(), &out, true, &[]);
    assert!(second.wait().unwrap().success(), "the resumed aggregator finishes the job");
    for d in devices {
        d.join().unwrap().expect("devices run to the end of the job");
    }
    stop.store(true, Ordering::SeqCst);
    let heard = tap.stop();

    let rounds = metric_rounds(&out);
    let expected: Vec<u64> = (1..=checkpoint_round).chain(checkpoint_round + 1..=4).collect();
    assert_eq!(rounds, expected, "every round recorded once, the closing evaluation as round 4");
    let after_restart = decode_rounds(&heard[heard_before_restart..]);
    let (&first_round, resumed) = after_restart.iter().next().expect("the resumed aggregator planned a round");
    assert_eq!(first_round, checkpoint_round + 1, "resumed at the round after the checkpoint");
    let plan = &resumed.plans[0];
    assert_eq!(hex::encode(&plan.global_model.digest), checkpoint_digest, "resumed from the checkpointed model");
    let records = common::metrics_records(&out);
    let resumed_record = records.iter().find(|r| r["round"] == first_round).unwrap();
    assert_eq!(resumed_record["participants"].as_array().unwrap().len(), 3, "{resumed_record}");
    let summary: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["rounds"], 3);

    // Across the restart, each round's new model (the next plan's) is exactly the
    // pair-weighted mean of that round's updates, each counted once.
    let all = decode_rounds(&heard);
    for r in 1..=3u64 {
        let this = &all[&r];
        assert_eq!(this.updates.len(), 3, "round {r}: every device's update heard");
        let updates: Vec<_> = this.updates.values().collect();
        let next = all[&(r + 1)].global.as_ref().expect("the next round's model on the wire");
        let worst = common::gap_from_weighted_mean(this.global.as_ref().unwrap(), &updates, |name| {
            common::tensor_values(next, name)
        });
        assert!(worst <= 1e-6, "round {r}: the model differs from the updates' mean by {worst:e}");
    }
}

#[test]
fn a_resumed_aggregator_goes_on_sending_deltas_against_the_model_devices_hold() {
    let dir = fedpo_tests::TestDir::new();
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let tap = Wiretap::start(&url, "fedpo/resume/down");
    let out = dir.path().join("aggregator");
    std::fs::create_dir_all(&out).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let devices = start_devices(&url, dir.path(), &stop);
    let downlink = ["--downlink-codec", "int8"];
    let mut first = spawn_aggregator(&url.to_string(), &out, false, &downlink);
    kill_after_round_one(&mut first, &out);
    let heard_before_restart = tap.heard().len();
    let mut second = spawn_aggregator(&url.to_string(), &out, true, &downlink);
    assert!(second.wait().unwrap().success(), "the resumed aggregator finishes the job");
    for d in devices {
        d.join().unwrap().expect("devices run to the end of the job");
    }
    stop.store(true, Ordering::SeqCst);
    let heard = tap.stop();

    let resumed = decode_rounds(&heard[heard_before_restart..]);
    let (round, first_resumed) = resumed.iter().next().expect("the resumed aggregator planned a round");
    assert!(
        first_resumed.plans[0].downlink.is_some(),
        "round {round}: the devices hold the checkpointed public model, so deltas go on"
    );
    for r in common::metrics_records(&out) {
        assert_eq!(r["participants"].as_array().unwrap().len(), 3, "every device took part in round {}", r["round"]);
    }
}
