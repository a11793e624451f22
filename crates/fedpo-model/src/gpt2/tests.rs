//! Mixed precision through a whole model on this CPU's own engines: under qemu-aarch64 in
//! CI, the f16 step on the FP16 kernel.

use candle_core::{DType, Device, Tensor};

use crate::{Gpt2Config, LoraConfig, Partition, PartitionPreset, Policy, PolicySpec};

fn small_policy() -> Policy {
    // Every product of the step at least a tile: 48 tokens, 64 wide, a 512-token vocabulary.
    let config =
        Gpt2Config { vocab_size: 512, n_positions: 32, n_embd: 64, n_layer: 2, n_head: 2, ..Gpt2Config::tiny() };
    let spec = PolicySpec {
        config,
        lora: Some(LoraConfig::new(4, 8.0, &["c_attn"]).unwrap()),
        partition: Partition::new(PartitionPreset::Pfeddpo),
    };
    let policy = Policy::random(spec, 5, &Device::Cpu).unwrap();
    // A non-zero adapter B, so that the adapter path carries signal and gradient to A.
    for p in policy.params.iter().filter(|p| p.name.ends_with("lora_B.weight")) {
        let n = p.tensor().elem_count();
        let noise = Tensor::arange(0f32, n as f32, &Device::Cpu).unwrap().affine(0.37, 0.0).unwrap().sin().unwrap();
        let noise = (noise * 0.02).unwrap().reshape(p.tensor().shape()).unwrap();
        p.var().unwrap().set(&noise).unwrap();
    }
    policy
}

/// Logits, and the gradient of a fixed weighting of them, flattened.
fn logits_and_grads(policy: &Policy) -> (Vec<f32>, Vec<(String, Vec<f32>)>) {
    let ids: Vec<u32> = (0..2 * 24).map(|i| (i * 97 % 512) as u32).collect();
    let ids = Tensor::from_vec(ids, (2, 24), &Device::Cpu).unwrap();
    let logits = policy.model.forward(&ids).unwrap();
    let coeff = Tensor::arange(0f32, 512.0, &Device::Cpu).unwrap().affine(0.05, -1.0).unwrap().sin().unwrap();
    let loss = logits.broadcast_mul(&coeff).unwrap().sum_all().unwrap();
    let grads = policy.model.backward(&loss).unwrap();
    let named = policy
        .params
        .trainable()
        .map(|p| (p.name.clone(), grads.get(p.tensor()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    (logits.flatten_all().unwrap().to_vec1::<f32>().unwrap(), named)
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
    let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

#[test]
fn an_f16_step_tracks_the_f32_one_closer_than_bf16_does() {
    let full = small_policy();
    let (logits, grads) = logits_and_grads(&full);
    let worst_logit = |compute: DType| {
        let mut half = full.clone();
        half.set_compute_dtype(compute).unwrap();
        assert_eq!(half.model.compute_dtype(), compute);
        let (half_logits, half_grads) = logits_and_grads(&half);
        for ((name, g), (_, h)) in grads.iter().zip(&half_grads) {
            let cos = cosine(g, h);
            assert!(cos > 0.999, "{compute:?}: gradient of {name} has cosine {cos} with f32's");
        }
        logits.iter().zip(&half_logits).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max)
    };
    let scale = logits.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (bf16, f16) = (worst_logit(DType::BF16), worst_logit(DType::F16));
    eprintln!("worst logit error against f32 (scale {scale:.3}): bf16 {bf16:.2e}, f16 {f16:.2e}");
    assert!(f16 > 0.0, "the f16 step computed exactly as f32 does: f16 did not run");
    assert!(f16 < 0.004 * scale, "f16 logits off by {f16} (scale {scale})");
    assert!(f16 < bf16 / 2.0, "f16 ({f16}) is not clearly closer to f32 than bf16 ({bf16})");
}
