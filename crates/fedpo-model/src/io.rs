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
use candle_core::{DType, Device, Storage, Tensor};

use crate::error::{ModelError, Result};
use crate::weights::TensorSource;

/// Writes `bytes` to `path` atomically (temp file + fsync + rename).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |w| w.write_all(bytes))
}

/// Writes what `write` produces to `path` atomically, through a buffer: for large values
/// serialised straight to the file instead of into memory first.
pub fn write_atomic_with(path: &Path, write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>) -> Result<()> {
    let tmp = temporary_beside(path)?;
    let result = (|| -> std::io::Result<()> {
        let mut buffered = std::io::BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
        write(&mut buffered)?;
        buffered.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        Ok(())
    })();
    commit_temporary(&tmp, path, result)
}

/// Rewrites `path` in place with what `write` produces, synced, truncated to what was
/// written. Not atomic: a crash leaves a torn file. For files that a separate atomic record
/// (written after this returns) declares complete, and that are rewritten often: the
/// file's cached pages are reused rather than a fresh set allocated for a temporary, which
/// for a model-sized file every round is most of the cost of writing it.
pub fn rewrite_in_place_with(path: &Path, write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>) -> Result<()> {
    overwrite_with(path, write).and_then(|file| file.sync_all().map_err(|e| ModelError::io(path, e)))
}

/// [`rewrite_in_place_with`] without the sync, for a caller that syncs later (off its
/// critical path) and keeps a synced copy of the previous content until then. Returns the
/// file.
pub fn overwrite_with(path: &Path, write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>) -> Result<File> {
    let result = (|| -> std::io::Result<File> {
        let file = fs::OpenOptions::new().write(true).create(true).truncate(false).open(path)?;
        let mut counted = CountingWriter { inner: std::io::BufWriter::with_capacity(1 << 20, file), written: 0 };
        write(&mut counted)?;
        let file = counted.inner.into_inner().map_err(|e| e.into_error())?;
        file.set_len(counted.written)?;
        Ok(file)
    })();
    result.map_err(|e| ModelError::io(path, e))
}

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
    overwrite_with(path, |w| {
        w.write_all(&(header.len() as u64).to_le_bytes())?;
        w.write_all(&header)?;
        tensors.iter().try_for_each(|(_, t)| w.write_all(&t.data()))
    })
}

/// Counts the bytes that pass through, so [`rewrite_in_place_with`] can cut off what is
/// left of a longer previous content.
struct CountingWriter<W> {
    inner: W,
    written: u64,
}

impl<W: Write> Write for CountingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Where [`write_atomic_with`] and [`write_safetensors`] write before the rename: a hidden
/// name in `path`'s directory (created if missing), so the rename stays on one file system.
fn temporary_beside(path: &Path) -> Result<std::path::PathBuf> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let file_name = path.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    Ok(dir.join(format!(".{file_name}.tmp-{}", std::process::id())))
}

/// Renames a written and synced temporary over `path` and syncs the directory, or removes
/// the temporary if writing it failed.
fn commit_temporary(tmp: &Path, path: &Path, written: std::io::Result<()>) -> Result<()> {
    let result = written.and_then(|()| {
        fs::rename(tmp, path)?;
        // Make the rename itself durable.
        if let Some(dir) = tmp.parent() {
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    });
    if result.is_err() {
        let _ = fs::remove_file(tmp);
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
    let tmp = temporary_beside(path)?;
    let written = safetensors::serialize_to_file(tensors, Some(metadata), &tmp)
        .map_err(std::io::Error::other)
        .and_then(|()| File::open(&tmp)?.sync_all());
    commit_temporary(&tmp, path, written)
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
    fn a_file_rewritten_in_place_holds_only_the_new_content() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("last_update.cbor");
        rewrite_in_place_with(&path, |w| w.write_all(&[9u8; 3 << 20])).unwrap();
        rewrite_in_place_with(&path, |w| w.write_all(b"shorter")).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"shorter", "what is left of the longer file is cut off");
        let err = rewrite_in_place_with(&dir.path().join("missing/x"), |w| w.write_all(b"x")).unwrap_err();
        assert!(err.to_string().contains("missing/x"), "{err}");
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
