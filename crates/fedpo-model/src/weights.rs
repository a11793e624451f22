//! Where a model's tensors come from: a checkpoint, or a seeded random initialisation.
//!
//! [`ParamBuilder`] walks the model like candle's `VarBuilder` walks a checkpoint. For each
//! tensor it checks the shape, asks the [`Partition`] for its role, and registers it in the
//! [`ParamStore`] as a trainable `Var` or a frozen tensor. A missing or mis-shaped tensor
//! is an error naming the tensor, the expected and the found shape.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal, Uniform};

use crate::error::{ModelError, Result};
use crate::params::{ParamKind, ParamStore, Partition};

/// Named tensors read from a checkpoint, with a description of where they came from.
#[derive(Debug, Clone, Default)]
pub struct TensorSource {
    /// Tensors by checkpoint name (without any `transformer.` prefix).
    pub tensors: HashMap<String, Tensor>,
    /// For error messages, e.g. the file path.
    pub description: String,
}

/// How a tensor is initialised when no checkpoint provides it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Init {
    Normal(f64),
    Uniform(f64),
    Zeros,
    Ones,
}

pub(crate) struct ParamBuilder<'a> {
    base: Option<&'a TensorSource>,
    adapter: Option<&'a TensorSource>,
    seed: u64,
    dtype: DType,
    device: Device,
    partition: Partition,
    pub(crate) store: ParamStore,
}

impl<'a> ParamBuilder<'a> {
    pub(crate) fn new(
        base: Option<&'a TensorSource>,
        adapter: Option<&'a TensorSource>,
        seed: u64,
        dtype: DType,
        device: &Device,
        partition: Partition,
    ) -> Self {
        Self { base, adapter, seed, dtype, device: device.clone(), partition, store: ParamStore::default() }
    }

    pub(crate) fn partition(&self) -> Partition {
        self.partition
    }

    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    pub(crate) fn device(&self) -> &Device {
        &self.device
    }

    /// A base-model tensor.
    pub(crate) fn base(&mut self, name: &str, shape: &[usize], init: Init) -> Result<Tensor> {
        let value = match self.base {
            Some(src) => take(src, name, shape, self.dtype, &self.device)?,
            None => self.random(name, shape, init)?,
        };
        let role = self.partition.base_role(name);
        self.store.register(name.to_string(), role, ParamKind::Base, value)
    }

    /// A LoRA tensor: from the adapter file when one is given, else initialised.
    pub(crate) fn adapter(&mut self, name: &str, shape: &[usize], init: Init) -> Result<Tensor> {
        let value = match self.adapter {
            Some(src) => take(src, name, shape, self.dtype, &self.device)?,
            None => self.random(name, shape, init)?,
        };
        let role = self.partition.adapter_role();
        self.store.register(name.to_string(), role, ParamKind::Adapter, value)
    }

    /// Each tensor draws from its own stream, keyed by the seed and its name, so a
    /// tensor's initial value does not depend on which other tensors were loaded or drawn.
    fn random(&self, name: &str, shape: &[usize], init: Init) -> Result<Tensor> {
        let mut rng = StdRng::seed_from_u64(self.seed ^ fnv1a(name.as_bytes()));
        let n: usize = shape.iter().product();
        let values: Vec<f32> = match init {
            Init::Zeros => vec![0.0; n],
            Init::Ones => vec![1.0; n],
            Init::Normal(std) => {
                let dist = Normal::new(0.0f32, std as f32).map_err(|e| ModelError::InvalidConfig(e.to_string()))?;
                (0..n).map(|_| dist.sample(&mut rng)).collect()
            }
            Init::Uniform(bound) => {
                let b = bound as f32;
                let dist = Uniform::new_inclusive(-b, b).map_err(|e| ModelError::InvalidConfig(e.to_string()))?;
                (0..n).map(|_| dist.sample(&mut rng)).collect()
            }
        };
        Ok(Tensor::from_vec(values, shape, &self.device)?.to_dtype(self.dtype)?)
    }
}

/// 64-bit FNV-1a: a stable, dependency-free hash of a tensor name.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

fn take(src: &TensorSource, name: &str, shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
    let t = src.tensors.get(name).ok_or_else(|| ModelError::MissingTensor {
        name: name.to_string(),
        source_desc: src.description.clone(),
        expected: shape.to_vec(),
    })?;
    if t.dims() != shape {
        return Err(ModelError::ShapeMismatch {
            name: name.to_string(),
            expected: shape.to_vec(),
            found: t.dims().to_vec(),
        });
    }
    Ok(t.to_dtype(dtype)?.to_device(device)?)
}
