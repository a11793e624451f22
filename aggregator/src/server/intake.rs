//! Taking device updates in: the announcement's checks, chunk by chunk reassembly of the
//! delta and its sections, and verification against the shared set before anything is
//! folded into the round's sums.

use anyhow::{bail, Result};
use fedpo_wire::{
    byte_bounds, Bundle, BundleBytes, BundleProgress, TensorPayload, TransferChunk, Update, UpdateCodec, WireDType,
};

use super::collector::{Announcement, Expected};
use super::{Aggregator, OpenRound};
use crate::diagnostics::Diagnostics;
use crate::global_model::GlobalModel;
use crate::weighted_sum::WeightedSum;

/// Updates in flight whose chunks wait in memory; later ones are spooled to files.
pub(super) const UPDATES_IN_MEMORY: usize = 2;

impl Aggregator {
    pub(super) fn start_update(&mut self, open: &mut OpenRound, device: &str, u: Update) {
        let expected = Expected {
            required_section: self.client_term.required_section(),
            client_term: self.client_term.kind().name(),
            optional_section: open.diagnostics.is_some().then_some(crate::diagnostics::SECTION),
            update_bytes: update_bytes_bound(&self.global, open.plan.update_codec),
            section_bytes: update_bytes_bound(&self.global, UpdateCodec::F32),
            declared_pairs: self.state.devices.get(device).map_or(0, |d| d.pairs),
        };
        let in_flight = open.transfers.get(device).map(|(_, b)| b.manifest());
        let u = match open.collector.announce(device, u, in_flight, &expected) {
            Announcement::Ignore => return,
            Announcement::Refused { round, why } => return self.refuse_update(device, round, why),
            Announcement::Accepted { update, clamped } => {
                if let Some(why) = clamped {
                    self.warnings.warn(device, "pairs", &why);
                }
                *update
            }
        };
        // The first updates in flight wait in memory, the rest in spool files: a small fleet
        // is spared writing and reading back every update, and memory stays O(model).
        let in_memory = open.transfers.values().filter(|(_, b)| b.in_memory()).count();
        let bundle = if in_memory < UPDATES_IN_MEMORY {
            Bundle::new(u.update.clone(), &u.sections, &self.limits)
        } else {
            Bundle::spooled(u.update.clone(), &u.sections, &self.limits, &self.out.join("spool"))
        };
        match bundle {
            Ok(b) => {
                open.transfers.insert(device.to_string(), (u, b));
            }
            Err(e) => {
                if let Announcement::Refused { round, why } = open.collector.refuse_for_good(device, e.to_string()) {
                    self.refuse_update(device, round, why);
                }
            }
        }
    }

    /// Warns that `device`'s update of `round` was refused.
    fn refuse_update(&mut self, device: &str, round: u64, why: String) {
        self.warnings.warn(device, "update", &format!("round {round}: update refused: {why}"));
    }

    pub(super) fn accept_chunk(&mut self, open: &mut OpenRound, device: &str, chunk: TransferChunk) {
        let Some((_, bundle)) = open.transfers.get_mut(device) else { return };
        let len = chunk.bytes.len() as u64;
        let diagnostic = Diagnostics::carries(&chunk.transfer);
        match bundle.accept(chunk) {
            Ok(BundleProgress::Foreign | BundleProgress::Duplicate) => {}
            Ok(progress) => {
                open.bytes_up += len;
                *open.bytes_up_by_device.entry(device.to_string()).or_default() += len;
                if diagnostic {
                    open.diagnostics_bytes += len;
                }
                if let BundleProgress::Complete(bytes) = progress {
                    let (update, _) = open.transfers.remove(device).expect("transfer present");
                    if let Some(sec) = open.secure.as_mut() {
                        match sec.add_input(device, update.pairs, &bytes, &self.limits) {
                            Ok(()) => {
                                open.collector.report(device, update.pairs, update.metrics);
                                let (reported, of) = (open.collector.reported().len(), open.collector.selected().len());
                                tracing::info!(%device, reported, of, "masked input accepted");
                            }
                            Err(e) => {
                                self.warnings.warn(device, "update", &format!("masked input refused: {e}"));
                                open.collector.refuse_for_good(device, e.to_string());
                            }
                        }
                        return;
                    }
                    match self.verify(open, &bytes) {
                        Ok((delta, sections)) => {
                            open.updates.add(&delta, update.pairs as f64);
                            for (name, payload) in &sections {
                                let diagnostic =
                                    open.diagnostics.as_mut().is_some_and(|d| d.take_section(name, payload));
                                if !diagnostic {
                                    self.client_term.take_section(name, payload);
                                }
                            }
                            if let Some(d) = open.diagnostics.as_mut() {
                                d.add_update(&delta);
                            }
                            open.collector.report(device, update.pairs, update.metrics);
                            let (reported, of) = (open.collector.reported().len(), open.collector.selected().len());
                            tracing::info!(%device, reported, of, "update accepted");
                        }
                        Err(e) => {
                            self.warnings.warn(device, "update", &format!("update refused: {e}"));
                            open.collector.refuse_for_good(device, e.to_string());
                        }
                    }
                }
            }
            Err(e) => {
                self.warnings.warn(device, "transfer", &format!("update transfer failed: {e}"));
                open.collector.transfer_failed(device, e.to_string());
            }
        }
    }

    /// Decodes and checks a complete update: the delta and every section must be shaped
    /// like the shared set, and a training round's delta must not be empty.
    fn verify(&self, open: &OpenRound, bytes: &BundleBytes) -> Result<(TensorPayload, Vec<(String, TensorPayload)>)> {
        // Decoded in place: the tensors are slices of the received bytes.
        let delta = TensorPayload::from_shared(bytes.main.clone(), &self.limits, true)?;
        WeightedSum::check(&self.global, &delta)?;
        let codec = open.plan.update_codec;
        if let Some(t) = delta.tensors.iter().find(|t| t.dtype() != codec.dtype()) {
            bail!(
                "update tensor `{}` is {}, and this round's plan asks for {} (--update-codec {codec})",
                t.name(),
                t.dtype(),
                codec.dtype()
            );
        }
        if delta.tensors.is_empty() && !open.collector.evaluation() {
            bail!("an empty update in a training round")
        }
        if let Some(max) = self.job.max_update_norm {
            let norm = delta.tensors.iter().map(|t| t.sum_of_squares()).sum::<f64>().sqrt();
            if norm > max {
                bail!("update norm {norm:.6} exceeds --max-update-norm {max}");
            }
        }
        let mut sections = Vec::new();
        for (name, b) in &bytes.sections {
            let payload = TensorPayload::from_shared(b.clone(), &self.limits, true)?;
            WeightedSum::check(&self.global, &payload).map_err(|e| anyhow::anyhow!("section `{name}`: {e}"))?;
            if payload.tensors.is_empty() {
                bail!("section `{name}` is empty");
            }
            sections.push((name.clone(), payload));
        }
        Ok((delta, sections))
    }
}

/// The most bytes an honest update of the shared set can take on the wire: every shared
/// tensor at its largest under `codec` (or as f32 words, whichever is larger, which also
/// covers a secure-aggregation round's masked words), plus room for each tensor's name,
/// shape and CBOR framing.
pub(super) fn update_bytes_bound(global: &GlobalModel, codec: UpdateCodec) -> u64 {
    const PAYLOAD_FRAMING: u64 = 1024;
    const TENSOR_FRAMING: u64 = 128;
    global.shared().fold(PAYLOAD_FRAMING, |total, t| {
        let shape: Vec<u64> = t.shape.iter().map(|&d| d as u64).collect();
        let largest = [codec.dtype(), WireDType::F32]
            .into_iter()
            .filter_map(|dtype| byte_bounds(&shape, dtype).map(|(_, most)| most))
            .max()
            .unwrap_or(u64::MAX);
        let framing = TENSOR_FRAMING + t.name.len() as u64 + 9 * shape.len() as u64;
        total.saturating_add(largest).saturating_add(framing)
    })
}
