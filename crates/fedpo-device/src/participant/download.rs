//! What a device accepts to download: a plan's transfers checked against the model its
//! own spec describes, before any byte of them is stored; and where they wait until the
//! device trains.

use std::path::Path;

use fedpo_wire::{apply_delta, Bundle, BundleBytes, Downlink, KeptBundle, Limits, RoundPlan, TensorPayload};

use crate::error::ParticipantError;
use crate::memory;
use crate::state_dir::{read_latest_model, StateDir};

/// Checks a plan's transfers against the model its spec describes before any byte of
/// them is stored: the model at most every parameter in f32, each section (SCAFFOLD's
/// control, FedGA's reference) at most every shared one, plus framing.
pub(super) fn check_download(plan: &RoundPlan) -> Result<(), String> {
    const FRAMING: u64 = 1 << 20;
    let spec: fedpo_model::PolicySpec =
        serde_json::from_str(&plan.model_spec).map_err(|e| format!("unreadable model spec: {e}"))?;
    let counts = memory::ParamCounts::of(&spec.config, spec.lora.as_ref(), spec.partition);
    let f32_bytes = |params: usize| (params as u64).saturating_mul(4).saturating_add(FRAMING);
    let transfers = std::iter::once(("model", &plan.global_model, f32_bytes(counts.total)))
        .chain(plan.sections.iter().map(|(name, m)| (name.as_str(), m, f32_bytes(counts.shared))));
    for (what, manifest, bound) in transfers {
        if manifest.bytes > bound {
            return Err(format!(
                "its {what} announces {} bytes, and its model spec accounts for {bound} at most",
                manifest.bytes
            ));
        }
    }
    Ok(())
}

/// Starts receiving a plan's transfers: in memory for a device alone in its process, or
/// kept on disk under `incoming` for one that may have to wait its turn to train.
pub(super) fn receive(plan: &RoundPlan, limits: &Limits, incoming: Option<&Path>) -> Result<Bundle, String> {
    check_download(plan)?;
    let bundle = match incoming {
        Some(dir) => Bundle::kept(plan.global_model.clone(), &plan.sections, limits, dir),
        None => Bundle::new(plan.global_model.clone(), &plan.sections, limits),
    };
    bundle.map_err(|e| e.to_string())
}

/// A round's transfers, complete and verified.
pub(super) enum Received {
    /// In memory.
    Bytes(BundleBytes),
    /// On disk, until the device's turn.
    Kept(KeptBundle),
}

impl Received {
    /// Bytes received, over every transfer.
    pub(super) fn len(&self) -> u64 {
        match self {
            Self::Bytes(b) => (b.main.len() + b.sections.values().map(|s| s.len()).sum::<usize>()) as u64,
            Self::Kept(k) => k.len(),
        }
    }

    /// The bytes, in memory (read back and checked again if they were kept).
    pub(super) fn into_bytes(self) -> Result<BundleBytes, fedpo_wire::WireError> {
        match self {
            Self::Bytes(b) => Ok(b),
            Self::Kept(k) => k.read(),
        }
    }
}

/// The model a downlink round gives: the model this device holds with the plan's deltas
/// added, from the step that starts at it, checked against the digest the plan names.
/// The deltas' sections are consumed; the others stay for the round.
///
/// Fails with [`ParticipantError::Downlink`] when the device holds no model, one no step
/// starts from, or the result does not verify: the device declines the round asking for
/// the whole model.
pub(super) fn rebuild(
    downlink: &Downlink,
    mut bytes: BundleBytes,
    state: &StateDir,
    limits: &Limits,
) -> Result<BundleBytes, ParticipantError> {
    let refuse = |why: String| ParticipantError::Downlink(why);
    let (info, held) = read_latest_model(state.root()).map_err(|e| refuse(format!("no usable model is held ({e})")))?;
    let held_digest = hex::decode(&info.digest).unwrap_or_default();
    let Some(steps) = downlink.steps_from(&held_digest) else {
        return Err(refuse(format!(
            "this device holds model {} (round {}), which none of the plan's {} steps starts from",
            info.digest,
            info.round,
            downlink.steps.len()
        )));
    };
    let mut model: Vec<u8> = held.into();
    for step in steps {
        let delta = if step.section.is_empty() {
            std::mem::take(&mut bytes.main)
        } else {
            bytes
                .sections
                .remove(&step.section)
                .ok_or_else(|| refuse(format!("section `{}` did not arrive", step.section)))?
        };
        let delta = TensorPayload::from_shared(delta, limits, true)?;
        apply_delta(&mut model, &delta, limits).map_err(|e| refuse(e.to_string()))?;
    }
    let found = fedpo_wire::digest(&model);
    if found != downlink.model {
        return Err(refuse(format!(
            "the rebuilt model has digest {}, and the plan names {}",
            hex::encode(found),
            hex::encode(&downlink.model)
        )));
    }
    bytes.sections.retain(|name, _| !name.starts_with(fedpo_wire::DOWNLINK_SECTION));
    bytes.main = model.into();
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use fedpo_model::{Gpt2Config, LoraConfig, Partition, PartitionPreset};

    use super::*;
    use crate::participant::test_plan::plan_announcing;

    #[test]
    fn a_plan_announcing_more_than_its_model_spec_accounts_for_is_not_followed() {
        let counts = memory::ParamCounts::of(
            &Gpt2Config::tiny(),
            Some(&LoraConfig::default()),
            Partition::new(PartitionPreset::Pfeddpo),
        );
        let model = 4 * counts.total as u64;
        assert_eq!(check_download(&plan_announcing(model, Some(4 * counts.shared as u64))), Ok(()));
        let err = check_download(&plan_announcing((2 << 30) - 1, None)).unwrap_err();
        assert!(err.contains("model announces 2147483647 bytes"), "{err}");
        let err = check_download(&plan_announcing(model, Some(model + (2 << 20)))).unwrap_err();
        assert!(err.contains("scaffold.control"), "{err}");
    }

    struct T(&'static str, Vec<f32>);
    impl fedpo_wire::ToWire for T {
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

    /// A state directory holding a two-tensor model; the model's payload bytes.
    fn holding(dir: &Path) -> (StateDir, Vec<u8>) {
        let state = StateDir::open(dir).unwrap();
        let model = [T("wte", vec![0.5; 8]), T("h.0.w", vec![1.0, 2.0, 3.0, 4.0])];
        let bytes = fedpo_wire::TensorPayload::encode(&model, fedpo_wire::WireDType::F32).to_bytes();
        let info = crate::state_dir::LatestModel {
            round: 3,
            digest: hex::encode(fedpo_wire::digest(&bytes)),
            model_spec: String::new(),
            job: "lab".into(),
        };
        state.keep_latest_model(&bytes, &info).unwrap();
        (state, bytes)
    }

    /// Round 4's bundle: a delta of `h.0.w` as the model transfer, beside a SCAFFOLD section.
    fn bundle() -> BundleBytes {
        let delta = TensorPayload::compress([&T("h.0.w", vec![0.25, 0.0, -1.0, 0.5])], fedpo_wire::UpdateCodec::F32);
        BundleBytes {
            main: delta.to_bytes().into(),
            sections: [("scaffold.control".to_string(), fedpo_wire::Bytes::from_static(b"c"))].into(),
        }
    }

    fn downlink(base: Vec<u8>, model: Vec<u8>) -> Downlink {
        let step = fedpo_wire::DeltaStep { base, section: String::new() };
        Downlink { codec: fedpo_wire::UpdateCodec::F32, steps: vec![step], model }
    }

    #[test]
    fn a_device_rebuilds_the_plans_model_from_the_one_it_holds_and_keeps_the_other_sections() {
        let dir = tempfile::tempdir().unwrap();
        let (state, held) = holding(dir.path());
        let want = [T("wte", vec![0.5; 8]), T("h.0.w", vec![1.25, 2.0, 2.0, 4.5])];
        let want = fedpo_wire::TensorPayload::encode(&want, fedpo_wire::WireDType::F32).to_bytes();
        let plan = downlink(fedpo_wire::digest(&held), fedpo_wire::digest(&want));
        let rebuilt = rebuild(&plan, bundle(), &state, &Limits::default()).unwrap();
        assert_eq!(rebuilt.main.as_ref(), want.as_slice());
        assert_eq!(rebuilt.sections.keys().collect::<Vec<_>>(), ["scaffold.control"]);
    }

    #[test]
    fn a_device_without_the_base_or_with_a_wrong_result_asks_for_the_whole_model() {
        let limits = Limits::default();
        let empty = tempfile::tempdir().unwrap();
        let nothing = StateDir::open(empty.path()).unwrap();
        let err = rebuild(&downlink(vec![1; 32], vec![2; 32]), bundle(), &nothing, &limits).unwrap_err();
        assert!(matches!(&err, ParticipantError::Downlink(why) if why.contains("no usable model")), "{err}");

        let dir = tempfile::tempdir().unwrap();
        let (state, held) = holding(dir.path());
        let err = rebuild(&downlink(vec![1; 32], vec![2; 32]), bundle(), &state, &limits).unwrap_err();
        assert!(matches!(&err, ParticipantError::Downlink(why) if why.contains("none of the plan's 1 steps")), "{err}");
        let err = rebuild(&downlink(fedpo_wire::digest(&held), vec![2; 32]), bundle(), &state, &limits).unwrap_err();
        assert!(matches!(&err, ParticipantError::Downlink(why) if why.contains("the plan names 0202")), "{err}");
        assert!(err.to_string().contains("asking for the whole model"), "{err}");
    }
}
