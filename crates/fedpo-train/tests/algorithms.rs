//! The federated local terms on a small random model: FedGA's penalty gradient against a
//! numerical derivative of the penalty itself, and FedProx holding the local model at the
//! global one.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor, Var};
use fedpo_data::TokenizedPair;
use fedpo_model::{Gpt2Config, LoraConfig, ParamKind, ParamRole, Partition, PartitionPreset, Policy, PolicySpec};
use fedpo_train::algorithms::{Alignment, AlignmentMode, Grads, Granularity, LocalTerms, Proximal};
use fedpo_train::{score_pairs, DpoSettings, LocalTrainer, LossKind, OptimConfig, OptimKind, PreferenceSet};
use rand::{Rng, SeedableRng};

fn policy(preset: PartitionPreset) -> Policy {
    let config =
        Gpt2Config { vocab_size: 64, n_positions: 32, n_embd: 16, n_head: 2, n_layer: 2, ..Gpt2Config::tiny() };
    let lora = Some(LoraConfig::new(2, 4.0, &["c_attn"]).unwrap());
    Policy::build(
        PolicySpec { config, lora, partition: Partition::new(preset) },
        None,
        None,
        5,
        DType::F64,
        &Device::Cpu,
    )
    .unwrap()
}

fn data(policy: &Policy) -> PreferenceSet {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let mut ids = |len: usize| (0..len).map(|_| rng.random_range(0..63u32)).collect::<Vec<_>>();
    let pairs: Vec<TokenizedPair> = (0..4)
        .map(|i| TokenizedPair { prompt: ids(3 + i % 2), chosen: ids(2 + i % 3), rejected: ids(4 - i % 2) })
        .collect();
    let reference = score_pairs(policy, &pairs, 4, 63).unwrap();
    PreferenceSet { pairs, reference }
}

fn trainer(lr: f64) -> LocalTrainer {
    let settings =
        DpoSettings { beta: 0.5, loss: LossKind::default(), batch_pairs: 4, micro_batch_pairs: 2, pad_id: 63 };
    LocalTrainer::new(settings, OptimConfig::new(OptimKind::Sgd, lr), 0).unwrap()
}

fn random_like(t: &Tensor, std: f64, rng: &mut impl Rng) -> Tensor {
    let v: Vec<f64> = (0..t.elem_count()).map(|_| rng.random_range(-std..std)).collect();
    Tensor::from_vec(v, t.shape(), &Device::Cpu).unwrap()
}

fn shared(policy: &Policy) -> Grads {
    policy.params.with_role(ParamRole::Shared).map(|p| (p.name.clone(), p.tensor().copy().unwrap())).collect()
}

fn dot(a: &Grads, b: &Grads) -> f64 {
    a.iter()
        .filter_map(|(n, x)| b.get(n).map(|y| (x * y).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()))
        .sum()
}

/// Moves every trainable parameter by `h·e`.
fn shift(policy: &Policy, e: &Grads, h: f64) {
    for p in policy.params.trainable() {
        let var: &Var = p.var().unwrap();
        var.set(&(var.as_tensor() + (&e[&p.name] * h).unwrap()).unwrap()).unwrap();
    }
}

/// Checks ⟨∇P, e⟩ against (P(θ + h·e) − P(θ − h·e)) / 2h along a random direction.
fn check_against_numerical_derivative(granularity: Granularity, mode: AlignmentMode, weights: BTreeMap<String, f64>) {
    let policy = policy(PartitionPreset::Pfeddpo);
    let data = data(&policy);
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    for p in policy.params.with_kind(ParamKind::Adapter) {
        p.var().unwrap().set(&random_like(p.tensor(), 0.3, &mut rng)).unwrap();
    }
    let anchor = shared(&policy);
    let trainer = trainer(0.5);
    // Step away from the anchor so the displacement is not zero.
    let g0 = trainer.full_gradient(&policy, &data).unwrap();
    let mut first = trainer;
    first.step(&policy, &data).unwrap();
    let trainer = first;
    let reference: Grads = policy
        .params
        .with_role(ParamRole::Shared)
        .map(|p| (p.name.clone(), (&g0[&p.name] + random_like(&g0[&p.name], 0.01, &mut rng)).unwrap()))
        .collect();
    let alignment = Alignment::new(0.7, granularity, weights, mode, reference, anchor.clone()).unwrap();

    let penalty_at = |policy: &Policy| -> f64 {
        match mode {
            AlignmentMode::Displacement => {
                let x: Grads = anchor
                    .iter()
                    .map(|(n, a)| (n.clone(), (a - policy.params.get(n).unwrap().tensor()).unwrap()))
                    .collect();
                alignment.penalty(&x).unwrap()
            }
            AlignmentMode::FiniteDifference { .. } => {
                alignment.penalty(&trainer.full_gradient(policy, &data).unwrap()).unwrap()
            }
        }
    };
    let g = trainer.full_gradient(&policy, &data).unwrap();
    let before: Vec<Vec<f64>> =
        policy.params.trainable().map(|p| p.tensor().flatten_all().unwrap().to_vec1().unwrap()).collect();
    let regrad = || trainer.full_gradient(&policy, &data);
    let (value, grad) = alignment.penalty_gradient(&policy, &g, &regrad).unwrap();
    let after: Vec<Vec<f64>> =
        policy.params.trainable().map(|p| p.tensor().flatten_all().unwrap().to_vec1().unwrap()).collect();
    assert_eq!(before, after, "the Hessian-vector product must restore the parameters exactly");
    assert!((value - penalty_at(&policy)).abs() < 1e-12);
    assert!(value > 1e-4, "a penalty of {value} tests nothing");

    let e: Grads =
        policy.params.trainable().map(|p| (p.name.clone(), random_like(p.tensor(), 1.0, &mut rng))).collect();
    let h = if mode == AlignmentMode::Displacement { 1e-7 } else { 1e-5 };
    shift(&policy, &e, h);
    let up = penalty_at(&policy);
    shift(&policy, &e, -2.0 * h);
    let down = penalty_at(&policy);
    shift(&policy, &e, h);
    let numeric = (up - down) / (2.0 * h);
    let analytic = dot(&grad, &e);
    assert!(numeric.abs() > 1e-5, "{granularity:?}/{mode:?}: derivative {numeric} too small to test");
    assert!(
        (numeric - analytic).abs() <= 1e-4 * numeric.abs(),
        "{granularity:?}/{mode:?}: numeric {numeric} vs penalty gradient {analytic}"
    );
}

#[test]
fn fedga_full_model_penalty_gradient_matches_numerical_derivative() {
    let mode = AlignmentMode::FiniteDifference { rel_step: 1e-6 };
    check_against_numerical_derivative(Granularity::Full, mode, BTreeMap::new());
}

#[test]
fn fedga_weighted_layer_penalty_gradient_matches_numerical_derivative() {
    let weights =
        BTreeMap::from([("wte".to_string(), 0.0), ("h.0.attn".to_string(), 2.5), ("h.1.mlp".to_string(), 0.5)]);
    check_against_numerical_derivative(Granularity::Layer, AlignmentMode::FiniteDifference { rel_step: 1e-6 }, weights);
}

#[test]
fn fedga_displacement_penalty_gradient_matches_numerical_derivative() {
    check_against_numerical_derivative(Granularity::Layer, AlignmentMode::Displacement, BTreeMap::new());
}

/// ‖θ_shared − θ_global‖ after `steps` local steps with FedProx's μ.
fn drift_after(mu: f64, lr: f64, steps: usize) -> (f64, f64) {
    let policy = policy(PartitionPreset::Feddpo);
    let data = data(&policy);
    let anchor = shared(&policy);
    let terms = LocalTerms { proximal: Some(Proximal::new(mu, anchor.clone()).unwrap()), ..LocalTerms::default() };
    let mut trainer = trainer(lr).with_terms(terms);
    let g_norm =
        dot(&trainer.full_gradient(&policy, &data).unwrap(), &trainer.full_gradient(&policy, &data).unwrap()).sqrt();
    for _ in 0..steps {
        trainer.step(&policy, &data).unwrap();
    }
    let theta = shared(&policy);
    let drift: Grads = theta.iter().map(|(n, t)| (n.clone(), (t - &anchor[n]).unwrap())).collect();
    (dot(&drift, &drift).sqrt(), g_norm)
}

#[test]
fn fedprox_with_very_large_mu_keeps_the_local_model_at_the_global_one() {
    let (lr, steps) = (1e-4, 20);
    let (free, g) = drift_after(0.0, lr, steps);
    let (held, _) = drift_after(1e4, lr, steps);
    // Without the term SGD walks about steps·lr·‖g‖; with it the model settles within
    // ‖g‖/μ of the global one, the proximal objective's minimiser.
    assert!(free > 0.5 * steps as f64 * lr * g, "free drift {free}, ‖g‖ {g}");
    assert!(held <= 1.05 * g / 1e4, "held drift {held} exceeds ‖g‖/μ = {}", g / 1e4);
    assert!(held < free / 10.0, "μ = 1e4 drifted {held}, μ = 0 drifted {free}");
}
