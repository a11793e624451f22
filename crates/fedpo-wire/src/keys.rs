//! The names devices and the aggregator agree on: settings in a plan's `strategy` map and
//! the sections a plan or an update carries.

/// FedProx's μ (absent or 0: no proximal term).
pub const PROXIMAL_MU: &str = "proximal_mu";
/// 1: SCAFFOLD is on; the plan carries [`SCAFFOLD_CONTROL`] and the update must carry
/// [`SCAFFOLD_CONTROL_DELTA`].
pub const SCAFFOLD: &str = "scaffold";
/// FedGA's λ (absent: no alignment term).
pub const FEDGA_LAMBDA: &str = "fedga.lambda";
/// FedGA granularity: 0 the whole model, 1 per layer.
pub const FEDGA_LAYER: &str = "fedga.layer";
/// FedGA mode: 0 finite-difference Hessian-vector product, 1 displacement.
pub const FEDGA_DISPLACEMENT: &str = "fedga.displacement";
/// FedGA finite-difference step, relative to the norm of the shared parameters.
pub const FEDGA_FD_STEP: &str = "fedga.fd_step";
/// Prefix of a FedGA per-layer weight: `fedga.w.h.0.attn` = 1.
pub const FEDGA_WEIGHT_PREFIX: &str = "fedga.w.";
/// 1: devices upload their full local gradient at the received model
/// ([`DIAGNOSTIC_GRADIENT`]).
pub const DIAGNOSTICS: &str = "diagnostics";
/// 0: a training round whose devices skip the held-out evaluation (absent: evaluate).
pub const HELDOUT_EVAL: &str = "heldout_eval";

/// Plan section: SCAFFOLD's server control variate `c`.
pub const SCAFFOLD_CONTROL: &str = "scaffold.control";
/// Plan section: FedGA's reference direction `r`.
pub const FEDGA_REFERENCE: &str = "fedga.reference";
/// Update section: the change of the device's control variate, `Δc_i`.
pub const SCAFFOLD_CONTROL_DELTA: &str = "scaffold.control_delta";
/// Update section: the device's full-data gradient at the received model.
pub const DIAGNOSTIC_GRADIENT: &str = "diagnostics.gradient";
