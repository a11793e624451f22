//! Greedy generation with a LoRA adapter against transformers' `generate` + PEFT.
//!
//! Fixture: `fixtures/golden/gen_generate.py`, on the small random GPT-2 and adapter of
//! `gen_golden.py`. Every greedy step there is decided by a logit gap of at least 1e-3, so
//! f32 rounding cannot flip a choice: the ids must be identical.

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use fedpo_model::checkpoint::load_hf_dir;
use fedpo_model::tensor_files::read_safetensors;
use fedpo_model::{
    generate, GenerateSettings, KvCache, LoraConfig, Partition, PartitionPreset, Policy, PolicySpec, Sampling,
    StopReason,
};

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/golden").join(name)
}

fn policy() -> Policy {
    let ckpt = load_hf_dir(&golden("hf-prefixed"), &Device::Cpu).unwrap();
    let adapter = read_safetensors(&golden("lora.safetensors"), &Device::Cpu).unwrap();
    let lora = LoraConfig::new(4, 8.0, &["c_attn"]).unwrap();
    // Nothing trains: the base and the adapter are frozen, as `generate` builds them.
    let spec =
        PolicySpec { config: ckpt.config, lora: Some(lora), partition: Partition::new(PartitionPreset::SharedLora) };
    Policy::build(spec, Some(&ckpt.base), Some(&adapter.tensors), 0, DType::F32, &Device::Cpu).unwrap()
}

fn ids(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::U32).unwrap().to_vec1().unwrap()
}

#[test]
fn greedy_ids_with_and_without_the_adapter_are_those_transformers_and_peft_generate() {
    let fixture = read_safetensors(&golden("generate.safetensors"), &Device::Cpu).unwrap();
    let t = &fixture.tensors.tensors;
    let prompts: usize = fixture.metadata["prompts"].parse().unwrap();
    let new_tokens: usize = fixture.metadata["new_tokens"].parse().unwrap();
    let policy = policy();
    let base = policy.model.base_only();
    let settings = GenerateSettings { max_new_tokens: new_tokens, sampling: Sampling::GREEDY, end_of_text: None };
    for k in 0..prompts {
        let prompt = ids(&t[&format!("prompt.{k}")]);
        let mut streamed = Vec::new();
        let out = generate(&policy.model, &prompt, &settings, |id| {
            streamed.push(id);
            true
        })
        .unwrap();
        assert_eq!(out.ids, ids(&t[&format!("greedy.{k}")]), "prompt {k}, with the adapter");
        assert_eq!(streamed, out.ids, "every token is streamed as chosen");
        assert_eq!(out.stop, StopReason::MaxNewTokens);
        let out = generate(&base, &prompt, &settings, |_| true).unwrap();
        assert_eq!(out.ids, ids(&t[&format!("greedy_base.{k}")]), "prompt {k}, the base alone");
    }
}

#[test]
fn the_cache_gives_the_logits_of_a_full_recompute_on_the_reference_model() {
    let policy = policy();
    let seq: Vec<u32> = (0..40u32).map(|i| (i * 131 + 7) % 512).collect();
    let full = policy.model.forward(&Tensor::new(seq.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap());
    let full = full.unwrap().squeeze(0).unwrap();
    let mut cache = KvCache::new(&policy.model, seq.len()).unwrap();
    let mut rows = vec![policy.model.logits(&policy.model.forward_cached(&seq[..16], &mut cache).unwrap()).unwrap()];
    for id in &seq[16..] {
        rows.push(policy.model.logits(&policy.model.forward_cached(&[*id], &mut cache).unwrap()).unwrap());
    }
    let cached = Tensor::cat(&rows, 0).unwrap();
    let gap: f32 = (cached - full).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap();
    assert!(gap < 1e-5, "cache vs recompute: {gap}");
}

#[test]
fn generation_stops_at_end_of_text_and_when_the_caller_says_so() {
    let fixture = read_safetensors(&golden("generate.safetensors"), &Device::Cpu).unwrap();
    let t = &fixture.tensors.tensors;
    let prompt = ids(&t["prompt.0"]);
    let expected = ids(&t["greedy.0"]);
    let policy = policy();
    // The fifth greedy token declared the end of text: four come back.
    let settings = GenerateSettings { max_new_tokens: 32, sampling: Sampling::GREEDY, end_of_text: Some(expected[4]) };
    let first = expected.iter().position(|&id| id == expected[4]).unwrap();
    let out = generate(&policy.model, &prompt, &settings, |_| true).unwrap();
    assert_eq!((out.ids.as_slice(), out.stop), (&expected[..first], StopReason::EndOfText));
    let settings = GenerateSettings { end_of_text: None, ..settings };
    let out = generate(&policy.model, &prompt, &settings, |id| id != expected[2]).unwrap();
    assert_eq!(out.stop, StopReason::Caller);
    assert_eq!(*out.ids.last().unwrap(), expected[2]);
    // Too long for the model's positions: refused, naming both numbers.
    let settings = GenerateSettings { max_new_tokens: 60, ..settings };
    let err = generate(&policy.model, &prompt, &settings, |_| true).unwrap_err().to_string();
    assert!(err.contains("68") && err.contains("64"), "{err}");
}
