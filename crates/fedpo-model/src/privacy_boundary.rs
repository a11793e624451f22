//! What a policy may send and how received tensors come back in.
//!
//! [`SharedTensor`] is the only type fedpo-model gives to the wire (it implements
//! [`fedpo_wire::ToWire`]), and only the shared and frozen sets produce one. Private
//! adapter tensors stay candle tensors inside the [`Policy`], and encoding one is a
//! compile error:
//!
//! ```compile_fail
//! # use fedpo_model::{ParamRole, Policy};
//! # use fedpo_wire::{TensorPayload, WireDType};
//! fn leak(policy: &Policy) {
//!     let adapter: Vec<_> = policy.params.with_role(ParamRole::Private).map(|p| p.tensor().clone()).collect();
//!     let _ = TensorPayload::encode(&adapter, WireDType::F32); // candle tensors are not `ToWire`
//! }
//! ```
//!
//! while the shared set encodes as expected:
//!
//! ```
//! # use fedpo_model::Policy;
//! # use fedpo_wire::{TensorPayload, WireDType};
//! fn upload(policy: &Policy) -> fedpo_model::Result<TensorPayload> {
//!     Ok(TensorPayload::encode(&policy.shared_tensors()?, WireDType::F32))
//! }
//! ```

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use fedpo_wire::{ToWire, WireTensor};

use crate::error::{ModelError, Result};
use crate::params::{Param, ParamRole};
use crate::policy::Policy;
use crate::weights::TensorSource;

/// The values of one shared or frozen tensor: something every party may see.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedTensor {
    name: String,
    shape: Vec<usize>,
    values: Vec<f32>,
    role: ParamRole,
}

impl SharedTensor {
    fn of(p: &Param) -> Result<Self> {
        debug_assert!(p.role != ParamRole::Private);
        let t = p.tensor();
        Ok(Self {
            name: p.name.clone(),
            shape: t.dims().to_vec(),
            values: t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?,
            role: p.role,
        })
    }

    /// Values formed elsewhere in this crate (a delta read back from disk).
    pub(crate) fn from_parts(name: String, shape: Vec<usize>, values: Vec<f32>, role: ParamRole) -> Self {
        Self { name, shape, values, role }
    }

    /// Checkpoint-style name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Dimensions.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Row-major values.
    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// Shared (trained and averaged) or frozen (sent, never changed).
    pub fn role(&self) -> ParamRole {
        self.role
    }

    /// Name, shape and values, e.g. for an aggregator that keeps its own copy.
    pub fn into_parts(self) -> (String, Vec<usize>, Vec<f32>) {
        (self.name, self.shape, self.values)
    }
}

impl ToWire for SharedTensor {
    fn wire_name(&self) -> &str {
        &self.name
    }
    fn wire_shape(&self) -> Vec<u64> {
        self.shape.iter().map(|&d| d as u64).collect()
    }
    fn wire_values(&self) -> &[f32] {
        &self.values
    }
}

impl Policy {
    /// Every tensor of the shared set: what a device trains and uploads.
    pub fn shared_tensors(&self) -> Result<Vec<SharedTensor>> {
        self.params.with_role(ParamRole::Shared).map(SharedTensor::of).collect()
    }

    /// The shared and frozen sets: what a global model carries. Never the private set.
    pub fn global_tensors(&self) -> Result<Vec<SharedTensor>> {
        self.params.iter().filter(|p| p.role != ParamRole::Private).map(SharedTensor::of).collect()
    }

    /// `shared - start` for every shared tensor: a device's update against the global
    /// model it started the round from.
    pub fn shared_delta(&self, start: &TensorSource) -> Result<Vec<SharedTensor>> {
        self.params
            .with_role(ParamRole::Shared)
            .map(|p| {
                let base = start.tensors.get(&p.name).ok_or_else(|| ModelError::MissingTensor {
                    name: p.name.clone(),
                    source_desc: start.description.clone(),
                    expected: p.tensor().dims().to_vec(),
                })?;
                let delta = (p.tensor().to_dtype(DType::F32)? - base.to_dtype(DType::F32)?)?;
                Ok(SharedTensor {
                    name: p.name.clone(),
                    shape: p.tensor().dims().to_vec(),
                    values: delta.flatten_all()?.to_vec1()?,
                    role: ParamRole::Shared,
                })
            })
            .collect()
    }
}

impl Policy {
    /// Tensors shaped like the shared set (a gradient, a control variate), ready for the
    /// wire. Only names of shared parameters are taken, in parameter order; anything else
    /// in `values` (an adapter's gradient) is left out, so it cannot leave the device.
    pub fn shared_values(&self, values: &HashMap<String, Tensor>) -> Result<Vec<SharedTensor>> {
        let mut out = Vec::new();
        for p in self.params.with_role(ParamRole::Shared) {
            let Some(t) = values.get(&p.name) else { continue };
            if t.dims() != p.tensor().dims() {
                return Err(ModelError::ShapeMismatch {
                    name: p.name.clone(),
                    expected: p.tensor().dims().to_vec(),
                    found: t.dims().to_vec(),
                });
            }
            out.push(SharedTensor {
                name: p.name.clone(),
                shape: t.dims().to_vec(),
                values: t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?,
                role: ParamRole::Shared,
            });
        }
        Ok(out)
    }
}

impl TensorSource {
    /// Tensors received over the wire, as a source to build a policy from.
    pub fn from_wire(tensors: &[WireTensor], description: &str, device: &Device) -> Result<Self> {
        let mut map = HashMap::with_capacity(tensors.len());
        for t in tensors {
            let shape: Vec<usize> = t.shape().iter().map(|&d| d as usize).collect();
            map.insert(t.name().to_string(), Tensor::from_vec(t.values(), shape, device)?);
        }
        Ok(Self { tensors: map, description: description.to_string() })
    }
}

#[cfg(test)]
mod tests {
    use fedpo_wire::{TensorPayload, WireDType};

    use super::*;
    use crate::{Gpt2Config, LoraConfig, Partition, PartitionPreset, PolicySpec};

    fn policy(preset: PartitionPreset) -> Policy {
        let spec = PolicySpec {
            config: Gpt2Config {
                vocab_size: 64,
                n_positions: 16,
                n_embd: 8,
                n_layer: 1,
                n_head: 2,
                ..Gpt2Config::tiny()
            },
            lora: Some(LoraConfig::new(2, 4.0, &["c_attn"]).unwrap()),
            partition: Partition::new(preset),
        };
        Policy::random(spec, 3, &Device::Cpu).unwrap()
    }

    #[test]
    fn pfeddpo_global_model_and_update_carry_no_adapter_tensor() {
        let p = policy(PartitionPreset::Pfeddpo);
        let global = p.global_tensors().unwrap();
        assert!(global.iter().all(|t| !t.name().contains("lora_")));
        assert_eq!(global.len(), p.params.iter().filter(|q| q.role != ParamRole::Private).count());
        let shared = p.shared_tensors().unwrap();
        assert!(shared.iter().all(|t| t.role() == ParamRole::Shared && !t.name().contains("lora_")));
    }

    #[test]
    fn shared_lora_sends_the_adapter_and_keeps_the_base_frozen() {
        let p = policy(PartitionPreset::SharedLora);
        let shared = p.shared_tensors().unwrap();
        assert!(!shared.is_empty() && shared.iter().all(|t| t.name().contains("lora_")));
    }

    #[test]
    fn delta_against_own_values_is_zero_and_round_trips_the_wire() {
        let p = policy(PartitionPreset::Feddpo);
        let payload = TensorPayload::encode(&p.global_tensors().unwrap(), WireDType::F32);
        let source = TensorSource::from_wire(&payload.tensors, "global", &Device::Cpu).unwrap();
        let delta = p.shared_delta(&source).unwrap();
        assert!(delta.iter().all(|t| t.values().iter().all(|v| *v == 0.0)));
        let wte = &source.tensors["wte.weight"];
        assert_eq!(wte.dims(), &[64, 8]);
        let original = p.params.get("wte.weight").unwrap().tensor();
        assert_eq!(wte.to_vec2::<f32>().unwrap(), original.to_vec2::<f32>().unwrap());
    }
}
