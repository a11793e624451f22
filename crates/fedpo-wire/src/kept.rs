//! Transfers that arrived whole and wait on disk until they are used.
//!
//! Devices simulated in one process take turns to train, and a round's model reaches all
//! of them at once: a hundred devices holding 28 MB each while two train would make the
//! simulation's memory grow with the fleet. A kept transfer is verified as it completes,
//! stays in its spool file, and is read (and its digest checked again, since a file can
//! change while it waits) only when its turn comes.

use std::collections::BTreeMap;
use std::path::Path;

use bytes::Bytes;

use crate::bundle_bytes::BundleBytes;
use crate::chunk_store::SpoolFile;
use crate::error::{Result, WireError};
use crate::message::Manifest;

/// A verified transfer in its spool file; the file is removed when this is dropped.
pub struct KeptTransfer {
    transfer: String,
    digest: Vec<u8>,
    bytes: u64,
    file: SpoolFile,
}

impl KeptTransfer {
    pub(crate) fn new(manifest: &Manifest, file: SpoolFile) -> Self {
        Self { transfer: manifest.transfer.clone(), digest: manifest.digest.clone(), bytes: manifest.bytes, file }
    }

    /// The transfer's size in bytes.
    pub fn len(&self) -> u64 {
        self.bytes
    }

    /// Whether the transfer is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Where the bytes wait.
    pub fn path(&self) -> &Path {
        self.file.path()
    }

    /// The bytes, read back and checked against the manifest's digest once more.
    pub fn read(mut self) -> Result<Vec<u8>> {
        let bytes = usize::try_from(self.bytes)
            .map_err(|_| WireError::OutOfMemory { transfer: self.transfer.clone(), bytes: self.bytes })?;
        let read = self.file.read_all(bytes)?;
        let found = crate::digest::digest(&read);
        if found != self.digest || read.len() != bytes {
            return Err(WireError::HashMismatch {
                transfer: format!("{} (kept in {})", self.transfer, self.file.path().display()),
                expected: hex::encode(&self.digest),
                found: hex::encode(found),
            });
        }
        Ok(read)
    }
}

impl std::fmt::Debug for KeptTransfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeptTransfer")
            .field("transfer", &self.transfer)
            .field("bytes", &self.bytes)
            .field("path", &self.file.path())
            .finish()
    }
}

/// Two kept transfers are equal when they are the same transfer in the same file.
impl PartialEq for KeptTransfer {
    fn eq(&self, other: &Self) -> bool {
        (&self.transfer, &self.digest, self.bytes, self.file.path())
            == (&other.transfer, &other.digest, other.bytes, other.file.path())
    }
}

/// A bundle whose transfers all arrived and wait on disk ([`crate::Bundle::kept`]).
#[derive(Debug, PartialEq)]
pub struct KeptBundle {
    /// The main transfer.
    pub main: KeptTransfer,
    /// Each section, by name.
    pub sections: BTreeMap<String, KeptTransfer>,
}

impl KeptBundle {
    /// Bytes in all the transfers together.
    pub fn len(&self) -> u64 {
        self.main.len() + self.sections.values().map(KeptTransfer::len).sum::<u64>()
    }

    /// Whether every transfer is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every transfer's bytes, each checked against its digest once more.
    pub fn read(self) -> Result<BundleBytes> {
        let main = Bytes::from(self.main.read()?);
        let sections =
            self.sections.into_iter().map(|(name, t)| Ok((name, Bytes::from(t.read()?)))).collect::<Result<_>>()?;
        Ok(BundleBytes { main, sections })
    }
}
