//! Saving and loading adapters and whole models.

use candle_core::{DType, Device, Tensor};
use fedpo_model::checkpoint::{load_adapter, load_hf_dir, save_adapter, save_model_dir};
use fedpo_model::{
    Gpt2Config, LoraConfig, ModelError, ParamKind, ParamRole, Partition, PartitionPreset, Policy, PolicySpec,
};

fn tiny_spec(preset: PartitionPreset, targets: &[&str]) -> PolicySpec {
    let config =
        Gpt2Config { vocab_size: 97, n_positions: 32, n_embd: 16, n_head: 2, n_layer: 2, ..Gpt2Config::tiny() };
    PolicySpec { config, lora: Some(LoraConfig::new(4, 8.0, targets).unwrap()), partition: Partition::new(preset) }
}

fn ids() -> Tensor {
    Tensor::new(&[[1u32, 5, 9, 42, 7, 3]], &Device::Cpu).unwrap()
}

/// Gives every adapter tensor non-zero values so a round trip is meaningful: the same
/// values every run (a Weyl sequence in [-0.5, 0.5)), so a tolerance is checked against
/// one model and not a fresh random draw each time.
fn perturb_adapter(policy: &Policy) {
    for (k, p) in policy.params.with_kind(ParamKind::Adapter).enumerate() {
        let v = p.var().expect("adapter is trainable");
        let values: Vec<f32> =
            (0..v.elem_count()).map(|i| ((i + 7919 * k) as f64 * 0.618_033_988_75).fract() as f32 - 0.5).collect();
        v.set(&Tensor::from_vec(values, v.shape(), &Device::Cpu).unwrap()).unwrap();
    }
}

#[test]
fn saved_adapter_reloads_to_identical_logits_with_its_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("adapter.safetensors");
    let spec = tiny_spec(PartitionPreset::Pfeddpo, &["c_attn", "mlp.c_fc"]);
    let policy = Policy::random(spec.clone(), 1, &Device::Cpu).unwrap();
    perturb_adapter(&policy);
    save_adapter(&policy, &path).unwrap();

    let saved = load_adapter(&path, &Device::Cpu).unwrap();
    assert_eq!(saved.lora, spec.lora.clone().unwrap());
    assert!(saved.base_hash.is_some());
    let reloaded = Policy::build(spec, None, Some(&saved.tensors), 1, DType::F32, &Device::Cpu).unwrap();
    let a = policy.model.forward(&ids()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = reloaded.model.forward(&ids()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(a, b);
}

#[test]
fn adapter_of_another_rank_is_rejected_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("adapter.safetensors");
    let policy = Policy::random(tiny_spec(PartitionPreset::Pfeddpo, &["c_attn"]), 1, &Device::Cpu).unwrap();
    save_adapter(&policy, &path).unwrap();
    let saved = load_adapter(&path, &Device::Cpu).unwrap();
    let mut spec = tiny_spec(PartitionPreset::Pfeddpo, &["c_attn"]);
    spec.lora = Some(LoraConfig::new(8, 16.0, &["c_attn"]).unwrap());
    let err = Policy::build(spec, None, Some(&saved.tensors), 1, DType::F32, &Device::Cpu).unwrap_err();
    assert!(matches!(err, ModelError::ShapeMismatch { .. }), "{err}");
    assert!(err.to_string().contains("lora_A"), "{err}");
}

#[test]
fn saved_model_directory_loads_back_as_an_hf_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let spec = tiny_spec(PartitionPreset::Feddpo, &["c_attn"]);
    let policy = Policy::random(spec.clone(), 3, &Device::Cpu).unwrap();
    save_model_dir(&policy, dir.path()).unwrap();
    let ckpt = load_hf_dir(dir.path(), &Device::Cpu).unwrap();
    assert_eq!(ckpt.config, spec.config);
    let reloaded = Policy::build(spec, Some(&ckpt.base), None, 99, DType::F32, &Device::Cpu).unwrap();
    let a = policy.model.forward(&ids()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = reloaded.model.forward(&ids()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(a, b);
}

#[test]
fn partitions_assign_the_documented_roles() {
    let count = |preset, role| {
        let p = Policy::random(tiny_spec(preset, &["c_attn"]), 0, &Device::Cpu).unwrap();
        p.params.with_role(role).count()
    };
    // 2 blocks x 1 target x (A, B) = 4 adapter tensors; base = 2 + 2*12 + 2 = 28 tensors.
    assert_eq!(count(PartitionPreset::Pfeddpo, ParamRole::Private), 4);
    assert_eq!(count(PartitionPreset::Pfeddpo, ParamRole::Shared), 28);
    assert_eq!(count(PartitionPreset::SharedLora, ParamRole::Shared), 4);
    assert_eq!(count(PartitionPreset::SharedLora, ParamRole::Frozen), 28);
    assert_eq!(count(PartitionPreset::Feddpo, ParamRole::Private), 0);
    let frozen_emb = Partition { preset: PartitionPreset::Pfeddpo, freeze_embeddings: true };
    let p = Policy::random(
        PolicySpec { partition: frozen_emb, ..tiny_spec(PartitionPreset::Pfeddpo, &["c_attn"]) },
        0,
        &Device::Cpu,
    )
    .unwrap();
    assert_eq!(p.params.get("wte.weight").unwrap().role, ParamRole::Frozen);
    assert!(p.params.get("wte.weight").unwrap().var().is_none());
}

#[test]
fn sequence_longer_than_positions_is_an_error_naming_the_limit() {
    let policy = Policy::random(tiny_spec(PartitionPreset::Feddpo, &["c_attn"]), 0, &Device::Cpu).unwrap();
    let long = Tensor::zeros((1, 33), DType::U32, &Device::Cpu).unwrap();
    let msg = policy.model.forward(&long).unwrap_err().to_string();
    assert!(msg.contains("33") && msg.contains("32"), "{msg}");
}

#[test]
fn an_adapter_changes_the_logits_alike_whether_the_base_trains_or_is_frozen() {
    // A trainable base folds the adapter into its weights; a frozen one adds its output.
    let targets = ["c_attn", "mlp.c_fc", "mlp.c_proj"];
    let trained = Policy::random(tiny_spec(PartitionPreset::Pfeddpo, &targets), 4, &Device::Cpu).unwrap();
    let frozen = Policy::random(tiny_spec(PartitionPreset::SharedLora, &targets), 4, &Device::Cpu).unwrap();
    let before = frozen.model.forward(&ids()).unwrap();
    perturb_adapter(&trained);
    for p in trained.params.with_kind(ParamKind::Adapter) {
        frozen.params.get(&p.name).unwrap().var().unwrap().set(p.tensor()).unwrap();
    }
    let a = trained.model.forward(&ids()).unwrap();
    let b = frozen.model.forward(&ids()).unwrap();
    let diff = |x: &Tensor, y: &Tensor| (x - y).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    let scale = a.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(diff(&a, &b) < 1e-5 * scale, "paths differ by {} (scale {scale})", diff(&a, &b));
    assert!(diff(&before, &b) > 1e-2 * scale, "the adapter must change the logits");
}
