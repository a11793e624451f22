//! The compressed downlink: a round's model as deltas against models devices already hold.
//!
//! Sending the whole model in f32 every round costs each device 328 MB a round for
//! DistilGPT-2, frozen tensors included, whatever codec the uplink uses. With a downlink
//! codec the aggregator keeps a *public model*, the model devices actually hold, and each
//! round sends only `C(global − public)` over the shared tensors in that codec; aggregator
//! and devices both add the decoded delta to the public model, in f32, so they agree on it
//! bit for bit. What the codec dropped stays in `global − public` and is sent in later
//! rounds: the aggregator's error feedback, per stream, with no state beyond the public
//! model itself.
//!
//! A plan names the steps as a chain (each step the base model it applies to, by digest),
//! oldest first, so that a device that missed a few rounds catches up from the model it
//! holds; and the digest of the model they yield, which a device checks before it trains.
//! A device whose model is not in the chain, or whose result does not verify, declines
//! the round asking for the whole model ([`crate::RoundDeclined::needs_model`]), and its
//! next plan carries it.

use std::collections::{BTreeMap, HashMap};

use crate::error::{Result, WireError};
use crate::in_place_decode::f32_ranges;
use crate::limits::Limits;
use crate::message::{check_digest_len, DeltaStep, Downlink, Manifest, RoundPlan};
use crate::wire_tensor::TensorPayload;

/// Prefix of the plan sections that carry the older steps of a chain.
pub const DOWNLINK_SECTION: &str = "downlink.";

impl Downlink {
    /// Checks a received downlink against its plan's sections: at least one step, digests
    /// of the right length, the newest step in the model transfer and every older one in
    /// a section of the plan with the downlink prefix, each named once.
    pub(crate) fn validate(&self, sections: &BTreeMap<String, Manifest>) -> Result<()> {
        let invalid = |reason: String| WireError::InvalidField { field: "downlink", reason };
        let Some((newest, older)) = self.steps.split_last() else {
            return Err(invalid("a downlink without steps".into()));
        };
        check_digest_len("downlink model", &self.model, false)?;
        if !newest.section.is_empty() {
            return Err(invalid(format!("its newest step names section `{}`, not the model transfer", newest.section)));
        }
        let mut named = std::collections::BTreeSet::new();
        for step in &self.steps {
            check_digest_len("downlink base", &step.base, false)?;
        }
        for step in older {
            if !step.section.starts_with(DOWNLINK_SECTION) || !sections.contains_key(&step.section) {
                return Err(invalid(format!("step section `{}` is not a downlink section of the plan", step.section)));
            }
            if !named.insert(&step.section) {
                return Err(invalid(format!("section `{}` is named by two steps", step.section)));
            }
        }
        Ok(())
    }

    /// The steps a device holding the model `held` (a digest) applies, in order: none when
    /// it holds the chain's result already (it rebuilt it before the aggregator restarted
    /// mid-round); `None` when that model is not in the chain.
    pub fn steps_from(&self, held: &[u8]) -> Option<&[DeltaStep]> {
        if held == self.model {
            return Some(&[]);
        }
        let first = self.steps.iter().position(|s| s.base == held)?;
        Some(&self.steps[first..])
    }
}

impl RoundPlan {
    /// Digest of the full model the plan gives the devices it selects: the model its
    /// downlink yields, or its model transfer itself.
    pub fn model_digest(&self) -> &[u8] {
        match &self.downlink {
            Some(d) => &d.model,
            None => &self.global_model.digest,
        }
    }
}

/// Adds a delta to a model payload in place: each of the delta's tensors, decoded, onto
/// the f32 tensor of the same name. The payload keeps its layout, so its bytes are exactly
/// those of the new model encoded afresh, and its digest is the one the plan names.
///
/// `model` must be a payload of f32 tensors (a full download, or the result of earlier
/// steps); the delta may use any codec. A tensor the model lacks, a shape that differs, or
/// a delta tensor named twice is an error naming it, and leaves `model` partly changed:
/// the caller verifies the digest anyway and discards a model that fails.
pub fn apply_delta(model: &mut [u8], delta: &TensorPayload, limits: &Limits) -> Result<()> {
    let layout: HashMap<String, (Vec<u64>, std::ops::Range<usize>)> = f32_ranges(model, limits)
        .map_err(|e| WireError::Malformed(format!("the held model: {e}")))?
        .into_iter()
        .map(|(name, shape, range)| (name, (shape, range)))
        .collect();
    let mut seen = std::collections::HashSet::new();
    for t in &delta.tensors {
        let name = t.name();
        let Some((shape, range)) = layout.get(name) else {
            return Err(WireError::Malformed(format!("the delta names tensor `{name}`, which the held model lacks")));
        };
        if t.shape() != shape.as_slice() {
            return Err(WireError::Malformed(format!(
                "delta tensor `{name}` has shape {:?}, and the held model's has {shape:?}",
                t.shape()
            )));
        }
        if !seen.insert(name) {
            return Err(WireError::Malformed(format!("the delta names tensor `{name}` twice")));
        }
        let bytes = &mut model[range.clone()];
        let mut words = bytes.chunks_exact_mut(4);
        t.for_each_value(|d| {
            if let Some(w) = words.next() {
                let v = f32::from_le_bytes([w[0], w[1], w[2], w[3]]) + d;
                w.copy_from_slice(&v.to_le_bytes());
            }
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::update_codec::UpdateCodec;
    use crate::wire_tensor::{ToWire, WireDType};
    use crate::{digest, EncodedPayload, DEFAULT_CHUNK_BYTES};

    struct T(&'static str, Vec<u64>, Vec<f32>);
    impl ToWire for T {
        fn wire_name(&self) -> &str {
            self.0
        }
        fn wire_shape(&self) -> Vec<u64> {
            self.1.clone()
        }
        fn wire_values(&self) -> &[f32] {
            &self.2
        }
    }

    fn wave(n: usize, phase: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32) * 0.37 + phase).sin()).collect()
    }

    fn model(a: Vec<f32>, b: Vec<f32>) -> Vec<T> {
        vec![T("frozen.wte", vec![6, 5], b), T("h.0.attn.w", vec![4, 25], a)]
    }

    fn full(tensors: &[T]) -> Vec<u8> {
        TensorPayload::encode(tensors, WireDType::F32).to_bytes()
    }

    #[test]
    fn a_delta_applied_in_place_yields_exactly_the_bytes_of_the_new_model_encoded_afresh() {
        let old = model(wave(100, 0.0), wave(30, 1.0));
        let mut held = full(&old);
        for codec in [UpdateCodec::F32, UpdateCodec::Int8, UpdateCodec::TopK(0.1), UpdateCodec::Bf16] {
            let current: Vec<f32> =
                TensorPayload::from_bytes(&held, &Limits::default(), true).unwrap().tensors[1].values();
            let target = wave(100, 0.5);
            let diff: Vec<f32> = target.iter().zip(&current).map(|(t, c)| t - c).collect();
            let delta = TensorPayload::compress([&T("h.0.attn.w", vec![4, 25], diff)], codec);
            let sent = delta.tensors[0].values();
            apply_delta(&mut held, &delta, &Limits::default()).unwrap();
            // What the aggregator computes on its side: the same f32 additions.
            let public: Vec<f32> = current.iter().zip(&sent).map(|(c, d)| c + d).collect();
            let expected = model(public, wave(30, 1.0));
            assert_eq!(held, full(&expected), "{codec}");
            let streamed = EncodedPayload::compress(&expected, UpdateCodec::F32, DEFAULT_CHUNK_BYTES);
            assert_eq!(digest(&held), streamed.digest(), "{codec}: the digest the aggregator names");
        }
    }

    #[test]
    fn a_delta_that_does_not_fit_the_held_model_is_refused_by_name() {
        let mut held = full(&model(wave(100, 0.0), wave(30, 1.0)));
        let limits = Limits::default();
        let unknown = TensorPayload::compress([&T("h.9.mlp", vec![100], wave(100, 0.0))], UpdateCodec::Int8);
        let err = apply_delta(&mut held, &unknown, &limits).unwrap_err().to_string();
        assert!(err.contains("`h.9.mlp`") && err.contains("lacks"), "{err}");
        let reshaped = TensorPayload::compress([&T("h.0.attn.w", vec![25, 4], wave(100, 0.0))], UpdateCodec::F32);
        let err = apply_delta(&mut held, &reshaped, &limits).unwrap_err().to_string();
        assert!(err.contains("shape [25, 4]") && err.contains("[4, 25]"), "{err}");
        let twice = TensorPayload::compress(
            [&T("h.0.attn.w", vec![4, 25], wave(100, 0.0)), &T("h.0.attn.w", vec![4, 25], wave(100, 0.0))],
            UpdateCodec::F32,
        );
        let err = apply_delta(&mut held, &twice, &limits).unwrap_err().to_string();
        assert!(err.contains("twice"), "{err}");
        let halves = TensorPayload::encode(&model(wave(100, 0.0), wave(30, 1.0)), WireDType::Bf16).to_bytes();
        let err = apply_delta(&mut halves.clone(), &reshaped, &limits).unwrap_err().to_string();
        assert!(err.contains("not f32"), "{err}");
        assert!(apply_delta(&mut b"not cbor".to_vec(), &reshaped, &limits).is_err());
    }

    #[test]
    fn a_device_applies_the_chain_from_the_model_it_holds() {
        let step = |base: u8, section: &str| DeltaStep { base: vec![base; 32], section: section.into() };
        let d = Downlink {
            codec: UpdateCodec::Int8,
            steps: vec![step(1, "downlink.3"), step(2, "downlink.4"), step(3, "")],
            model: vec![4; 32],
        };
        assert_eq!(d.steps_from(&[2; 32]).unwrap().len(), 2);
        assert_eq!(d.steps_from(&[1; 32]).unwrap().len(), 3);
        assert_eq!(d.steps_from(&[4; 32]).unwrap().len(), 0, "a device holding the result already");
        assert!(d.steps_from(&[5; 32]).is_none(), "a model the chain does not know");
        assert!(d.steps_from(&[]).is_none(), "a device holding nothing");
    }

    #[test]
    fn a_plan_whose_downlink_does_not_match_its_sections_is_refused() {
        let m =
            |t: &str| crate::Manifest { transfer: t.into(), bytes: 0, chunks: 1, digest: vec![0; 32], tensors: vec![] };
        let sections = BTreeMap::from([("downlink.4".to_string(), m("r5/downlink.4"))]);
        let step = |section: &str| DeltaStep { base: vec![1; 32], section: section.into() };
        let downlink = |steps| Downlink { codec: UpdateCodec::Int8, steps, model: vec![2; 32] };
        assert!(downlink(vec![step("downlink.4"), step("")]).validate(&sections).is_ok());
        for (steps, want) in [
            (vec![], "without steps"),
            (vec![step("downlink.4")], "newest step"),
            (vec![step("downlink.3"), step("")], "`downlink.3`"),
            (vec![step("downlink.4"), step("downlink.4"), step("")], "two steps"),
        ] {
            let err = downlink(steps).validate(&sections).unwrap_err().to_string();
            assert!(err.contains(want), "{err}");
        }
        let short = Downlink { model: vec![2; 5], ..downlink(vec![step("")]) };
        assert!(short.validate(&sections).unwrap_err().to_string().contains("5 bytes"));
    }
}
