//! Client-side terms and diagnostics through real MQTT rounds: the gradient diversity of
//! identical devices is zero, SCAFFOLD's and FedGA's tensors travel as named plan and
//! update sections, and the diagnostics land in metrics.jsonl.

mod common;

use std::path::Path;

use common::{decode_rounds, Wiretap};
use fedpo_data::synthetic::{generate_device, SyntheticSpec};
use fedpo_transport::{BrokerUrl, EmbeddedBroker};
use fedpo_wire::{keys, Message};

/// Three devices; `same_data` gives all of them device 0's pairs.
fn start_devices(url: &BrokerUrl, job: &str, dir: &Path, same_data: bool) -> Vec<std::thread::JoinHandle<()>> {
    // Four pairs, the batch size serve_args sets: every step sees all of a device's pairs.
    let spec = SyntheticSpec { heterogeneity: 1.0, train_pairs: 4, heldout_pairs: 4, seed: 0 };
    let shards = (0..3)
        .map(|k| {
            let data = generate_device(&spec, if same_data { 0 } else { k }).unwrap();
            (data.train, data.heldout)
        })
        .collect();
    common::start_devices(url, job, dir, shards, 48)
}

/// Runs a 3-device job and returns its metrics records and what the wire carried.
fn run_job(
    job: &str,
    dir: &Path,
    same_data: bool,
    extra: &[&str],
) -> (Vec<serde_json::Value>, Vec<fedpo_transport::Delivery>) {
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let tap = Wiretap::start(&url, "fedpo/#");
    let out = dir.join("aggregator");
    let args = common::serve_args(&url, job, &out, extra);
    let aggregator = std::thread::spawn(move || fedpo_aggregator::run_cli(args));
    let devices = start_devices(&url, job, dir, same_data);
    aggregator.join().unwrap().expect("the aggregator finishes the job");
    devices.into_iter().for_each(|d| d.join().unwrap());
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let records = metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    (records, tap.stop())
}

#[test]
fn identical_devices_have_zero_gradient_diversity_and_aligned_updates() {
    let dir = fedpo_tests::TestDir::new();
    // pFedDPO's fresh adapters have B = 0, so they do not change the model: with the same
    // pairs, every device's gradient and first step are the same.
    let extra = ["--method", "pfeddpo", "--rounds", "1", "--local-steps", "1", "--diagnostics", "--no-final-eval"];
    let (records, heard) = run_job("same", dir.path(), true, &extra);
    let r = &records[0];
    let grad_norm = r["grad_norm"].as_f64().unwrap();
    let kappa2 = r["kappa2"].as_f64().unwrap();
    assert!(grad_norm > 1e-3, "a zero gradient would make κ² = 0 trivially: {grad_norm}");
    assert!(kappa2 <= 1e-10 * grad_norm * grad_norm, "κ² = {kappa2} with |g| = {grad_norm}");
    // The devices are threads of this process: none reports the process's peak as its own.
    assert!(r.get("peak_rss_mib").is_none(), "{r}");
    let layer_cos = r["layer_cos"].as_object().unwrap();
    assert!(layer_cos.len() > 5, "{layer_cos:?}");
    for (layer, cos) in layer_cos {
        assert!((cos.as_f64().unwrap() - 1.0).abs() < 1e-6, "{layer}: {cos}");
    }
    // The diagnostic gradients crossed the wire as their own section and were counted.
    let diagnostic_bytes = r["diagnostics_bytes"].as_u64().unwrap();
    assert!(diagnostic_bytes > 0 && diagnostic_bytes < r["bytes_up"].as_u64().unwrap());
    let sections: Vec<String> = heard
        .iter()
        .filter_map(|d| match Message::decode(&d.payload, &Default::default()) {
            Ok(Message::Update(u)) => Some(u.sections.keys().cloned().collect::<Vec<_>>()),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(sections, vec![keys::DIAGNOSTIC_GRADIENT.to_string(); 3]);
}

#[test]
fn scaffold_and_fedga_send_their_tensors_as_named_sections_and_diverse_devices_have_positive_kappa2() {
    let dir = fedpo_tests::TestDir::new();
    let common = ["--method", "pfeddpo", "--rounds", "2", "--local-steps", "2", "--diagnostics", "--no-final-eval"];
    let scaffold = [&common[..], &["--client-term", "scaffold"]].concat();
    let (records, heard) = run_job("scaffold", &dir.path().join("scaffold"), false, &scaffold);
    assert!(records.iter().all(|r| r["kappa2"].as_f64().unwrap() > 0.0), "different personas disagree");
    let rounds = decode_rounds(&heard);
    for r in 1..=2u64 {
        let plan = &rounds[&r].plans[0];
        assert_eq!(plan.strategy.get(keys::SCAFFOLD), Some(&1.0));
        assert!(plan.sections.contains_key(keys::SCAFFOLD_CONTROL), "round {r}: {:?}", plan.sections.keys());
    }
    for k in 0..3 {
        let control = dir.path().join(format!("scaffold/dev-{k}/scaffold_control.safetensors"));
        assert!(control.exists(), "{} was not saved", control.display());
    }
    let update_sections: Vec<Vec<String>> = heard
        .iter()
        .filter_map(|d| match Message::decode(&d.payload, &Default::default()) {
            Ok(Message::Update(u)) => Some(u.sections.keys().cloned().collect()),
            _ => None,
        })
        .collect();
    assert_eq!(update_sections.len(), 6);
    assert!(update_sections.iter().all(|s| s == &[keys::DIAGNOSTIC_GRADIENT, keys::SCAFFOLD_CONTROL_DELTA]));

    let fedga = [
        &common[..],
        &["--client-term", "fedga", "--fedga-granularity", "layer", "--fedga-layer-weights", "h.*.mlp=0.5"],
    ]
    .concat();
    let (records, heard) = run_job("fedga", &dir.path().join("fedga"), false, &fedga);
    assert_eq!(records.len(), 2);
    assert!(records.iter().all(|r| r["participants"].as_array().unwrap().len() == 3), "every device trained");
    let rounds = decode_rounds(&heard);
    assert!(rounds[&1].plans[0].sections.is_empty(), "no reference before the first global step");
    let plan = &rounds[&2].plans[0];
    assert!(plan.sections.contains_key(keys::FEDGA_REFERENCE));
    assert_eq!(plan.strategy.get("fedga.w.h.0.mlp"), Some(&0.5));
    assert_eq!(plan.strategy.get(keys::FEDGA_LAYER), Some(&1.0));
}
