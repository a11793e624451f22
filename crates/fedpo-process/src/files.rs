//! Crash-safe writes: a power cut or a kill leaves either the old file or the new one.
//!
//! Devices run on boards that lose power, and everything they keep (the private adapter,
//! progress, the last update) must survive that; so must the aggregator's checkpoints.
//! [`write_atomic`] writes beside the target, syncs, renames over it and syncs the
//! directory. [`rewrite_in_place_with`] is for large files rewritten often whose
//! completeness a separate atomic record declares.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

/// A file that could not be written, named.
#[derive(Debug, thiserror::Error)]
#[error("{}: {source}", path.display())]
pub struct FileError {
    /// The file (or the directory it was to go in).
    pub path: PathBuf,
    /// What the OS said.
    #[source]
    pub source: std::io::Error,
}

impl FileError {
    fn new(path: &Path, source: std::io::Error) -> Self {
        Self { path: path.to_path_buf(), source }
    }
}

type Result<T> = std::result::Result<T, FileError>;

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
    overwrite_with(path, write).and_then(|file| file.sync_all().map_err(|e| FileError::new(path, e)))
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
    result.map_err(|e| FileError::new(path, e))
}

/// Writes `path` atomically through a writer that takes a file path (a library's
/// `serialize_to_file`): it writes the temporary, which is then synced and renamed.
pub fn write_atomic_via_path(path: &Path, write: impl FnOnce(&Path) -> std::io::Result<()>) -> Result<()> {
    let tmp = temporary_beside(path)?;
    let written = write(&tmp).and_then(|()| File::open(&tmp)?.sync_all());
    commit_temporary(&tmp, path, written)
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

/// Where [`write_atomic_with`] (and what writes through it) writes before the rename: a hidden
/// name in `path`'s directory (created if missing), so the rename stays on one file system.
fn temporary_beside(path: &Path) -> Result<PathBuf> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    fs::create_dir_all(dir).map_err(|e| FileError::new(dir, e))?;
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
    result.map_err(|e| FileError::new(path, e))
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
    fn a_write_through_a_path_that_fails_keeps_the_old_file_and_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        write_atomic(&path, b"old").unwrap();
        let err = write_atomic_via_path(&path, |tmp| {
            fs::write(tmp, b"half")?;
            Err(std::io::Error::other("serializer failed"))
        })
        .unwrap_err();
        assert!(
            err.to_string().contains("model.safetensors") && err.to_string().contains("serializer failed"),
            "{err}"
        );
        assert_eq!(fs::read(&path).unwrap(), b"old");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1, "the temporary file is removed");
        write_atomic_via_path(&path, |tmp| fs::write(tmp, b"new")).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"new");
    }
}
