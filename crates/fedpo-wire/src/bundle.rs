//! Several transfers that belong to one message and complete together.
//!
//! A plan carries the global model and, for some algorithms, named sections (SCAFFOLD's
//! server control variate, FedGA's reference direction); an update carries the shared
//! delta and, likewise, named sections (the control-variate change, the diagnostic
//! gradient). Each section is its own transfer with its own manifest, never a slice of
//! another tensor list, so a receiver can check every section's tensors by name.

use std::collections::BTreeMap;
use std::path::Path;

use bytes::Bytes;

use crate::bundle_bytes::BundleBytes;
use crate::chunk::{Reassembler, ReassemblyProgress};
use crate::error::Result;
use crate::kept::{KeptBundle, KeptTransfer};
use crate::limits::Limits;
use crate::message::{check_sections, Manifest, TransferChunk};

/// What accepting a chunk did to a bundle.
#[derive(Debug, PartialEq)]
pub enum BundleProgress {
    /// The chunk belongs to none of the bundle's transfers.
    Foreign,
    /// Stored.
    Accepted,
    /// Already had it.
    Duplicate,
    /// Every transfer is complete and verified.
    Complete(BundleBytes),
    /// Every transfer of a [`Bundle::kept`] is complete, verified, and waits on disk.
    Kept(KeptBundle),
}

/// Collects a main transfer and its named sections.
pub struct Bundle {
    main: Reassembler,
    sections: BTreeMap<String, Reassembler>,
    done: BTreeMap<String, Done>,
    main_done: Option<Done>,
}

/// A transfer of the bundle that is complete.
enum Done {
    Bytes(Bytes),
    Kept(KeptTransfer),
}

impl Bundle {
    /// Starts collecting after checking every manifest against the limits.
    pub fn new(main: Manifest, sections: &BTreeMap<String, Manifest>, limits: &Limits) -> Result<Self> {
        check_sections(&main, sections, limits)?;
        let sections = sections
            .iter()
            .map(|(name, m)| Ok((name.clone(), Reassembler::new(m.clone(), limits)?)))
            .collect::<Result<_>>()?;
        Ok(Self { main: Reassembler::new(main, limits)?, sections, done: BTreeMap::new(), main_done: None })
    }

    /// Like [`Bundle::new`], with every transfer's chunks spooled to files under `dir`.
    pub fn spooled(main: Manifest, sections: &BTreeMap<String, Manifest>, limits: &Limits, dir: &Path) -> Result<Self> {
        Self::on_disk(main, sections, limits, dir, Reassembler::spooled)
    }

    /// Like [`Bundle::spooled`], and the complete bundle stays in its files:
    /// [`BundleProgress::Kept`] hands them over, verified, to be read when wanted.
    pub fn kept(main: Manifest, sections: &BTreeMap<String, Manifest>, limits: &Limits, dir: &Path) -> Result<Self> {
        Self::on_disk(main, sections, limits, dir, Reassembler::kept)
    }

    fn on_disk(
        main: Manifest,
        sections: &BTreeMap<String, Manifest>,
        limits: &Limits,
        dir: &Path,
        reassembler: fn(Manifest, &Limits, &Path) -> Result<Reassembler>,
    ) -> Result<Self> {
        check_sections(&main, sections, limits)?;
        let sections = sections
            .iter()
            .map(|(name, m)| Ok((name.clone(), reassembler(m.clone(), limits, dir)?)))
            .collect::<Result<_>>()?;
        let main = reassembler(main, limits, dir)?;
        Ok(Self { main, sections, done: BTreeMap::new(), main_done: None })
    }

    /// The main transfer's manifest.
    pub fn manifest(&self) -> &Manifest {
        self.main.manifest()
    }

    /// Whether the chunks wait in memory ([`Bundle::new`]) rather than in spool files.
    pub fn in_memory(&self) -> bool {
        self.main.in_memory()
    }

    /// Routes a chunk to its transfer. A transfer whose bytes fail their hash starts over
    /// and reports the error; the others keep what they have.
    pub fn accept(&mut self, chunk: TransferChunk) -> Result<BundleProgress> {
        let (progress, section) = if chunk.transfer == self.main.manifest().transfer {
            (self.main.accept(chunk)?, None)
        } else if let Some((name, r)) = self.sections.iter_mut().find(|(_, r)| r.manifest().transfer == chunk.transfer)
        {
            (r.accept(chunk)?, Some(name.clone()))
        } else {
            return Ok(BundleProgress::Foreign);
        };
        let done = match progress {
            ReassemblyProgress::Duplicate => return Ok(BundleProgress::Duplicate),
            ReassemblyProgress::Accepted { .. } => return Ok(BundleProgress::Accepted),
            ReassemblyProgress::Complete(bytes) => Done::Bytes(bytes.into()),
            ReassemblyProgress::Kept(kept) => Done::Kept(kept),
        };
        match section {
            Some(name) => {
                self.done.insert(name, done);
            }
            None => self.main_done = Some(done),
        }
        if self.main_done.is_none() || self.done.len() < self.sections.len() {
            return Ok(BundleProgress::Accepted);
        }
        let main = self.main_done.take().expect("main transfer done");
        let sections = std::mem::take(&mut self.done);
        // Every transfer of a bundle is reassembled alike, so all are bytes or all are kept.
        Ok(match main {
            Done::Bytes(main) => BundleProgress::Complete(BundleBytes {
                main,
                sections: sections
                    .into_iter()
                    .map(|(name, d)| match d {
                        Done::Bytes(b) => (name, b),
                        Done::Kept(_) => unreachable!("a bundle's transfers are reassembled alike"),
                    })
                    .collect(),
            }),
            Done::Kept(main) => BundleProgress::Kept(KeptBundle {
                main,
                sections: sections
                    .into_iter()
                    .map(|(name, d)| match d {
                        Done::Kept(k) => (name, k),
                        Done::Bytes(_) => unreachable!("a bundle's transfers are reassembled alike"),
                    })
                    .collect(),
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk::split_payload;
    use crate::wire_tensor::{TensorPayload, ToWire, WireDType};

    struct T(&'static str, Vec<f32>);
    impl ToWire for T {
        fn wire_name(&self) -> &str {
            self.0
        }
        fn wire_shape(&self) -> Vec<u64> {
            vec![self.1.len() as u64]
        }
        fn wire_values(&self) -> &[f32] {
            &self.1
        }
    }

    #[test]
    fn bundle_completes_only_when_main_and_every_section_arrived_in_any_order() {
        let payload = |v: f32| TensorPayload::encode(&[T("a", vec![v; 300])], WireDType::F32);
        let (main, mut chunks) = split_payload("r1/dev", &payload(1.0), 500);
        let (grad, grad_chunks) = split_payload("r1/dev/grad", &payload(2.0), 500);
        chunks.extend(grad_chunks);
        chunks.reverse();
        let sections = BTreeMap::from([("diagnostics.gradient".to_string(), grad)]);
        let limits = Limits { max_chunk_bytes: 500, ..Limits::default() };
        let mut bundle = Bundle::new(main, &sections, &limits).unwrap();
        let foreign = TransferChunk { transfer: "r1/other".into(), index: 0, count: 1, bytes: Bytes::new() };
        assert_eq!(bundle.accept(foreign).unwrap(), BundleProgress::Foreign);
        let last = chunks.pop().unwrap();
        for c in chunks.clone() {
            assert_eq!(bundle.accept(c).unwrap(), BundleProgress::Accepted);
        }
        assert_eq!(bundle.accept(chunks[0].clone()).unwrap(), BundleProgress::Duplicate);
        let BundleProgress::Complete(bytes) = bundle.accept(last).unwrap() else { panic!("not complete") };
        assert_eq!(bytes.main, payload(1.0).to_bytes());
        assert_eq!(bytes.sections["diagnostics.gradient"], payload(2.0).to_bytes());
    }

    #[test]
    fn sections_reusing_a_transfer_id_are_refused_by_name() {
        let (main, _) = split_payload("r1/dev", &TensorPayload::default(), 500);
        let sections = BTreeMap::from([("scaffold.control_delta".to_string(), main.clone())]);
        let err = Bundle::new(main, &sections, &Limits::default()).err().unwrap().to_string();
        assert!(err.contains("scaffold.control_delta") && err.contains("r1/dev"), "{err}");
    }
}
