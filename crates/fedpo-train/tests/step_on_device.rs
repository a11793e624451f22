//! The device-resident step (what a GPU runs: loss, norm and clipping as tensor ops, one
//! read per step) against the host step, both on the CPU: the same metrics and parameters.

use candle_core::{DType, Device};
use fedpo_data::TokenizedPair;
use fedpo_model::{Gpt2Config, LoraConfig, Partition, PartitionPreset, Policy, PolicySpec};
use fedpo_train::{
    score_pairs, DpoSettings, LocalTrainer, LossKind, OptimConfig, OptimKind, PreferenceSet, StepMetrics,
};
use rand::{Rng, SeedableRng};

fn policy(dtype: DType) -> Policy {
    let config =
        Gpt2Config { vocab_size: 64, n_positions: 32, n_embd: 16, n_head: 2, n_layer: 2, ..Gpt2Config::tiny() };
    let spec = PolicySpec {
        config,
        lora: Some(LoraConfig::new(2, 4.0, &["c_attn"]).unwrap()),
        partition: Partition::new(PartitionPreset::Pfeddpo),
    };
    Policy::build(spec, None, None, 7, dtype, &Device::Cpu).unwrap()
}

fn data(policy: &Policy) -> PreferenceSet {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let mut ids = |len: usize| (0..len).map(|_| rng.random_range(0..63u32)).collect::<Vec<_>>();
    let pairs: Vec<TokenizedPair> = (0..6)
        .map(|i| TokenizedPair { prompt: ids(3 + i % 3), chosen: ids(2 + i % 4), rejected: ids(5 - i % 3) })
        .collect();
    let reference = score_pairs(policy, &pairs, 6, 63).unwrap();
    PreferenceSet { pairs, reference }
}

/// Five steps from the same start; the metrics of each step and the final parameters.
fn train(on_device: bool, optim: OptimConfig, loss: LossKind, dtype: DType) -> (Vec<StepMetrics>, Vec<Vec<f64>>) {
    let policy = policy(dtype);
    let data = data(&policy);
    let settings = DpoSettings { beta: 0.5, loss, batch_pairs: 4, micro_batch_pairs: 2, pad_id: 63 };
    let mut trainer = LocalTrainer::new(settings, optim, 1).unwrap().with_step_on_device(on_device);
    let metrics = (0..5).map(|_| trainer.step(&policy, &data).unwrap()).collect();
    let params = policy
        .params
        .trainable()
        .map(|p| p.tensor().flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap())
        .collect();
    (metrics, params)
}

fn assert_same_training(what: &str, optim: OptimConfig, loss: LossKind, dtype: DType, tol: f64) {
    let (host, host_params) = train(false, optim, loss, dtype);
    let (device, device_params) = train(true, optim, loss, dtype);
    let close = |a: f64, b: f64| (a - b).abs() <= tol * a.abs().max(b.abs()).max(1e-3);
    for (h, d) in host.iter().zip(&device) {
        assert!(close(h.loss, d.loss), "{what} step {}: loss {} vs {}", h.step, h.loss, d.loss);
        assert!(close(h.grad_norm, d.grad_norm), "{what} step {}: norm {} vs {}", h.step, h.grad_norm, d.grad_norm);
        assert!(close(h.margin, d.margin), "{what} step {}: margin {} vs {}", h.step, h.margin, d.margin);
        assert_eq!(h.reward_acc, d.reward_acc, "{what} step {}", h.step);
        assert_eq!(h.step, d.step);
    }
    assert!(host.last().unwrap().loss < host[0].loss, "{what}: the steps train");
    for (h, d) in host_params.iter().zip(&device_params) {
        for (a, b) in h.iter().zip(d) {
            assert!((a - b).abs() <= tol * a.abs().max(1.0), "{what}: parameter {a} vs {b}");
        }
    }
}

#[test]
fn sgd_steps_on_the_device_path_match_the_host_path() {
    let sgd = OptimConfig::new(OptimKind::Sgd, 0.5);
    assert_same_training("sgd f64", sgd, LossKind::default(), DType::F64, 1e-10);
    assert_same_training("sgd f32", sgd, LossKind::default(), DType::F32, 1e-4);
}

#[test]
fn clipped_adamw_and_ipo_steps_on_the_device_path_match_the_host_path() {
    let adamw = OptimConfig { max_grad_norm: Some(0.05), ..OptimConfig::new(OptimKind::Adamw, 0.01) };
    let (host, _) = train(false, adamw, LossKind::default(), DType::F64);
    assert!(host.iter().all(|m| m.grad_norm > 0.05), "every step clips: {host:?}");
    assert_same_training("adamw clipped f64", adamw, LossKind::default(), DType::F64, 1e-10);
    assert_same_training("adamw clipped f32", adamw, LossKind::default(), DType::F32, 1e-4);
    let smoothed = LossKind::Sigmoid { label_smoothing: 0.1 };
    assert_same_training("sgd label smoothing", OptimConfig::new(OptimKind::Sgd, 0.5), smoothed, DType::F64, 1e-10);
    assert_same_training("ipo", OptimConfig::new(OptimKind::Sgd, 0.05), LossKind::Ipo, DType::F64, 1e-10);
}
