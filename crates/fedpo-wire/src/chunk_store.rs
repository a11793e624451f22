//! Where a transfer's chunks wait for the last one: in memory, or in a spool file.
//!
//! A device assembles one transfer at a time and keeps it in memory. An aggregator may
//! have an update in flight from every device at once (a thousand devices upload
//! together), and holding them all would make its memory grow with the fleet; spooled,
//! each waiting chunk costs a few bytes of bookkeeping, and only the transfer being
//! verified and folded is in memory. A device that waits its turn to train keeps the
//! model it downloaded in its spool file ([`crate::KeptTransfer`]) until the turn comes.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use bytes::Bytes;

use crate::digest::Hasher;
use crate::error::{Result, WireError};

/// The chunks received so far, by index.
pub(crate) enum ChunkStore {
    Memory(MemoryParts),
    Spool(SpoolFile),
}

/// Chunks joined as they come: one MQTT connection delivers a transfer in order, so each
/// chunk is appended to the payload and freed at once, and the complete payload needs no
/// second, model-sized copy to join it. A chunk that arrives early waits until those
/// before it are in.
#[derive(Default)]
pub(crate) struct MemoryParts {
    joined: Vec<u8>,
    /// Chunks joined so far: indices below this one.
    next: usize,
    early: BTreeMap<usize, Bytes>,
    count: usize,
}

/// Chunks appended to a file as they come, with each one's place.
pub(crate) struct SpoolFile {
    path: PathBuf,
    file: File,
    at: Vec<Option<(u64, usize)>>,
    end: u64,
}

fn spool_err(path: &Path, e: impl std::fmt::Display) -> WireError {
    WireError::Spool { path: path.display().to_string(), reason: e.to_string() }
}

impl ChunkStore {
    /// In memory, for `count` chunks of `total` bytes together (a checked manifest's). The
    /// space is reserved up front, so joining never reallocates; what was not reserved
    /// cannot be touched, and a device without the memory says so instead of aborting.
    pub(crate) fn memory(transfer: &str, count: usize, total: u64) -> Result<Self> {
        let mut joined = Vec::new();
        usize::try_from(total)
            .ok()
            .and_then(|n| joined.try_reserve_exact(n).ok())
            .ok_or_else(|| WireError::OutOfMemory { transfer: transfer.to_string(), bytes: total })?;
        Ok(Self::Memory(MemoryParts { joined, next: 0, early: BTreeMap::new(), count }))
    }

    /// A spool file for `count` chunks at `path` (created, truncated; removed on drop).
    pub(crate) fn spool(path: PathBuf, count: usize) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(|e| spool_err(&path, e))?;
        Ok(Self::Spool(SpoolFile { path, file, at: vec![None; count], end: 0 }))
    }

    pub(crate) fn has(&self, index: usize) -> bool {
        match self {
            Self::Memory(m) => index < m.next || m.early.contains_key(&index),
            Self::Spool(s) => s.at[index].is_some(),
        }
    }

    pub(crate) fn put(&mut self, index: usize, bytes: Bytes) -> Result<()> {
        match self {
            Self::Memory(m) => {
                if index != m.next {
                    m.early.insert(index, bytes);
                    return Ok(());
                }
                m.joined.extend_from_slice(&bytes);
                m.next += 1;
                while let Some(bytes) = m.early.remove(&m.next) {
                    m.joined.extend_from_slice(&bytes);
                    m.next += 1;
                }
            }
            Self::Spool(s) => {
                s.file.seek(SeekFrom::Start(s.end)).map_err(|e| spool_err(&s.path, e))?;
                s.file.write_all(&bytes).map_err(|e| spool_err(&s.path, e))?;
                s.at[index] = Some((s.end, bytes.len()));
                s.end += bytes.len() as u64;
            }
        }
        Ok(())
    }

    /// Every chunk in index order, as one buffer of `total` bytes; the parts start over.
    pub(crate) fn take_all(&mut self, total: usize) -> Result<Vec<u8>> {
        match self {
            // Every chunk is in (the caller counted them), so every one was joined.
            Self::Memory(m) => {
                debug_assert!(m.early.is_empty() && m.next == m.count);
                m.next = 0;
                m.early.clear();
                Ok(std::mem::take(&mut m.joined))
            }
            Self::Spool(s) => {
                let bytes = s.read_all(total)?;
                s.at.iter_mut().for_each(|a| *a = None);
                s.end = 0;
                s.file.set_len(0).map_err(|e| spool_err(&s.path, e))?;
                Ok(bytes)
            }
        }
    }

    /// The digest of every chunk in index order, read back from the spool file one chunk
    /// at a time.
    pub(crate) fn digest(&mut self) -> Result<Vec<u8>> {
        match self {
            Self::Memory(m) => Ok(crate::digest::digest(&m.joined)),
            Self::Spool(s) => s.digest(),
        }
    }

    /// The spool file, for a transfer that stays on disk once complete; the parts are left
    /// empty. `None` for chunks held in memory.
    pub(crate) fn take_spool(&mut self) -> Option<SpoolFile> {
        match std::mem::replace(self, Self::Memory(MemoryParts::default())) {
            Self::Spool(s) => Some(s),
            memory => {
                *self = memory;
                None
            }
        }
    }

    /// Forgets every chunk.
    pub(crate) fn clear(&mut self) -> Result<()> {
        match self {
            Self::Memory(m) => {
                m.joined.clear();
                m.next = 0;
                m.early.clear();
            }
            Self::Spool(s) => {
                s.at.iter_mut().for_each(|a| *a = None);
                s.end = 0;
                s.file.set_len(0).map_err(|e| spool_err(&s.path, e))?;
            }
        }
        Ok(())
    }
}

impl SpoolFile {
    /// Every chunk in index order, as one buffer of `total` bytes.
    pub(crate) fn read_all(&mut self, total: usize) -> Result<Vec<u8>> {
        let mut bytes = Vec::with_capacity(total);
        for (offset, len) in self.at.iter().flatten() {
            let start = bytes.len();
            bytes.resize(start + len, 0);
            self.file.seek(SeekFrom::Start(*offset)).map_err(|e| spool_err(&self.path, e))?;
            self.file.read_exact(&mut bytes[start..]).map_err(|e| spool_err(&self.path, e))?;
        }
        Ok(bytes)
    }

    /// The digest of the chunks in index order, read back one chunk at a time, so that
    /// checking a transfer never holds more of it than its largest chunk.
    pub(crate) fn digest(&mut self) -> Result<Vec<u8>> {
        let mut hasher = Hasher::default();
        let mut buffer = Vec::new();
        for (offset, len) in self.at.iter().flatten() {
            buffer.resize(*len, 0);
            self.file.seek(SeekFrom::Start(*offset)).map_err(|e| spool_err(&self.path, e))?;
            self.file.read_exact(&mut buffer).map_err(|e| spool_err(&self.path, e))?;
            hasher.update(&buffer);
        }
        Ok(hasher.finish())
    }

    /// The file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SpoolFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
