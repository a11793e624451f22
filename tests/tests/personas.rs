//! The synthetic personas disagree for real: a policy trained on one persona's pairs
//! wins on its own held-out pairs and loses on a conflicting persona's. This is the
//! heterogeneity that personalised federated DPO has to cope with.

use candle_core::Device;
use fedpo_data::synthetic::{generate_device, SyntheticSpec};
use fedpo_data::{tokenize_pairs, PreferencePair, TokenizedPair};
use fedpo_model::checkpoint::{load_adapter, save_adapter};
use fedpo_model::{Gpt2Config, Gpt2Tokenizer, LoraConfig, Partition, PartitionPreset, Policy, PolicySpec};
use fedpo_train::{
    evaluate, score_pairs, DpoSettings, EvalMetrics, LocalTrainer, LossKind, OptimConfig, OptimKind, PreferenceSet,
};

fn tokenize(pairs: &[PreferencePair], tok: &Gpt2Tokenizer) -> Vec<TokenizedPair> {
    tokenize_pairs(pairs, |s| tok.encode(s), 128, tok.eos_id()).unwrap()
}

fn set(policy: &Policy, pairs: Vec<TokenizedPair>, pad: u32) -> PreferenceSet {
    let reference = score_pairs(policy, &pairs, 8, pad).unwrap();
    PreferenceSet { pairs, reference }
}

fn eval_on(
    policy: &Policy,
    pairs: &[PreferencePair],
    tok: &Gpt2Tokenizer,
    s: &DpoSettings,
    reference: &Policy,
) -> EvalMetrics {
    evaluate(policy, &set(reference, tokenize(pairs, tok), s.pad_id), s).unwrap()
}

#[test]
fn policy_trained_on_one_persona_beats_chance_on_it_and_loses_on_its_opposite() {
    let tok = Gpt2Tokenizer::gpt2().unwrap();
    let spec = SyntheticSpec { heterogeneity: 1.0, train_pairs: 64, heldout_pairs: 32, seed: 3 };
    let mine = generate_device(&spec, 0).unwrap();
    let theirs = generate_device(&spec, 1).unwrap();

    let policy_spec = PolicySpec {
        config: Gpt2Config::tiny(),
        lora: Some(LoraConfig::default()),
        partition: Partition::new(PartitionPreset::Pfeddpo),
    };
    let reference = Policy::random(policy_spec.clone(), 5, &Device::Cpu).unwrap();
    let policy = Policy::random(policy_spec.clone(), 5, &Device::Cpu).unwrap();
    let s = DpoSettings {
        beta: 0.2,
        loss: LossKind::default(),
        batch_pairs: 8,
        micro_batch_pairs: 8,
        pad_id: tok.eos_id(),
    };
    let train = set(&policy, tokenize(&mine.train, &tok), s.pad_id);
    let mut trainer = LocalTrainer::new(s, OptimConfig::new(OptimKind::Sgd, 0.1), 0).unwrap();
    for _ in 0..25 {
        trainer.step(&policy, &train).unwrap();
    }

    let own = eval_on(&policy, &mine.heldout, &tok, &s, &reference);
    let other = eval_on(&policy, &theirs.heldout, &tok, &s, &reference);
    assert!(own.reward_acc >= 0.8, "own persona held-out accuracy {}", own.reward_acc);
    assert!(
        other.reward_acc <= own.reward_acc - 0.25,
        "own {} vs conflicting persona {}",
        own.reward_acc,
        other.reward_acc
    );

    // The private adapter survives a save/load cycle with its scores intact.
    let dir = fedpo_tests::TestDir::new();
    let path = dir.path().join("adapter.safetensors");
    save_adapter(&policy, &path).unwrap();
    let saved = load_adapter(&path, &Device::Cpu).unwrap();
    let base: Vec<(String, candle_core::Tensor)> =
        policy.params.with_kind(fedpo_model::ParamKind::Base).map(|p| (p.name.clone(), p.tensor().clone())).collect();
    let base = fedpo_model::TensorSource { tensors: base.into_iter().collect(), description: "trained base".into() };
    let reloaded =
        Policy::build(policy_spec, Some(&base), Some(&saved.tensors), 0, candle_core::DType::F32, &Device::Cpu)
            .unwrap();
    let again = eval_on(&reloaded, &mine.heldout, &tok, &s, &reference);
    assert_eq!(again.reward_acc, own.reward_acc);
    assert!((again.loss - own.loss).abs() < 1e-9);
}
