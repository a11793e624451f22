//! Update announcements made to hurt the aggregator, each from a device it selected: a
//! chunk count that would cost memory no byte justifies, a size the shared set does not
//! account for, metrics that are no measurement, and a pair count beyond the device's
//! hello. The first three are refused before a byte of them is stored, the last is
//! counted as the hello declared, and the round closes with the honest updates. And finite
//! updates that would sum past f32's range, which are dropped with their round.

mod common;

use candle_core::Device;
use common::fake_device::FakeDevice;
use fedpo_model::tensor_files::read_safetensors;
use fedpo_transport::EmbeddedBroker;
use fedpo_wire::DEFAULT_CHUNK_BYTES;

const JOB: &str = "hostile";

#[test]
fn chunk_bombs_oversized_updates_and_non_finite_metrics_are_refused_before_anything_is_stored() {
    let dir = fedpo_tests::TestDir::new();
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let out = dir.path().join("aggregator");
    let aggregator = {
        let args = ["fedpo-aggregator", "serve", "--broker", &url.to_string(), "--job", JOB, "--out"]
            .map(String::from)
            .into_iter()
            .chain([out.display().to_string()])
            .chain(
                [
                    "--freeze-embeddings",
                    "--per-round",
                    "5",
                    "--min-devices",
                    "5",
                    "--batch-pairs",
                    "4",
                    "--rounds",
                    "1",
                ]
                .map(String::from),
            )
            .chain(["--local-steps", "1", "--no-final-eval", "--round-deadline", "120"].map(String::from))
            .collect::<Vec<_>>();
        std::thread::spawn(move || fedpo_aggregator::run_cli(args))
    };
    // Every fake says hello until the plan that selects it arrives.
    let [(a, plan), (b, _), (bomb, _), (huge, _), (nan, _)] =
        FakeDevice::join_all(&url, JOB, ["dev-a", "dev-b", "dev-c", "dev-d", "dev-e"]);

    // Two honest updates in flight fill the aggregator's memory slots, so that what comes
    // next would be spooled to disk.
    let (ua, chunks_a) = a.prepare(&plan, 1, 0.0);
    let (mut ub, chunks_b) = b.prepare(&plan, 1, 1.0);
    ub.pairs = u64::MAX; // its hello said 4
    ub.metrics.grad_norm = 3.0;
    a.publish(ua, Vec::new());
    b.publish(ub, Vec::new());
    assert!(a.flush() && b.flush());
    std::thread::sleep(std::time::Duration::from_secs(1));

    let (mut u, _) = bomb.prepare(&plan, 1, 0.5);
    u.update.chunks = u32::MAX;
    bomb.publish(u, Vec::new());
    let (mut u, _) = huge.prepare(&plan, 1, 0.5);
    u.update.bytes = (2 << 30) - 1;
    u.update.chunks = u.update.bytes.div_ceil(DEFAULT_CHUNK_BYTES as u64) as u32;
    huge.publish(u, Vec::new());
    let (mut u, chunks) = nan.prepare(&plan, 1, 0.5);
    u.metrics.reward_acc = f64::NAN;
    nan.publish(u, chunks);
    assert!(bomb.flush() && huge.flush() && nan.flush());

    a.publish_chunks(chunks_a);
    b.publish_chunks(chunks_b);
    let started = std::time::Instant::now();
    aggregator.join().unwrap().expect("the aggregator finishes the job");
    assert!(started.elapsed().as_secs() < 60, "the round waited {:?} for refused devices", started.elapsed());

    let record = &common::metrics_records(&out)[0];
    assert_eq!(record["participants"], serde_json::json!(["dev-a", "dev-b"]), "{record}");
    let rejected = &record["rejected"];
    let reason =
        |id: &str| rejected[id].as_str().unwrap_or_else(|| panic!("{id} is not rejected: {record}")).to_string();
    assert!(reason("dev-c").contains("chunks"), "{}", reason("dev-c"));
    assert!(reason("dev-d").contains("more than the shared set takes"), "{}", reason("dev-d"));
    assert!(reason("dev-e").contains("reward_acc"), "{}", reason("dev-e"));
    // dev-b weighs its declared 4 pairs, as dev-a does: (4 · 1 + 4 · 3) / 8.
    assert_eq!(record["device_grad_norm"].as_f64().unwrap(), 2.0, "{record}");
    let spool = out.join("spool");
    assert!(!spool.exists() || spool.read_dir().unwrap().next().is_none(), "nothing is left spooled");
}

/// Finite updates whose sum leaves f32's range: every value f32::MAX from every device, two
/// rounds running. The first round's model is still finite; the second would be Inf
/// everywhere, and is dropped so that the model devices receive, and the checkpoint
/// `--resume` reads, stay finite.
#[test]
fn updates_that_would_overflow_the_global_model_are_dropped_and_the_model_stays_finite() {
    let dir = fedpo_tests::TestDir::new();
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let out = dir.path().join("aggregator");
    let aggregator = {
        let args =
            common::serve_args(&url, "overflow", &out, &["--rounds", "2", "--no-final-eval", "--round-deadline", "60"]);
        std::thread::spawn(move || fedpo_aggregator::run_cli(args))
    };
    let devices = FakeDevice::join_all(&url, "overflow", ["dev-a", "dev-b", "dev-c"]);
    for (device, plan) in &devices {
        device.send(plan, 1, f32::MAX, false);
    }
    for (device, _) in &devices {
        let plan = device.plan();
        assert_eq!(plan.round, 2);
        device.send(&plan, 2, f32::MAX, false);
    }
    aggregator.join().unwrap().expect("the aggregator finishes the job");

    let records = common::metrics_records(&out);
    assert!(records[0].get("unchanged").is_none(), "round 1 stays finite: {}", records[0]);
    let why = records[1]["unchanged"].as_str().unwrap_or_else(|| panic!("round 2 is not dropped: {}", records[1]));
    assert!(why.contains("not finite"), "{why}");
    assert_eq!(records[1]["update_norm"], 0.0);
    let checkpoint = read_safetensors(&out.join("checkpoint/global.safetensors"), &Device::Cpu).unwrap();
    for (name, t) in &checkpoint.tensors.tensors {
        let values: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        assert!(values.iter().all(|v| v.is_finite()), "`{name}` in the checkpoint is not finite");
    }
}
