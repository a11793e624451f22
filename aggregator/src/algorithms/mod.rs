//! The server's half of every federated algorithm, one file each, as Flower keeps one
//! file per strategy.
//!
//! | algorithm | here | device (`fedpo-device`'s `algorithms/`) | training (`fedpo-train`'s `algorithms/`) |
//! |---|---|---|---|
//! | FedAvg | `fedavg.rs` | — | — |
//! | FedAdam, FedYogi | `fedopt.rs` | — | — |
//! | FedProx | `fedprox.rs` | its μ and the anchor | `fedprox.rs` |
//! | SCAFFOLD | `scaffold.rs` | `scaffold.rs` (`c_i` on disk) | `scaffold.rs` |
//! | FedGA | `fedga.rs` | `fedga.rs` | `fedga.rs` |
//! | median, trimmed mean, Krum | `robust.rs` | — | — |
//! | client-level DP | `dp.rs` | — | — |
//!
//! A [`strategy::Strategy`] applies a round's combined update to the global model; a
//! [`client_term::ClientTerm`] adds a term to the devices' local objective and keeps the
//! server's side of it. The wire's names for their settings and sections are in
//! `fedpo_wire::keys`.

pub(crate) mod client_term;
pub(crate) mod dp;
pub(crate) mod fedavg;
pub(crate) mod fedga;
pub(crate) mod fedopt;
pub(crate) mod fedprox;
pub(crate) mod robust;
pub(crate) mod scaffold;
pub(crate) mod server_half;
pub(crate) mod strategy;
