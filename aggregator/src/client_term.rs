//! The aggregator's side of the client-side terms: what each plan tells devices, the
//! tensors it sends along, and the state kept between rounds.
//!
//! - FedProx: only μ, in the plan.
//! - SCAFFOLD: the server variate `c` goes out as the plan section `scaffold.control`;
//!   each device returns `Δc_i` as `scaffold.control_delta`, and after the round
//!   `c ← c + (|S|/N)·mean_i Δc_i = c + Σ_i Δc_i / N`, N the registered devices.
//! - FedGA: the reference `r` goes out as `fedga.reference`. After each round
//!   `r ← β·r + (1 − β)·d`, with `d = −Δθ` the global step turned to point like a gradient
//!   (uphill), since the device compares it with its loss gradient: the EMA of the global
//!   update direction as FedGA defines it, where a round weighs by the size of its step.
//!   `--fedga-reference unit-ema` takes the unit step `−Δθ/‖Δθ‖` instead, so that every
//!   round weighs alike. Devices use only `r`'s direction (a cosine), not its length.
//!
//! `c` and `r` are part of the checkpointed state, so `--resume` continues them exactly.

use std::collections::BTreeMap;

use anyhow::{bail, Context, Result};
use fedpo_train::terms::layer_of;
use fedpo_wire::{keys, TensorPayload, WireDType};
use serde::{Deserialize, Serialize};

use crate::accumulator::WeightedSum;
use crate::global_model::{GlobalModel, GlobalTensor};

/// Which term devices add to their local objective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub(crate) enum ClientTermKind {
    /// Plain local DPO.
    None,
    /// FedProx's proximal term.
    Fedprox,
    /// SCAFFOLD's control variates.
    Scaffold,
    /// FedGA's gradient alignment.
    Fedga,
}

impl ClientTermKind {
    /// The CLI spelling.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Fedprox => "fedprox",
            Self::Scaffold => "scaffold",
            Self::Fedga => "fedga",
        }
    }
}

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

/// A zero vector shaped like the shared set.
fn zeros_like_shared(global: &GlobalModel) -> Vec<GlobalTensor> {
    global
        .shared()
        .map(|t| GlobalTensor {
            name: t.name.clone(),
            shape: t.shape.clone(),
            values: vec![0.0; t.values.len()],
            shared: true,
        })
        .collect()
}

/// The client term and its server-side state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ClientTerm {
    pub(crate) kind: ClientTermKind,
    pub(crate) mu: f64,
    pub(crate) fedga: FedgaSettings,
    /// SCAFFOLD's `c`.
    control: Option<Vec<GlobalTensor>>,
    /// FedGA's `r` (none before the first global step).
    reference: Option<Vec<GlobalTensor>>,
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

impl ClientTerm {
    pub(crate) fn new(kind: ClientTermKind, mu: f64, fedga: FedgaSettings, global: &GlobalModel) -> Self {
        let control = (kind == ClientTermKind::Scaffold).then(|| zeros_like_shared(global));
        Self { kind, mu, fedga, control, reference: None }
    }

    /// Settings for the plan's `strategy` map.
    pub(crate) fn configure(&self, strategy: &mut BTreeMap<String, f64>) {
        match self.kind {
            ClientTermKind::None => {}
            ClientTermKind::Fedprox => {
                strategy.insert(keys::PROXIMAL_MU.into(), self.mu);
            }
            ClientTermKind::Scaffold => {
                strategy.insert(keys::SCAFFOLD.into(), 1.0);
            }
            ClientTermKind::Fedga => {
                let f = &self.fedga;
                strategy.insert(keys::FEDGA_LAMBDA.into(), f.lambda);
                strategy.insert(keys::FEDGA_LAYER.into(), if f.layer { 1.0 } else { 0.0 });
                strategy.insert(keys::FEDGA_DISPLACEMENT.into(), if f.displacement { 1.0 } else { 0.0 });
                strategy.insert(keys::FEDGA_FD_STEP.into(), f.fd_step);
                for (layer, w) in &f.weights {
                    strategy.insert(format!("{}{layer}", keys::FEDGA_WEIGHT_PREFIX), *w);
                }
            }
        }
    }

    /// The tensors the plan carries as sections.
    pub(crate) fn plan_sections(&self) -> Vec<(String, TensorPayload)> {
        let mut out = Vec::new();
        if let Some(c) = &self.control {
            out.push((keys::SCAFFOLD_CONTROL.to_string(), TensorPayload::encode(c, WireDType::F32)));
        }
        if let Some(r) = self.reference.as_ref().filter(|_| self.kind == ClientTermKind::Fedga) {
            out.push((keys::FEDGA_REFERENCE.to_string(), TensorPayload::encode(r, WireDType::F32)));
        }
        out
    }

    /// The section every training update must carry, if any.
    pub(crate) fn required_section(&self) -> Option<&'static str> {
        (self.kind == ClientTermKind::Scaffold).then_some(keys::SCAFFOLD_CONTROL_DELTA)
    }

    /// Whether [`ClientTerm::after_round`] needs the shared values from before the step.
    pub(crate) fn needs_previous_model(&self) -> bool {
        self.kind == ClientTermKind::Fedga
    }

    /// Updates `c` from the round's `Σ Δc_i` (each added with weight 1) and `r` from the
    /// global step `previous → global`.
    pub(crate) fn after_round(
        &mut self,
        previous: Option<&GlobalModel>,
        global: &GlobalModel,
        control_changes: Option<&WeightedSum>,
        registered_devices: usize,
    ) {
        if let (Some(c), Some(changes)) = (self.control.as_mut(), control_changes) {
            if changes.count() > 0 {
                let scale = changes.count() as f64 / registered_devices.max(changes.count()) as f64;
                for v in c.iter_mut() {
                    if let Some(mean) = changes.mean(&v.name) {
                        for (x, d) in v.values.iter_mut().zip(mean) {
                            *x = (f64::from(*x) + scale * d) as f32;
                        }
                    }
                }
            }
        }
        if let (ClientTermKind::Fedga, Some(previous)) = (self.kind, previous) {
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
            let beta = self.fedga.beta;
            let scale = if self.fedga.unit_steps { 1.0 / norm } else { 1.0 };
            let reference = self.reference.get_or_insert_with(|| zeros_like_shared(global));
            for (r, (_, _, d)) in reference.iter_mut().zip(&step) {
                for (x, s) in r.values.iter_mut().zip(d) {
                    *x = (beta * f64::from(*x) + (1.0 - beta) * s * scale) as f32;
                }
            }
        }
    }

    pub(crate) fn state(&self) -> Result<Vec<u8>> {
        serde_cbor::to_vec(self).context("encoding the client-term state")
    }

    pub(crate) fn restore(&mut self, state: &[u8]) -> Result<()> {
        let saved: Self = serde_cbor::from_slice(state).context("decoding the client-term state")?;
        if saved.kind != self.kind {
            bail!("the checkpoint was made with --client-term {}, not {}", saved.kind.name(), self.kind.name());
        }
        // The flags of this run stay; only the vectors carry over.
        self.control = saved.control;
        self.reference = saved.reference;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use candle_core::{Device, Tensor, Var};
    use fedpo_model::{Gpt2Config, Partition, PartitionPreset, PolicySpec, TensorSource};
    use fedpo_train::terms::Scaffold;
    use fedpo_train::{OptimConfig, OptimKind, Optimizer};

    use super::*;
    use crate::strategy::{FedAvg, Strategy};

    /// Client i minimises ½·Σ_j a_ij·(x_j − b_ij)²: heterogeneous curvatures and optima.
    const A: [[f64; 2]; 3] = [[1.0, 4.0], [4.0, 1.0], [2.0, 0.5]];
    const B: [[f64; 2]; 3] = [[1.0, -1.0], [-2.0, 3.0], [3.0, 0.0]];

    fn optimum() -> [f64; 2] {
        let x = |j: usize| (0..3).map(|i| A[i][j] * B[i][j]).sum::<f64>() / (0..3).map(|i| A[i][j]).sum::<f64>();
        [x(0), x(1)]
    }

    fn vector(values: Vec<f32>) -> GlobalTensor {
        GlobalTensor { name: "w".into(), shape: vec![2], values, shared: true }
    }

    fn tensors(payload: &TensorPayload) -> HashMap<String, Tensor> {
        TensorSource::from_wire(&payload.tensors, "plan section", &Device::Cpu).unwrap().tensors
    }

    /// Runs `rounds` rounds of 20 local SGD steps per client; returns the distance of the
    /// global model from the optimum of the mean objective.
    fn run(kind: ClientTermKind, rounds: usize) -> f64 {
        let spec =
            PolicySpec { config: Gpt2Config::tiny(), lora: None, partition: Partition::new(PartitionPreset::Feddpo) };
        let mut global = GlobalModel::new(spec, vec![vector(vec![0.0, 0.0])]);
        let fedga = FedgaSettings {
            lambda: 0.0,
            beta: 0.9,
            layer: false,
            displacement: false,
            fd_step: 1e-3,
            weights: BTreeMap::new(),
            unit_steps: false,
        };
        let mut term = ClientTerm::new(kind, 0.0, fedga, &global);
        let mut device_controls: Vec<Option<HashMap<String, Tensor>>> = vec![None; 3];
        for _ in 0..rounds {
            let server_control = term.plan_sections().into_iter().find(|(n, _)| n == keys::SCAFFOLD_CONTROL);
            let mut deltas = WeightedSum::new(&global);
            let mut controls = WeightedSum::new(&global);
            for i in 0..3 {
                let start: Vec<f64> = global.get("w").unwrap().values.iter().map(|v| f64::from(*v)).collect();
                let x = Var::new(start.as_slice(), &Device::Cpu).unwrap();
                let mut scaffold =
                    server_control.as_ref().map(|(_, c)| Scaffold::new(tensors(c), device_controls[i].take()).unwrap());
                let mut sgd = Optimizer::new(OptimConfig::new(OptimKind::Sgd, 0.1)).unwrap();
                for _ in 0..20 {
                    let xv: Vec<f64> = x.as_tensor().to_vec1().unwrap();
                    let g: Vec<f64> = (0..2).map(|j| A[i][j] * (xv[j] - B[i][j])).collect();
                    let mut grads =
                        HashMap::from([("w".to_string(), Tensor::new(g.as_slice(), &Device::Cpu).unwrap())]);
                    if let Some(s) = scaffold.as_mut() {
                        s.observe(&grads).unwrap();
                        s.apply(&mut grads).unwrap();
                    }
                    sgd.step(&[("w", &x)], &grads).unwrap();
                }
                let end: Vec<f64> = x.as_tensor().to_vec1().unwrap();
                let delta: Vec<f32> = end.iter().zip(&start).map(|(e, s)| (e - s) as f32).collect();
                deltas.add(&TensorPayload::encode(&[vector(delta)], WireDType::F32), 1.0);
                if let Some(s) = scaffold {
                    let (next, change) = s.finish().unwrap().unwrap();
                    let change: Vec<f32> = change["w"].to_dtype(candle_core::DType::F32).unwrap().to_vec1().unwrap();
                    controls.add(&TensorPayload::encode(&[vector(change)], WireDType::F32), 1.0);
                    device_controls[i] = Some(next);
                }
            }
            FedAvg::new(1.0).aggregate(1, &mut global, &deltas).unwrap();
            term.after_round(None, &global, Some(&controls), 3);
        }
        let x = &global.get("w").unwrap().values;
        let opt = optimum();
        ((f64::from(x[0]) - opt[0]).powi(2) + (f64::from(x[1]) - opt[1]).powi(2)).sqrt()
    }

    #[test]
    fn scaffold_converges_on_heterogeneous_quadratics_where_fedavg_drifts() {
        let fedavg = run(ClientTermKind::None, 200);
        let scaffold = run(ClientTermKind::Scaffold, 200);
        assert!(fedavg > 0.1, "FedAvg with 20 local steps should settle away from the optimum, got {fedavg}");
        assert!(scaffold < 1e-4, "SCAFFOLD should reach the optimum, {scaffold} away");
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
        term.after_round(Some(&before), &after, None, 1);
        let after2 = GlobalModel::new(spec, vec![vector(vec![3.0, 14.0])]);
        term.after_round(Some(&after), &after2, None, 1);
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
    fn restored_state_keeps_the_vectors_and_this_runs_flags_and_refuses_another_term() {
        let spec =
            PolicySpec { config: Gpt2Config::tiny(), lora: None, partition: Partition::new(PartitionPreset::Feddpo) };
        let before = GlobalModel::new(spec.clone(), vec![vector(vec![0.0, 0.0])]);
        let after = GlobalModel::new(spec, vec![vector(vec![1.0, 0.0])]);
        let fedga = |lambda| FedgaSettings {
            lambda,
            beta: 0.5,
            layer: false,
            displacement: false,
            fd_step: 1e-3,
            weights: BTreeMap::new(),
            unit_steps: false,
        };
        let mut saved = ClientTerm::new(ClientTermKind::Fedga, 0.0, fedga(0.1), &before);
        saved.after_round(Some(&before), &after, None, 1);
        let mut resumed = ClientTerm::new(ClientTermKind::Fedga, 0.0, fedga(0.7), &before);
        resumed.restore(&saved.state().unwrap()).unwrap();
        assert_eq!(resumed.plan_sections(), saved.plan_sections(), "r carries over");
        assert_eq!(resumed.fedga.lambda, 0.7, "the flags of the resumed run apply");
        let mut other = ClientTerm::new(ClientTermKind::Scaffold, 0.0, fedga(0.1), &before);
        let err = other.restore(&saved.state().unwrap()).unwrap_err().to_string();
        assert!(err.contains("--client-term fedga, not scaffold"), "{err}");
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
