//! Tensor files: safetensors written crash-safely ([`fedpo_process::files`]) and read back,
//! and the hash that names a base model.

use std::collections::HashMap;
use std::fs::{self, File};
use std::path::Path;

use fedpo_process::files::{overwrite_with, write_atomic, write_atomic_via_path};

use candle_core::safetensors::Load;
use candle_core::{DType, Device, Storage, Tensor};

use crate::error::{ModelError, Result};
use crate::weights::TensorSource;

/// Writes tensors given as safetensors views into `path` in place, not synced (see
/// [`overwrite_with`]): the bytes [`safetensors::serialize`] produces, streamed from the
/// views. The header is the crate's own `Metadata`, laid out as `serialize` lays it out
/// (tensors by descending dtype alignment, then name; padded to 8 bytes with spaces).
pub fn overwrite_safetensors_views<S, V>(
    path: &Path,
    tensors: impl IntoIterator<Item = (S, V)>,
    metadata: HashMap<String, String>,
) -> Result<File>
where
    S: AsRef<str> + Ord + std::fmt::Display,
    V: safetensors::View,
{
    let header_err = |e: String| ModelError::io(path, std::io::Error::new(std::io::ErrorKind::InvalidInput, e));
    let mut tensors: Vec<(S, V)> = tensors.into_iter().collect();
    tensors.sort_by(|(a, left), (b, right)| right.dtype().cmp(&left.dtype()).then(a.cmp(b)));
    let mut offset = 0;
    let infos = tensors
        .iter()
        .map(|(name, t)| {
            let end = offset + t.data_len();
            let info = safetensors::tensor::TensorInfo {
                dtype: t.dtype(),
                shape: t.shape().to_vec(),
                data_offsets: (offset, end),
            };
            offset = end;
            (name.to_string(), info)
        })
        .collect();
    let header = safetensors::tensor::Metadata::new(Some(metadata), infos).map_err(|e| header_err(e.to_string()))?;
    let mut header = serde_json::to_vec(&header).map_err(|e| header_err(e.to_string()))?;
    header.resize(header.len().next_multiple_of(8), b' ');
    Ok(overwrite_with(path, |w| {
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        tensors.iter().try_for_each(|(_, t)| w.write_all(&t.data()))
    })?)
}

/// Named tensors and the string metadata of a safetensors file.
pub struct SafetensorsFile {
    /// The tensors, by their names in the file.
    pub tensors: TensorSource,
    /// The `__metadata__` map (empty when absent).
    pub metadata: HashMap<String, String>,
}

/// Reads every tensor of a safetensors file onto `device`.
pub fn read_safetensors(path: &Path, device: &Device) -> Result<SafetensorsFile> {
    let bytes = fs::read(path).map_err(|e| ModelError::io(path, e))?;
    let st_err = |reason: String| ModelError::Safetensors { path: path.to_path_buf(), reason };
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| st_err(e.to_string()))?;
    let metadata = header.metadata().clone().unwrap_or_default();
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| st_err(e.to_string()))?;
    let mut tensors = HashMap::new();
    for (name, view) in st.tensors() {
        let t = view.load(device).map_err(|e| st_err(format!("tensor `{name}`: {e}")))?;
        tensors.insert(name, t);
    }
    Ok(SafetensorsFile { tensors: TensorSource { tensors, description: path.display().to_string() }, metadata })
}

/// Writes named tensors with metadata as one safetensors file, atomically.
pub fn write_safetensors(path: &Path, tensors: &[(String, Tensor)], metadata: HashMap<String, String>) -> Result<()> {
    let contiguous =
        tensors.iter().map(|(n, t)| Ok((n.clone(), t.contiguous()?))).collect::<Result<Vec<(String, Tensor)>>>()?;
    write_safetensors_views(path, contiguous, metadata)
}

/// Writes tensors given as safetensors views to `path`, atomically and durably, streamed
/// from the views to the file: a DistilGPT-2 checkpoint is 328 MB, and the file is never
/// whole in memory on the way.
pub fn write_safetensors_views<S, V>(
    path: &Path,
    tensors: impl IntoIterator<Item = (S, V)>,
    metadata: HashMap<String, String>,
) -> Result<()>
where
    S: AsRef<str> + Ord + std::fmt::Display,
    V: safetensors::View,
{
    Ok(write_atomic_via_path(path, |tmp| {
        safetensors::serialize_to_file(tensors, Some(metadata), tmp).map_err(std::io::Error::other)
    })?)
}

/// Writes `value` as pretty JSON, crash-safely.
pub(crate) fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let bytes =
        serde_json::to_vec_pretty(value).map_err(|source| ModelError::Json { path: path.to_path_buf(), source })?;
    Ok(write_atomic(path, &bytes)?)
}

/// BLAKE3 (hex) over names, shapes and f32 little-endian values, in name order.
///
/// Identifies a base model in adapter metadata; the dtype the model runs in does not change
/// the hash. A pFedDPO device saves its adapter every round, so this runs over the whole
/// base each round: the values of f32 CPU tensors are hashed where they lie, in one call
/// per tensor, not copied out and fed four bytes at a time.
pub fn hash_tensors<'a>(tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>) -> Result<String> {
    let mut sorted: Vec<(&str, &Tensor)> = tensors.into_iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    let mut hasher = blake3::Hasher::new();
    for (name, t) in sorted {
        hasher.update(name.as_bytes());
        hasher.update(&[0u8]);
        for d in t.dims() {
            hasher.update(&(*d as u64).to_le_bytes());
        }
        let t = t.to_dtype(DType::F32)?;
        let (storage, layout) = t.storage_and_layout();
        match (&*storage, layout.contiguous_offsets()) {
            (Storage::Cpu(cpu), Some((start, end))) if cfg!(target_endian = "little") => {
                hasher.update(bytemuck::cast_slice(&cpu.as_slice::<f32>()?[start..end]));
            }
            _ => {
                drop(storage);
                for v in t.flatten_all()?.to_vec1::<f32>()? {
                    hasher.update(&v.to_le_bytes());
                }
            }
        }
    }
    Ok(hasher.finalize().to_hex().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn safetensors_round_trip_keeps_values_and_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let t = Tensor::new(&[[1.0f32, 2.0], [3.0, 4.0]], &Device::Cpu).unwrap();
        let meta = HashMap::from([("rank".to_string(), "8".to_string())]);
        write_safetensors(&path, &[("a.weight".into(), t.t().unwrap())], meta).unwrap();
        let back = read_safetensors(&path, &Device::Cpu).unwrap();
        assert_eq!(back.metadata["rank"], "8");
        let a = back.tensors.tensors["a.weight"].to_vec2::<f32>().unwrap();
        assert_eq!(a, vec![vec![1.0, 3.0], vec![2.0, 4.0]]);
    }

    /// A view whose bytes disagree with its shape: safetensors refuses it mid-write.
    struct Mismatched;
    impl safetensors::View for Mismatched {
        fn dtype(&self) -> safetensors::Dtype {
            safetensors::Dtype::F32
        }
        fn shape(&self) -> &[usize] {
            &[3]
        }
        fn data(&self) -> std::borrow::Cow<'_, [u8]> {
            std::borrow::Cow::Borrowed(&[0u8; 4])
        }
        fn data_len(&self) -> usize {
            4
        }
    }

    #[test]
    fn a_refused_safetensors_write_keeps_the_old_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("global.safetensors");
        let t = Tensor::new(&[5.0f32, 6.0], &Device::Cpu).unwrap();
        write_safetensors(&path, &[("w".into(), t)], HashMap::new()).unwrap();
        let before = fs::read(&path).unwrap();
        let err = write_safetensors_views(&path, [("w", Mismatched)], HashMap::new()).unwrap_err();
        assert!(err.to_string().contains("global.safetensors"), "{err}");
        assert_eq!(fs::read(&path).unwrap(), before);
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1, "stray files: {names:?}");
    }

    /// Raw bytes under a dtype and shape.
    struct Raw(safetensors::Dtype, Vec<usize>, Vec<u8>);
    impl safetensors::View for &Raw {
        fn dtype(&self) -> safetensors::Dtype {
            self.0
        }
        fn shape(&self) -> &[usize] {
            &self.1
        }
        fn data(&self) -> std::borrow::Cow<'_, [u8]> {
            std::borrow::Cow::Borrowed(&self.2)
        }
        fn data_len(&self) -> usize {
            self.2.len()
        }
    }

    #[test]
    fn safetensors_overwritten_in_place_are_the_bytes_the_crate_serialises() {
        use safetensors::Dtype::{BF16, F32, U8};
        let tensors = [
            ("z.weight", Raw(F32, vec![2, 3], (0..24).collect())),
            ("a.bias", Raw(F32, vec![1], vec![1, 2, 3, 4])),
            ("h.0.codes", Raw(U8, vec![3], vec![7, 8, 9])),
            ("h.0.half", Raw(BF16, vec![2], vec![1, 0, 2, 0])),
        ];
        let meta = HashMap::from([("format".to_string(), "fedpo-global/1".to_string())]);
        let expected = safetensors::serialize(tensors.iter().map(|(n, t)| (*n, t)), Some(meta.clone())).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("global-a.safetensors");
        fs::write(&path, vec![0xAB; expected.len() + 100]).unwrap(); // a longer previous content
        overwrite_safetensors_views(&path, tensors.iter().map(|(n, t)| (*n, t)), meta).unwrap();
        assert_eq!(fs::read(&path).unwrap(), expected);
        let back = read_safetensors(&path, &Device::Cpu).unwrap();
        assert_eq!(back.tensors.tensors.len(), 4);
    }

    #[test]
    fn a_refused_in_place_write_names_the_file_and_leaves_it_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("global-b.safetensors");
        fs::write(&path, b"round 3").unwrap();
        let err = overwrite_safetensors_views(&path, [("w", Mismatched)], HashMap::new()).unwrap_err();
        assert!(err.to_string().contains("global-b.safetensors"), "{err}");
        assert_eq!(fs::read(&path).unwrap(), b"round 3");
    }

    #[test]
    fn tensor_hash_depends_on_values_not_on_order() {
        let a = Tensor::new(&[1.0f32, 2.0], &Device::Cpu).unwrap();
        let b = Tensor::new(&[3.0f32], &Device::Cpu).unwrap();
        let h1 = hash_tensors([("a", &a), ("b", &b)]).unwrap();
        let h2 = hash_tensors([("b", &b), ("a", &a)]).unwrap();
        assert_eq!(h1, h2);
        let c = Tensor::new(&[3.5f32], &Device::Cpu).unwrap();
        assert_ne!(h1, hash_tensors([("a", &a), ("b", &c)]).unwrap());
    }

    #[test]
    fn tensor_hash_is_the_same_for_a_strided_view_its_copy_and_another_dtype() {
        let w = Tensor::arange(0f32, 6.0, &Device::Cpu).unwrap().reshape((2, 3)).unwrap();
        let strided = w.t().unwrap(); // hashed value by value
        let copy = strided.contiguous().unwrap(); // hashed where it lies
        let hash = hash_tensors([("w", &copy)]).unwrap();
        assert_eq!(hash_tensors([("w", &strided)]).unwrap(), hash);
        let half = copy.to_dtype(DType::F16).unwrap(); // these values are exact in f16
        assert_eq!(hash_tensors([("w", &half)]).unwrap(), hash);
        assert_ne!(hash_tensors([("w", &w)]).unwrap(), hash, "a transpose is another tensor");
    }
}
