//! Gradient checks on a small random model: central differences for LoRA A, LoRA B and a
//! base weight, and that every trainable tensor actually receives a gradient (candle's fused
//! layer norm / softmax return none, silently).

use candle_core::{DType, Device, Tensor, Var};
use fedpo_data::TokenizedPair;
use fedpo_model::{Gpt2Config, LoraConfig, ParamKind, Partition, PartitionPreset, Policy, PolicySpec};
use fedpo_train::{evaluate, score_pairs, DpoSettings, LocalTrainer, LossKind, OptimConfig, OptimKind, PreferenceSet};
use rand::{Rng, SeedableRng};

fn small_policy(preset: PartitionPreset, targets: &[&str], dtype: DType) -> Policy {
    let config =
        Gpt2Config { vocab_size: 64, n_positions: 32, n_embd: 16, n_head: 2, n_layer: 2, ..Gpt2Config::tiny() };
    let spec =
        PolicySpec { config, lora: Some(LoraConfig::new(2, 4.0, targets).unwrap()), partition: Partition::new(preset) };
    Policy::build(spec, None, None, 7, dtype, &Device::Cpu).unwrap()
}

fn random_pairs(n: usize, seed: u64) -> Vec<TokenizedPair> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut ids = |len: usize| (0..len).map(|_| rng.random_range(0..63u32)).collect::<Vec<_>>();
    (0..n).map(|i| TokenizedPair { prompt: ids(3 + i % 3), chosen: ids(2 + i % 4), rejected: ids(5 - i % 3) }).collect()
}

fn settings() -> DpoSettings {
    DpoSettings { beta: 0.5, loss: LossKind::default(), batch_pairs: 4, micro_batch_pairs: 2, pad_id: 63 }
}

fn data(policy: &Policy) -> PreferenceSet {
    let pairs = random_pairs(4, 11);
    let reference = score_pairs(policy, &pairs, 4, 63).unwrap();
    PreferenceSet { pairs, reference }
}

fn set_random(var: &Var, std: f64, seed: u64) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let v: Vec<f64> = (0..var.elem_count()).map(|_| rng.random_range(-std..std)).collect();
    var.set(&Tensor::from_vec(v, var.shape(), &Device::Cpu).unwrap().to_dtype(var.dtype()).unwrap()).unwrap();
}

fn entry(var: &Var, k: usize) -> f64 {
    var.as_tensor().flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap()[k]
}

fn set_entry(var: &Var, k: usize, value: f64) {
    let mut v = var.as_tensor().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    v[k] = value;
    var.set(&Tensor::from_vec(v, var.shape(), &Device::Cpu).unwrap()).unwrap();
}

#[test]
fn lora_and_base_gradients_match_central_differences() {
    let policy = small_policy(PartitionPreset::Pfeddpo, &["c_attn", "mlp.c_fc"], DType::F64);
    let data = data(&policy);
    // Move away from the reference and give B non-zero values, so A's gradient is non-zero.
    for (i, p) in policy.params.with_kind(ParamKind::Adapter).enumerate() {
        set_random(p.var().unwrap(), 0.3, 100 + i as u64);
    }
    let s = settings();
    let trainer = LocalTrainer::new(s, OptimConfig::new(OptimKind::Sgd, 0.1), 0).unwrap();
    let grads = trainer.full_gradient(&policy, &data).unwrap();
    let loss = |policy: &Policy| evaluate(policy, &data, &s).unwrap().loss;

    for name in ["h.0.attn.c_attn.lora_A.weight", "h.1.mlp.c_fc.lora_B.weight", "h.0.mlp.c_proj.weight", "wte.weight"] {
        let var = policy.params.get(name).unwrap().var().unwrap().clone();
        let g = grads[name].flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let n = g.len();
        for k in [0, n / 3, n / 2, n - 1] {
            let x = entry(&var, k);
            let h = 1e-5;
            set_entry(&var, k, x + h);
            let up = loss(&policy);
            set_entry(&var, k, x - h);
            let down = loss(&policy);
            set_entry(&var, k, x);
            let numeric = (up - down) / (2.0 * h);
            assert!(
                (numeric - g[k]).abs() <= 1e-7 + 1e-4 * g[k].abs(),
                "{name}[{k}]: numeric {numeric} vs analytic {}",
                g[k]
            );
        }
    }
}

#[test]
fn every_trainable_tensor_receives_a_nonzero_gradient() {
    let policy =
        small_policy(PartitionPreset::Pfeddpo, &["c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"], DType::F32);
    let data = data(&policy);
    let mut trainer = LocalTrainer::new(settings(), OptimConfig::new(OptimKind::Sgd, 0.5), 0).unwrap();
    // One step makes B non-zero; from then on every tensor, A included, must get gradient.
    trainer.step(&policy, &data).unwrap();
    let grads = trainer.full_gradient(&policy, &data).unwrap();
    for p in policy.params.trainable() {
        let g = grads.get(&p.name).unwrap_or_else(|| panic!("{} received no gradient", p.name));
        let norm = g.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(norm > 0.0, "{} has an all-zero gradient", p.name);
    }
    assert_eq!(grads.len(), policy.params.trainable().count());
}

#[test]
fn frozen_base_receives_no_gradient_and_does_not_change() {
    let policy = small_policy(PartitionPreset::SharedLora, &["c_attn"], DType::F32);
    let data = data(&policy);
    let before = policy.params.get("h.0.attn.c_attn.weight").unwrap().tensor().to_vec2::<f32>().unwrap();
    let mut trainer = LocalTrainer::new(settings(), OptimConfig::new(OptimKind::Adamw, 0.01), 0).unwrap();
    for _ in 0..3 {
        trainer.step(&policy, &data).unwrap();
    }
    let after = policy.params.get("h.0.attn.c_attn.weight").unwrap().tensor().to_vec2::<f32>().unwrap();
    assert_eq!(before, after);
    let grads = trainer.full_gradient(&policy, &data).unwrap();
    assert!(grads.keys().all(|k| k.contains("lora_")), "{:?}", grads.keys().collect::<Vec<_>>());
}

#[test]
fn training_steps_lower_the_dpo_loss() {
    let policy = small_policy(PartitionPreset::Pfeddpo, &["c_attn"], DType::F32);
    let data = data(&policy);
    let s = settings();
    let start = evaluate(&policy, &data, &s).unwrap();
    assert!((start.loss - std::f64::consts::LN_2).abs() < 1e-6, "policy == reference gives ln 2");
    let mut trainer = LocalTrainer::new(s, OptimConfig::new(OptimKind::Adamw, 1e-2), 0).unwrap();
    for _ in 0..20 {
        trainer.step(&policy, &data).unwrap();
    }
    let end = evaluate(&policy, &data, &s).unwrap();
    assert!(end.loss < 0.5 * start.loss, "loss {} -> {}", start.loss, end.loss);
    assert_eq!(end.reward_acc, 1.0);
}
