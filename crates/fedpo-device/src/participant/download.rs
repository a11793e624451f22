//! What a device accepts to download: a plan's transfers checked against the model its
//! own spec describes, before any byte of them is stored; and where they wait until the
//! device trains.

use std::path::Path;

use fedpo_wire::{Bundle, BundleBytes, KeptBundle, Limits, RoundPlan};

use crate::memory;

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
}
