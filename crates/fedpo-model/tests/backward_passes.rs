//! A step whose batch runs in several backward passes: the gradients the model buffers
//! itself (the tied embedding's and the fused blocks') stay in the model between passes and
//! come out once, in the last pass, summed; the rest come out of every pass.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
mod common;

use fedpo_model::{BackwardPass, Gpt2Config, LoraConfig, ParamKind, Partition, PartitionPreset, Policy, PolicySpec};

fn policy(preset: PartitionPreset) -> Policy {
    let config =
        Gpt2Config { vocab_size: 101, n_positions: 32, n_embd: 24, n_head: 3, n_layer: 2, ..Gpt2Config::tiny() };
    let lora =
        (preset != PartitionPreset::Feddpo).then(|| LoraConfig::new(4, 8.0, &["c_attn", "c_proj", "c_fc"]).unwrap());
    let spec = PolicySpec { config, lora, partition: Partition::new(preset) };
    let policy = Policy::build(spec, None, None, 5, DType::F64, &Device::Cpu).unwrap();
    // adapters that carry signal (B starts at zero, which would hide a wrong gradient for A)
    for (seed, p) in (1..).zip(policy.params.with_kind(ParamKind::Adapter)) {
        if let Some(v) = p.var() {
            v.set(&common::seeded_normal(v.shape(), 0.3, seed, DType::F64)).unwrap();
        }
    }
    policy
}

/// A loss over the logits of three sequences of 7 tokens drawn with `seed`.
fn loss(policy: &Policy, seed: usize) -> Tensor {
    let ids: Vec<u32> = (0..21).map(|i| ((i * 37 + seed * 11) % 101) as u32).collect();
    let logits = policy.model.forward(&Tensor::from_vec(ids, (3, 7), &Device::Cpu).unwrap()).unwrap();
    let v = logits.dim(2).unwrap();
    let coeff = Tensor::arange(0f64, v as f64, &Device::Cpu).unwrap().affine(0.37, seed as f64).unwrap().sin().unwrap();
    logits.sqr().unwrap().broadcast_mul(&coeff).unwrap().sum_all().unwrap()
}

fn values(store: &GradStore, t: &Tensor) -> Option<Vec<f64>> {
    store.get(t).map(|g| g.flatten_all().unwrap().to_vec1::<f64>().unwrap())
}

/// Whether the model buffers this parameter's gradient itself.
fn buffered(name: &str) -> bool {
    name == "wte.weight" || name.starts_with("h.")
}

fn passes_sum_to_the_whole_batch_gradient(preset: PartitionPreset) {
    let policy = policy(preset);
    let trainable: Vec<_> = policy.params.trainable().map(|p| (p.name.clone(), p.tensor().clone())).collect();
    // each half alone, in one pass
    let whole: Vec<GradStore> = [1, 2].map(|seed| policy.model.backward(&loss(&policy, seed)).unwrap()).into();
    // the same halves as two passes of one step
    let first = policy.model.backward_pass(&loss(&policy, 1), BackwardPass::of(0, 2)).unwrap();
    let last = policy.model.backward_pass(&loss(&policy, 2), BackwardPass::of(1, 2)).unwrap();
    let mut compared = 0;
    for (name, t) in &trainable {
        if buffered(name) {
            assert!(values(&first, t).is_none(), "{preset:?} {name}: a buffered gradient left the model early");
        }
        let expected: Vec<f64> = match (values(&whole[0], t), values(&whole[1], t)) {
            (Some(a), Some(b)) => a.iter().zip(&b).map(|(a, b)| a + b).collect(),
            other => panic!("{preset:?} {name}: a half without a gradient: {other:?}"),
        };
        let got: Vec<f64> = match (values(&first, t), values(&last, t)) {
            (Some(a), Some(b)) => a.iter().zip(&b).map(|(a, b)| a + b).collect(),
            (None, Some(b)) => b,
            other => panic!("{preset:?} {name}: the passes' gradients are missing: {other:?}"),
        };
        let scale = expected.iter().fold(0f64, |m, v| m.max(v.abs()));
        assert!(scale > 0.0, "{preset:?} {name}: a zero gradient proves nothing");
        let err = got.iter().zip(&expected).map(|(g, e)| (g - e).abs()).fold(0.0, f64::max) / scale;
        assert!(err < 1e-12, "{preset:?} {name}: the passes sum to {err:e} off the whole batch's gradient");
        compared += usize::from(buffered(name));
    }
    assert!(compared > 0, "{preset:?}: no buffered gradient was compared");
}

#[test]
fn two_passes_of_a_trainable_base_with_merged_adapters_sum_to_the_whole_batch_gradient() {
    passes_sum_to_the_whole_batch_gradient(PartitionPreset::Pfeddpo);
}

#[test]
fn two_passes_of_a_base_without_adapters_sum_to_the_whole_batch_gradient() {
    passes_sum_to_the_whole_batch_gradient(PartitionPreset::Feddpo);
}

#[test]
fn two_passes_of_adapters_over_a_frozen_base_sum_to_the_whole_batch_gradient() {
    passes_sum_to_the_whole_batch_gradient(PartitionPreset::SharedLora);
}

#[test]
fn a_step_abandoned_after_its_first_pass_leaves_nothing_in_the_next_steps_gradient() {
    let policy = policy(PartitionPreset::Pfeddpo);
    let alone = policy.model.backward(&loss(&policy, 2)).unwrap();
    // a step that failed after its first pass, then a fresh step
    policy.model.backward_pass(&loss(&policy, 1), BackwardPass::of(0, 3)).unwrap();
    let fresh = policy.model.backward(&loss(&policy, 2)).unwrap();
    for p in policy.params.trainable() {
        assert_eq!(values(&fresh, p.tensor()), values(&alone, p.tensor()), "{}", p.name);
    }
}
