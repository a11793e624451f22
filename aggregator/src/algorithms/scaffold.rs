//! SCAFFOLD (Karimireddy et al. 2020) on the server: the server variate `c` goes out as
//! the plan section `scaffold.control`; each device returns `Δc_i` as
//! `scaffold.control_delta`, and after the round
//! `c ← c + (|S|/N)·mean_i Δc_i = c + Σ_i Δc_i / N`, N the registered devices.

use std::collections::BTreeMap;

use fedpo_wire::{keys, TensorPayload, WireDType};

use super::server_half::{zeros_like_shared, ServerHalf};
use crate::global_model::{GlobalModel, GlobalTensor};
use crate::weighted_sum::WeightedSum;

/// SCAFFOLD's server half.
#[derive(Debug)]
pub(super) struct Scaffold {
    /// `c`.
    control: Vec<GlobalTensor>,
    /// The round's `Σ Δc_i`, each added with weight 1.
    changes: Option<WeightedSum>,
}

impl Scaffold {
    pub(super) fn new(global: &GlobalModel) -> Self {
        Self { control: zeros_like_shared(global), changes: None }
    }
}

impl ServerHalf for Scaffold {
    fn configure(&self, strategy: &mut BTreeMap<String, f64>) {
        strategy.insert(keys::SCAFFOLD.into(), 1.0);
    }

    fn plan_sections(&self) -> Vec<(String, TensorPayload)> {
        vec![(keys::SCAFFOLD_CONTROL.to_string(), TensorPayload::encode(&self.control, WireDType::F32))]
    }

    fn required_section(&self) -> Option<&'static str> {
        Some(keys::SCAFFOLD_CONTROL_DELTA)
    }

    fn begin_round(&mut self, global: &GlobalModel) {
        self.changes = Some(WeightedSum::new(global));
    }

    fn take_section(&mut self, payload: &TensorPayload) {
        if let Some(changes) = self.changes.as_mut() {
            changes.add(payload, 1.0);
        }
    }

    fn after_round(&mut self, _previous: Option<&GlobalModel>, _global: &GlobalModel, registered_devices: usize) {
        let Some(changes) = self.changes.take().filter(|c| c.count() > 0) else { return };
        let scale = changes.count() as f64 / registered_devices.max(changes.count()) as f64;
        for v in self.control.iter_mut() {
            if let Some(mean) = changes.mean(&v.name) {
                for (x, d) in v.values.iter_mut().zip(mean) {
                    *x = (f64::from(*x) + scale * d) as f32;
                }
            }
        }
    }

    fn carried(&self) -> Option<&Vec<GlobalTensor>> {
        Some(&self.control)
    }

    fn restore_carried(&mut self, carried: Option<Vec<GlobalTensor>>) {
        if let Some(control) = carried {
            self.control = control;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use candle_core::{Device, Tensor, Var};
    use fedpo_model::{Gpt2Config, Partition, PartitionPreset, PolicySpec, TensorSource};
    use fedpo_train::algorithms::Scaffold as DeviceScaffold;
    use fedpo_train::{OptimConfig, OptimKind, Optimizer};

    use fedpo_wire::WireDType;

    use super::*;
    use crate::algorithms::client_term::{ClientTerm, ClientTermKind};
    use crate::algorithms::fedavg::FedAvg;
    use crate::algorithms::fedga::FedgaSettings;
    use crate::algorithms::strategy::Strategy;
    use crate::global_model::GlobalModel;

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
            weights: Default::default(),
            unit_steps: false,
        };
        let mut term = ClientTerm::new(kind, 0.0, fedga, &global);
        let mut device_controls: Vec<Option<HashMap<String, Tensor>>> = vec![None; 3];
        for _ in 0..rounds {
            let server_control = term.plan_sections().into_iter().find(|(n, _)| n == keys::SCAFFOLD_CONTROL);
            let mut deltas = WeightedSum::new(&global);
            term.begin_round(&global);
            for i in 0..3 {
                let start: Vec<f64> = global.get("w").unwrap().values.iter().map(|v| f64::from(*v)).collect();
                let x = Var::new(start.as_slice(), &Device::Cpu).unwrap();
                let mut scaffold = server_control
                    .as_ref()
                    .map(|(_, c)| DeviceScaffold::new(tensors(c), device_controls[i].take()).unwrap());
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
                    let section = TensorPayload::encode(&[vector(change)], WireDType::F32);
                    assert!(term.take_section(keys::SCAFFOLD_CONTROL_DELTA, &section));
                    device_controls[i] = Some(next);
                }
            }
            FedAvg::new(1.0).aggregate(1, &mut global, &deltas.into()).unwrap();
            term.after_round(None, &global, 3);
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
}
