//! SCAFFOLD (Karimireddy et al. 2020): control variates that remove client drift.
//!
//! Every local step follows `g_i(θ) − c_i + c`, where `c` is the server's control
//! variate and `c_i` the device's. After the round the device's variate becomes the mean
//! of the DPO gradients its local steps saw:
//!
//! `c_i⁺ = (1/K)·Σ_k g_i(θ_k)`.
//!
//! With SGD and no clipping this is exactly the paper's option II,
//! `c_i⁺ = c_i − c + (θ_global − θ_local)/(K·η)`, because each SGD step moves
//! `η·(g_k − c_i + c)`. With AdamW the correction still enters the gradient before the
//! moments, and `c_i⁺` is still the mean raw gradient (an unbiased estimate of ∇F_i along
//! the trajectory); option II's formula would instead measure Adam's preconditioned step,
//! which is not a gradient. The device uploads `Δc_i = c_i⁺ − c_i`; the server adds
//! `(|S|/N)·mean Δc_i` to `c`.

use super::vector::{add_scaled, Grads};
use crate::error::{Result, TrainError};

/// A device's side of SCAFFOLD for one round.
pub struct Scaffold {
    /// `c − c_i`, added to every step's gradient.
    correction: Grads,
    /// `c_i` at the start of the round.
    control: Grads,
    /// Σ_k g_i(θ_k) over the round's steps (raw DPO gradients).
    gradient_sum: Grads,
    steps: u32,
}

impl Scaffold {
    /// `server` is `c` (one tensor per shared parameter); `device` is the saved `c_i`,
    /// or `None` on a device's first SCAFFOLD round (then `c_i = 0`).
    pub fn new(server: Grads, device: Option<Grads>) -> Result<Self> {
        let control = match device {
            Some(c) => c,
            None => server.iter().map(|(n, t)| Ok((n.clone(), t.zeros_like()?))).collect::<Result<Grads>>()?,
        };
        let mut correction = Grads::new();
        for (name, c) in &server {
            let ci = control.get(name).ok_or_else(|| {
                TrainError::Invalid(format!("the device control variate has no `{name}`; was the model changed?"))
            })?;
            if ci.dims() != c.dims() {
                return Err(TrainError::Invalid(format!(
                    "control variate `{name}`: device {:?}, server {:?}",
                    ci.dims(),
                    c.dims()
                )));
            }
            correction.insert(name.clone(), (c - ci.to_dtype(c.dtype())?)?);
        }
        Ok(Self { correction, control, gradient_sum: Grads::new(), steps: 0 })
    }

    /// Records one step's raw DPO gradient (only the shared parameters count).
    pub fn observe(&mut self, raw: &Grads) -> Result<()> {
        let shared: Grads =
            raw.iter().filter(|(n, _)| self.correction.contains_key(*n)).map(|(n, g)| (n.clone(), g.clone())).collect();
        add_scaled(&mut self.gradient_sum, &shared, 1.0)?;
        self.steps += 1;
        Ok(())
    }

    /// Adds `c − c_i` to the step's gradient.
    pub fn apply(&self, grads: &mut Grads) -> Result<()> {
        add_scaled(grads, &self.correction, 1.0)
    }

    /// After the round: `(c_i⁺, Δc_i)`, or `None` if no step was taken.
    pub fn finish(&self) -> Result<Option<(Grads, Grads)>> {
        if self.steps == 0 {
            return Ok(None);
        }
        let mut next = Grads::new();
        let mut delta = Grads::new();
        for (name, ci) in &self.control {
            let mean = match self.gradient_sum.get(name) {
                Some(s) => (s.to_dtype(ci.dtype())? / f64::from(self.steps))?,
                None => ci.zeros_like()?,
            };
            delta.insert(name.clone(), (&mean - ci)?);
            next.insert(name.clone(), mean);
        }
        Ok(Some((next, delta)))
    }
}
