//! Forward logits against transformers' `GPT2LMHeadModel` on a small random checkpoint.
//!
//! Fixtures: `fixtures/golden/gen_golden.py` (transformers + PEFT) wrote the checkpoint in
//! both key layouts and the reference logits in f64.

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use fedpo_model::checkpoint::load_hf_dir;
use fedpo_model::tensor_files::read_safetensors;
use fedpo_model::{LoraConfig, ModelError, Partition, PartitionPreset, Policy, PolicySpec, TensorSource};

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/golden").join(name)
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap();
    let b = b.to_dtype(DType::F64).unwrap();
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
}

fn reference() -> (Tensor, Tensor) {
    let file = read_safetensors(&golden("logits.safetensors"), &Device::Cpu).unwrap();
    let ids = file.tensors.tensors["input_ids"].to_dtype(DType::U32).unwrap();
    (ids, file.tensors.tensors["logits"].clone())
}

fn policy_from(dir: &str, partition: PartitionPreset, dtype: DType) -> Policy {
    let ckpt = load_hf_dir(&golden(dir), &Device::Cpu).unwrap();
    let spec =
        PolicySpec { config: ckpt.config, lora: Some(LoraConfig::default()), partition: Partition::new(partition) };
    Policy::build(spec, Some(&ckpt.base), None, 0, dtype, &Device::Cpu).unwrap()
}

#[test]
fn logits_match_transformers_for_prefixed_keys_within_1e_4() {
    let (ids, expected) = reference();
    let policy = policy_from("hf-prefixed", PartitionPreset::Feddpo, DType::F32);
    let diff = max_abs_diff(&policy.model.forward(&ids).unwrap(), &expected);
    eprintln!("max |logits - transformers| = {diff:.2e}");
    assert!(diff < 1e-4, "max |diff| = {diff}");
}

#[test]
fn logits_match_transformers_for_bare_keys_with_attention_buffers_within_1e_4() {
    let (ids, expected) = reference();
    let policy = policy_from("hf-bare", PartitionPreset::Feddpo, DType::F32);
    let diff = max_abs_diff(&policy.model.forward(&ids).unwrap(), &expected);
    eprintln!("max |logits - transformers| = {diff:.2e}");
    assert!(diff < 1e-4, "max |diff| = {diff}");
}

#[test]
fn logits_in_f64_match_transformers_to_1e_12() {
    let (ids, expected) = reference();
    let policy = policy_from("hf-prefixed", PartitionPreset::Feddpo, DType::F64);
    let diff = max_abs_diff(&policy.model.forward(&ids).unwrap(), &expected);
    eprintln!("f64: max |logits - transformers| = {diff:.2e}");
    assert!(diff < 1e-12, "max |diff| = {diff}");
}

#[test]
fn fresh_adapter_leaves_logits_unchanged() {
    let (ids, _) = reference();
    let plain = policy_from("hf-prefixed", PartitionPreset::Feddpo, DType::F32);
    for preset in [PartitionPreset::Pfeddpo, PartitionPreset::SharedLora] {
        let adapted = policy_from("hf-prefixed", preset, DType::F32);
        assert!(adapted.spec.lora.is_some());
        let diff = max_abs_diff(&plain.model.forward(&ids).unwrap(), &adapted.model.forward(&ids).unwrap());
        assert_eq!(diff, 0.0, "{preset}");
    }
}

#[test]
fn missing_tensor_error_names_the_tensor_and_expected_shape() {
    let ckpt = load_hf_dir(&golden("hf-prefixed"), &Device::Cpu).unwrap();
    let mut base = ckpt.base.clone();
    base.tensors.remove("h.1.mlp.c_fc.weight");
    let spec = PolicySpec { config: ckpt.config, lora: None, partition: Partition::new(PartitionPreset::Feddpo) };
    let err = Policy::build(spec, Some(&base), None, 0, DType::F32, &Device::Cpu).unwrap_err();
    assert!(matches!(err, ModelError::MissingTensor { .. }));
    let msg = err.to_string();
    assert!(msg.contains("h.1.mlp.c_fc.weight") && msg.contains("[32, 128]"), "{msg}");
}

#[test]
fn misshaped_tensor_error_names_expected_and_found_shapes() {
    let ckpt = load_hf_dir(&golden("hf-prefixed"), &Device::Cpu).unwrap();
    let mut base: TensorSource = ckpt.base.clone();
    // An nn.Linear-style [out, in] weight where Conv1D's [in, out] is expected.
    let w = base.tensors["h.0.attn.c_attn.weight"].t().unwrap();
    base.tensors.insert("h.0.attn.c_attn.weight".into(), w);
    let spec = PolicySpec { config: ckpt.config, lora: None, partition: Partition::new(PartitionPreset::Feddpo) };
    let msg = Policy::build(spec, Some(&base), None, 0, DType::F32, &Device::Cpu).unwrap_err().to_string();
    assert!(msg.contains("h.0.attn.c_attn.weight") && msg.contains("[32, 96]") && msg.contains("[96, 32]"), "{msg}");
}

#[test]
fn model_directory_without_config_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let msg = match load_hf_dir(dir.path(), &Device::Cpu) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("loaded an empty directory"),
    };
    assert!(msg.contains("config.json"), "{msg}");
}
