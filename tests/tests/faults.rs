//! Fault scenarios at the aggregator, each checked against the aggregate of the updates it
//! accepted: duplicated QoS 1 deliveries count once, an update holding NaN is refused, an
//! update that arrives for an old round changes nothing, and a corrupted chunk (hash
//! mismatch) keeps its update out.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use candle_core::Device;
use common::fake_device::FakeDevice;
use common::{decode_rounds, tensor_values, Wiretap};
use fedpo_data::synthetic::{generate_device, SyntheticSpec};
use fedpo_model::tensor_files::read_safetensors;
use fedpo_transport::{BrokerUrl, EmbeddedBroker, LinkEvent, LinkOptions, MqttLink, Topics};
use fedpo_wire::TensorPayload;

const JOB: &str = "faults";
const FAKE: &str = "dev-x";

/// Publishes every message a device sends a second time, as a broker's QoS 1 redelivery
/// would.
fn duplicate_everything_from(url: &BrokerUrl, device: &str) -> std::thread::JoinHandle<()> {
    let link = MqttLink::connect(url, &LinkOptions::new("duplicator")).unwrap();
    let topic = Topics::new(JOB).unwrap().up(device);
    link.subscribe(&topic).unwrap();
    std::thread::spawn(move || {
        let mut seen = HashSet::new();
        let quiet_since = Instant::now();
        let mut last = quiet_since;
        while last.elapsed() < Duration::from_secs(60) {
            if let Ok(Some(LinkEvent::Message(d))) = link.recv_timeout(Duration::from_millis(100)) {
                last = Instant::now();
                if seen.insert(d.payload.clone()) {
                    link.publish(&topic, d.payload.to_vec()).unwrap();
                }
            }
        }
    })
}

#[test]
fn duplicates_count_once_and_nan_late_or_corrupted_updates_change_nothing() {
    let dir = fedpo_tests::TestDir::new();
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let tap = Wiretap::start(&url, "fedpo/#");
    let _duplicator = duplicate_everything_from(&url, "dev-0");
    let out = dir.path().join("aggregator");
    let aggregator = {
        let extra = ["--rounds", "2", "--local-steps", "1", "--no-final-eval", "--round-deadline", "15"];
        let args = common::serve_args(&url, JOB, &out, &extra);
        std::thread::spawn(move || fedpo_aggregator::run_cli(args))
    };
    let fake = FakeDevice::join(&url, JOB, FAKE);
    let spec = SyntheticSpec { heterogeneity: 1.0, train_pairs: 6, heldout_pairs: 4, seed: 0 };
    let shards = (0..2)
        .map(|k| {
            let mut d = generate_device(&spec, k).unwrap();
            d.train.truncate(if k == 0 { 4 } else { 6 }); // unequal pair weights
            (d.train, d.heldout)
        })
        .collect();
    let devices = common::start_devices(&url, JOB, dir.path(), shards, 48);

    let round1 = fake.plan();
    fake.send(&round1, 1, f32::NAN, false);
    let round2 = fake.plan();
    assert_eq!(round2.round, 2);
    fake.send(&round2, 1, 0.25, false); // late: stamped for round 1, sent during round 2
    fake.send(&round2, 2, 0.25, true); // this round's, with a corrupted chunk
    aggregator.join().unwrap().expect("the aggregator finishes the job");
    devices.into_iter().for_each(|d| d.join().unwrap());

    let records = common::metrics_records(&out);
    let r1 = &records[0];
    assert_eq!(r1["participants"], serde_json::json!(["dev-0", "dev-1"]));
    let reason = r1["rejected"][FAKE].as_str().expect("the NaN update is recorded as rejected");
    assert!(reason.contains("non-finite") || reason.contains("NaN"), "{reason}");
    assert_eq!(records[1]["participants"], serde_json::json!(["dev-0", "dev-1"]), "neither fake update counted");
    let reason = records[1]["rejected"][FAKE].as_str().expect("the corrupted transfer is recorded as rejected");
    assert!(reason.contains("digest mismatch"), "{reason}");

    // Each new global model is the pair-weighted mean of dev-0's and dev-1's (global +
    // delta), each counted once, recomputed from the wire in f64.
    let heard = tap.stop();
    let duplicated = heard.iter().filter(|d| d.topic.ends_with("/up/dev-0")).count();
    let distinct: HashSet<&fedpo_wire::Bytes> =
        heard.iter().filter(|d| d.topic.ends_with("/up/dev-0")).map(|d| &d.payload).collect();
    assert!(
        duplicated >= 2 * distinct.len() - 1,
        "dev-0's messages were delivered twice ({duplicated} of {})",
        distinct.len()
    );
    let rounds = decode_rounds(&heard);
    let checkpoint = read_safetensors(&out.join("checkpoint/global.safetensors"), &Device::Cpu).unwrap();
    for r in 1..=2u64 {
        let this = &rounds[&r];
        let global = this.global.as_ref().expect("the round's model on the wire");
        let real: BTreeMap<&str, &(u64, TensorPayload)> =
            this.updates.iter().filter(|(d, _)| d.as_str() != FAKE).map(|(d, u)| (d.as_str(), u)).collect();
        assert_eq!(real.keys().copied().collect::<Vec<_>>(), ["dev-0", "dev-1"]);
        let updates: Vec<&(u64, TensorPayload)> = real.values().copied().collect();
        let worst = common::gap_from_weighted_mean(global, &updates, |name| {
            if r == 2 {
                checkpoint.tensors.tensors[name].flatten_all().unwrap().to_vec1().unwrap()
            } else {
                tensor_values(rounds[&2].global.as_ref().unwrap(), name)
            }
        });
        assert!(worst <= 1e-6, "round {r}: the global model differs from the accepted updates' mean by {worst:e}");
    }
}
