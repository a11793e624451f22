//! A pair run as one sequence that forks after its prompt scores exactly as its two rows:
//! the same log-probs and the same gradient for every trainable tensor, on the fused and the
//! composed path, with prompts and responses of uneven lengths and padding.

use candle_core::{DType, Device, Tensor};
use fedpo_data::{collate, TokenizedPair};
use fedpo_model::{Gpt2Config, LoraConfig, Partition, PartitionPreset, Policy, PolicySpec};
use fedpo_train::logps::{sequence_logps, BatchTensors};
use rand::{Rng, SeedableRng};

fn small_policy(preset: PartitionPreset, dtype: DType) -> Policy {
    let config =
        Gpt2Config { vocab_size: 64, n_positions: 32, n_embd: 16, n_head: 2, n_layer: 2, ..Gpt2Config::tiny() };
    let lora = LoraConfig::new(2, 4.0, &["c_attn", "mlp.c_fc"]).unwrap();
    let spec = PolicySpec { config, lora: Some(lora), partition: Partition::new(preset) };
    Policy::build(spec, None, None, 7, dtype, &Device::Cpu).unwrap()
}

/// Prompts of 1 to 5 tokens, chosen responses of 0 to 4 and rejected ones of 1 to 6, so the
/// rows pad differently and one chosen response is empty.
fn uneven_pairs(n: usize, seed: u64) -> Vec<TokenizedPair> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut ids = |len: usize| (0..len).map(|_| rng.random_range(0..63u32)).collect::<Vec<_>>();
    (0..n)
        .map(|i| TokenizedPair { prompt: ids(1 + (i * 2) % 5), chosen: ids(i % 5), rejected: ids(6 - i % 6) })
        .collect()
}

fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap()
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// Log-probs and, for `sum(w_i * logp_i)`, every trainable tensor's gradient by name.
fn logps_and_grads(policy: &Policy, batch: &BatchTensors) -> (Vec<f64>, Vec<(String, Vec<f64>)>) {
    let logps = sequence_logps(policy, batch).unwrap();
    let n = logps.dim(0).unwrap();
    let weights: Vec<f64> = (0..n).map(|i| 0.5 + i as f64 * 0.25).collect();
    let weights = Tensor::from_vec(weights, n, &Device::Cpu).unwrap().to_dtype(logps.dtype()).unwrap();
    let loss = (&logps * weights).unwrap().sum_all().unwrap();
    let grads = policy.model.backward(&loss).unwrap();
    let by_name = policy
        .params
        .trainable()
        .map(|p| {
            (p.name.clone(), values(grads.get(p.tensor()).unwrap_or_else(|| panic!("{} has no gradient", p.name))))
        })
        .collect();
    (values(&logps), by_name)
}

fn assert_forked_matches_rows(policy: &Policy, tolerance: f64) {
    let pairs = uneven_pairs(6, 3);
    let batch = collate(&pairs.iter().collect::<Vec<_>>(), 63);
    let forked = BatchTensors::new(&batch, policy).unwrap();
    let rows = BatchTensors::unshared(&batch, policy.model_dtype(), &policy.model_device()).unwrap();
    let ((s_f, t_f), (s_r, t_r)) = (forked.grid().unwrap(), rows.grid().unwrap());
    assert!(!forked.forks.is_none(), "the batch ran as rows");
    assert!(rows.forks.is_none());
    assert_eq!((s_f, s_r), (6, 12));
    assert!(s_f * t_f < s_r * t_r, "forked {s_f} x {t_f} is not smaller than {s_r} x {t_r}");
    let (lp_f, g_f) = logps_and_grads(policy, &forked);
    let (lp_r, g_r) = logps_and_grads(policy, &rows);
    assert_eq!(lp_f.len(), 12);
    assert!(lp_r.iter().all(|v| v.is_finite()));
    let lp_err = max_diff(&lp_f, &lp_r);
    assert!(lp_err < tolerance, "log-probs differ by {lp_err}: {lp_f:?} vs {lp_r:?}");
    // the empty chosen response of pair 0 scores exactly zero either way
    assert_eq!((lp_f[0], lp_r[0]), (0.0, 0.0));
    for ((name, a), (_, b)) in g_f.iter().zip(&g_r) {
        let scale = b.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        let err = max_diff(a, b) / scale;
        assert!(err < tolerance, "{name}: gradients differ by {err} (relative)");
    }
}

#[test]
fn a_forked_pair_scores_and_trains_as_its_two_rows_on_the_fused_path() {
    assert_forked_matches_rows(&small_policy(PartitionPreset::Pfeddpo, DType::F64), 1e-10);
}

#[test]
fn a_forked_pair_scores_and_trains_as_its_two_rows_on_the_composed_path() {
    let mut policy = small_policy(PartitionPreset::Pfeddpo, DType::F64);
    policy.model.set_fused_blocks(false);
    assert_forked_matches_rows(&policy, 1e-10);
}

#[test]
fn a_forked_pair_in_f32_stays_within_rounding_of_its_two_rows() {
    assert_forked_matches_rows(&small_policy(PartitionPreset::Pfeddpo, DType::F32), 1e-4);
    assert_forked_matches_rows(&small_policy(PartitionPreset::SharedLora, DType::F32), 1e-4);
}

#[test]
fn rows_that_do_not_share_their_prompt_run_as_rows() {
    let pairs = uneven_pairs(2, 5);
    let mut batch = collate(&pairs.iter().collect::<Vec<_>>(), 63);
    // the rejected row of pair 0 gets another first prompt token
    let t = batch.seq_len;
    batch.input_ids[2 * t] = (batch.input_ids[2 * t] + 1) % 63;
    let tensors = BatchTensors::for_width(&batch, (16, 1024), DType::F32, &Device::Cpu).unwrap();
    assert!(tensors.forks.is_none());
    assert_eq!(tensors.grid().unwrap(), (4, t));
}

#[test]
fn short_prompts_with_long_responses_run_as_rows_where_forking_would_cost_more() {
    // a 1-token prompt saves one token's projections (12 x 768 per token and channel) but
    // a 1 + 300 + 300 sequence attends over twice as many keys as 1 + 300: rows are cheaper
    let pair = TokenizedPair { prompt: vec![1], chosen: vec![2; 300], rejected: vec![3; 300] };
    let batch = collate(&[&pair], 0);
    let long = BatchTensors::for_width(&batch, (768, 1024), DType::F32, &Device::Cpu).unwrap();
    assert!(long.forks.is_none());
    assert_eq!(long.grid().unwrap(), (2, 301));
    // a long prompt with the same responses forks
    let pair = TokenizedPair { prompt: vec![1; 300], chosen: vec![2; 300], rejected: vec![3; 300] };
    let forked = BatchTensors::for_width(&collate(&[&pair], 0), (768, 1024), DType::F32, &Device::Cpu).unwrap();
    assert!(!forked.forks.is_none());
    assert_eq!(forked.grid().unwrap(), (1, 900));
}

#[test]
fn a_batch_whose_rows_fit_the_positions_is_scored_even_where_forked_padding_would_not_fit() {
    let policy = small_policy(PartitionPreset::Feddpo, DType::F32);
    let long = TokenizedPair { prompt: vec![5; 10], chosen: vec![6; 15], rejected: vec![7; 15] };
    let short = TokenizedPair { prompt: vec![5; 2], chosen: vec![6; 1], rejected: vec![7; 1] };
    // Each row fits in 32 positions (10 + 15 and 2 + 1); forked, the grid is 40 wide and
    // pair 1's padding would sit at positions up to 40 − 1 − 1 = 38.
    let batch = collate(&[&long, &short], 0);
    let tensors = BatchTensors::for_width(&batch, (16, 32), DType::F32, &Device::Cpu).unwrap();
    assert!(tensors.forks.is_none(), "the forked layout would need 39 positions of 32");
    let logps = sequence_logps(&policy, &tensors).unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(logps.len(), 4);
    assert!(logps.iter().all(|v| v.is_finite()));
    // With room for the padding the same batch forks.
    let roomy = BatchTensors::for_width(&batch, (16, 1024), DType::F32, &Device::Cpu).unwrap();
    assert!(!roomy.forks.is_none());
}
