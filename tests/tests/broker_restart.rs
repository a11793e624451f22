//! The broker restarts mid-round: Mosquitto is killed (SIGKILL, no persistence, so every
//! session and every message in flight is gone) after the round's plan is out and the
//! first update is on its way, and comes back on the same port a second later. Every
//! client reconnects; the round completes with every device's update, none lost and none
//! counted twice, and each new global model is exactly the pair-weighted mean of the
//! updates.
//!
//! The fleet reaches the broker through a gated proxy and the wiretap connects directly,
//! so the test can hold the fleet off until the tap has subscribed again: whatever a
//! device resends after the restart is then heard and checked.

mod common;

use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::Device;
use common::gated_proxy::GatedProxy;
use common::{decode_rounds, tensor_values, Wiretap};
use fedpo_data::synthetic::{generate_device, SyntheticSpec};
use fedpo_model::tensor_files::read_safetensors;
use fedpo_transport::{BrokerUrl, LinkOptions, MqttLink};
use fedpo_wire::{Limits, Message, TensorPayload};

const JOB: &str = "restart";
/// Published by the test itself to learn that the tap hears the restarted broker.
const PROBE_TOPIC: &str = "fedpo/probe";

/// A plain Mosquitto on a loopback port, without persistence.
fn start_mosquitto(dir: &Path, port: u16) -> Child {
    let conf = dir.join("mosquitto.conf");
    std::fs::write(&conf, format!("listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nuser root\n"))
        .unwrap();
    let child = Command::new(common::mosquitto_binary())
        .arg("-c")
        .arg(&conf)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("mosquitto starts");
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "mosquitto did not listen on {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

#[test]
fn a_broker_restarted_mid_round_loses_no_update_and_the_model_is_the_mean_of_them() {
    let dir = fedpo_tests::TestDir::new();
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut broker = start_mosquitto(dir.path(), port);
    let direct = BrokerUrl::parse(&format!("mqtt://127.0.0.1:{port}")).unwrap();
    let proxy = GatedProxy::start(port);
    let url = BrokerUrl::parse(&format!("mqtt://127.0.0.1:{}", proxy.port())).unwrap();
    let tap = Wiretap::start(&direct, "fedpo/#");
    let out = dir.path().join("aggregator");
    let aggregator = {
        let extra = ["--rounds", "2", "--local-steps", "1", "--no-final-eval", "--round-deadline", "300"];
        let args = common::serve_args(&url, JOB, &out, &extra);
        std::thread::spawn(move || fedpo_aggregator::run_cli(args))
    };
    let spec = SyntheticSpec { heterogeneity: 1.0, train_pairs: 6, heldout_pairs: 4, seed: 0 };
    let shards = (0..3)
        .map(|k| {
            let mut d = generate_device(&spec, k).unwrap();
            d.train.truncate(4 + k);
            (d.train, d.heldout)
        })
        .collect();
    let devices = common::start_devices(&url, JOB, dir.path(), shards, 48);

    let deadline = Instant::now() + Duration::from_secs(240);
    while !tap
        .heard()
        .iter()
        .any(|d| matches!(Message::decode(&d.payload, &Limits::default()), Ok(Message::Update(u)) if u.round == 1))
    {
        assert!(Instant::now() < deadline, "no round-1 update was announced");
        std::thread::sleep(Duration::from_millis(20));
    }
    proxy.close();
    broker.kill().unwrap();
    broker.wait().unwrap();
    let restarted_at = Instant::now();
    std::thread::sleep(Duration::from_secs(1));
    let mut broker = start_mosquitto(dir.path(), port);
    wait_until_the_tap_hears_the_broker(&direct, &tap);
    proxy.open();

    aggregator.join().unwrap().expect("the aggregator finishes the job");
    let finished_after = restarted_at.elapsed();
    devices.into_iter().for_each(|d| d.join().unwrap());
    let heard: Vec<_> = tap.stop().into_iter().filter(|d| d.topic != PROBE_TOPIC).collect();
    broker.kill().unwrap();
    let _ = broker.wait();

    let records = common::metrics_records(&out);
    for r in &records {
        assert_eq!(r["participants"], serde_json::json!(["dev-0", "dev-1", "dev-2"]), "round {}", r["round"]);
    }
    assert!(finished_after < Duration::from_secs(120), "the job took {finished_after:?} after the restart");

    let rounds = decode_rounds(&heard);
    let checkpoint = read_safetensors(&out.join("checkpoint/global.safetensors"), &Device::Cpu).unwrap();
    for r in 1..=2u64 {
        let this = &rounds[&r];
        let updates: Vec<&(u64, TensorPayload)> =
            ["dev-0", "dev-1", "dev-2"].iter().map(|d| &this.updates[*d]).collect();
        let worst = common::gap_from_weighted_mean(this.global.as_ref().unwrap(), &updates, |name| {
            if r == 2 {
                checkpoint.tensors.tensors[name].flatten_all().unwrap().to_vec1().unwrap()
            } else {
                tensor_values(rounds[&2].global.as_ref().unwrap(), name)
            }
        });
        assert!(worst <= 1e-6, "round {r}: the model differs from the updates' mean by {worst:e}");
    }
}

/// Publishes probes directly to the broker until the tap hears one: it has reconnected
/// and subscribed again.
fn wait_until_the_tap_hears_the_broker(direct: &BrokerUrl, tap: &Wiretap) {
    let probe = MqttLink::connect(direct, &LinkOptions::new("probe")).expect("the probe connects");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !tap.heard().iter().any(|d| d.topic == PROBE_TOPIC) {
        assert!(Instant::now() < deadline, "the wiretap did not come back after the restart");
        probe.publish(PROBE_TOPIC, b"probe".to_vec()).unwrap();
        std::thread::sleep(Duration::from_millis(200));
    }
    probe.close(Duration::from_millis(100));
}
