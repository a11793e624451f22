//! The federated side of `fedpo-device`, as a library so that the aggregator's
//! simulation can run real devices in-process.
//!
//! [`participant::run`] joins a job over MQTT and, in every round that selects it, trains
//! the received global model with its private adapter and uploads only the shared delta.

mod algorithms;
mod error;
mod local_round;
pub mod memory;
pub mod participant;
mod state_dir;

pub use state_dir::{read_latest_model, LatestModel};
