//! Splitting a payload into chunks and putting it back together.
//!
//! The sender announces a [`Manifest`] (size, chunk count, digest) and then publishes the
//! chunks. The [`Reassembler`] accepts them in any order, ignores duplicates (QoS 1 may
//! deliver twice), refuses chunks that do not fit the manifest, and releases the bytes
//! only when their digest matches.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::chunk_store::ChunkStore;
use crate::chunked_encoder::EncodedPayload;
use crate::digest::{digest, Hasher};
use crate::error::{Result, WireError};
use crate::kept::KeptTransfer;
use crate::limits::Limits;
use crate::message::{Manifest, TransferChunk};
use crate::wire_tensor::TensorPayload;

/// The manifest and chunks of a payload.
pub fn split_payload(transfer: &str, payload: &TensorPayload, chunk_bytes: usize) -> (Manifest, Vec<TransferChunk>) {
    EncodedPayload::new(payload, chunk_bytes).into_transfer(transfer)
}

/// What accepting a chunk did.
#[derive(Debug, PartialEq)]
pub enum ReassemblyProgress {
    /// Stored; `received` of the manifest's chunks are in.
    Accepted {
        /// Distinct chunks received so far.
        received: u32,
    },
    /// Already had it; nothing changed.
    Duplicate,
    /// The last chunk: the verified payload bytes.
    Complete(Vec<u8>),
    /// The last chunk of a transfer kept on disk ([`Reassembler::kept`]): verified, and
    /// still in its file.
    Kept(KeptTransfer),
}

/// Collects the chunks of one transfer.
pub struct Reassembler {
    manifest: Manifest,
    parts: ChunkStore,
    received: u32,
    bytes_so_far: u64,
    done: bool,
    /// Hand the complete transfer over in its spool file rather than read into memory.
    keep: bool,
    /// Digest of the chunks so far while they arrive in order (as one MQTT connection
    /// delivers them), so the last chunk needs no pass over the whole transfer; `None`
    /// once one came out of order, and the hash is then taken at the end.
    in_order: Option<(Hasher, u32)>,
}

impl Reassembler {
    /// Starts a transfer after checking its manifest against the limits.
    pub fn new(manifest: Manifest, limits: &Limits) -> Result<Self> {
        manifest.validate(limits)?;
        let parts = ChunkStore::memory(&manifest.transfer, manifest.chunks as usize, manifest.bytes)?;
        Ok(Self::with_parts(manifest, parts))
    }

    /// Like [`Reassembler::new`], but the chunks wait in a file under `dir` (removed when
    /// the reassembler is dropped) rather than in memory.
    pub fn spooled(manifest: Manifest, limits: &Limits, dir: &Path) -> Result<Self> {
        manifest.validate(limits)?;
        // Numbered, since a kept transfer's file outlives its reassembler and another may
        // be started for the same transfer id.
        static SPOOLED: AtomicU64 = AtomicU64::new(0);
        let n = SPOOLED.fetch_add(1, Ordering::Relaxed);
        let name = format!("{}-{n}.part", hex::encode(&digest(manifest.transfer.as_bytes())[..12]));
        let parts = ChunkStore::spool(dir.join(name), manifest.chunks as usize)?;
        Ok(Self::with_parts(manifest, parts))
    }

    /// Like [`Reassembler::spooled`], and the complete transfer stays in its file: the last
    /// chunk yields [`ReassemblyProgress::Kept`], verified, and the bytes are read when wanted. A
    /// device that must wait its turn to train holds the model it downloaded on disk, not
    /// in memory.
    pub fn kept(manifest: Manifest, limits: &Limits, dir: &Path) -> Result<Self> {
        Ok(Self { keep: true, ..Self::spooled(manifest, limits, dir)? })
    }

    fn with_parts(manifest: Manifest, parts: ChunkStore) -> Self {
        Self {
            manifest,
            parts,
            received: 0,
            bytes_so_far: 0,
            done: false,
            keep: false,
            in_order: Some((Hasher::default(), 0)),
        }
    }

    /// The manifest being assembled.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Whether the chunks wait in memory rather than in a spool file.
    pub fn in_memory(&self) -> bool {
        matches!(self.parts, ChunkStore::Memory(_))
    }

    /// Accepts one chunk.
    pub fn accept(&mut self, chunk: TransferChunk) -> Result<ReassemblyProgress> {
        if chunk.transfer != self.manifest.transfer {
            return Err(WireError::WrongTransfer { expected: self.manifest.transfer.clone(), found: chunk.transfer });
        }
        if chunk.count != self.manifest.chunks || chunk.index >= self.manifest.chunks {
            return Err(WireError::BadChunk {
                index: chunk.index,
                count: chunk.count,
                expected_count: self.manifest.chunks,
            });
        }
        if self.done || self.parts.has(chunk.index as usize) {
            return Ok(ReassemblyProgress::Duplicate);
        }
        let new_total = self.bytes_so_far + chunk.bytes.len() as u64;
        if new_total > self.manifest.bytes {
            return Err(WireError::TransferTooLarge { size: new_total, max: self.manifest.bytes });
        }
        self.in_order = match self.in_order.take() {
            Some((mut hasher, next)) if next == chunk.index => {
                hasher.update(&chunk.bytes);
                Some((hasher, next + 1))
            }
            _ => None,
        };
        self.parts.put(chunk.index as usize, chunk.bytes)?;
        self.bytes_so_far = new_total;
        self.received += 1;
        if self.received < self.manifest.chunks {
            return Ok(ReassemblyProgress::Accepted { received: self.received });
        }
        if self.keep {
            let found = match self.in_order.take() {
                Some((hasher, _)) => hasher.finish(),
                None => self.parts.digest()?,
            };
            self.check(found)?;
            let file = self.parts.take_spool().expect("a kept transfer is spooled");
            return Ok(ReassemblyProgress::Kept(KeptTransfer::new(&self.manifest, file)));
        }
        let bytes = self.parts.take_all(self.manifest.bytes as usize)?;
        let found = match self.in_order.take() {
            Some((hasher, _)) => hasher.finish(),
            None => digest(&bytes),
        };
        self.check(found)?;
        Ok(ReassemblyProgress::Complete(bytes))
    }

    /// Checks a complete transfer's digest against the manifest's. On a mismatch the
    /// transfer starts over: a corrupted chunk means it must be sent again.
    fn check(&mut self, found: Vec<u8>) -> Result<()> {
        if found != self.manifest.digest || self.bytes_so_far != self.manifest.bytes {
            self.parts.clear()?;
            self.received = 0;
            self.bytes_so_far = 0;
            self.in_order = Some((Hasher::default(), 0));
            return Err(WireError::HashMismatch {
                transfer: self.manifest.transfer.clone(),
                expected: hex::encode(&self.manifest.digest),
                found: hex::encode(found),
            });
        }
        self.done = true;
        Ok(())
    }
}
