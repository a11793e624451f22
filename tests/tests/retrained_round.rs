//! A device publishes its update while the copy it keeps for resending is still being
//! written, so a crash in between leaves its state directory at the previous round: after
//! the restart it trains the round again and sends a second, different update for it.
//! The aggregator must count the first complete update and ignore the second.

mod common;

use candle_core::Device;
use common::fake_device::FakeDevice;
use common::{decode_rounds, tensor_values, Wiretap};
use fedpo_model::tensor_files::read_safetensors;
use fedpo_transport::EmbeddedBroker;

const JOB: &str = "retrained";

#[test]
fn a_second_update_for_a_round_already_counted_changes_nothing() {
    let dir = fedpo_tests::TestDir::new();
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let tap = Wiretap::start(&url, "fedpo/#");
    let out = dir.path().join("aggregator");
    let aggregator = {
        let args = common::serve_args(&url, JOB, &out, &["--rounds", "1", "--no-final-eval", "--round-deadline", "30"]);
        std::thread::spawn(move || fedpo_aggregator::run_cli(args))
    };
    // Each says hello while it waits: the aggregator plans once all three are there.
    let (devices, plans): (Vec<FakeDevice>, Vec<_>) =
        FakeDevice::join_all(&url, JOB, ["dev-a", "dev-b", "dev-c"]).into_iter().unzip();
    let (retrained, others) = devices.split_first().unwrap();
    retrained.send(&plans[0], 1, 0.1, false);
    retrained.send(&plans[0], 1, 0.9, false); // trained again after a crash
    for (device, (plan, value)) in others.iter().zip(plans[1..].iter().zip([0.2, 0.3])) {
        device.send(plan, 1, value, false);
    }
    aggregator.join().unwrap().expect("the aggregator finishes the job");

    let rounds = decode_rounds(&tap.stop());
    let start = rounds[&1].global.as_ref().expect("round 1's model on the wire");
    let checkpoint = read_safetensors(&out.join("checkpoint/global.safetensors"), &Device::Cpu).unwrap();
    let name = "h.0.attn.c_attn.weight";
    let before = tensor_values(start, name);
    let after: Vec<f32> = checkpoint.tensors.tensors[name].flatten_all().unwrap().to_vec1().unwrap();
    // Equal pair counts: the mean of 0.1, 0.2 and 0.3; with the second update counted
    // instead of the first it would be 0.467, with both 0.375.
    let worst = before.iter().zip(&after).map(|(b, a)| (a - b - 0.2).abs()).fold(0.0f32, f32::max);
    assert!(worst < 1e-6, "the model moved by the mean of the first updates ± {worst:e}");
}
