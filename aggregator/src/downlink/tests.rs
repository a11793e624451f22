use fedpo_model::{Gpt2Config, Partition, PartitionPreset, PolicySpec};
use fedpo_wire::{apply_delta, digest, Limits};

use super::*;

const N: usize = 600;

/// A model with one frozen tensor and two shared ones, the shared values shifted by `t`.
fn model(t: f32) -> GlobalModel {
    let spec =
        PolicySpec { config: Gpt2Config::tiny(), lora: None, partition: Partition::new(PartitionPreset::Feddpo) };
    let wave = |phase: f32, n: usize| (0..n).map(|i| ((i as f32) * 0.37 + phase).sin() * 0.1).collect::<Vec<_>>();
    let tensor = |name: &str, values: Vec<f32>, shared| GlobalTensor {
        name: name.into(),
        shape: vec![values.len()],
        values,
        shared,
    };
    GlobalModel::new(
        spec,
        vec![
            tensor("wte.weight", wave(0.0, 4 * N), false),
            tensor("h.0.attn.c_attn.weight", wave(t, N), true),
            tensor("h.0.mlp.c_fc.weight", wave(2.0 * t, N), true),
        ],
    )
}

/// What a device holds: a whole model payload, and the step payloads it applies.
struct Device {
    held: Vec<u8>,
}

impl Device {
    fn digest(&self) -> Vec<u8> {
        if self.held.is_empty() {
            Vec::new()
        } else {
            digest(&self.held)
        }
    }

    /// Follows a round's download; returns the digest of what it now holds.
    fn receive(&mut self, download: &RoundDownload, global: &GlobalModel) -> Vec<u8> {
        match download {
            RoundDownload::Full => self.held = global.encode().into_transfer("m").1.concat_bytes(),
            RoundDownload::Chain(plan, payloads) => {
                let steps = plan.steps_from(&self.digest()).expect("this device can follow the chain");
                for step in steps {
                    let (_, payload) = payloads.iter().find(|(s, _)| *s == step.section).unwrap();
                    let bytes = payload.clone().into_transfer("d").1.concat_bytes();
                    let delta = TensorPayload::from_bytes(&bytes, &Limits::default(), true).unwrap();
                    apply_delta(&mut self.held, &delta, &Limits::default()).unwrap();
                }
                assert_eq!(digest(&self.held), plan.model, "the chain yields the model the plan names");
            }
        }
        self.digest()
    }
}

trait ConcatBytes {
    fn concat_bytes(self) -> Vec<u8>;
}

impl ConcatBytes for Vec<fedpo_wire::TransferChunk> {
    fn concat_bytes(self) -> Vec<u8> {
        self.iter().flat_map(|c| c.bytes.iter().copied()).collect()
    }
}

fn full_digest(m: &GlobalModel) -> Vec<u8> {
    m.encode().digest().to_vec()
}

fn gap(global: &GlobalModel, public: &GlobalModel) -> f64 {
    public
        .tensors
        .iter()
        .flat_map(|p| p.values.iter().zip(&global.get(&p.name).unwrap().values))
        .map(|(p, g)| f64::from(g - p).powi(2))
        .sum::<f64>()
        .sqrt()
}

#[test]
fn devices_following_the_chain_hold_exactly_the_public_model_in_every_codec() {
    for codec in [UpdateCodec::F32, UpdateCodec::Bf16, UpdateCodec::Int8, UpdateCodec::TopK(0.05)] {
        let mut stream = DownlinkStream::new(codec);
        let mut device = Device { held: Vec::new() };
        for round in 1..=6 {
            let global = model(round as f32 * 0.1);
            let held = device.digest();
            let download = stream.download(round, &global, &full_digest(&global), &[&held]);
            assert_eq!(matches!(download, RoundDownload::Full), round == 1, "{codec}: round {round}");
            let now = device.receive(&download, &global);
            assert_eq!(now, stream.digest(), "{codec}: round {round}");
            assert_eq!(now, public_digest(&global, stream.public().unwrap()), "{codec}: round {round}");
        }
    }
}

#[test]
fn a_delta_round_sends_only_shared_tensors_at_a_fraction_of_the_whole_model() {
    let mut stream = DownlinkStream::new(UpdateCodec::Int8);
    let first = model(0.0);
    let _ = stream.download(1, &first, &full_digest(&first), &[]);
    let second = model(0.1);
    let held = stream.digest().to_vec();
    let RoundDownload::Chain(plan, payloads) = stream.download(2, &second, &full_digest(&second), &[&held]) else {
        panic!("a device holding the public model gets a delta")
    };
    assert_eq!(plan.steps.len(), 1);
    let names: Vec<_> = payloads[0].1.clone().into_transfer("d").0.tensors.into_iter().map(|t| t.name).collect();
    assert_eq!(names, ["h.0.attn.c_attn.weight", "h.0.mlp.c_fc.weight"], "the frozen tensor is not resent");
    let whole = second.encode().len();
    assert!(payloads[0].1.len() * 10 < whole, "{} bytes against {whole}", payloads[0].1.len());
}

#[test]
fn what_top_k_leaves_out_reaches_the_devices_in_later_rounds() {
    let mut stream = DownlinkStream::new(UpdateCodec::TopK(0.1));
    let start = model(0.0);
    let _ = stream.download(1, &start, &full_digest(&start), &[]);
    let target = model(1.0);
    let mut gaps = Vec::new();
    for round in 2..=40 {
        let held = stream.digest().to_vec();
        let _ = stream.download(round, &target, &full_digest(&target), &[&held]);
        gaps.push(gap(&target, stream.public().unwrap()));
    }
    assert!(gaps[0] > 0.5, "one step of 10 % leaves most of the change: {}", gaps[0]);
    assert!(gaps[38] < 1e-6 * gaps[0].max(1.0), "the public model reaches the global one: {gaps:?}");
}

#[test]
fn a_device_that_sat_rounds_out_catches_up_and_one_holding_another_model_gets_the_whole_model() {
    let mut stream = DownlinkStream::new(UpdateCodec::Int8);
    let (mut early, mut late) = (Device { held: Vec::new() }, Device { held: Vec::new() });
    let first = model(0.0);
    let download = stream.download(1, &first, &full_digest(&first), &[&[], &[]]);
    early.receive(&download, &first);
    late.receive(&download, &first);
    for round in 2..=4 {
        let global = model(round as f32 * 0.1);
        let held = early.digest();
        let download = stream.download(round, &global, &full_digest(&global), &[&held]);
        early.receive(&download, &global);
    }
    let global = model(0.5);
    let (e, l) = (early.digest(), late.digest());
    let download = stream.download(5, &global, &full_digest(&global), &[&e, &l]);
    let RoundDownload::Chain(plan, _) = &download else { panic!("both can follow") };
    assert_eq!(plan.steps.len(), 4, "rounds 2 to 5 for the device that sat them out");
    assert_eq!(early.receive(&download, &global), late.receive(&download, &global));

    let global = model(0.6);
    let stranger = vec![9u8; 32];
    let download = stream.download(6, &global, &full_digest(&global), &[&early.digest(), &stranger]);
    assert!(matches!(download, RoundDownload::Full));
    assert_eq!(stream.digest(), full_digest(&global), "the public model is the global one again");
}

#[test]
fn the_chain_keeps_at_most_max_steps() {
    let mut stream = DownlinkStream::new(UpdateCodec::TopK(0.01));
    let first = model(0.0);
    let _ = stream.download(1, &first, &full_digest(&first), &[]);
    let origin = stream.digest().to_vec();
    for round in 2..=(MAX_STEPS as u64 + 1) {
        let global = model(round as f32 * 0.1);
        assert!(matches!(stream.download(round, &global, &full_digest(&global), &[&origin]), RoundDownload::Chain(..)));
    }
    let global = model(5.0);
    let round = MAX_STEPS as u64 + 2;
    assert!(
        matches!(stream.download(round, &global, &full_digest(&global), &[&origin]), RoundDownload::Full),
        "a device {} steps behind gets the whole model",
        MAX_STEPS + 1
    );
}
