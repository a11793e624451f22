//! FedProx's proximal term (Li et al. 2020): `(μ/2)·‖θ − θ_global‖²` on the shared
//! parameters, whose gradient `μ·(θ − θ_global)` pulls the local model back towards the
//! round's global model and so bounds client drift.

use candle_core::DType;
use fedpo_model::{ParamRole, Policy};

use super::vector::Grads;
use crate::error::{Result, TrainError};

/// The proximal pull towards the round's global model.
pub struct Proximal {
    mu: f64,
    anchor: Grads,
}

impl Proximal {
    /// μ and the global model's shared tensors (θ_global).
    pub fn new(mu: f64, anchor: Grads) -> Result<Self> {
        if !(mu.is_finite() && mu >= 0.0) {
            return Err(TrainError::Invalid(format!("proximal mu must be finite and non-negative, got {mu}")));
        }
        Ok(Self { mu, anchor })
    }

    /// `(μ/2)·‖θ − θ_global‖²` at the policy's current shared parameters.
    pub fn value(&self, policy: &Policy) -> Result<f64> {
        let mut sq = 0.0;
        for p in policy.params.with_role(ParamRole::Shared) {
            if let Some(a) = self.anchor.get(&p.name) {
                let d = (p.tensor().to_dtype(DType::F64)? - a.to_dtype(DType::F64)?)?;
                sq += d.sqr()?.sum_all()?.to_scalar::<f64>()?;
            }
        }
        Ok(0.5 * self.mu * sq)
    }

    /// Adds `μ·(θ − θ_global)` to the gradient of every shared parameter.
    pub(crate) fn apply(&self, policy: &Policy, grads: &mut Grads) -> Result<()> {
        if self.mu == 0.0 {
            return Ok(());
        }
        for p in policy.params.with_role(ParamRole::Shared) {
            let Some(anchor) = self.anchor.get(&p.name) else { continue };
            let theta = p.tensor();
            let pull = ((theta - anchor.to_dtype(theta.dtype())?)? * self.mu)?;
            let g = match grads.remove(&p.name) {
                Some(g) => (g + pull)?,
                None => pull,
            };
            grads.insert(p.name.clone(), g);
        }
        Ok(())
    }
}
