//! Why a participant stops: one error type for the participant and the modules it drives
//! (a round's training, the state directory, the client terms), kept apart from all of
//! them so that none of those modules imports the participant for it.

use thiserror::Error;

use crate::memory::PlanError;

/// Why a participant stopped.
#[derive(Debug, Error)]
pub enum ParticipantError {
    /// Settings that cannot work.
    #[error("invalid participant settings: {0}")]
    Config(String),
    /// The state directory could not be read or written.
    #[error("state directory: {0}")]
    State(String),
    /// The aggregator sent something this device cannot use.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The round's downlink deltas did not lead from the model this device holds to the
    /// model the plan names: the device declines the round, asking for the whole model.
    #[error("downlink: {0}; asking for the whole model")]
    Downlink(String),
    /// MQTT failed.
    #[error(transparent)]
    Transport(#[from] fedpo_transport::TransportError),
    /// Encoding or decoding failed.
    #[error(transparent)]
    Wire(#[from] fedpo_wire::WireError),
    /// The job's model does not fit this device's memory budget.
    #[error("round {round}: {reason}")]
    Memory {
        /// The round whose plan was refused.
        round: u64,
        /// What would not fit, and what would.
        reason: PlanError,
    },
    /// The model could not be built.
    #[error(transparent)]
    Model(#[from] fedpo_model::ModelError),
    /// Training failed.
    #[error(transparent)]
    Train(#[from] fedpo_train::TrainError),
    /// A secure-aggregation step failed.
    #[error("secure aggregation: {0}")]
    SecAgg(#[from] fedpo_secagg::SecAggError),
    /// The data could not be prepared.
    #[error(transparent)]
    Data(#[from] fedpo_data::DataError),
}
