//! Errors of `fedpo-data`; parse errors carry `file:line`.

use std::path::PathBuf;

/// Errors raised while reading, generating or batching preference data.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// One JSONL line could not be used.
    #[error("{file}:{line}: {reason}")]
    BadLine {
        /// The data file.
        file: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The data file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file holds no usable pair.
    #[error("{path}: no preference pairs (skipped {skipped} bad lines)")]
    Empty {
        /// The data file.
        path: PathBuf,
        /// Lines skipped as bad.
        skipped: usize,
    },
    /// A setting is out of range.
    #[error("invalid data setting: {0}")]
    Invalid(String),
    /// Tokenizing a text failed.
    #[error("tokenizing pair {index}: {reason}")]
    Tokenize {
        /// Index of the pair.
        index: usize,
        /// The tokenizer's message.
        reason: String,
    },
}

/// Shorthand for results in this crate.
pub type Result<T> = std::result::Result<T, DataError>;
