//! Secure aggregation over MQTT. The same three devices train one round three times:
//! in clear, under secure aggregation, and under secure aggregation with a fourth device
//! that leaves after the key exchange and its shares. Both secure rounds give the plain
//! round's global model within the fixed-point rounding; on the wire every update is
//! masked words that, read as an update, have nothing to do with the device's real one;
//! and the round with the vanished device completes with the other three.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::Device;
use common::fake_device::FakeDevice;
use common::{decode_rounds, tensor_values, Wiretap};
use fedpo_data::synthetic::{generate_device, SyntheticSpec};
use fedpo_model::tensor_files::read_safetensors;
use fedpo_transport::EmbeddedBroker;
use fedpo_wire::{Limits, Message, SecAggPlan, TensorPayload, WireDType, MASKED_TENSOR};

const QUIT: &str = "dev-x";

struct Run {
    /// The shared tensors of the global model after round 1.
    model: BTreeMap<String, Vec<f32>>,
    /// Device → (pairs, the update payload heard on the wire).
    updates: BTreeMap<String, (u64, TensorPayload)>,
    secagg: Option<SecAggPlan>,
    record: serde_json::Value,
}

fn run(dir: &Path, job: &str, secure: bool, with_quitter: bool) -> Run {
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let tap = Wiretap::start(&url, "fedpo/#");
    let out = dir.join(job);
    let devices = if with_quitter { "4" } else { "3" };
    let mut args: Vec<String> = ["fedpo-aggregator", "serve", "--broker", &url.to_string(), "--job", job]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let flags = ["--freeze-embeddings", "--batch-pairs", "4", "--rounds", "1", "--local-steps", "1", "--no-final-eval"];
    args.extend(flags.iter().map(|s| s.to_string()));
    args.extend(["--per-round", devices, "--min-devices", devices, "--out"].iter().map(|s| s.to_string()));
    args.push(out.to_str().unwrap().to_string());
    if secure {
        args.push("--secure-aggregation".into());
    }
    let aggregator = std::thread::spawn(move || fedpo_aggregator::run_cli(args));
    let quitter = with_quitter.then(|| FakeDevice::join(&url, job, QUIT));
    let spec = SyntheticSpec { heterogeneity: 1.0, train_pairs: 6, heldout_pairs: 4, seed: 0 };
    let shards = (0..3)
        .map(|k| {
            let mut d = generate_device(&spec, k).unwrap();
            d.train.truncate(4 + k);
            (d.train, d.heldout)
        })
        .collect();
    let real = common::start_devices(&url, job, dir.join(format!("{job}-devices")).as_path(), shards, 48);
    if let Some(q) = &quitter {
        q.share_then_leave(&q.plan());
    }
    aggregator.join().unwrap().expect("the aggregator finishes the job");
    real.into_iter().for_each(|d| d.join().unwrap());

    let heard = tap.stop();
    let secagg = heard.iter().find_map(|d| match Message::decode(&d.payload, &Limits::default()) {
        Ok(Message::Plan(p)) => p.secagg,
        _ => None,
    });
    let round = decode_rounds(&heard).remove(&1).unwrap();
    let checkpoint = read_safetensors(&out.join("checkpoint/global.safetensors"), &Device::Cpu).unwrap();
    let model = checkpoint
        .tensors
        .tensors
        .iter()
        .map(|(name, t)| (name.clone(), t.flatten_all().unwrap().to_vec1().unwrap()))
        .collect();
    let record =
        serde_json::from_str(std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().next().unwrap())
            .unwrap();
    Run { model, updates: round.updates, secagg, record }
}

#[test]
fn secure_rounds_give_the_plain_mean_carry_only_masked_words_and_survive_a_device_leaving() {
    let dir = fedpo_tests::TestDir::new();
    let plain = run(dir.path(), "plain", false, false);
    let secure = run(dir.path(), "secure", true, false);
    let dropout = run(dir.path(), "dropout", true, true);
    assert!(plain.secagg.is_none());
    let devices = serde_json::json!(["dev-0", "dev-1", "dev-2"]);
    for r in [&plain, &secure, &dropout] {
        assert_eq!(r.record["participants"], devices, "{}", r.record);
    }
    assert_eq!(dropout.record["selected"], serde_json::json!(["dev-0", "dev-1", "dev-2", QUIT]));

    // The plain round's model, within the rounding of the fixed-point sum (each of the
    // n inputs rounds by half a step; the sum is divided by the pairs, 4 + 5 + 6) plus
    // f32 rounding of the model itself.
    let pairs = 15.0;
    for (name, run) in [("secure", &secure), ("dropout", &dropout)] {
        let fp = run.secagg.expect("secure plans carry the fixed point").fixed_point;
        let bound = 4.0 / (2.0 * fp.scale * pairs) + 1e-7;
        let mut worst = 0.0f64;
        for (tensor, values) in &plain.model {
            for (a, b) in values.iter().zip(&run.model[tensor]) {
                worst = worst.max(f64::from((a - b).abs()));
            }
        }
        assert!(worst <= bound, "{name}: the model differs from the plain round's by {worst:e} (bound {bound:e})");
    }

    // On the wire: one masked tensor per update, unrelated to the device's real delta.
    let fp = secure.secagg.unwrap().fixed_point;
    for (device, (pairs, payload)) in &secure.updates {
        let [t] = payload.tensors.as_slice() else { panic!("{device}: {} tensors", payload.tensors.len()) };
        assert_eq!((t.name(), t.dtype()), (MASKED_TENSOR, WireDType::U32), "{device}");
        let read_as_update: Vec<f64> = fp.decode(&t.words()).iter().map(|v| v / *pairs as f64).collect();
        let real_delta: Vec<f64> = plain.updates[device]
            .1
            .tensors
            .iter()
            .flat_map(|t| tensor_values(&plain.updates[device].1, t.name()))
            .map(f64::from)
            .collect();
        assert_eq!(read_as_update.len(), real_delta.len());
        let corr = correlation(&read_as_update, &real_delta);
        assert!(corr.abs() < 0.05, "{device}: the masked upload correlates with the real update ({corr})");
    }
}

fn correlation(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len() as f64;
    let (ma, mb) = (a.iter().sum::<f64>() / n, b.iter().sum::<f64>() / n);
    let cov: f64 = a.iter().zip(b).map(|(x, y)| (x - ma) * (y - mb)).sum();
    let va: f64 = a.iter().map(|x| (x - ma).powi(2)).sum();
    let vb: f64 = b.iter().map(|y| (y - mb).powi(2)).sum();
    cov / (va * vb).sqrt()
}

#[test]
fn secure_aggregation_refuses_rules_that_need_individual_updates() {
    let dir = fedpo_tests::TestDir::new();
    for (flags, needle) in [
        (&["--aggregation", "median", "--byzantine", "1"][..], "median needs every device's own update"),
        (&["--max-update-norm", "1"][..], "--max-update-norm"),
        (&["--diagnostics"][..], "--diagnostics"),
    ] {
        let mut args = vec!["fedpo-aggregator", "simulate", "--devices", "3", "--secure-aggregation", "--out"];
        let out = dir.path().join("refused");
        args.push(out.to_str().unwrap());
        args.extend(flags);
        let err = format!("{:#}", fedpo_aggregator::run_cli(args).unwrap_err());
        assert!(err.contains(needle) && err.contains("secure aggregation"), "{flags:?}: {err}");
        assert!(!out.join("metrics.jsonl").exists());
    }
}
