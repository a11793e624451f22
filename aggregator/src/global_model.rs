//! The global model as the aggregator holds it: plain f32 tensors with their roles.
//!
//! The aggregator never needs candle to average: it keeps the values in memory, changes
//! only the shared tensors, and hands the whole model to the wire through
//! [`fedpo_wire::ToWire`].

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::Device;
use fedpo_model::tensor_files::{overwrite_safetensors_views, read_safetensors};
use fedpo_model::{ParamRole, Policy, PolicySpec};
use fedpo_wire::{EncodedPayload, ToWire, UpdateCodec, DEFAULT_CHUNK_BYTES};

/// One tensor of the global model (also the shape of server-side vectors such as
/// SCAFFOLD's control variate).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(crate) struct GlobalTensor {
    pub(crate) name: String,
    pub(crate) shape: Vec<usize>,
    pub(crate) values: Vec<f32>,
    /// Shared tensors are averaged; frozen ones are only distributed.
    pub(crate) shared: bool,
}

impl ToWire for GlobalTensor {
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

/// A tensor's values as safetensors reads them, without a copy on little-endian targets:
/// a checkpoint is written every round and is the size of the model.
struct F32View<'a>(&'a GlobalTensor);

impl safetensors::View for F32View<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        safetensors::Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.0.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        if cfg!(target_endian = "little") {
            std::borrow::Cow::Borrowed(bytemuck::cast_slice(&self.0.values))
        } else {
            std::borrow::Cow::Owned(self.0.values.iter().flat_map(|v| v.to_le_bytes()).collect())
        }
    }
    fn data_len(&self) -> usize {
        self.0.values.len() * std::mem::size_of::<f32>()
    }
}

/// The model every round starts from.
#[derive(Debug, Clone)]
pub(crate) struct GlobalModel {
    pub(crate) spec: PolicySpec,
    pub(crate) tensors: Vec<GlobalTensor>,
    index: HashMap<String, usize>,
}

impl GlobalModel {
    /// The shared and frozen tensors of a freshly built policy.
    pub(crate) fn from_policy(policy: &Policy) -> Result<Self> {
        let tensors = policy
            .global_tensors()?
            .into_iter()
            .map(|t| {
                let shared = t.role() == ParamRole::Shared;
                let (name, shape, values) = t.into_parts();
                GlobalTensor { name, shape, values, shared }
            })
            .collect();
        Ok(Self::new(policy.spec.clone(), tensors))
    }

    pub(crate) fn new(spec: PolicySpec, tensors: Vec<GlobalTensor>) -> Self {
        let index = tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Self { spec, tensors, index }
    }

    pub(crate) fn get(&self, name: &str) -> Option<&GlobalTensor> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    pub(crate) fn get_mut(&mut self, name: &str) -> Option<&mut GlobalTensor> {
        self.index.get(name).map(|&i| &mut self.tensors[i])
    }

    /// Tensors devices train and upload.
    pub(crate) fn shared(&self) -> impl Iterator<Item = &GlobalTensor> {
        self.tensors.iter().filter(|t| t.shared)
    }

    /// The first shared tensor holding a NaN or an infinity: a model devices must never
    /// receive, whatever the updates that produced it.
    pub(crate) fn first_non_finite(&self) -> Option<&str> {
        self.shared().find(|t| !t.values.iter().all(|v| v.is_finite())).map(|t| t.name.as_str())
    }

    /// The wire bytes devices receive, in chunks, with their digest: the model as a
    /// payload in f32 (so devices start from exactly these values), written from the
    /// tensors' own buffers.
    pub(crate) fn encode(&self) -> EncodedPayload {
        EncodedPayload::compress(&self.tensors, UpdateCodec::F32, DEFAULT_CHUNK_BYTES)
    }

    /// The most bytes the model takes on the wire, where [`GlobalModel::encode`] puts it:
    /// every tensor in f32 with room for its name, shape and framing. The largest
    /// transfer of a job, which sizes the embedded broker's queues.
    pub(crate) fn wire_bytes_bound(&self) -> u64 {
        self.tensors.iter().fold(1024, |total, t| {
            total + 4 * t.values.len() as u64 + 128 + t.name.len() as u64 + 9 * t.shape.len() as u64
        })
    }

    /// Digest (hex) of the wire payload: what devices verify.
    pub(crate) fn digest_hex(&self) -> String {
        hex::encode(self.encode().digest())
    }

    /// Writes the model as safetensors into `path` in place, shared tensors marked in the
    /// metadata. Neither atomic nor synced: [`crate::checkpoint`] writes only a slot no
    /// state names, and decides when it must be on disk.
    pub(crate) fn overwrite_file(&self, path: &Path) -> Result<()> {
        let shared: Vec<&str> = self.shared().map(|t| t.name.as_str()).collect();
        let metadata = HashMap::from([
            ("format".to_string(), "fedpo-global/1".to_string()),
            ("spec".to_string(), serde_json::to_string(&self.spec)?),
            ("shared".to_string(), shared.join(",")),
            // Payload order decides the digest devices verify; keep it across a resume.
            ("order".to_string(), self.tensors.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(",")),
        ]);
        let views = self.tensors.iter().map(|t| (t.name.as_str(), F32View(t)));
        overwrite_safetensors_views(path, views, metadata).with_context(|| format!("saving {}", path.display()))?;
        Ok(())
    }

    /// Loads what [`GlobalModel::save`] wrote.
    pub(crate) fn load(path: &Path) -> Result<Self> {
        let file = read_safetensors(path, &Device::Cpu).with_context(|| format!("reading {}", path.display()))?;
        let meta = &file.metadata;
        if meta.get("format").map(String::as_str) != Some("fedpo-global/1") {
            bail!("{} is not a fedpo global model (metadata format {:?})", path.display(), meta.get("format"));
        }
        let spec: PolicySpec = serde_json::from_str(meta.get("spec").map(String::as_str).unwrap_or_default())
            .with_context(|| format!("{}: unreadable spec", path.display()))?;
        let shared: Vec<&str> = meta.get("shared").map(|s| s.split(',').collect()).unwrap_or_default();
        let names: Vec<&str> = meta.get("order").map(|s| s.split(',').collect()).unwrap_or_default();
        if names.len() != file.tensors.tensors.len() {
            bail!(
                "{}: metadata lists {} tensors, the file holds {}",
                path.display(),
                names.len(),
                file.tensors.tensors.len()
            );
        }
        let mut tensors = Vec::with_capacity(names.len());
        for name in names {
            let t = file
                .tensors
                .tensors
                .get(name)
                .with_context(|| format!("{}: tensor `{name}` listed but missing", path.display()))?;
            tensors.push(GlobalTensor {
                name: name.to_string(),
                shape: t.dims().to_vec(),
                values: t.flatten_all()?.to_vec1()?,
                shared: shared.contains(&name),
            });
        }
        Ok(Self::new(spec, tensors))
    }
}
