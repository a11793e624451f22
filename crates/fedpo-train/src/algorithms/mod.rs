//! The training half of each federated algorithm: the terms it adds to a device's local
//! DPO objective. Each algorithm has one home of the same name in each crate: here,
//! `fedpo_device::algorithms` (what a plan asks of the device) and
//! `fedpo_aggregator`'s `algorithms` (the server's half).
//!
//! Each term acts on the gradient of the shared parameters before the optimizer step, so
//! it composes with any parameter partition (pfeddpo, feddpo, shared-lora) and with
//! either optimizer:
//!
//! - [`Proximal`] (FedProx): `(μ/2)·‖θ − θ_global‖²`;
//! - [`Scaffold`]: the drift correction `c − c_i` and the device's control variate;
//! - [`Alignment`] (FedGA): `λ·Σ_l w_l·(1 − cos(g_l, r_l))` against the aggregator's
//!   reference direction.

mod fedga;
mod fedprox;
mod scaffold;
mod vector;

pub use fedga::{layer_of, Alignment, AlignmentMode, Granularity};
pub use fedprox::Proximal;
pub use scaffold::Scaffold;
pub(crate) use vector::add_scaled;
pub use vector::Grads;

/// The terms one round's local objective carries, applied in this order to the DPO
/// gradient `g`: the alignment penalty's gradient (computed from `g` itself), the
/// proximal pull, the SCAFFOLD correction.
#[derive(Default)]
pub struct LocalTerms {
    /// FedProx.
    pub proximal: Option<Proximal>,
    /// SCAFFOLD.
    pub scaffold: Option<Scaffold>,
    /// FedGA.
    pub alignment: Option<Alignment>,
}

impl LocalTerms {
    /// Whether any term is active.
    pub fn is_empty(&self) -> bool {
        self.proximal.is_none() && self.scaffold.is_none() && self.alignment.is_none()
    }
}
