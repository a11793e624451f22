//! FedGA on the server. The reference `r` goes out as the plan section `fedga.reference`.
//! After each round `r ← β·r + (1 − β)·d`, with `d = −Δθ` the global step turned to point
//! like a gradient (uphill), since the device compares it with its loss gradient: the EMA
//! of the global update direction as FedGA defines it, where a round weighs by the size of
//! its step. `--fedga-reference unit-ema` takes the unit step `−Δθ/‖Δθ‖` instead, so that
//! every round weighs alike. Devices use only `r`'s direction (a cosine), not its length.

use std::collections::BTreeMap;

use anyhow::{bail, Context, Result};
use fedpo_train::algorithms::layer_of;
use fedpo_wire::{keys, TensorPayload, WireDType};
use serde::{Deserialize, Serialize};

use super::server_half::{zeros_like_shared, ServerHalf};
use crate::global_model::{GlobalModel, GlobalTensor};

/// FedGA's settings, with the layer weights already resolved to layer names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct FedgaSettings {
    pub(crate) lambda: f64,
    pub(crate) beta: f64,
    pub(crate) layer: bool,
    pub(crate) displacement: bool,
    pub(crate) fd_step: f64,
    pub(crate) weights: BTreeMap<String, f64>,
    /// The reference averages unit global steps rather than the steps themselves.
    #[serde(default)]
    pub(crate) unit_steps: bool,
}

/// Resolves `h.*.attn=1,wte=0` against the model's layers; later patterns override
/// earlier ones, and a pattern that matches no layer is an error naming the layers.
pub(crate) fn resolve_layer_weights(spec: &str, global: &GlobalModel) -> Result<BTreeMap<String, f64>> {
    let mut layers: Vec<String> = global.shared().map(|t| layer_of(&t.name)).collect();
    layers.dedup();
    let mut weights = BTreeMap::new();
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (pattern, weight) =
            item.split_once('=').with_context(|| format!("--fedga-layer-weights: `{item}` is not PATTERN=WEIGHT"))?;
        let weight: f64 =
            weight.trim().parse().with_context(|| format!("--fedga-layer-weights: `{weight}` is not a number"))?;
        if !(weight.is_finite() && weight >= 0.0) {
            bail!("--fedga-layer-weights: weight {weight} for `{pattern}` must be a non-negative number");
        }
        let glob = glob::Pattern::new(pattern.trim())
            .with_context(|| format!("--fedga-layer-weights: `{pattern}` is not a valid pattern"))?;
        let matched: Vec<&String> = layers.iter().filter(|l| glob.matches(l)).collect();
        if matched.is_empty() {
            bail!("--fedga-layer-weights: `{pattern}` matches no shared layer; the layers are {}", layers.join(", "));
        }
        for layer in matched {
            weights.insert(layer.clone(), weight);
        }
    }
    Ok(weights)
}

/// FedGA's server half.
#[derive(Debug)]
pub(super) struct FedGa {
    settings: FedgaSettings,
    /// `r` (none before the first global step).
    reference: Option<Vec<GlobalTensor>>,
}

impl FedGa {
    pub(super) fn new(settings: FedgaSettings) -> Self {
        Self { settings, reference: None }
    }
}

impl ServerHalf for FedGa {
    fn configure(&self, strategy: &mut BTreeMap<String, f64>) {
        let f = &self.settings;
        strategy.insert(keys::FEDGA_LAMBDA.into(), f.lambda);
        strategy.insert(keys::FEDGA_LAYER.into(), if f.layer { 1.0 } else { 0.0 });
        strategy.insert(keys::FEDGA_DISPLACEMENT.into(), if f.displacement { 1.0 } else { 0.0 });
        strategy.insert(keys::FEDGA_FD_STEP.into(), f.fd_step);
        for (layer, w) in &f.weights {
            strategy.insert(format!("{}{layer}", keys::FEDGA_WEIGHT_PREFIX), *w);
        }
    }

    fn plan_sections(&self) -> Vec<(String, TensorPayload)> {
        let reference = self.reference.as_ref();
        reference
            .map(|r| (keys::FEDGA_REFERENCE.to_string(), TensorPayload::encode(r, WireDType::F32)))
            .into_iter()
            .collect()
    }

    fn needs_previous_model(&self) -> bool {
        true
    }

    fn after_round(&mut self, previous: Option<&GlobalModel>, global: &GlobalModel, _registered_devices: usize) {
        let Some(previous) = previous else { return };
        let step: Vec<(String, Vec<usize>, Vec<f64>)> = global
            .shared()
            .filter_map(|t| {
                let before = previous.get(&t.name)?;
                let d = before.values.iter().zip(&t.values).map(|(b, a)| f64::from(*b) - f64::from(*a)).collect();
                Some((t.name.clone(), t.shape.clone(), d))
            })
            .collect();
        let norm = step.iter().flat_map(|(_, _, d)| d).map(|x| x * x).sum::<f64>().sqrt();
        if norm == 0.0 {
            return; // no global step (quorum not met): r stays
        }
        let beta = self.settings.beta;
        let scale = if self.settings.unit_steps { 1.0 / norm } else { 1.0 };
        let reference = self.reference.get_or_insert_with(|| zeros_like_shared(global));
        for (r, (_, _, d)) in reference.iter_mut().zip(&step) {
            for (x, s) in r.values.iter_mut().zip(d) {
                *x = (beta * f64::from(*x) + (1.0 - beta) * s * scale) as f32;
            }
        }
    }

    fn carried(&self) -> Option<&Vec<GlobalTensor>> {
        self.reference.as_ref()
    }

    fn restore_carried(&mut self, carried: Option<Vec<GlobalTensor>>) {
        self.reference = carried;
    }
}

#[cfg(test)]
mod tests {
    use fedpo_model::{Gpt2Config, Partition, PartitionPreset, PolicySpec};

    use super::*;
    use crate::algorithms::client_term::{ClientTerm, ClientTermKind};

    fn vector(values: Vec<f32>) -> GlobalTensor {
        GlobalTensor { name: "w".into(), shape: vec![2], values, shared: true }
    }

    /// The reference after global steps (3, 4) then (0, 10) from the origin.
    fn fedga_reference_after_two_steps(unit_steps: bool) -> Vec<f32> {
        let spec =
            PolicySpec { config: Gpt2Config::tiny(), lora: None, partition: Partition::new(PartitionPreset::Feddpo) };
        let before = GlobalModel::new(spec.clone(), vec![vector(vec![0.0, 0.0])]);
        let fedga = FedgaSettings {
            lambda: 0.1,
            beta: 0.9,
            layer: false,
            displacement: false,
            fd_step: 1e-3,
            weights: BTreeMap::new(),
            unit_steps,
        };
        let mut term = ClientTerm::new(ClientTermKind::Fedga, 0.0, fedga, &before);
        assert!(term.plan_sections().is_empty(), "no reference before the first global step");
        let after = GlobalModel::new(spec.clone(), vec![vector(vec![3.0, 4.0])]);
        term.after_round(Some(&before), &after, 1);
        let after2 = GlobalModel::new(spec, vec![vector(vec![3.0, 14.0])]);
        term.after_round(Some(&after), &after2, 1);
        let (_, r) = term.plan_sections().pop().unwrap();
        r.tensors[0].values()
    }

    fn close(r: &[f32], expected: [f64; 2]) -> bool {
        r.iter().zip(expected).all(|(a, b)| (f64::from(*a) - b).abs() < 1e-6)
    }

    #[test]
    fn fedga_reference_is_an_ema_of_uphill_global_steps_weighted_by_their_size() {
        // r = 0.9·(0.1·(−3, −4)) + 0.1·(0, −10): the longer second step counts for more.
        let r = fedga_reference_after_two_steps(false);
        assert!(close(&r, [-0.27, -1.36]), "{r:?}");
    }

    #[test]
    fn fedga_unit_ema_reference_weighs_every_round_alike() {
        // r = 0.9·(0.1·(−0.6, −0.8)) + 0.1·(0, −1)
        let r = fedga_reference_after_two_steps(true);
        assert!(close(&r, [-0.054, -0.172]), "{r:?}");
    }

    #[test]
    fn layer_weight_patterns_resolve_to_layers_and_unknown_patterns_are_named() {
        let spec =
            PolicySpec { config: Gpt2Config::tiny(), lora: None, partition: Partition::new(PartitionPreset::Feddpo) };
        let t = |name: &str| GlobalTensor { name: name.into(), shape: vec![1], values: vec![0.0], shared: true };
        let global = GlobalModel::new(
            spec,
            vec![t("wte.weight"), t("h.0.attn.c_attn.weight"), t("h.0.mlp.c_fc.weight"), t("h.1.attn.c_proj.bias")],
        );
        let w = resolve_layer_weights("h.*=0.5, h.*.attn=2,wte=0", &global).unwrap();
        assert_eq!(w["h.0.attn"], 2.0);
        assert_eq!(w["h.1.attn"], 2.0);
        assert_eq!(w["h.0.mlp"], 0.5);
        assert_eq!(w["wte"], 0.0);
        let err = resolve_layer_weights("h.*.atn=1", &global).unwrap_err().to_string();
        assert!(err.contains("h.*.atn") && err.contains("h.0.mlp"), "{err}");
        assert!(resolve_layer_weights("wte=-1", &global).is_err());
    }
}
