//! The fused block (one op per GPT-2 block, its backward written out) against the same
//! model run op by op through candle's autograd: logits and every trainable parameter's
//! gradient, for each partition and with adapters on every kind of projection.

use candle_core::{DType, Device, Tensor};
mod common;

use fedpo_model::{Gpt2Config, LoraConfig, ParamKind, Partition, PartitionPreset, Policy, PolicySpec};

fn spec(preset: PartitionPreset, targets: Option<&[&str]>, freeze_embeddings: bool) -> PolicySpec {
    let config =
        Gpt2Config { vocab_size: 101, n_positions: 32, n_embd: 24, n_head: 3, n_layer: 2, ..Gpt2Config::tiny() };
    PolicySpec {
        config,
        lora: targets.map(|t| LoraConfig::new(4, 8.0, t).unwrap()),
        partition: Partition { preset, freeze_embeddings },
    }
}

/// A policy whose adapters carry signal (B starts at zero, which would hide a wrong
/// gradient for A).
fn policy(spec: PolicySpec, dtype: DType) -> Policy {
    let policy = Policy::build(spec, None, None, 5, dtype, &Device::Cpu).unwrap();
    for (seed, p) in (1..).zip(policy.params.with_kind(ParamKind::Adapter)) {
        if let Some(v) = p.var() {
            v.set(&common::seeded_normal(v.shape(), 0.3, seed, dtype)).unwrap();
        }
    }
    policy
}

/// Three sequences of 7 tokens.
fn ids() -> Tensor {
    let ids: Vec<u32> = (0..21).map(|i| (i * 37 % 101) as u32).collect();
    Tensor::from_vec(ids, (3, 7), &Device::Cpu).unwrap()
}

/// Logits and the gradient of a fixed weighting of them, by parameter name, in f64.
fn logits_and_grads(policy: &Policy) -> (Vec<f64>, Vec<(String, Vec<f64>)>) {
    let logits = policy.model.forward(&ids()).unwrap();
    let v = logits.dim(2).unwrap();
    let coeff = Tensor::arange(0f64, v as f64, &Device::Cpu).unwrap().affine(0.37, -1.0).unwrap().sin().unwrap();
    let coeff = coeff.to_dtype(logits.dtype()).unwrap();
    let loss = logits.sqr().unwrap().broadcast_mul(&coeff).unwrap().sum_all().unwrap();
    let grads = policy.model.backward(&loss).unwrap();
    let f64s = |t: &Tensor| t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
    let named = policy
        .params
        .trainable()
        .map(|p| {
            let g = grads.get(p.tensor()).unwrap_or_else(|| panic!("{} has no gradient", p.name));
            assert_eq!(g.dims(), p.tensor().dims(), "{}", p.name);
            (p.name.clone(), f64s(g))
        })
        .collect();
    (f64s(&logits), named)
}

fn max_rel_diff(a: &[f64], b: &[f64]) -> f64 {
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max) / scale
}

/// Fused and composed runs of the same policy agree to `tol` of each tensor's largest
/// value; returns how many gradients were compared.
fn fused_matches_composed(spec: PolicySpec, dtype: DType, tol: f64) -> usize {
    let mut policy = policy(spec, dtype);
    let (fused_logits, fused_grads) = logits_and_grads(&policy);
    policy.model.set_fused_blocks(false);
    let (logits, grads) = logits_and_grads(&policy);
    let err = max_rel_diff(&fused_logits, &logits);
    assert!(err < tol, "logits differ by {err:e} of their largest");
    assert_eq!(fused_grads.len(), grads.len());
    for ((name, fused), (_, composed)) in fused_grads.iter().zip(&grads) {
        let err = max_rel_diff(fused, composed);
        assert!(err < tol, "{name}: gradient differs by {err:e} of its largest");
        assert!(composed.iter().any(|g| *g != 0.0), "{name}: a zero gradient proves nothing");
    }
    grads.len()
}

#[test]
fn pfeddpo_block_gradients_match_autograd_with_adapters_on_every_projection() {
    let targets: &[&str] = &["c_attn", "c_proj", "mlp.c_fc"];
    // 2 layers x (12 base tensors + 4 adapters x 2) + embeddings + ln_f
    let n = fused_matches_composed(spec(PartitionPreset::Pfeddpo, Some(targets), false), DType::F64, 1e-11);
    assert_eq!(n, 2 * (12 + 8) + 4);
}

#[test]
fn frozen_base_block_gives_adapter_gradients_only_and_they_match_autograd() {
    let targets: &[&str] = &["c_attn", "mlp.c_proj"];
    let n = fused_matches_composed(spec(PartitionPreset::SharedLora, Some(targets), false), DType::F64, 1e-11);
    assert_eq!(n, 2 * 2 * 2, "two adapters of two factors per layer");
}

#[test]
fn feddpo_block_without_adapters_and_with_frozen_embeddings_matches_autograd() {
    let n = fused_matches_composed(spec(PartitionPreset::Feddpo, None, true), DType::F64, 1e-11);
    assert_eq!(n, 2 * 12 + 2, "block tensors and ln_f, embeddings frozen");
}

#[test]
fn fused_block_in_f32_tracks_autograd_within_f32_rounding() {
    fused_matches_composed(spec(PartitionPreset::Pfeddpo, Some(&["c_attn"]), false), DType::F32, 1e-4);
    fused_matches_composed(spec(PartitionPreset::SharedLora, Some(&["c_attn"]), false), DType::F32, 1e-4);
}

#[test]
fn consecutive_passes_collect_only_their_own_block_gradients() {
    let policy = policy(spec(PartitionPreset::Pfeddpo, Some(&["c_attn"]), false), DType::F64);
    let first = logits_and_grads(&policy).1;
    let second = logits_and_grads(&policy).1;
    for ((name, a), (_, b)) in first.iter().zip(&second) {
        assert_eq!(a, b, "{name}: gradients from a second pass must not include the first's");
    }
}
