//! FedGA's gradient-alignment penalty: `P(θ) = λ·Σ_l w_l·(1 − cos(g_l(θ), r_l))`.
//!
//! `g` is the device's DPO gradient of the shared parameters and `r` the aggregator's
//! reference direction, an EMA of past global steps oriented like a gradient (see the
//! aggregator's FedGA term). `l` runs over one group (`full`) or over the model's layers
//! (`layer`: `wte`, `wpe`, `h.N.ln_1`, `h.N.attn`, `h.N.ln_2`, `h.N.mlp`, `ln_f`).
//!
//! Because `g` is itself a gradient, `∇P = −λ·H·v` with `v = Σ_l w_l·∂cos_l/∂g_l` and `H`
//! the Hessian of the DPO loss. Two ways to get it:
//!
//! - [`AlignmentMode::FiniteDifference`] (default): central differences of gradients,
//!   `H·v ≈ ‖v‖·(g(θ + ε·v̂) − g(θ − ε·v̂)) / 2ε`, two extra backward passes per step on the
//!   same batch. `ε = rel_step·max(‖θ_shared‖, 1)`, so each weight moves by about `rel_step` of its
//!   own size: 1e-3 keeps f32 rounding (~6e-8 relative) three orders below the step while
//!   the truncation error, O(ε²), stays small. Exact double backprop is not offered:
//!   candle detaches intermediate gradients unless `CANDLE_GRAD_DO_NOT_DETACH=1`, and its
//!   second-order results are not verified.
//! - [`AlignmentMode::Displacement`]: a first-order stand-in with no Hessian, the cosine
//!   between the running local step `θ_global − θ` (oriented like a gradient) and `r`.
//!   Its gradient is exact and costs nothing; the penalty is zero at the first step.

use std::collections::BTreeMap;

use candle_core::DType;
use fedpo_model::Policy;
use serde::{Deserialize, Serialize};

use super::vector::{dot, Grads};
use crate::error::{Result, TrainError};

/// Whether the cosine is taken over the whole model or per layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Granularity {
    /// The shared parameters as one vector.
    Full,
    /// One cosine per layer (see [`layer_of`]), weighted.
    Layer,
}

/// How the penalty's gradient is obtained.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum AlignmentMode {
    /// The gradient's cosine with `r`, differentiated through a finite-difference
    /// Hessian-vector product with step `rel_step·‖θ‖`.
    FiniteDifference {
        /// Step relative to the norm of the shared parameters.
        rel_step: f64,
    },
    /// The running local update's cosine with `r`.
    Displacement,
}

/// The layer a parameter belongs to: `h.N.<module>` inside a block, else its first name
/// component (`wte`, `wpe`, `ln_f`).
pub fn layer_of(name: &str) -> String {
    let parts: Vec<&str> = name.split('.').collect();
    if parts.first() == Some(&"h") && parts.len() >= 4 {
        parts[..3].join(".")
    } else {
        parts[0].to_string()
    }
}

/// FedGA's penalty for one round.
pub struct Alignment {
    lambda: f64,
    /// The cosine's groups, with zero-weight layers left out; fixed for the round.
    groups: Vec<Group>,
    mode: AlignmentMode,
    reference: Grads,
    anchor: Grads,
}

struct Group {
    weight: f64,
    names: Vec<String>,
    /// `‖r_l‖²`, which does not change within a round.
    reference_sq: f64,
}

/// The reference's names grouped by `granularity`, weighted, in name order.
fn group_names(
    reference: &Grads,
    granularity: Granularity,
    weights: &BTreeMap<String, f64>,
) -> Vec<(f64, Vec<String>)> {
    let mut names: Vec<String> = reference.keys().cloned().collect();
    names.sort();
    match granularity {
        Granularity::Full => vec![(1.0, names)],
        Granularity::Layer => {
            let mut by_layer: BTreeMap<String, Vec<String>> = BTreeMap::new();
            for n in names {
                by_layer.entry(layer_of(&n)).or_default().push(n);
            }
            by_layer.into_iter().map(|(layer, names)| (weights.get(&layer).copied().unwrap_or(1.0), names)).collect()
        }
    }
}

impl Alignment {
    /// `reference` is `r` by shared-parameter name; `anchor` the round's global shared
    /// tensors (used by the displacement mode). Layers missing from `weights` weigh 1.
    pub fn new(
        lambda: f64,
        granularity: Granularity,
        weights: BTreeMap<String, f64>,
        mode: AlignmentMode,
        reference: Grads,
        anchor: Grads,
    ) -> Result<Self> {
        if !(lambda.is_finite() && lambda >= 0.0) {
            return Err(TrainError::Invalid(format!("FedGA lambda must be finite and non-negative, got {lambda}")));
        }
        if let Some((layer, w)) = weights.iter().find(|(_, w)| !(w.is_finite() && **w >= 0.0)) {
            return Err(TrainError::Invalid(format!("FedGA weight of layer `{layer}` must be non-negative, got {w}")));
        }
        if let AlignmentMode::FiniteDifference { rel_step } = mode {
            if !(rel_step.is_finite() && rel_step > 0.0) {
                return Err(TrainError::Invalid(format!(
                    "FedGA finite-difference step must be positive, got {rel_step}"
                )));
            }
        }
        let mut groups = Vec::new();
        for (weight, names) in group_names(&reference, granularity, &weights) {
            if weight == 0.0 {
                continue;
            }
            let reference_sq = dot(&reference, &reference, names.iter().map(String::as_str))?;
            groups.push(Group { weight, names, reference_sq });
        }
        Ok(Self { lambda, groups, mode, reference, anchor })
    }

    /// The penalty and `v = Σ_l w_l·∂cos(x_l, r_l)/∂x_l`. Groups where `x` or `r` is zero
    /// have no direction and contribute nothing.
    fn cosine_gradient(&self, x: &Grads) -> Result<(f64, Grads)> {
        let mut penalty = 0.0;
        let mut v = Grads::new();
        for group in &self.groups {
            let names = || group.names.iter().map(String::as_str);
            let xr = dot(x, &self.reference, names())?;
            let xx = dot(x, x, names())?;
            let rr = group.reference_sq;
            if xx <= 0.0 || rr <= 0.0 {
                continue;
            }
            let (nx, nr) = (xx.sqrt(), rr.sqrt());
            let cos = xr / (nx * nr);
            penalty += self.lambda * group.weight * (1.0 - cos);
            for name in names() {
                let (Some(xi), Some(ri)) = (x.get(name), self.reference.get(name)) else { continue };
                let ri = ri.to_dtype(xi.dtype())?;
                let u = ((ri / (nx * nr))? - (xi * (cos / xx))?)?;
                v.insert(name.to_string(), (u * group.weight)?);
            }
        }
        Ok((penalty, v))
    }

    /// The penalty at the DPO gradient `g`.
    pub fn penalty(&self, g: &Grads) -> Result<f64> {
        Ok(self.cosine_gradient(g)?.0)
    }

    /// The penalty and its gradient with respect to every trainable parameter. `g` is the
    /// DPO gradient at the current parameters; `regrad` recomputes it (on the same batch)
    /// at whatever the policy's parameters are when it is called.
    pub fn penalty_gradient(
        &self,
        policy: &Policy,
        g: &Grads,
        regrad: &dyn Fn() -> Result<Grads>,
    ) -> Result<(f64, Grads)> {
        match self.mode {
            AlignmentMode::Displacement => {
                let mut x = Grads::new();
                for (name, anchor) in &self.anchor {
                    let Some(p) = policy.params.get(name) else { continue };
                    x.insert(name.clone(), (anchor.to_dtype(p.tensor().dtype())? - p.tensor())?);
                }
                let (penalty, v) = self.cosine_gradient(&x)?;
                // x = θ_global − θ, so ∂P/∂θ = −λ·v·∂x/∂θ = λ·v.
                let grad = v.into_iter().map(|(n, t)| Ok((n, (t * self.lambda)?))).collect::<Result<Grads>>()?;
                Ok((penalty, grad))
            }
            AlignmentMode::FiniteDifference { rel_step } => {
                let (penalty, v) = self.cosine_gradient(g)?;
                let v_norm = dot(&v, &v, v.keys().map(String::as_str))?.sqrt();
                if v_norm == 0.0 || self.lambda == 0.0 {
                    return Ok((penalty, Grads::new()));
                }
                let hv = hessian_vector_product(policy, &v, v_norm, rel_step, regrad)?;
                let grad = hv.into_iter().map(|(n, t)| Ok((n, (t * -self.lambda)?))).collect::<Result<Grads>>()?;
                Ok((penalty, grad))
            }
        }
    }
}

/// `H·v` by central differences along `v̂ = v/‖v‖`, for every parameter `regrad` returns.
/// The parameters are restored bit for bit, also when `regrad` fails.
fn hessian_vector_product(
    policy: &Policy,
    v: &Grads,
    v_norm: f64,
    rel_step: f64,
    regrad: &dyn Fn() -> Result<Grads>,
) -> Result<Grads> {
    let mut saved = Vec::with_capacity(v.len());
    let mut theta_sq = 0.0;
    for name in v.keys() {
        let var = policy.params.get(name).and_then(|p| p.var()).ok_or_else(|| {
            TrainError::Invalid(format!("FedGA direction names `{name}`, which is not a trainable parameter"))
        })?;
        theta_sq += var.as_tensor().to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
        saved.push((name, var, var.as_tensor().copy()?));
    }
    let eps = rel_step * theta_sq.sqrt().max(1.0);
    let at = |sign: f64| -> Result<Grads> {
        for (name, var, original) in &saved {
            let step = (v[*name].to_dtype(original.dtype())? * (sign * eps / v_norm))?;
            var.set(&(original + step)?)?;
        }
        regrad()
    };
    let result = at(1.0).and_then(|plus| Ok((plus, at(-1.0)?)));
    for (_, var, original) in &saved {
        var.set(original)?;
    }
    let (plus, minus) = result?;
    let scale = v_norm / (2.0 * eps);
    let mut hv = Grads::new();
    for (name, gp) in plus {
        if let Some(gm) = minus.get(&name) {
            hv.insert(name, ((gp - gm)? * scale)?);
        }
    }
    Ok(hv)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_group_block_modules_and_top_level_tensors() {
        assert_eq!(layer_of("h.3.attn.c_attn.weight"), "h.3.attn");
        assert_eq!(layer_of("h.0.attn.c_attn.lora_A.weight"), "h.0.attn");
        assert_eq!(layer_of("h.11.ln_1.bias"), "h.11.ln_1");
        assert_eq!(layer_of("wte.weight"), "wte");
        assert_eq!(layer_of("ln_f.weight"), "ln_f");
    }
}
