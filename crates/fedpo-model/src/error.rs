//! The one error type of `fedpo-model`: every variant names the input that was wrong.

use std::path::PathBuf;

/// Errors raised while building, loading or saving a model, an adapter or a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A tensor the model needs is absent from the checkpoint.
    #[error("tensor `{name}` is missing from {source_desc} (expected shape {expected:?})")]
    MissingTensor {
        /// Checkpoint name of the tensor, without the `transformer.` prefix.
        name: String,
        /// Where the tensors came from, e.g. a file path.
        source_desc: String,
        /// Shape the model expects.
        expected: Vec<usize>,
    },
    /// A tensor has the wrong shape for the configuration.
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        /// Checkpoint name of the tensor.
        name: String,
        /// Shape the model expects.
        expected: Vec<usize>,
        /// Shape found in the checkpoint.
        found: Vec<usize>,
    },
    /// A LoRA target list names modules that do not exist in the model.
    #[error("LoRA target `{target}` matches no module; valid targets are {valid:?}")]
    UnknownLoraTarget {
        /// The target as given.
        target: String,
        /// Targets the GPT-2 family offers.
        valid: Vec<&'static str>,
    },
    /// The configuration is not usable.
    #[error("invalid model configuration: {0}")]
    InvalidConfig(String),
    /// A sequence is longer than the model's position table.
    #[error("sequence of {len} tokens exceeds the model's {max} positions")]
    SequenceTooLong {
        /// Tokens in the sequence.
        len: usize,
        /// `n_positions` of the model.
        max: usize,
    },
    /// A saved adapter was made for another base model or LoRA shape.
    #[error("adapter {path} does not fit this model: {reason}")]
    AdapterMismatch {
        /// The adapter file.
        path: PathBuf,
        /// What differs.
        reason: String,
    },
    /// The tokenizer could not be built or loaded.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A JSON file could not be parsed.
    #[error("{path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: serde_json::Error,
    },
    /// A safetensors file could not be parsed or written.
    #[error("{path}: {reason}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Shorthand for results in this crate.
pub type Result<T> = std::result::Result<T, ModelError>;

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), source }
    }
}

impl From<fedpo_process::FileError> for ModelError {
    fn from(e: fedpo_process::FileError) -> Self {
        Self::Io { path: e.path, source: e.source }
    }
}
