//! Crash-safe file writes and tensor-file reading.
//!
//! Every file fedpo writes (adapters, models, optimizer state, caches, summaries) goes
//! through [`write_atomic`]: a temporary file in the same directory, fsync, rename, fsync of
//! the directory. A crash leaves either the old file or the new one, never half of either.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::Path;

use candle_core::safetensors::Load;
use candle_core::{Device, Tensor};
use sha2::{Digest, Sha256};

use crate::error::{ModelError, Result};
use crate::weights::TensorSource;

/// Writes `bytes` to `path` atomically (temp file + fsync + rename).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |w| w.write_all(bytes))
}

/// Writes what `write` produces to `path` atomically, through a buffer: for large values
/// serialised straight to the file instead of into memory first.
pub fn write_atomic_with(path: &Path, write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>) -> Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let file_name = path.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    let tmp = dir.join(format!(".{file_name}.tmp-{}", std::process::id()));
    let result = (|| -> std::io::Result<()> {
        let mut buffered = std::io::BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
        write(&mut buffered)?;
        let f = buffered.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        // Make the rename itself durable.
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.map_err(|e| ModelError::io(path, e))
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
    let bytes = safetensors::serialize(contiguous.iter().map(|(n, t)| (n.as_str(), t)), Some(metadata))
        .map_err(|e| ModelError::Safetensors { path: path.to_path_buf(), reason: e.to_string() })?;
    write_atomic(path, &bytes)
}

/// SHA-256 over names, shapes and f32 little-endian values, in name order.
///
/// Identifies a base model for reference-cache keys and adapter metadata; the dtype the
/// model runs in does not change the hash.
pub fn hash_tensors<'a>(tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>) -> Result<String> {
    let mut sorted: Vec<(&str, &Tensor)> = tensors.into_iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    let mut hasher = Sha256::new();
    for (name, t) in sorted {
        hasher.update(name.as_bytes());
        hasher.update([0u8]);
        for d in t.dims() {
            hasher.update((*d as u64).to_le_bytes());
        }
        let values = t.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        for v in values {
            hasher.update(v.to_le_bytes());
        }
    }
    Ok(hex::encode(hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_the_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        write_atomic(&path, b"first").unwrap();
        write_atomic(&path, b"second").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"second");
        let names: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1, "stray files: {names:?}");
    }

    #[test]
    fn a_streamed_write_that_fails_halfway_keeps_the_old_file_and_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("update.cbor");
        write_atomic(&path, b"old").unwrap();
        let err = write_atomic_with(&path, |w| {
            w.write_all(&[7u8; 3 << 20])?; // past the buffer, so part of it reached the file
            Err(std::io::Error::other("encoder failed"))
        })
        .unwrap_err();
        assert!(err.to_string().contains("encoder failed"), "{err}");
        assert_eq!(fs::read(&path).unwrap(), b"old");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1, "the temporary file is removed");
        write_atomic_with(&path, |w| w.write_all(b"new")).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"new");
    }

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
}
