//! The aggregator's side of the compressed downlink (`--downlink-codec`): the public
//! model devices hold, and the chain of deltas that leads to it.
//!
//! Each round the public model moves toward the global model by one codec step,
//! `public += decode(C(global − public))` over the shared tensors, the same f32 additions
//! a device makes ([`fedpo_wire::apply_delta`]); what the codec left out stays in
//! `global − public` and goes out in later rounds, so the stream is its own error
//! feedback. Frozen tensors never change, so after a device's first, whole download
//! nothing of them is sent again.
//!
//! The stream keeps the last few steps, so that a device that sat some rounds out
//! catches up from the model it holds. A round whose selected devices do not all hold a
//! model in the chain sends the whole global model instead, and the public model becomes
//! it exactly. The chain is kept short ([`MAX_STEPS`], and no more bytes than half the
//! whole model): a device further behind is cheaper to send the model to.

use std::collections::VecDeque;

use fedpo_wire::{DeltaStep, Downlink, EncodedPayload, TensorPayload, UpdateCodec, DEFAULT_CHUNK_BYTES};

use crate::global_model::{GlobalModel, GlobalTensor};

/// The largest top-k fraction a downlink delta may keep: a sparse entry is 8 bytes
/// (index and value), so past half the entries it is larger than the f32 model.
pub(crate) const MAX_TOPK_FRACTION: f32 = 0.5;

/// `--downlink-codec`: the whole model every round, or deltas in a codec.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum DownlinkCodec {
    Full,
    Delta(UpdateCodec),
}

impl std::str::FromStr for DownlinkCodec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "full" {
            return Ok(Self::Full);
        }
        s.parse().map(Self::Delta).map_err(|e: String| format!("{e}, or full"))
    }
}

/// The most steps a chain keeps.
pub(crate) const MAX_STEPS: usize = 8;

/// One step of the chain: the delta from the public model of digest `base` to the next.
struct Step {
    base: Vec<u8>,
    round: u64,
    payload: EncodedPayload,
}

/// What a round sends down.
pub(crate) enum RoundDownload {
    /// The whole global model; the public model is now exactly it.
    Full,
    /// The chain's steps from the oldest any selected device needs, oldest first: the
    /// plan's downlink, and each step's section name (empty for the newest, which is the
    /// model transfer) with its encoding.
    Chain(Downlink, Vec<(String, EncodedPayload)>),
}

/// The public model and the chain of deltas that built it.
pub(crate) struct DownlinkStream {
    codec: UpdateCodec,
    /// The public model's shared tensors, in the global model's order: its frozen ones are
    /// the global model's own. `None` until a whole model has gone out.
    public: Option<GlobalModel>,
    /// Digest of the public model as a whole f32 payload, frozen tensors included.
    digest: Vec<u8>,
    chain: VecDeque<Step>,
}

impl DownlinkStream {
    pub(crate) fn new(codec: UpdateCodec) -> Self {
        Self { codec, public: None, digest: Vec::new(), chain: VecDeque::new() }
    }

    /// A stream resumed from a checkpoint: devices that hold `public` (whose digest is
    /// `digest`) go on from it; the chain before it is gone.
    pub(crate) fn resumed(codec: UpdateCodec, public: GlobalModel, digest: Vec<u8>) -> Self {
        Self { codec, public: Some(public), digest, chain: VecDeque::new() }
    }

    pub(crate) fn codec(&self) -> UpdateCodec {
        self.codec
    }

    /// The public model's shared tensors, once there is one.
    pub(crate) fn public(&self) -> Option<&GlobalModel> {
        self.public.as_ref()
    }

    /// Digest of the public model; empty before the first whole download.
    pub(crate) fn digest(&self) -> &[u8] {
        &self.digest
    }

    /// Round `round`'s download for devices holding `held` (one digest each, empty for
    /// none): the chain when every one of them can follow it, else the whole model.
    /// `full_digest` is the digest of `global` as a whole payload.
    pub(crate) fn download(
        &mut self,
        round: u64,
        global: &GlobalModel,
        full_digest: &[u8],
        held: &[&[u8]],
    ) -> RoundDownload {
        if self.public.is_none() {
            self.reset(global, full_digest);
            return RoundDownload::Full;
        }
        self.advance(round, global);
        // A device may hold the new public model already: it rebuilt it from a plan of
        // this round before the aggregator restarted.
        if held.iter().any(|h| *h != self.digest.as_slice() && !self.chain.iter().any(|s| s.base == *h)) {
            self.reset(global, full_digest);
            return RoundDownload::Full;
        }
        let first = self.chain.iter().position(|s| held.contains(&s.base.as_slice())).unwrap_or(self.chain.len() - 1);
        let newest = self.chain.len() - 1;
        let (steps, payloads) = self
            .chain
            .iter()
            .enumerate()
            .skip(first)
            .map(|(i, s)| {
                let section =
                    if i == newest { String::new() } else { format!("{}{}", fedpo_wire::DOWNLINK_SECTION, s.round) };
                (DeltaStep { base: s.base.clone(), section: section.clone() }, (section, s.payload.clone()))
            })
            .unzip();
        RoundDownload::Chain(Downlink { codec: self.codec, steps, model: self.digest.clone() }, payloads)
    }

    /// The whole model went out: the public model is exactly `global`.
    fn reset(&mut self, global: &GlobalModel, full_digest: &[u8]) {
        let shared = global.shared().cloned().collect();
        self.public = Some(GlobalModel::new(global.spec.clone(), shared));
        self.digest = full_digest.to_vec();
        self.chain.clear();
    }

    /// One codec step of the public model toward `global`, recorded in the chain.
    fn advance(&mut self, round: u64, global: &GlobalModel) {
        let Some(public) = self.public.as_mut() else { return };
        let mut tensors = Vec::with_capacity(public.tensors.len());
        for p in &mut public.tensors {
            let Some(g) = global.get(&p.name) else { continue };
            let diff: Vec<f32> = g.values.iter().zip(&p.values).map(|(g, p)| g - p).collect();
            let shape: Vec<u64> = p.shape.iter().map(|&d| d as u64).collect();
            let wire = self.codec.encode(&p.name, &shape, &diff);
            let mut sent = Vec::with_capacity(diff.len());
            wire.for_each_value(|v| sent.push(v));
            p.values.iter_mut().zip(sent).for_each(|(p, d)| *p += d);
            tensors.push(wire);
        }
        let payload = EncodedPayload::new(&TensorPayload { tensors }, DEFAULT_CHUNK_BYTES);
        let base = std::mem::replace(&mut self.digest, public_digest(global, public));
        self.chain.push_back(Step { base, round, payload });
        let limit = global.wire_bytes_bound() / 2;
        while self.chain.len() > MAX_STEPS || self.chain.iter().map(|s| s.payload.len()).sum::<u64>() > limit {
            if self.chain.len() == 1 {
                break;
            }
            self.chain.pop_front();
        }
    }
}

/// Digest of the model devices hold: `global`'s frozen tensors and `public`'s shared ones,
/// in `global`'s order, as one f32 payload.
pub(crate) fn public_digest(global: &GlobalModel, public: &GlobalModel) -> Vec<u8> {
    let tensors: Vec<&GlobalTensor> =
        global.tensors.iter().map(|t| if t.shared { public.get(&t.name).unwrap_or(t) } else { t }).collect();
    EncodedPayload::compress(&tensors, UpdateCodec::F32, DEFAULT_CHUNK_BYTES).digest().to_vec()
}

#[cfg(test)]
mod tests;
