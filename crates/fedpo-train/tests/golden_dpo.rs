//! DPO loss, log-probs and gradients against PyTorch + PEFT on a fixed, right-padded batch.
//!
//! Fixtures: `fixtures/golden/gen_golden.py`. The reference computes in f64 on f32-rounded
//! weights, so fedpo in f64 must agree to 1e-12 and in f32 to 2e-5 relative (measured:
//! 1e-14 and 1.5e-6). Mixed precision is held to the bounds its tests state, against the
//! same f64 reference: the accuracy guard any faster half-precision kernel must keep.
//! On the CPU both half precisions keep f32 activations and round only the large matmuls'
//! operands: to bf16 (the packed kernels), or to f16 after scaling each row and column by
//! a power of two (on this host, the emulation of aarch64's FP16 kernel: the same
//! operands, f32 accumulation).

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use fedpo_data::TokenizedPair;
use fedpo_model::checkpoint::load_hf_dir;
use fedpo_model::tensor_files::read_safetensors;
use fedpo_model::{LoraConfig, Partition, PartitionPreset, Policy, PolicySpec};
use fedpo_train::{evaluate, score_pairs, DpoSettings, LocalTrainer, LossKind, OptimConfig, OptimKind, PreferenceSet};

/// How far from the f64 reference a precision may land: log-probs, loss and gradients
/// relative as [`rel_err`] measures them, and the least cosine of a gradient with the
/// reference's.
struct Bounds {
    logps: f64,
    loss: f64,
    grads: f64,
    grad_cosine: f64,
}

impl Bounds {
    fn all(tol: f64) -> Self {
        Self { logps: tol, loss: tol, grads: tol, grad_cosine: 1.0 - tol }
    }
}

/// Mixed precision's bounds, two to four times what each measured (`docs/benchmark-log.md`,
/// "Mixed-precision accuracy"). bf16 keeps 8 significant bits and f16 11; a gradient's
/// largest error lands on its smallest-magnitude direction, so its cosine is the sharper
/// test.
const BF16: Bounds = Bounds { logps: 5e-4, loss: 2e-3, grads: 1.5e-3, grad_cosine: 0.9999999 };
/// Below this the reference log-probs' error says the bf16 matmuls did not run: f32 lands
/// about ten times under it and bf16 about ten times over (`docs/benchmark-log.md`).
const BF16_FLOOR: f64 = 2e-5;
const F16: Bounds = Bounds { logps: 2e-4, loss: 1e-3, grads: 1.5e-3, grad_cosine: 0.9999999 };
/// As [`BF16_FLOOR`], for f16: f32 lands about three hundred times under it, f16 about six times
/// over.
const F16_FLOOR: f64 = 1e-5;

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/golden").join(name)
}

struct Fixture {
    tensors: HashMap<String, Tensor>,
    pairs: Vec<TokenizedPair>,
    beta: f64,
    pad_id: u32,
}

fn fixture() -> Fixture {
    let file = read_safetensors(&golden("dpo.safetensors"), &Device::Cpu).unwrap();
    let meta = &file.metadata;
    let prompt_lens: Vec<usize> = serde_json::from_str(&meta["prompt_lens"]).unwrap();
    let resp_lens: Vec<usize> = serde_json::from_str(&meta["response_lens"]).unwrap();
    let ids: Vec<Vec<u32>> = file.tensors.tensors["input_ids"].to_dtype(DType::U32).unwrap().to_vec2().unwrap();
    let p = ids.len() / 2;
    let response = |row: usize| ids[row][prompt_lens[row]..prompt_lens[row] + resp_lens[row]].to_vec();
    let pairs = (0..p)
        .map(|i| TokenizedPair {
            prompt: ids[i][..prompt_lens[i]].to_vec(),
            chosen: response(i),
            rejected: response(p + i),
        })
        .collect();
    Fixture {
        tensors: file.tensors.tensors,
        pairs,
        beta: meta["beta"].parse().unwrap(),
        pad_id: meta["pad_id"].parse().unwrap(),
    }
}

/// The fixture's policy with `dtype` parameters computing in `compute`.
fn policy(preset: PartitionPreset, dtype: DType, compute: DType) -> Policy {
    let ckpt = load_hf_dir(&golden("hf-prefixed"), &Device::Cpu).unwrap();
    let adapter = read_safetensors(&golden("lora.safetensors"), &Device::Cpu).unwrap();
    let lora = LoraConfig::new(4, 8.0, &["c_attn"]).unwrap();
    let spec = PolicySpec { config: ckpt.config, lora: Some(lora), partition: Partition::new(preset) };
    let mut policy = Policy::build(spec, Some(&ckpt.base), Some(&adapter.tensors), 0, dtype, &Device::Cpu).unwrap();
    policy.set_compute_dtype(compute).unwrap();
    policy
}

fn settings(f: &Fixture) -> DpoSettings {
    DpoSettings { beta: f.beta, loss: LossKind::default(), batch_pairs: 2, micro_batch_pairs: 1, pad_id: f.pad_id }
}

/// max |a - b| / max |b|
fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap();
    let b = b.to_dtype(DType::F64).unwrap();
    let scale = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap().max(1e-30);
    (a - &b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap() / scale
}

fn vec_tensor(v: &[f64]) -> Tensor {
    Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap()
}

fn cosine(a: &Tensor, b: &Tensor) -> f64 {
    let flat = |t: &Tensor| t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let (a, b) = (flat(a), flat(b));
    let dot: f64 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
    dot / (a.iter().map(|x| x * x).sum::<f64>().sqrt() * b.iter().map(|x| x * x).sum::<f64>().sqrt())
}

/// Checks log-probs, loss and gradients of `dtype` parameters computing in `compute`
/// against the f64 reference, within `bounds`.
fn check(dtype: DType, compute: DType, bounds: Bounds) {
    let f = fixture();
    let s = settings(&f);
    // The reference is the base without adapter (PEFT's disable_adapter()).
    let ckpt = load_hf_dir(&golden("hf-prefixed"), &Device::Cpu).unwrap();
    let mut base_only = Policy::build(
        PolicySpec { config: ckpt.config, lora: None, partition: Partition::new(PartitionPreset::Feddpo) },
        Some(&ckpt.base),
        None,
        0,
        dtype,
        &Device::Cpu,
    )
    .unwrap();
    base_only.set_compute_dtype(compute).unwrap();
    let reference = score_pairs(&base_only, &f.pairs, 2, f.pad_id).unwrap();
    let ref_rows: Vec<f64> = reference.chosen.iter().chain(&reference.rejected).copied().collect();
    let e = rel_err(&vec_tensor(&ref_rows), &f.tensors["ref_logps"]);
    eprintln!("{compute:?} reference log-probs: rel err {e:.2e}");
    assert!(e < bounds.logps, "reference log-probs: rel err {e}");
    if compute == DType::BF16 {
        assert!(e > BF16_FLOOR, "reference log-probs at f32's accuracy ({e}): bf16 did not run");
    }
    if compute == DType::F16 {
        assert!(e > F16_FLOOR, "reference log-probs at f32's accuracy ({e}): f16 did not run");
    }

    let lora_policy = policy(PartitionPreset::SharedLora, dtype, compute);
    let pol = score_pairs(&lora_policy, &f.pairs, 2, f.pad_id).unwrap();
    let pol_rows: Vec<f64> = pol.chosen.iter().chain(&pol.rejected).copied().collect();
    let e = rel_err(&vec_tensor(&pol_rows), &f.tensors["policy_logps"]);
    eprintln!("{compute:?} policy log-probs: rel err {e:.2e}");
    assert!(e < bounds.logps, "policy log-probs: rel err {e}");

    let data = PreferenceSet { pairs: f.pairs.clone(), reference };
    let loss = evaluate(&lora_policy, &data, &s).unwrap().loss;
    let expected = f.tensors["loss"].to_vec1::<f64>().unwrap()[0];
    eprintln!("{compute:?} loss {loss} vs {expected}: rel err {:.2e}", (loss - expected).abs() / expected.abs());
    assert!((loss - expected).abs() < bounds.loss * expected.abs(), "loss {loss} vs {expected}");

    // Frozen base: every LoRA gradient. Micro-batches of one pair exercise accumulation.
    let trainer = LocalTrainer::new(s, OptimConfig::new(OptimKind::Sgd, 0.1), 0).unwrap();
    let grads = trainer.full_gradient(&lora_policy, &data).unwrap();
    let mut checked = 0;
    for (key, expected) in &f.tensors {
        if let Some(name) = key.strip_prefix("grad.") {
            let (e, cos) = (rel_err(&grads[name], expected), cosine(&grads[name], expected));
            eprintln!("{compute:?} grad {name}: rel err {e:.2e}, cosine {cos:.9}");
            assert!(e < bounds.grads && cos >= bounds.grad_cosine, "{name}: rel err {e}, cosine {cos}");
            checked += 1;
        }
    }
    assert_eq!(checked, 4);
    assert_eq!(grads.len(), 4, "a frozen base gets no gradient: {:?}", grads.keys().collect::<Vec<_>>());

    // Base trainable (pFedDPO): a projection and the tied embedding (lookup + head).
    let full = policy(PartitionPreset::Pfeddpo, dtype, compute);
    let grads = trainer.full_gradient(&full, &data).unwrap();
    for name in ["h.1.attn.c_proj.weight", "wte.weight"] {
        let expected = &f.tensors[&format!("grad_base.{name}")];
        let (e, cos) = (rel_err(&grads[name], expected), cosine(&grads[name], expected));
        eprintln!("{compute:?} base grad {name}: rel err {e:.2e}, cosine {cos:.9}");
        assert!(e < bounds.grads && cos >= bounds.grad_cosine, "{name}: rel err {e}, cosine {cos}");
    }
}

#[test]
fn dpo_logps_loss_and_gradients_match_pytorch_peft_in_f64() {
    check(DType::F64, DType::F64, Bounds::all(1e-12));
}

#[test]
fn dpo_logps_loss_and_gradients_match_pytorch_peft_in_f32() {
    check(DType::F32, DType::F32, Bounds::all(2e-5));
}

#[test]
fn dpo_logps_loss_and_gradients_in_bf16_compute_stay_within_its_bound_of_pytorch_f64() {
    check(DType::F32, DType::BF16, BF16);
}

#[test]
fn dpo_logps_loss_and_gradients_in_f16_compute_stay_within_its_bound_of_pytorch_f64() {
    check(DType::F32, DType::F16, F16);
}
