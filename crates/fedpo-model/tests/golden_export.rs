//! The exported directories load in transformers and PEFT with fedpo's logits, and a PEFT
//! adapter made in Python loads in fedpo with Python's.
//!
//! Fixtures: fedpo exports the golden model and adapter of `gen_golden.py` into
//! `fixtures/golden/export/` (this test rewrites them when `FEDPO_WRITE_FIXTURES=1`), and
//! `fixtures/golden/gen_export.py` loads them with `GPT2LMHeadModel.from_pretrained` and
//! `PeftModel.from_pretrained`, makes a PEFT adapter of its own (`peft-adapter/`), and
//! records the logits of each in f64 (`export_logits.safetensors`).

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use fedpo_model::checkpoint::{load_adapter, load_hf_dir};
use fedpo_model::export::{write_dir_atomically, write_peft_dir, write_transformers_dir};
use fedpo_model::tensor_files::read_safetensors;
use fedpo_model::{LoraConfig, Partition, PartitionPreset, Policy, PolicySpec};

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/golden").join(name)
}

fn policy(adapter: &Path, dtype: DType) -> Policy {
    let ckpt = load_hf_dir(&golden("hf-prefixed"), &Device::Cpu).unwrap();
    let saved = load_adapter(adapter, &Device::Cpu).unwrap();
    let spec = PolicySpec {
        config: ckpt.config,
        lora: Some(saved.lora),
        partition: Partition::new(PartitionPreset::SharedLora),
    };
    Policy::build(spec, Some(&ckpt.base), Some(&saved.tensors), 0, dtype, &Device::Cpu).unwrap()
}

fn export(policy: &Policy, root: &Path, force: bool) {
    write_dir_atomically(&root.join("model"), force, |d| write_transformers_dir(policy, None, false, d)).unwrap();
    write_dir_atomically(&root.join("merged"), force, |d| write_transformers_dir(policy, None, true, d)).unwrap();
    write_dir_atomically(&root.join("adapter"), force, |d| write_peft_dir(policy, "fixtures/golden/export/model", d))
        .unwrap();
}

fn logits(policy: &Policy, ids: &Tensor) -> Tensor {
    policy.model.forward(ids).unwrap().to_dtype(DType::F64).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
}

/// Every tensor and JSON file of `a` equals `b`'s.
fn same_dir(a: &Path, b: &Path) {
    let mut names: Vec<_> = std::fs::read_dir(a).unwrap().map(|e| e.unwrap().file_name()).collect();
    names.sort();
    for name in names {
        let (x, y) = (a.join(&name), b.join(&name));
        if name.to_string_lossy().ends_with(".json") {
            let read = |p: &Path| serde_json::from_slice::<serde_json::Value>(&std::fs::read(p).unwrap()).unwrap();
            assert_eq!(read(&x), read(&y), "{}", y.display());
        } else {
            let (x, y) = (read_safetensors(&x, &Device::Cpu).unwrap(), read_safetensors(&y, &Device::Cpu).unwrap());
            assert_eq!(x.tensors.tensors.len(), y.tensors.tensors.len());
            for (k, t) in &x.tensors.tensors {
                let u = &y.tensors.tensors[k];
                assert_eq!(max_diff(&t.to_dtype(DType::F64).unwrap(), &u.to_dtype(DType::F64).unwrap()), 0.0, "{k}");
            }
        }
    }
}

#[test]
fn exported_directories_give_transformers_and_peft_the_logits_of_fedpo() {
    let exported = golden("export");
    let f32_policy = policy(&golden("lora.safetensors"), DType::F32);
    if std::env::var_os("FEDPO_WRITE_FIXTURES").is_some() {
        export(&f32_policy, &exported, true);
    }
    // What fedpo writes today is what Python read.
    let fresh = tempfile::tempdir().unwrap();
    export(&f32_policy, fresh.path(), false);
    for dir in ["model", "merged", "adapter"] {
        same_dir(&fresh.path().join(dir), &exported.join(dir));
    }
    let reference = read_safetensors(&golden("export_logits.safetensors"), &Device::Cpu).unwrap().tensors.tensors;
    let ids = reference["input_ids"].to_dtype(DType::U32).unwrap();
    // transformers + PEFT on the exported directories, against fedpo in f64 on the same
    // f32 values: the adapter applied, merged into the weights, and the base alone.
    let ours = logits(&policy(&golden("lora.safetensors"), DType::F64), &ids);
    let gap = max_diff(&ours, &reference["peft"]);
    assert!(gap < 1e-5, "PeftModel on export/model + export/adapter: {gap}");
    let gap = max_diff(&ours, &reference["merged"]);
    assert!(gap < 1e-5, "GPT2LMHeadModel on export/merged: {gap}");
    let base = f32_policy.model.base_only().forward(&ids).unwrap().to_dtype(DType::F64).unwrap();
    let gap = max_diff(&base, &reference["base"]);
    assert!(gap < 1e-4, "GPT2LMHeadModel on export/model (f32): {gap}");
}

#[test]
fn a_peft_adapter_made_in_python_loads_with_its_logits() {
    let reference = read_safetensors(&golden("export_logits.safetensors"), &Device::Cpu).unwrap().tensors.tensors;
    let ids = reference["input_ids"].to_dtype(DType::U32).unwrap();
    let dir = golden("peft-adapter");
    let saved = load_adapter(&dir, &Device::Cpu).unwrap();
    assert_eq!(saved.lora, LoraConfig::new(2, 5.0, &["c_attn", "mlp.c_fc"]).unwrap());
    let ours = logits(&policy(&dir, DType::F64), &ids);
    let gap = max_diff(&ours, &reference["python_adapter"]);
    assert!(gap < 1e-5, "fedpo with the PEFT adapter: {gap}");
}

#[test]
fn an_export_refuses_to_overwrite_without_force() {
    let root = tempfile::tempdir().unwrap();
    let p = policy(&golden("lora.safetensors"), DType::F32);
    export(&p, root.path(), false);
    let again = write_dir_atomically(&root.path().join("adapter"), false, |d| write_peft_dir(&p, "base", d));
    assert!(again.unwrap_err().to_string().contains("--force"));
    export(&p, root.path(), true);
}
