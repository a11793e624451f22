//! Update codecs through a real job: devices encode their update as the plan asks, the
//! uplink shrinks by what the codec promises, and each new global model is exactly the
//! pair-weighted mean of the updates as decoded from the wire. A top-k device keeps what
//! it did not send in its state directory; an update in another encoding than the plan's
//! is refused.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::Device;
use common::fake_device::FakeDevice;
use common::{decode_rounds, tensor_values, RoundOnWire, Wiretap};
use fedpo_data::synthetic::{generate_device, SyntheticSpec};
use fedpo_model::tensor_files::read_safetensors;
use fedpo_transport::EmbeddedBroker;
use fedpo_wire::{TensorPayload, WireDType};

const JOB: &str = "codecs";

struct Job {
    records: Vec<serde_json::Value>,
    rounds: BTreeMap<u64, RoundOnWire>,
    out: std::path::PathBuf,
}

/// A `rounds`-round job of `devices` real devices (plus, with `fake`, a device that
/// uploads f32 whatever the plan says) under `--update-codec codec`.
fn run(dir: &Path, codec: &str, rounds: u64, devices: usize, fake: bool) -> Job {
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let tap = Wiretap::start(&url, "fedpo/#");
    let out = dir.join("aggregator");
    let rounds_arg = rounds.to_string();
    // The whole model down every round: the test reads each round's model off the wire.
    let extra = [
        "--rounds",
        &rounds_arg,
        "--local-steps",
        "1",
        "--no-final-eval",
        "--update-codec",
        codec,
        "--downlink-codec",
        "full",
    ];
    let args = common::serve_args(&url, JOB, &out, &extra);
    let aggregator = std::thread::spawn(move || fedpo_aggregator::run_cli(args));
    let fake = fake.then(|| FakeDevice::join(&url, JOB, "dev-x"));
    let spec = SyntheticSpec { heterogeneity: 1.0, train_pairs: 6, heldout_pairs: 4, seed: 0 };
    let shards = (0..devices)
        .map(|k| {
            let mut d = generate_device(&spec, k).unwrap();
            d.train.truncate(4 + k); // unequal pair weights
            (d.train, d.heldout)
        })
        .collect();
    let handles = common::start_devices(&url, JOB, dir, shards, 48);
    if let Some(fake) = &fake {
        let plan = fake.plan();
        fake.send(&plan, plan.round, 0.01, false);
    }
    aggregator.join().unwrap().expect("the aggregator finishes the job");
    handles.into_iter().for_each(|d| d.join().unwrap());
    let records = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    Job { records, rounds: decode_rounds(&tap.stop()), out }
}

/// The largest gap between each round's new model and the pair-weighted mean of its
/// updates as decoded from the wire.
fn worst_gap_from_decoded_mean(job: &Job) -> f64 {
    let last = *job.rounds.keys().max().unwrap();
    let checkpoint = read_safetensors(&job.out.join("checkpoint/global.safetensors"), &Device::Cpu).unwrap();
    (1..=last)
        .map(|r| {
            let this = &job.rounds[&r];
            let updates: Vec<_> = this.updates.values().collect();
            common::gap_from_weighted_mean(this.global.as_ref().unwrap(), &updates, |name| {
                if r == last {
                    checkpoint.tensors.tensors[name].flatten_all().unwrap().to_vec1().unwrap()
                } else {
                    tensor_values(job.rounds[&(r + 1)].global.as_ref().unwrap(), name)
                }
            })
        })
        .fold(0.0, f64::max)
}

fn dtypes(p: &TensorPayload) -> Vec<WireDType> {
    p.tensors.iter().map(|t| t.dtype()).collect()
}

fn device_bytes(record: &serde_json::Value, device: &str) -> f64 {
    record["bytes_up_by_device"][device].as_f64().unwrap_or_else(|| panic!("bytes_up_by_device of {device}"))
}

#[test]
fn int8_updates_take_about_a_quarter_of_the_f32_bytes_and_the_model_is_their_decoded_mean() {
    let (f32_dir, int8_dir) = (fedpo_tests::TestDir::new(), fedpo_tests::TestDir::new());
    let plain = run(f32_dir.path(), "f32", 2, 3, false);
    let int8 = run(int8_dir.path(), "int8", 2, 3, false);

    for (device, (_, update)) in &int8.rounds[&1].updates {
        assert!(dtypes(update).iter().all(|d| *d == WireDType::Int8), "{device}: {:?}", dtypes(update));
    }
    for device in ["dev-0", "dev-1", "dev-2"] {
        let ratio = device_bytes(&int8.records[0], device) / device_bytes(&plain.records[0], device);
        // 1 byte a value plus a 4-byte scale per 64 values is 0.266 of f32; CBOR framing
        // adds a little.
        assert!((0.26..0.30).contains(&ratio), "{device}: int8 takes {ratio:.3} of the f32 bytes");
    }
    // Round 1 trains from the same model on the same pairs, so the two mean updates differ
    // only by int8's rounding.
    let norm = |job: &Job| job.records[0]["update_norm"].as_f64().unwrap();
    let relative = (norm(&int8) - norm(&plain)).abs() / norm(&plain);
    assert!(norm(&plain) > 0.0 && relative < 0.01, "update norms {} vs {}", norm(&int8), norm(&plain));
    let gap = worst_gap_from_decoded_mean(&int8);
    assert!(gap <= 1e-6, "the model differs from the decoded updates' mean by {gap:e}");
}

#[test]
fn top_k_devices_send_their_largest_entries_and_keep_the_rest_for_later_rounds() {
    let dir = fedpo_tests::TestDir::new();
    let job = run(dir.path(), "topk:0.05", 3, 3, false);

    let shared = job.rounds[&1].global.as_ref().unwrap();
    for (r, round) in &job.rounds {
        for (device, (_, update)) in &round.updates {
            for t in &update.tensors {
                assert_eq!(t.dtype(), WireDType::Sparse, "round {r}, {device}, `{}`", t.name());
                let kept = (0.05 * t.len() as f64).ceil() as usize;
                assert_eq!(t.data().len(), 8 * kept, "round {r}, {device}, `{}` of {} values", t.name(), t.len());
            }
        }
    }
    // Eight bytes per kept entry, about a tenth of the f32 update.
    let dense_f32: f64 = job.rounds[&1].updates["dev-0"].1.tensors.iter().map(|t| 4.0 * t.len() as f64).sum();
    for device in ["dev-0", "dev-1", "dev-2"] {
        let ratio = device_bytes(&job.records[0], device) / dense_f32;
        assert!((0.09..0.12).contains(&ratio), "{device}: top-5 % takes {ratio:.3} of the f32 bytes");
    }
    let gap = worst_gap_from_decoded_mean(&job);
    assert!(gap <= 1e-6, "the model differs from the decoded updates' mean by {gap:e}");

    for device in ["dev-0", "dev-1", "dev-2"] {
        let state = dir.path().join(device);
        assert!(!state.join("residual.next.safetensors").exists(), "{device}: a staged residual was left behind");
        let residual = read_safetensors(&state.join("residual.safetensors"), &Device::Cpu).unwrap();
        assert_eq!(residual.metadata["round"], "3", "{device}: the residual is owed after the last round");
        let mut owed = 0.0f64;
        for t in &job.rounds[&3].updates[device].1.tensors {
            let values: Vec<f32> = residual.tensors.tensors[t.name()].flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(values.len(), tensor_values(shared, t.name()).len(), "{device}: `{}`", t.name());
            owed += values.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>();
        }
        assert!(owed > 0.0, "{device}: top-5 % left nothing owed");
    }
}

#[test]
fn an_update_encoded_otherwise_than_the_plan_asks_is_refused_by_name() {
    let dir = fedpo_tests::TestDir::new();
    let mut job = run(dir.path(), "bf16", 1, 2, true);
    let reason = job.records[0]["rejected"]["dev-x"].as_str().expect("the f32 update was refused");
    assert!(reason.contains("is f32") && reason.contains("asks for bf16"), "{reason}");
    assert_eq!(job.records[0]["participants"], serde_json::json!(["dev-0", "dev-1"]));
    job.rounds.values_mut().for_each(|w| {
        w.updates.remove("dev-x");
    });
    let gap = worst_gap_from_decoded_mean(&job);
    assert!(gap <= 1e-6, "the model differs from the accepted updates' mean by {gap:e}");
}
