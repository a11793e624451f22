//! Mixed precision: bf16/f16 matmuls over f32 parameters give logits and gradients close to
//! the f32 model's, with every gradient landing on the f32 parameters.

use candle_core::{DType, Device, Tensor};
mod common;

use fedpo_model::{Gpt2Config, LoraConfig, Partition, PartitionPreset, Policy, PolicySpec};

fn tiny_policy() -> Policy {
    let mut config = Gpt2Config::tiny();
    config.n_positions = 64;
    let spec = PolicySpec {
        config,
        lora: Some(LoraConfig::new(4, 8.0, &["c_attn", "mlp.c_fc"]).unwrap()),
        partition: Partition::new(PartitionPreset::Pfeddpo),
    };
    let policy = Policy::random(spec, 3, &Device::Cpu).unwrap();
    // A non-zero adapter B, so that the adapter path carries signal and gradient to A.
    for (seed, p) in (1..).zip(policy.params.iter().filter(|p| p.name.ends_with("lora_B.weight"))) {
        let noise = common::seeded_normal(p.tensor().shape(), 0.02, seed, DType::F32);
        p.var().unwrap().set(&noise).unwrap();
    }
    policy
}

fn ids() -> Tensor {
    let ids: Vec<u32> = (0..2 * 24).map(|i| (i * 7919 % 50257) as u32).collect();
    Tensor::from_vec(ids, (2, 24), &Device::Cpu).unwrap()
}

/// Logits and the gradient of a fixed linear function of them, by parameter name.
fn logits_and_grads(policy: &Policy) -> (Vec<f32>, Vec<(String, Vec<f32>)>) {
    let logits = policy.model.forward(&ids()).unwrap();
    assert_eq!(logits.dtype(), DType::F32, "logits come back in the master dtype");
    // A fixed, deterministic weighting of the vocabulary (the same for both runs).
    let coeff = Tensor::arange(0f32, logits.dim(2).unwrap() as f32, &Device::Cpu)
        .unwrap()
        .affine(1e-4, -2.0)
        .unwrap()
        .sin()
        .unwrap();
    let loss = logits.broadcast_mul(&coeff).unwrap().sum_all().unwrap();
    let grads = policy.model.backward(&loss).unwrap();
    let named = policy
        .params
        .trainable()
        .map(|p| {
            let g = grads.get(p.tensor()).unwrap_or_else(|| panic!("{} has a gradient", p.name));
            assert_eq!(g.dtype(), DType::F32, "{}: gradient in the master dtype", p.name);
            (p.name.clone(), g.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        })
        .collect();
    (logits.flatten_all().unwrap().to_vec1::<f32>().unwrap(), named)
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
    let na: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

#[test]
fn half_precision_compute_tracks_the_f32_model_in_logits_and_gradients() {
    let full = tiny_policy();
    let (logits, grads) = logits_and_grads(&full);
    let scale = logits.iter().fold(0f32, |m, v| m.max(v.abs()));
    for compute in [DType::BF16, DType::F16] {
        let mut half = full.clone();
        half.set_compute_dtype(compute).unwrap();
        let (half_logits, half_grads) = logits_and_grads(&half);
        let worst = logits.iter().zip(&half_logits).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        // bf16 keeps 8 significant bits: about 0.4 % of the largest logit per rounding.
        assert!(worst < 0.03 * scale, "{compute:?}: logits differ by {worst} (scale {scale})");
        assert!(worst > 0.0, "{compute:?}: the model really computed in half precision");
        let mut lowest = 1.0f64;
        for ((name, g), (_, h)) in grads.iter().zip(&half_grads) {
            let cos = cosine(g, h);
            lowest = lowest.min(cos);
            assert!(cos > 0.98, "{compute:?}: gradient of {name} has cosine {cos} with f32's");
        }
        eprintln!("{compute:?}: logits within {:.2e} of scale {scale:.2}; lowest gradient cosine {lowest:.5}", worst);
    }
}

#[test]
fn half_precision_over_f64_parameters_is_refused() {
    let spec =
        PolicySpec { config: Gpt2Config::tiny(), lora: None, partition: Partition::new(PartitionPreset::Feddpo) };
    let mut policy = Policy::build(spec, None, None, 0, DType::F64, &Device::Cpu).unwrap();
    let err = policy.set_compute_dtype(DType::BF16).unwrap_err().to_string();
    assert!(err.contains("f32 parameters"), "{err}");
    assert!(policy.set_compute_dtype(DType::F64).is_ok());
}

#[test]
fn bf16_parameters_train_through_candles_ops_with_a_gradient_for_the_tied_embedding() {
    // The fused embedding and head kernels are f32/f64 only; bf16 parameters take candle's ops.
    let mut config = Gpt2Config::tiny();
    config.n_positions = 64;
    let spec = PolicySpec { config, lora: None, partition: Partition::new(PartitionPreset::Feddpo) };
    let policy = Policy::build(spec, None, None, 0, DType::BF16, &Device::Cpu).unwrap();
    let hidden = policy.model.hidden_states(&ids()).unwrap();
    let rows = hidden.reshape((48, ())).unwrap();
    let targets = Tensor::from_vec((0..48u32).map(|i| i * 101 % 50257).collect::<Vec<_>>(), 48, &Device::Cpu).unwrap();
    let loss = policy.model.token_logprobs(&rows, &targets).unwrap().sum_all().unwrap();
    let grads = policy.model.backward(&loss).unwrap();
    let wte = policy.params.get("wte.weight").unwrap();
    let g = grads.get(wte.tensor()).expect("the tied embedding has a gradient");
    assert_eq!(g.dtype(), DType::BF16);
    let norm = g.to_dtype(DType::F32).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(norm > 0.0);
}
