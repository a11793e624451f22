//! Signed plans: devices that pin the aggregator's public key train on its plans, and a
//! device pinned to another key refuses every plan, so the round closes without it, and
//! every result, so the end of the job does not end it either.

mod common;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use candle_core::Device;
use fedpo_data::synthetic::{generate_device, SyntheticSpec};
use fedpo_device::participant::{self, ParticipantConfig};
use fedpo_transport::EmbeddedBroker;
use fedpo_wire::TrustedKey;

#[test]
fn devices_train_only_on_plans_signed_by_the_key_they_pin() {
    let dir = fedpo_tests::TestDir::new();
    let (key, public) = common::signing_key(&dir.path().join("aggregator-keys"));
    let (_, stranger) = common::signing_key(&dir.path().join("other-keys"));
    assert_ne!(public, stranger);

    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let out = dir.path().join("aggregator");
    let aggregator = {
        let extra = [
            "--rounds",
            "1",
            "--local-steps",
            "1",
            "--no-final-eval",
            "--round-deadline",
            "20",
            "--signing-key",
            key.to_str().unwrap(),
        ];
        let args = common::serve_args(&url, "signed", &out, &extra);
        std::thread::spawn(move || fedpo_aggregator::run_cli(args))
    };
    let spec = SyntheticSpec { heterogeneity: 1.0, train_pairs: 4, heldout_pairs: 4, seed: 0 };
    let stop = Arc::new(AtomicBool::new(false));
    let devices: Vec<_> = [("dev-0", &public), ("dev-1", &public), ("dev-2", &stranger)]
        .into_iter()
        .enumerate()
        .map(|(k, (id, pinned))| {
            let data = generate_device(&spec, k).unwrap();
            let cfg = ParticipantConfig {
                vocab: None,
                broker: url.clone(),
                tls: Default::default(),
                job: "signed".into(),
                id: id.into(),
                state_dir: dir.path().join(id),
                train: data.train,
                heldout: data.heldout,
                max_len: 48,
                compute: Device::Cpu,
                max_memory_mib: None,
                max_micro_batch_pairs: None,
                start_on_disk: false,
                compute_dtype: candle_core::DType::F32,
                trusted_key: Some(TrustedKey::parse(pinned).unwrap()),
                rejoin: false,
                reset_adapter: false,
                alone_in_process: false,
                training_slots: None,
                rewrite_update: None,
                stop: if pinned == &stranger { stop.clone() } else { Arc::new(AtomicBool::new(false)) },
            };
            std::thread::spawn(move || participant::run(cfg).expect("device leaves when the job ends"))
        })
        .collect();
    aggregator.join().unwrap().expect("the aggregator finishes the job");
    let mut devices = devices.into_iter();
    for d in devices.by_ref().take(2) {
        d.join().unwrap();
    }
    let misled = devices.next().unwrap();
    std::thread::sleep(std::time::Duration::from_secs(1));
    assert!(!misled.is_finished(), "dev-2 took the end of the job from a result its key did not sign");
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    misled.join().unwrap();

    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let round: serde_json::Value = serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
    assert_eq!(round["selected"], serde_json::json!(["dev-0", "dev-1", "dev-2"]));
    assert_eq!(round["participants"], serde_json::json!(["dev-0", "dev-1"]), "dev-2 refused the plan");
    assert!(dir.path().join("dev-0/adapter.safetensors").exists());
    assert!(!dir.path().join("dev-2/adapter.safetensors").exists(), "dev-2 never trained");
}
