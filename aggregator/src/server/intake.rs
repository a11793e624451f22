//! Taking device updates in: the announcement's checks, chunk by chunk reassembly of the
//! delta and its sections, and verification against the shared set before anything is
//! folded into the round's sums.

use anyhow::{bail, Result};
use fedpo_wire::{
    byte_bounds, keys, Bundle, BundleBytes, BundleProgress, TensorPayload, TransferChunk, Update, UpdateCodec,
    WireDType,
};

use super::{OpenRound, Server};
use crate::accumulator::WeightedSum;
use crate::global_model::GlobalModel;

/// Updates in flight whose chunks wait in memory; later ones are spooled to files.
pub(super) const UPDATES_IN_MEMORY: usize = 2;

impl Server {
    /// Refuses an announcement that a later one from the device may put right.
    fn refuse_update(&mut self, device: &str, round: u64, why: String) {
        self.warnings.warn(device, "update", &format!("round {round}: update refused: {why}"));
    }

    /// Refuses for good: the same announcement again would be refused again, so the
    /// round stops waiting for this device.
    fn refuse_for_good(&mut self, open: &mut OpenRound, device: &str, why: String) {
        self.warnings.warn(device, "update", &format!("round {}: update refused: {why}", open.round));
        open.rejected.insert(device.to_string(), why);
        open.refused.insert(device.to_string());
    }

    pub(super) fn start_update(&mut self, open: &mut OpenRound, device: &str, mut u: Update) {
        let round = u.round;
        if u.device != device {
            return self.refuse_update(
                device,
                round,
                format!("it names device `{}` but came on {device}'s topic", u.device),
            );
        }
        if u.round != open.round {
            return self.refuse_update(
                device,
                round,
                format!("it is for round {}, the open round is {}", u.round, open.round),
            );
        }
        if !open.selected.contains(device) {
            return self.refuse_update(device, round, "the device was not selected this round".into());
        }
        if open.reported.contains_key(device) {
            return; // a duplicate delivery or a resend of an update already counted
        }
        if open.transfers.get(device).is_some_and(|(_, b)| b.manifest() == &u.update) {
            return; // the same update announced again while its chunks are arriving
        }
        if let Err(why) = check_metrics(&u.metrics) {
            return self.refuse_for_good(open, device, why);
        }
        // A device weighs what it declared when it joined, whatever an update claims.
        let declared = self.state.devices.get(device).map_or(0, |d| d.pairs);
        if u.pairs > declared {
            let why = format!("update claims {} pairs, its hello {declared}; counted as declared", u.pairs);
            self.warnings.warn(device, "pairs", &why);
            u.pairs = declared;
        }
        let transfer = format!("r{}/{device}", open.round);
        if u.update.transfer != transfer {
            return self.refuse_update(device, round, format!("transfer id `{}` is not {transfer}", u.update.transfer));
        }
        let required = self.client_term.required_section().filter(|_| !open.evaluation);
        for (name, m) in &u.sections {
            let expected =
                Some(name.as_str()) == required || (name == keys::DIAGNOSTIC_GRADIENT && open.diagnostics.is_some());
            if !expected {
                return self.refuse_update(device, round, format!("unexpected section `{name}`"));
            }
            if m.transfer != format!("{transfer}/{name}") {
                return self.refuse_update(
                    device,
                    round,
                    format!("section `{name}` has transfer id `{}`, not {transfer}/{name}", m.transfer),
                );
            }
        }
        // Sizes are bounded by the shared set before a byte is stored: the transfer's
        // buffer is reserved, or its chunks spooled, on the word of the announcement.
        let oversized =
            std::iter::once(("update", u.update.bytes, update_bytes_bound(&self.global, open.plan.update_codec)))
                .chain(
                    u.sections
                        .iter()
                        .map(|(name, m)| (name.as_str(), m.bytes, update_bytes_bound(&self.global, UpdateCodec::F32))),
                )
                .find(|(_, bytes, bound)| bytes > bound);
        if let Some((what, bytes, bound)) = oversized {
            return self.refuse_for_good(
                open,
                device,
                format!("its {what} announces {bytes} bytes, more than the shared set takes ({bound} at most)"),
            );
        }
        if let Some(name) = required.filter(|n| !u.sections.contains_key(*n)) {
            open.rejected.insert(device.to_string(), format!("no `{name}` section"));
            return self.refuse_update(
                device,
                round,
                format!("the job runs {} but the update has no `{name}` section", self.client_term.kind.name()),
            );
        }
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
            Err(e) => self.refuse_for_good(open, device, e.to_string()),
        }
    }

    pub(super) fn accept_chunk(&mut self, open: &mut OpenRound, device: &str, chunk: TransferChunk) {
        let Some((_, bundle)) = open.transfers.get_mut(device) else { return };
        let len = chunk.bytes.len() as u64;
        let diagnostic = chunk.transfer.ends_with(&format!("/{}", keys::DIAGNOSTIC_GRADIENT));
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
                                open.reported.insert(device.to_string(), (update.pairs, update.metrics));
                                tracing::info!(%device, reported = open.reported.len(), of = open.selected.len(), "masked input accepted");
                            }
                            Err(e) => {
                                self.warnings.warn(device, "update", &format!("masked input refused: {e}"));
                                open.rejected.insert(device.to_string(), e.to_string());
                                open.refused.insert(device.to_string());
                            }
                        }
                        return;
                    }
                    match self.verify(open, &bytes) {
                        Ok((delta, sections)) => {
                            open.updates.add(&delta, update.pairs as f64);
                            for (name, payload) in &sections {
                                if name == keys::DIAGNOSTIC_GRADIENT {
                                    if let Some(d) = open.diagnostics.as_mut() {
                                        d.add_gradient(payload);
                                    }
                                } else if let Some(controls) = open.controls.as_mut() {
                                    controls.add(payload, 1.0);
                                }
                            }
                            if let Some(d) = open.diagnostics.as_mut() {
                                d.add_update(&delta);
                            }
                            open.reported.insert(device.to_string(), (update.pairs, update.metrics));
                            tracing::info!(%device, reported = open.reported.len(), of = open.selected.len(), "update accepted");
                        }
                        Err(e) => {
                            self.warnings.warn(device, "update", &format!("update refused: {e}"));
                            open.rejected.insert(device.to_string(), e.to_string());
                            open.refused.insert(device.to_string());
                        }
                    }
                }
            }
            Err(e) => {
                self.warnings.warn(device, "transfer", &format!("update transfer failed: {e}"));
                open.rejected.insert(device.to_string(), e.to_string());
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
        if delta.tensors.is_empty() && !open.evaluation {
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

/// What a device reports must be a measurement: finite, accuracies within [0, 1], the
/// rest not negative. Anything else would reach `metrics.jsonl` and the summary as null.
fn check_metrics(m: &fedpo_wire::UpdateMetrics) -> Result<(), String> {
    let fields = [
        ("train_loss", Some(m.train_loss), f64::INFINITY),
        ("reward_acc", Some(m.reward_acc), 1.0),
        ("heldout_acc", m.heldout_acc, 1.0),
        ("grad_norm", Some(m.grad_norm), f64::INFINITY),
        ("seconds", Some(m.seconds), f64::INFINITY),
        ("peak_rss_mib", m.peak_rss_mib, f64::INFINITY),
    ];
    for (name, value, most) in fields {
        if let Some(v) = value.filter(|v| !(v.is_finite() && (0.0..=most).contains(v))) {
            let range = if most == 1.0 { "within [0, 1]" } else { "finite and not negative" };
            return Err(format!("its metric {name} = {v} is not {range}"));
        }
    }
    Ok(())
}
