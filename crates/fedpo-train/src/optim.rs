//! SGD and AdamW over named variables, with clipping and state that can be saved.
//!
//! candle's own AdamW keeps its moments private and has no clipping; fedpo owns its
//! optimizer so that a device can persist the state of its private parameters across rounds
//! and restarts.

use std::collections::HashMap;
use std::path::Path;
use std::str::FromStr;

use candle_core::{Tensor, Var};
use fedpo_model::tensor_files::{read_safetensors, write_safetensors};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};
use crate::loss_on_device::global_norm_on_device;
use crate::optimizer_ops::{
    cpu_sum_of_squares, AdamApply, ClippedMomentUpdate, ClippedSgdStep, MomentUpdate, SgdStep, SgdStepSummingSquares,
};

/// The update rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimKind {
    /// Plain SGD: no state, the lightest on memory.
    Sgd,
    /// AdamW (Loshchilov & Hutter) with decoupled weight decay.
    Adamw,
}

impl FromStr for OptimKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "sgd" => Ok(Self::Sgd),
            "adamw" => Ok(Self::Adamw),
            _ => Err(format!("unknown optimizer `{s}`; expected sgd or adamw")),
        }
    }
}

/// Optimizer settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OptimConfig {
    /// The rule.
    pub kind: OptimKind,
    /// Learning rate.
    pub lr: f64,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f64,
    /// AdamW's first-moment decay.
    pub beta1: f64,
    /// AdamW's second-moment decay.
    pub beta2: f64,
    /// AdamW's denominator epsilon.
    pub eps: f64,
    /// Clip the global gradient norm to this value.
    pub max_grad_norm: Option<f64>,
}

impl OptimConfig {
    /// Defaults for a rule at a learning rate.
    pub fn new(kind: OptimKind, lr: f64) -> Self {
        Self { kind, lr, weight_decay: 0.0, beta1: 0.9, beta2: 0.999, eps: 1e-8, max_grad_norm: None }
    }

    fn validate(&self) -> Result<()> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(TrainError::Invalid(format!("learning rate must be positive, got {}", self.lr)));
        }
        if let Some(c) = self.max_grad_norm {
            if !(c.is_finite() && c > 0.0) {
                return Err(TrainError::Invalid(format!("max grad norm must be positive, got {c}")));
            }
        }
        Ok(())
    }
}

struct Moments {
    m: Var,
    v: Var,
}

/// An optimizer over variables identified by name.
pub struct Optimizer {
    cfg: OptimConfig,
    step: u64,
    moments: HashMap<String, Moments>,
}

/// One AdamW update of `var` from its (already clipped) gradient with candle's ops, where
/// the in-place CPU kernels do not apply.
fn adamw_composed(c: &OptimConfig, t: i32, var: &Var, mo: &mut Moments, g: &Tensor) -> Result<()> {
    let (bc1, bc2) = (1.0 - c.beta1.powi(t), 1.0 - c.beta2.powi(t));
    let theta = var.as_tensor();
    let m = ((mo.m.as_tensor() * c.beta1)? + (g * (1.0 - c.beta1))?)?;
    let v = ((mo.v.as_tensor() * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
    let update = ((&m / bc1)? / ((&v / bc2)?.sqrt()? + c.eps)?)?;
    let decayed = (theta * (1.0 - c.lr * c.weight_decay))?;
    var.set(&(decayed - (update * c.lr)?)?)?;
    mo.m.set(&m)?;
    mo.v.set(&v)?;
    Ok(())
}

/// L2 norm over a set of gradients.
pub fn global_norm<'a>(grads: impl IntoIterator<Item = &'a Tensor>) -> Result<f64> {
    let mut sq = 0.0;
    for g in grads {
        sq += match cpu_sum_of_squares(g) {
            Some(v) => v,
            None => g.sqr()?.sum_all()?.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?,
        };
    }
    Ok(sq.sqrt())
}

/// Whether the in-place CPU kernels can update this parameter with this gradient.
fn in_place_ok(theta: &Tensor, g: &Tensor) -> bool {
    theta.device().is_cpu()
        && theta.is_contiguous()
        && g.is_contiguous()
        && theta.dtype() == g.dtype()
        && matches!(theta.dtype(), candle_core::DType::F32 | candle_core::DType::F64)
}

/// Whether the device-resident step's in-place kernels can update this parameter: f32 or
/// f64 on the CPU (the reference, which tests run), f32 on an NVIDIA GPU in a `cuda` build.
fn in_place_on_device(theta: &Tensor, g: &Tensor) -> bool {
    use candle_core::{DType, Device};
    let kernel = match theta.device() {
        Device::Cpu => matches!(theta.dtype(), DType::F32 | DType::F64),
        Device::Cuda(_) => cfg!(feature = "cuda") && theta.dtype() == DType::F32,
        Device::Metal(_) => false,
    };
    kernel && theta.is_contiguous() && g.is_contiguous() && theta.dtype() == g.dtype()
}

impl Optimizer {
    /// A fresh optimizer.
    pub fn new(cfg: OptimConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Self { cfg, step: 0, moments: HashMap::new() })
    }

    /// Optimizer steps taken.
    pub fn steps_taken(&self) -> u64 {
        self.step
    }

    /// The settings.
    pub fn config(&self) -> &OptimConfig {
        &self.cfg
    }

    /// Applies one update. `grads` maps parameter names to gradients; parameters without a
    /// gradient are left alone. Returns the global gradient norm before clipping.
    ///
    /// A non-finite gradient norm is an error. With clipping or AdamW it is found before any
    /// parameter changes; an unclipped SGD step on the CPU finds it while updating (one pass
    /// over the gradients instead of two), so after that error the parameters hold the
    /// non-finite update and are to be discarded, as a device discards a failed round.
    pub fn step(&mut self, params: &[(&str, &Var)], grads: &HashMap<String, Tensor>) -> Result<f64> {
        let with_grads = || params.iter().filter_map(|(n, v)| grads.get(*n).map(|g| (v.as_tensor(), g)));
        let one_pass = self.cfg.kind == OptimKind::Sgd
            && self.cfg.max_grad_norm.is_none()
            && with_grads().all(|(theta, g)| in_place_ok(theta, g));
        if one_pass {
            let mut sum_of_squares = 0.0;
            for (theta, g) in with_grads() {
                let op = SgdStepSummingSquares::new(self.cfg.lr);
                theta.inplace_op2(g, &op)?;
                sum_of_squares += op.take_sum();
            }
            let norm = sum_of_squares.sqrt();
            if !norm.is_finite() {
                return Err(TrainError::NonFinite { what: "gradient norm", step: self.step });
            }
            self.step += 1;
            return Ok(norm);
        }
        let norm = global_norm(params.iter().filter_map(|(n, _)| grads.get(*n)))?;
        if !norm.is_finite() {
            return Err(TrainError::NonFinite { what: "gradient norm", step: self.step });
        }
        let clip = match self.cfg.max_grad_norm {
            Some(c) if norm > c => c / norm,
            _ => 1.0,
        };
        self.step += 1;
        let t = self.step as i32;
        for (name, var) in params {
            let Some(g) = grads.get(*name) else { continue };
            let theta = var.as_tensor();
            let fast = in_place_ok(theta, g);
            match self.cfg.kind {
                OptimKind::Sgd if fast => theta.inplace_op2(g, &SgdStep { step: self.cfg.lr * clip })?,
                OptimKind::Sgd => var.set(&(theta - (g * (self.cfg.lr * clip))?)?)?,
                OptimKind::Adamw if !fast => {
                    let moments = Self::moments_of(&mut self.moments, name, theta)?;
                    adamw_composed(&self.cfg, t, var, moments, &(g * clip)?)?
                }
                OptimKind::Adamw => {
                    let c = self.cfg;
                    let mo = Self::moments_of(&mut self.moments, name, theta)?;
                    let (bc1, bc2) = (1.0 - c.beta1.powi(t), 1.0 - c.beta2.powi(t));
                    mo.m.as_tensor().inplace_op2(g, &MomentUpdate { beta: c.beta1, scale: clip, square: false })?;
                    mo.v.as_tensor().inplace_op2(g, &MomentUpdate { beta: c.beta2, scale: clip, square: true })?;
                    let apply = AdamApply {
                        lr: c.lr,
                        weight_decay: c.weight_decay,
                        bias_correction1: bc1,
                        bias_correction2: bc2,
                        eps: c.eps,
                    };
                    theta.inplace_op3(mo.m.as_tensor(), mo.v.as_tensor(), &apply)?;
                }
            }
        }
        Ok(norm)
    }

    /// [`Optimizer::step`] without reading anything back to the host, for a model on a GPU:
    /// the norm, the clipping factor and the updates stay on the device, and the norm comes
    /// back as a scalar tensor (`None` when no parameter has a gradient) for the caller to
    /// read with the step's other metrics.
    ///
    /// A non-finite norm is therefore found after the update, not before: the caller
    /// reports it, and the parameters, which then hold the non-finite update, are to be
    /// discarded, as a device discards a failed round.
    pub fn step_on_device(
        &mut self,
        params: &[(&str, &Var)],
        grads: &HashMap<String, Tensor>,
    ) -> Result<Option<Tensor>> {
        let Some(norm) = global_norm_on_device(params.iter().filter_map(|(n, _)| grads.get(*n)))? else {
            self.step += 1;
            return Ok(None);
        };
        // min(1, max_norm / norm) as a one-value tensor: 1 for a zero norm, whose
        // reciprocal is infinite, and 1 without clipping
        let clip = match self.cfg.max_grad_norm {
            Some(c) => (norm.recip()? * c)?.minimum(1.0)?.reshape(1)?,
            None => Tensor::ones(1, norm.dtype(), norm.device())?,
        };
        let mut clip_as: Vec<Tensor> = Vec::new();
        self.step += 1;
        let t = self.step as i32;
        let c = self.cfg;
        for (name, var) in params {
            let Some(g) = grads.get(*name) else { continue };
            let theta = var.as_tensor();
            // the factor in the parameter's dtype, converted once per dtype
            let clip = match clip_as.iter().find(|x| x.dtype() == theta.dtype()) {
                Some(x) => x.clone(),
                None => {
                    clip_as.push(clip.to_dtype(theta.dtype())?);
                    clip_as[clip_as.len() - 1].clone()
                }
            };
            let in_place = in_place_on_device(theta, g);
            match self.cfg.kind {
                OptimKind::Sgd if in_place => theta.inplace_op3(g, &clip, &ClippedSgdStep { lr: c.lr })?,
                OptimKind::Sgd => var.set(&(theta - g.broadcast_mul(&(clip * c.lr)?)?)?)?,
                OptimKind::Adamw => {
                    let mo = Self::moments_of(&mut self.moments, name, theta)?;
                    if in_place {
                        let (bc1, bc2) = (1.0 - c.beta1.powi(t), 1.0 - c.beta2.powi(t));
                        mo.m.as_tensor().inplace_op3(
                            g,
                            &clip,
                            &ClippedMomentUpdate { beta: c.beta1, square: false },
                        )?;
                        mo.v.as_tensor().inplace_op3(g, &clip, &ClippedMomentUpdate { beta: c.beta2, square: true })?;
                        let apply = AdamApply {
                            lr: c.lr,
                            weight_decay: c.weight_decay,
                            bias_correction1: bc1,
                            bias_correction2: bc2,
                            eps: c.eps,
                        };
                        theta.inplace_op3(mo.m.as_tensor(), mo.v.as_tensor(), &apply)?;
                    } else {
                        adamw_composed(&self.cfg, t, var, mo, &g.broadcast_mul(&clip)?)?
                    }
                }
            }
        }
        Ok(Some(norm))
    }

    fn moments_of<'m>(
        moments: &'m mut HashMap<String, Moments>,
        name: &str,
        theta: &Tensor,
    ) -> Result<&'m mut Moments> {
        Ok(match moments.entry(name.to_string()) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(Moments {
                m: Var::zeros(theta.shape(), theta.dtype(), theta.device())?,
                v: Var::zeros(theta.shape(), theta.dtype(), theta.device())?,
            }),
        })
    }

    /// Saves the step count and the moments of the named parameters (e.g. only the private
    /// ones: shared parameters are replaced by the aggregator each round).
    pub fn save_state(&self, path: &Path, names: &[&str]) -> Result<()> {
        let mut tensors = Vec::new();
        for name in names {
            if let Some(mo) = self.moments.get(*name) {
                tensors.push((format!("m.{name}"), mo.m.as_tensor().clone()));
                tensors.push((format!("v.{name}"), mo.v.as_tensor().clone()));
            }
        }
        let meta = HashMap::from([
            ("format".to_string(), "fedpo-optim/1".to_string()),
            ("kind".to_string(), serde_json::to_string(&self.cfg.kind).unwrap_or_default()),
            ("step".to_string(), self.step.to_string()),
        ]);
        Ok(write_safetensors(path, &tensors, meta)?)
    }

    /// Restores state written by [`Optimizer::save_state`].
    pub fn load_state(&mut self, path: &Path, device: &candle_core::Device) -> Result<()> {
        let file = read_safetensors(path, device)?;
        let bad = |reason: String| TrainError::StateMismatch { path: path.to_path_buf(), reason };
        let kind = file.metadata.get("kind").cloned().unwrap_or_default();
        let expected = serde_json::to_string(&self.cfg.kind).unwrap_or_default();
        if kind != expected {
            return Err(bad(format!("saved by optimizer {kind}, this run uses {expected}")));
        }
        self.step =
            file.metadata.get("step").and_then(|s| s.parse().ok()).ok_or_else(|| bad("no step count".into()))?;
        let tensors = file.tensors.tensors;
        for (key, m) in &tensors {
            let Some(name) = key.strip_prefix("m.") else { continue };
            let v = tensors.get(&format!("v.{name}")).ok_or_else(|| bad(format!("`m.{name}` without `v.{name}`")))?;
            self.moments.insert(name.to_string(), Moments { m: Var::from_tensor(m)?, v: Var::from_tensor(v)? });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn in_place_and_tensor_op_updates_agree_for_both_rules() {
        // The same trajectory on the CPU kernels (contiguous f64) and the tensor-op path
        // (forced by a non-contiguous gradient).
        for kind in [OptimKind::Sgd, OptimKind::Adamw] {
            let run = |transposed: bool| -> Vec<f64> {
                let x = Var::new(&[[1.0f64, -2.0], [3.0, 0.5]], &Device::Cpu).unwrap();
                let mut cfg = OptimConfig::new(kind, 0.05);
                cfg.weight_decay = 0.1;
                cfg.max_grad_norm = Some(1.0);
                let mut opt = Optimizer::new(cfg).unwrap();
                for _ in 0..5 {
                    let g = (x.as_tensor() - 0.25).unwrap();
                    let g = if transposed { g.t().unwrap().contiguous().unwrap().t().unwrap() } else { g };
                    opt.step(&[("x", &x)], &HashMap::from([("x".to_string(), g)])).unwrap();
                }
                x.as_tensor().flatten_all().unwrap().to_vec1().unwrap()
            };
            let (a, b) = (run(false), run(true));
            for (p, q) in a.iter().zip(&b) {
                assert!((p - q).abs() < 1e-12, "{kind:?}: {a:?} vs {b:?}");
            }
        }
    }

    fn quadratic_grad(x: &Var) -> HashMap<String, Tensor> {
        // f(x) = 0.5 * |x - 3|^2, so grad = x - 3
        HashMap::from([("x".to_string(), (x.as_tensor() - 3.0).unwrap())])
    }

    #[test]
    fn sgd_and_adamw_minimise_a_quadratic() {
        for (kind, lr) in [(OptimKind::Sgd, 0.1), (OptimKind::Adamw, 0.1)] {
            let x = Var::new(&[0.0f64, 10.0], &Device::Cpu).unwrap();
            let mut opt = Optimizer::new(OptimConfig::new(kind, lr)).unwrap();
            for _ in 0..300 {
                opt.step(&[("x", &x)], &quadratic_grad(&x)).unwrap();
            }
            let v: Vec<f64> = x.as_tensor().to_vec1().unwrap();
            assert!(v.iter().all(|v| (v - 3.0).abs() < 1e-2), "{kind:?}: {v:?}");
        }
    }

    #[test]
    fn first_adamw_step_moves_each_coordinate_by_lr() {
        // With bias correction the first update is lr * g / |g| for every coordinate.
        let x = Var::new(&[0.0f64, 100.0], &Device::Cpu).unwrap();
        let mut opt = Optimizer::new(OptimConfig::new(OptimKind::Adamw, 0.01)).unwrap();
        opt.step(&[("x", &x)], &quadratic_grad(&x)).unwrap();
        let v: Vec<f64> = x.as_tensor().to_vec1().unwrap();
        assert!((v[0] - 0.01).abs() < 1e-6 && (v[1] - 99.99).abs() < 1e-6, "{v:?}");
    }

    #[test]
    fn clipping_caps_the_update_and_reports_the_raw_norm() {
        let x = Var::new(&[0.0f64, 0.0], &Device::Cpu).unwrap();
        let grads = HashMap::from([("x".to_string(), Tensor::new(&[3.0f64, 4.0], &Device::Cpu).unwrap())]);
        let mut cfg = OptimConfig::new(OptimKind::Sgd, 1.0);
        cfg.max_grad_norm = Some(1.0);
        let norm = Optimizer::new(cfg).unwrap().step(&[("x", &x)], &grads).unwrap();
        assert!((norm - 5.0).abs() < 1e-12);
        let v: Vec<f64> = x.as_tensor().to_vec1().unwrap();
        assert!((v[0] + 0.6).abs() < 1e-12 && (v[1] + 0.8).abs() < 1e-12, "{v:?}");
    }

    #[test]
    fn saved_adamw_state_resumes_the_same_trajectory() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("optim.safetensors");
        let run = |split: bool| -> Vec<f64> {
            let x = Var::new(&[0.0f64, 10.0], &Device::Cpu).unwrap();
            let cfg = OptimConfig::new(OptimKind::Adamw, 0.05);
            let mut opt = Optimizer::new(cfg).unwrap();
            for i in 0..10 {
                if split && i == 5 {
                    opt.save_state(&path, &["x"]).unwrap();
                    opt = Optimizer::new(cfg).unwrap();
                    opt.load_state(&path, &Device::Cpu).unwrap();
                }
                opt.step(&[("x", &x)], &quadratic_grad(&x)).unwrap();
            }
            x.as_tensor().to_vec1().unwrap()
        };
        assert_eq!(run(false), run(true));
    }

    #[test]
    fn unclipped_sgd_in_one_pass_gives_the_two_pass_parameters_and_norm_bit_for_bit() {
        // f32 over several of the kernels' chunks and a tail, f64 small, one parameter
        // without a gradient, and a non-contiguous gradient (which takes the two passes)
        let big = 3 * 64 * 1024 + 333;
        let values = |n: usize, seed: usize| -> Vec<f32> {
            (0..n).map(|i| (((i * 7919 + seed * 31) % 2003) as f32 - 1001.0) / 211.0).collect()
        };
        let run = |max_grad_norm: Option<f64>, transposed: bool| -> (Vec<Vec<f32>>, Vec<f64>, f64) {
            let a = Var::from_slice(&values(big, 1), big, &Device::Cpu).unwrap();
            let b = Var::new(&[[0.5f64, -1.5], [2.0, 0.25]], &Device::Cpu).unwrap();
            let untouched = Var::new(&[7.0f32], &Device::Cpu).unwrap();
            let mut cfg = OptimConfig::new(OptimKind::Sgd, 0.003);
            cfg.max_grad_norm = max_grad_norm;
            let mut opt = Optimizer::new(cfg).unwrap();
            let mut norm = 0.0;
            for step in 0..3 {
                let ga = Tensor::from_slice(&values(big, step + 2), big, &Device::Cpu).unwrap();
                let gb = (b.as_tensor() * (step as f64 + 0.5)).unwrap();
                let gb = if transposed { gb.t().unwrap().contiguous().unwrap().t().unwrap() } else { gb };
                let grads = HashMap::from([("a".to_string(), ga), ("b".to_string(), gb)]);
                norm = opt.step(&[("a", &a), ("b", &b), ("u", &untouched)], &grads).unwrap();
            }
            let b = b.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            (vec![a.as_tensor().to_vec1().unwrap(), untouched.as_tensor().to_vec1().unwrap()], b, norm)
        };
        // a threshold no norm reaches: the clipping path, with a factor of exactly one
        let two_pass = run(Some(1e30), false);
        assert_eq!(run(None, false), two_pass);
        assert_eq!(run(None, true), two_pass);
        assert_eq!(two_pass.0[1], vec![7.0], "a parameter without a gradient stays");
        assert!(two_pass.2 > 0.0);
    }

    #[test]
    fn non_finite_gradient_is_an_error_not_a_silent_nan() {
        let x = Var::new(&[0.0f64], &Device::Cpu).unwrap();
        let grads = HashMap::from([("x".to_string(), Tensor::new(&[f64::NAN], &Device::Cpu).unwrap())]);
        for max_grad_norm in [None, Some(1.0)] {
            let mut cfg = OptimConfig::new(OptimKind::Sgd, 0.1);
            cfg.max_grad_norm = max_grad_norm;
            let mut opt = Optimizer::new(cfg).unwrap();
            let err = opt.step(&[("x", &x)], &grads);
            assert!(matches!(err, Err(TrainError::NonFinite { .. })), "clipping {max_grad_norm:?}");
            assert_eq!(opt.steps_taken(), 0, "a failed step is not counted");
        }
    }
}
