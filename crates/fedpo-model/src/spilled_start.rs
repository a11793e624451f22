//! The model a round started from, set aside on disk until the round's delta is formed.
//!
//! A device needs the global model it received only twice in a round: to build its policy,
//! and at the end, to form the delta it uploads. Held in memory in between, its shared
//! tensors are one more copy of everything the device trains: on DistilGPT-2 with
//! trainable embeddings, 328 MB, most of which shows in a round's peak RSS. Under a tight
//! memory budget the device writes them to its state directory instead and frees them, and
//! [`SpilledStart::delta`] reads them back a chunk at a time, so the round never holds them
//! beside its gradients. The delta is bit for bit [`Policy::shared_delta`]'s.
//!
//! The file is scratch: raw little-endian f32 in the policy's parameter order, with the
//! index kept here. A crash leaves at most a stale file, which the next spill overwrites.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use candle_core::{DType, Storage, Tensor};

use crate::error::{ModelError, Result};
use crate::params::ParamRole;
use crate::policy::Policy;
use crate::privacy_boundary::SharedTensor;
use crate::weights::TensorSource;

/// Values per read or write: 256 KiB of f32, small beside any tensor worth spilling.
const CHUNK: usize = 64 * 1024;

/// The shared tensors of a round's starting model, in a file.
#[derive(Debug)]
pub struct SpilledStart {
    path: PathBuf,
    /// Name and shape of each tensor, in file order (the policy's shared parameters').
    index: Vec<(String, Vec<usize>)>,
}

fn io_error(path: &Path) -> impl Fn(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io { path: path.to_path_buf(), source }
}

/// Calls `each` with consecutive runs of a tensor's f32 values, without copying a CPU
/// tensor whole.
fn for_each_run(t: &Tensor, mut each: impl FnMut(&[f32]) -> Result<()>) -> Result<()> {
    let t = t.to_dtype(DType::F32)?;
    {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) {
            for run in cpu.as_slice::<f32>()?[start..end].chunks(CHUNK) {
                each(run)?;
            }
            return Ok(());
        }
    }
    // another device, or a strided view: one copy, as `shared_delta` makes
    for run in t.flatten_all()?.to_vec1::<f32>()?.chunks(CHUNK) {
        each(run)?;
    }
    Ok(())
}

impl SpilledStart {
    /// Writes the tensors of `start` that are shared parameters of `policy` to `path`.
    /// `start` can then be dropped: the policy holds its own copies.
    pub fn write(path: &Path, policy: &Policy, start: &TensorSource) -> Result<Self> {
        let file = File::create(path).map_err(io_error(path))?;
        let mut out = BufWriter::with_capacity(CHUNK * 4, file);
        let mut index = Vec::new();
        let mut bytes = Vec::with_capacity(CHUNK * 4);
        for p in policy.params.with_role(ParamRole::Shared) {
            let expected = p.tensor().dims().to_vec();
            let base = start.tensors.get(&p.name).ok_or_else(|| ModelError::MissingTensor {
                name: p.name.clone(),
                source_desc: start.description.clone(),
                expected: expected.clone(),
            })?;
            if base.dims() != expected.as_slice() {
                return Err(ModelError::ShapeMismatch { name: p.name.clone(), found: base.dims().to_vec(), expected });
            }
            for_each_run(base, |run| {
                bytes.clear();
                bytes.extend(run.iter().flat_map(|v| v.to_le_bytes()));
                out.write_all(&bytes).map_err(io_error(path))
            })?;
            index.push((p.name.clone(), expected));
        }
        out.flush().map_err(io_error(path))?;
        Ok(Self { path: path.to_path_buf(), index })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `shared - start` for every shared tensor of `policy`, as
    /// [`Policy::shared_delta`] forms it, reading the start back chunk by chunk. The file
    /// is removed once read.
    pub fn delta(self, policy: &Policy) -> Result<Vec<SharedTensor>> {
        let path = self.path.as_path();
        let file = File::open(path).map_err(io_error(path))?;
        let mut input = BufReader::with_capacity(CHUNK * 4, file);
        let shared: Vec<_> = policy.params.with_role(ParamRole::Shared).collect();
        if shared.len() != self.index.len() {
            return Err(ModelError::InvalidConfig(format!(
                "{}: holds {} tensors, the policy shares {}",
                path.display(),
                self.index.len(),
                shared.len()
            )));
        }
        let mut bytes = vec![0u8; CHUNK * 4];
        let mut deltas = Vec::with_capacity(shared.len());
        for (p, (name, shape)) in shared.into_iter().zip(&self.index) {
            if &p.name != name || p.tensor().dims() != shape.as_slice() {
                return Err(ModelError::ShapeMismatch {
                    name: p.name.clone(),
                    found: p.tensor().dims().to_vec(),
                    expected: shape.clone(),
                });
            }
            let mut values = Vec::with_capacity(p.tensor().elem_count());
            for_each_run(p.tensor(), |run| {
                let bytes = &mut bytes[..run.len() * 4];
                input.read_exact(bytes).map_err(io_error(path))?;
                let starts = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
                values.extend(run.iter().zip(starts).map(|(now, start)| now - start));
                Ok(())
            })?;
            deltas.push(SharedTensor::from_parts(name.clone(), shape.clone(), values, ParamRole::Shared));
        }
        let mut rest = [0u8; 1];
        if input.read(&mut rest).map_err(io_error(path))? != 0 {
            return Err(ModelError::InvalidConfig(format!("{}: longer than the tensors it indexes", path.display())));
        }
        drop(input);
        std::fs::remove_file(path).map_err(io_error(path))?;
        Ok(deltas)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    use crate::{Gpt2Config, LoraConfig, Partition, PartitionPreset, PolicySpec};

    fn tiny_policy(preset: PartitionPreset, start: Option<&TensorSource>) -> Policy {
        let spec = PolicySpec {
            config: Gpt2Config::tiny(),
            lora: Some(LoraConfig::new(4, 8.0, &["c_attn"]).unwrap()),
            partition: Partition::new(preset),
        };
        Policy::build(spec, start, None, 3, DType::F32, &Device::Cpu).unwrap()
    }

    /// A global model, a policy built from it and then moved as training would move it.
    fn trained_from_start(preset: PartitionPreset) -> (Policy, TensorSource) {
        let donor = tiny_policy(preset, None);
        let start = TensorSource {
            tensors: donor
                .global_tensors()
                .unwrap()
                .into_iter()
                .map(|t| {
                    let (name, shape, values) = t.into_parts();
                    (name, Tensor::from_vec(values, shape, &Device::Cpu).unwrap())
                })
                .collect(),
            description: "the test's global model".into(),
        };
        let policy = tiny_policy(preset, Some(&start));
        for (i, p) in policy.params.with_role(ParamRole::Shared).enumerate() {
            let t = p.tensor();
            let moved = (t + (t.ones_like().unwrap() * (0.001 * (i + 1) as f64)).unwrap()).unwrap().sin().unwrap();
            p.var().unwrap().set(&moved).unwrap();
        }
        (policy, start)
    }

    #[test]
    fn the_delta_read_back_from_disk_is_the_in_memory_delta_bit_for_bit() {
        let dir = tempfile::tempdir().unwrap();
        for preset in [PartitionPreset::Pfeddpo, PartitionPreset::Feddpo, PartitionPreset::SharedLora] {
            let (policy, start) = trained_from_start(preset);
            let in_memory = policy.shared_delta(&start).unwrap();
            assert!(!in_memory.is_empty(), "{preset}: something is shared");
            let path = dir.path().join(format!("{preset}.start"));
            let spilled = SpilledStart::write(&path, &policy, &start).unwrap();
            let expected_bytes: usize = in_memory.iter().map(|t| t.values().len() * 4).sum();
            assert_eq!(std::fs::metadata(&path).unwrap().len() as usize, expected_bytes, "{preset}");
            drop(start);
            let from_disk = spilled.delta(&policy).unwrap();
            assert_eq!(from_disk, in_memory, "{preset}");
            assert!(!path.exists(), "{preset}: the scratch file is removed once read");
        }
    }

    #[test]
    fn a_start_without_a_shared_tensor_is_refused_before_anything_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let (policy, mut start) = trained_from_start(PartitionPreset::Pfeddpo);
        start.tensors.remove("wte.weight");
        let err = SpilledStart::write(&dir.path().join("start"), &policy, &start).unwrap_err().to_string();
        assert!(err.contains("wte.weight") && err.contains("the test's global model"), "{err}");
    }

    #[test]
    fn a_truncated_or_missing_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let (policy, start) = trained_from_start(PartitionPreset::Pfeddpo);
        let path = dir.path().join("start");
        let spilled = SpilledStart::write(&path, &policy, &start).unwrap();
        let len = std::fs::metadata(&path).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len - 4).unwrap();
        let err = spilled.delta(&policy).unwrap_err().to_string();
        assert!(err.contains(&path.display().to_string()), "{err}");

        let spilled = SpilledStart::write(&path, &policy, &start).unwrap();
        std::fs::remove_file(&path).unwrap();
        let err = spilled.delta(&policy).unwrap_err().to_string();
        assert!(err.contains(&path.display().to_string()), "{err}");
    }
}
