//! A fleet of real MQTT devices and a real aggregator over the embedded broker.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use candle_core::Device;
use common::{decode_rounds, tensor_values, Wiretap};
use fedpo_data::synthetic::{generate_device, SyntheticSpec};
use fedpo_model::tensor_files::read_safetensors;
use fedpo_transport::{BrokerUrl, EmbeddedBroker};

/// Training pairs per device: different, so that pair weighting matters.
const PAIRS: [usize; 3] = [6, 10, 16];

fn start_devices(url: &BrokerUrl, job: &str, dir: &Path) -> Vec<std::thread::JoinHandle<()>> {
    let spec = SyntheticSpec { heterogeneity: 1.0, train_pairs: 16, heldout_pairs: 4, seed: 0 };
    let shards = (0..PAIRS.len())
        .map(|k| {
            let mut data = generate_device(&spec, k).unwrap();
            data.train.truncate(PAIRS[k]);
            (data.train, data.heldout)
        })
        .collect();
    common::start_devices(url, job, dir, shards, 64)
}

/// Little-endian bytes of every pair of adjacent non-zero values of a tensor.
fn value_pairs(values: &[f32]) -> impl Iterator<Item = u64> + '_ {
    values.windows(2).filter(|w| w[0] != 0.0 && w[1] != 0.0).map(|w| {
        let mut b = [0u8; 8];
        b[..4].copy_from_slice(&w[0].to_le_bytes());
        b[4..].copy_from_slice(&w[1].to_le_bytes());
        u64::from_le_bytes(b)
    })
}

/// Whether any 8-byte window of `haystack` is in `needles`.
fn contains_any(haystack: &[u8], needles: &HashSet<u64>) -> bool {
    haystack.windows(8).any(|w| needles.contains(&u64::from_le_bytes(w.try_into().unwrap())))
}

#[test]
fn fleet_over_the_embedded_broker_averages_by_pairs_and_never_sends_an_adapter() {
    let dir = fedpo_tests::TestDir::new();
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let tap = Wiretap::start(&url, "fedpo/#");
    let out = dir.path().join("aggregator");
    let aggregator = {
        let args = common::serve_args(
            &url,
            "fleet",
            &out,
            &["--method", "pfeddpo", "--rounds", "2", "--local-steps", "2", "--lr", "0.1"],
        );
        std::thread::spawn(move || fedpo_aggregator::run_cli(args))
    };
    let devices = start_devices(&url, "fleet", dir.path());
    aggregator.join().unwrap().expect("the aggregator finishes the job");
    for d in devices {
        d.join().unwrap();
    }
    let heard = tap.stop();
    let rounds = decode_rounds(&heard);

    // 1. Each new global model is the pair-weighted mean of the devices' shared tensors
    //    (received global + their delta), recomputed here in f64 from what crossed the wire.
    let checkpoint = read_safetensors(&out.join("checkpoint/global.safetensors"), &Device::Cpu).unwrap();
    for r in 1..=2u64 {
        let this = &rounds[&r];
        let global = this.global.as_ref().expect("global model on the wire");
        assert_eq!(this.updates.len(), 3, "round {r}: every device's update was heard");
        let pairs: BTreeMap<&str, u64> = this.updates.iter().map(|(d, (p, _))| (d.as_str(), *p)).collect();
        assert_eq!(pairs.values().copied().collect::<Vec<_>>(), PAIRS.map(|p| p as u64).to_vec());
        let next = rounds[&(r + 1)].global.as_ref().expect("next global model on the wire");
        let total: f64 = pairs.values().map(|&p| p as f64).sum();
        let shared: Vec<String> =
            this.updates.values().next().unwrap().1.tensors.iter().map(|t| t.name().into()).collect();
        assert!(shared.iter().all(|n| !n.starts_with("wte") && !n.starts_with("wpe")), "embeddings are frozen");
        let mut worst = 0.0f64;
        for name in &shared {
            let g = tensor_values(global, name);
            let mut expected = vec![0.0f64; g.len()];
            for (p, delta) in this.updates.values() {
                for ((e, gv), dv) in expected.iter_mut().zip(&g).zip(tensor_values(delta, name)) {
                    *e += *p as f64 * (f64::from(*gv) + f64::from(dv)) / total;
                }
            }
            let mut actual = tensor_values(next, name);
            if r == 2 {
                let saved = checkpoint.tensors.tensors[name.as_str()].flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert_eq!(saved, actual, "the checkpoint holds the model sent for the final evaluation");
                actual = saved;
            }
            for (e, a) in expected.iter().zip(&actual) {
                worst = worst.max((e - f64::from(*a)).abs());
            }
        }
        assert!(worst <= 1e-6, "round {r}: global model differs from the weighted mean by {worst:e}");
        assert!(shared.len() > 10, "the shared set is the transformer blocks ({} tensors)", shared.len());
    }

    // 2. No adapter tensor's bytes appear anywhere in the traffic, while the global
    //    model's do (so the tap really saw the payloads).
    let mut adapter_pairs = HashSet::new();
    for k in 0..PAIRS.len() {
        let adapter = read_safetensors(&dir.path().join(format!("dev-{k}/adapter.safetensors")), &Device::Cpu).unwrap();
        assert!(!adapter.tensors.tensors.is_empty());
        for t in adapter.tensors.tensors.values() {
            adapter_pairs.extend(value_pairs(&t.flatten_all().unwrap().to_vec1::<f32>().unwrap()));
        }
    }
    assert!(adapter_pairs.len() > 1000, "trained adapters have many distinct values");
    let all_bytes: Vec<u8> = heard.iter().flat_map(|d| d.payload.iter().copied()).collect();
    assert!(!contains_any(&all_bytes, &adapter_pairs), "adapter bytes crossed the wire");
    let ln = checkpoint.tensors.tensors["h.1.ln_2.weight"].to_vec1::<f32>().unwrap();
    assert!(contains_any(&all_bytes, &value_pairs(&ln).collect()), "the tap saw the global model");
    for r in rounds.values() {
        for p in &r.plans {
            assert!(p.global_model.tensors.iter().all(|t| !t.name.contains("lora")));
        }
        for (_, u) in r.updates.values() {
            assert!(u.tensors.iter().all(|t| !t.name().contains("lora")));
        }
    }
}
