//! Two devices claim the same id: two processes start with one `--id` (a copied
//! configuration). Their hellos carry different instance numbers and, as the broker hands
//! the MQTT session back and forth between them, alternate. The aggregator leaves that id
//! out of the job; the rounds run with the other devices, and each new global model is
//! exactly the pair-weighted mean of their updates.

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use candle_core::Device;
use common::{decode_rounds, tensor_values, Wiretap};
use fedpo_data::synthetic::{generate_device, SyntheticSpec};
use fedpo_device::participant;
use fedpo_model::tensor_files::read_safetensors;
use fedpo_transport::EmbeddedBroker;
use fedpo_wire::{Limits, Message, TensorPayload};

const JOB: &str = "dup";
const TWIN: &str = "dev-2";

#[test]
fn two_devices_claiming_one_id_are_left_out_and_the_rounds_run_with_the_rest() {
    let dir = fedpo_tests::TestDir::new();
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let tap = Wiretap::start(&url, "fedpo/#");
    let out = dir.path().join("aggregator");
    let aggregator = {
        let mut args: Vec<String> = ["fedpo-aggregator", "serve", "--broker", &url.to_string(), "--job", JOB]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.extend(
            ["--freeze-embeddings", "--min-devices", "2", "--per-round", "3", "--batch-pairs", "4", "--rounds", "2"]
                .iter()
                .map(|s| s.to_string()),
        );
        args.extend(["--local-steps", "1", "--no-final-eval", "--out"].iter().map(|s| s.to_string()));
        args.push(out.to_str().unwrap().to_string());
        std::thread::spawn(move || fedpo_aggregator::run_cli(args))
    };
    let spec = SyntheticSpec { heterogeneity: 1.0, train_pairs: 6, heldout_pairs: 4, seed: 0 };
    let shard = |k| {
        let d = generate_device(&spec, k).unwrap();
        (d.train, d.heldout)
    };

    // The twins first. Once the aggregator listens (it opens metrics.jsonl just before it
    // subscribes), let their hellos alternate ten times before the other devices join, so
    // that the aggregator has found the shared id before it selects anyone.
    let twins: Vec<_> = ["a", "b"]
        .iter()
        .map(|copy| {
            let cfg = common::participant_config(&url, JOB, TWIN, dir.path().join(copy), shard(2), 48);
            let stop = cfg.stop.clone();
            (std::thread::spawn(move || participant::run(cfg)), stop)
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !out.join("metrics.jsonl").exists() {
        assert!(Instant::now() < deadline, "the aggregator never started");
        std::thread::sleep(Duration::from_millis(50));
    }
    let listening_from = tap.heard().len();
    loop {
        let instances: Vec<u64> = tap.heard()[listening_from..]
            .iter()
            .filter_map(|d| match Message::decode(&d.payload, &Limits::default()) {
                Ok(Message::Hello(h)) if h.device == TWIN => Some(h.instance),
                _ => None,
            })
            .collect();
        if instances.windows(2).filter(|w| w[0] != w[1]).count() >= 10 {
            break;
        }
        assert!(Instant::now() < deadline, "the twins' hellos never alternated: {instances:x?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let devices = common::start_devices(&url, JOB, dir.path(), vec![shard(0), shard(1)], 48);
    aggregator.join().unwrap().expect("the aggregator finishes the job");
    devices.into_iter().for_each(|d| d.join().unwrap());
    for (handle, stop) in twins {
        stop.store(true, Ordering::SeqCst);
        let _ = handle.join().unwrap();
    }

    let records = common::metrics_records(&out);
    assert_eq!(records.len(), 2);
    for r in &records {
        assert_eq!(r["selected"], serde_json::json!(["dev-0", "dev-1"]), "round {}", r["round"]);
        assert_eq!(r["participants"], serde_json::json!(["dev-0", "dev-1"]), "round {}", r["round"]);
    }

    let rounds = decode_rounds(&tap.stop());
    let checkpoint = read_safetensors(&out.join("checkpoint/global.safetensors"), &Device::Cpu).unwrap();
    for r in 1..=2u64 {
        let this = &rounds[&r];
        assert!(!this.updates.contains_key(TWIN), "round {r}: a twin uploaded");
        let updates: Vec<&(u64, TensorPayload)> = ["dev-0", "dev-1"].iter().map(|d| &this.updates[*d]).collect();
        let worst = common::gap_from_weighted_mean(this.global.as_ref().unwrap(), &updates, |name| {
            if r == 2 {
                checkpoint.tensors.tensors[name].flatten_all().unwrap().to_vec1().unwrap()
            } else {
                tensor_values(rounds[&2].global.as_ref().unwrap(), name)
            }
        });
        assert!(worst <= 1e-6, "round {r}: the model differs from dev-0's and dev-1's mean by {worst:e}");
    }
}
