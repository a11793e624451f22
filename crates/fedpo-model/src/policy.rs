//! A policy: the GPT-2 model together with its named parameter sets and the settings that
//! built it. This is the unit the trainer trains and the checkpoint code saves.

use candle_core::{DType, Device};
use serde::{Deserialize, Serialize};

use crate::config::Gpt2Config;
use crate::error::{ModelError, Result};
use crate::gpt2::Gpt2;
use crate::lora::LoraConfig;
use crate::params::{ParamStore, Partition};
use crate::weights::{ParamBuilder, TensorSource};

/// Everything needed to rebuild a policy's structure (not its values).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicySpec {
    /// The model's hyper-parameters.
    pub config: Gpt2Config,
    /// The adapter, when the partition uses one.
    pub lora: Option<LoraConfig>,
    /// Which tensors are shared, private or frozen.
    pub partition: Partition,
}

/// The trainable model with its parameter sets.
#[derive(Debug, Clone)]
pub struct Policy {
    /// The network.
    pub model: Gpt2,
    /// Every parameter, by name and role.
    pub params: ParamStore,
    /// How it was built.
    pub spec: PolicySpec,
}

impl Policy {
    /// Builds a policy. `base` provides the base tensors (random GPT-2 init when `None`),
    /// `adapter` a saved adapter (a fresh one when `None`). `seed` drives every random init.
    pub fn build(
        spec: PolicySpec,
        base: Option<&TensorSource>,
        adapter: Option<&TensorSource>,
        seed: u64,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let lora = if spec.partition.uses_adapter() { spec.lora.clone() } else { None };
        let mut builder = ParamBuilder::new(base, adapter, seed, dtype, device, spec.partition);
        let model = Gpt2::load(&mut builder, &spec.config, lora.as_ref())?;
        let spec = PolicySpec { lora, ..spec };
        Ok(Self { model, params: builder.store, spec })
    }

    /// A randomly initialised policy (GPT-2's initialiser), e.g. the `tiny` demo model.
    pub fn random(spec: PolicySpec, seed: u64, device: &Device) -> Result<Self> {
        Self::build(spec, None, None, seed, DType::F32, device)
    }

    /// The dtype of the parameters and of the logits (batch masks use it).
    pub fn model_dtype(&self) -> DType {
        self.model.dtype()
    }

    /// Mixed precision: matmuls and activations in `compute` (`bf16` or `f16`), parameters,
    /// gradients, reductions and logits in the master dtype. Half precision over an f64
    /// model, or anything but a float type, is refused.
    pub fn set_compute_dtype(&mut self, compute: DType) -> Result<()> {
        let ok = compute == self.model.dtype()
            || (self.model.dtype() == DType::F32 && matches!(compute, DType::BF16 | DType::F16));
        if !ok {
            return Err(ModelError::InvalidConfig(format!(
                "compute dtype {compute:?} over {:?} parameters; use f32 parameters with bf16 or f16 compute",
                self.model.dtype()
            )));
        }
        self.model.set_compute_dtype(compute);
        Ok(())
    }

    /// The device the model lives on.
    pub fn model_device(&self) -> Device {
        self.model.device().clone()
    }
}
