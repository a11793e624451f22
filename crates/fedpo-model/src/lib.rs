//! The policy model of fedpo: GPT-2 family transformers with LoRA adapters in candle.
//!
//! - [`Gpt2Config`]: HF-compatible hyper-parameters and the `tiny` / `distilgpt2` presets;
//! - [`Policy`]: the model with its **shared**, **private** and **frozen** parameter sets
//!   ([`Partition`]), built from a checkpoint or a seeded random init;
//! - [`checkpoint`]: HF directories in, adapters and models out, written atomically;
//! - [`export`]: transformers model and PEFT adapter directories out, PEFT adapters in;
//! - [`generate`]: completions with a [`KvCache`], greedy or sampled ([`Sampling`]);
//! - [`Gpt2Tokenizer`]: the GPT-2 BPE, built offline, optionally renumbered into a
//!   [`TrimmedVocab`] for simulations;
//! - [`ops`]: gradient-correct layer norm, softmax and the fused kernels training relies on.

mod adapter_file;
pub mod checkpoint;
mod config;
mod error;
pub mod export;
mod generate;
mod gpt2;
mod lora;
pub mod ops;
mod params;
mod policy;
mod privacy_boundary;
mod sampler;
mod spilled_start;
pub mod tensor_files;
pub mod tokenizer;
mod trimmed_vocab;
mod weights;

pub use config::{Gpt2Config, GPT2_VOCAB_SIZE};
pub use error::{ModelError, Result};
pub use generate::{fit_prompt, generate, GenerateSettings, Generated, StopReason};
pub use gpt2::{BackwardPass, Gpt2, KvCache};
pub use lora::{LoraConfig, LoraTargets, LORA_MODULES};
pub use params::{Param, ParamKind, ParamRole, ParamStore, Partition, PartitionPreset};
pub use policy::{Policy, PolicySpec};
pub use privacy_boundary::SharedTensor;
pub use sampler::{Sampler, Sampling};
pub use spilled_start::SpilledStart;
pub use tokenizer::Gpt2Tokenizer;
pub use trimmed_vocab::TrimmedVocab;
pub use weights::TensorSource;
