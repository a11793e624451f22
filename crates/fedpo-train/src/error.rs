//! Errors of `fedpo-train`.

use std::path::PathBuf;

/// Errors raised while training, evaluating or persisting training state.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A setting is out of range.
    #[error("invalid training setting: {0}")]
    Invalid(String),
    /// The loss or a gradient became NaN or infinite.
    #[error("non-finite {what} at step {step}; lower the learning rate or enable clipping")]
    NonFinite {
        /// What diverged.
        what: &'static str,
        /// The optimizer step.
        step: u64,
    },
    /// A state file does not match the run.
    #[error("{path}: {reason}")]
    StateMismatch {
        /// The file.
        path: PathBuf,
        /// What differs.
        reason: String,
    },
    /// Model-side failure (tensors, checkpoints).
    #[error(transparent)]
    Model(#[from] fedpo_model::ModelError),
    /// Data-side failure.
    #[error(transparent)]
    Data(#[from] fedpo_data::DataError),
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A file could not be written.
    #[error(transparent)]
    File(#[from] fedpo_process::FileError),
}

/// Shorthand for results in this crate.
pub type Result<T> = std::result::Result<T, TrainError>;
