//! Errors of the wire layer. Each variant says what was wrong and, where a limit was hit,
//! the limit.

/// Why a message, payload or chunk was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum WireError {
    /// The encoded message is larger than the decoder accepts.
    #[error("message of {size} bytes exceeds the limit of {max} bytes")]
    MessageTooLarge {
        /// Bytes received.
        size: usize,
        /// The limit.
        max: usize,
    },
    /// The message was made by another protocol version.
    #[error("unsupported protocol version {found} (this build speaks version {supported})")]
    UnsupportedVersion {
        /// Version in the message.
        found: u16,
        /// Version of this build.
        supported: u16,
    },
    /// The bytes are not a valid CBOR message.
    #[error("malformed CBOR: {0}")]
    Malformed(String),
    /// More tensors than allowed.
    #[error("{count} tensors exceed the limit of {max}")]
    TooManyTensors {
        /// Tensors in the payload or manifest.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A tensor's byte length does not match its shape and dtype.
    #[error("tensor `{name}`: shape {shape:?} of {dtype} needs {expected} bytes, found {found}")]
    TensorSizeMismatch {
        /// The tensor.
        name: String,
        /// Its declared shape.
        shape: Vec<u64>,
        /// Its declared dtype.
        dtype: String,
        /// Bytes the shape and dtype imply (saturating).
        expected: u64,
        /// Bytes present.
        found: u64,
    },
    /// A transfer is larger than allowed.
    #[error("transfer of {size} bytes exceeds the limit of {max} bytes")]
    TransferTooLarge {
        /// Declared or implied bytes.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// An update holds NaN or infinity.
    #[error("tensor `{name}` holds a non-finite value at index {index}")]
    NonFinite {
        /// The tensor.
        name: String,
        /// Flat index of the first bad value.
        index: usize,
    },
    /// A chunk does not belong to the transfer being assembled.
    #[error("chunk of transfer `{found}` given to transfer `{expected}`")]
    WrongTransfer {
        /// The transfer being assembled.
        expected: String,
        /// The chunk's transfer.
        found: String,
    },
    /// A chunk's index or count is inconsistent.
    #[error("chunk {index} of {count} does not fit a transfer of {expected_count} chunks")]
    BadChunk {
        /// The chunk's index.
        index: u32,
        /// The chunk's count.
        count: u32,
        /// Chunks the manifest announced.
        expected_count: u32,
    },
    /// The reassembled bytes do not have the manifest's digest.
    #[error("transfer `{transfer}` digest mismatch: expected {expected}, got {found}")]
    HashMismatch {
        /// The transfer.
        transfer: String,
        /// Digest announced, hex.
        expected: String,
        /// Digest of the bytes received, hex.
        found: String,
    },
    /// A spool file could not be written or read back.
    #[error("spool file {path}: {reason}")]
    Spool {
        /// The file.
        path: String,
        /// What failed.
        reason: String,
    },
    /// The memory for a transfer within the limits could not be reserved.
    #[error("transfer `{transfer}`: cannot reserve {bytes} bytes of memory")]
    OutOfMemory {
        /// The transfer.
        transfer: String,
        /// What it needed.
        bytes: u64,
    },
    /// A field is out of its allowed range.
    #[error("invalid field `{field}`: {reason}")]
    InvalidField {
        /// The field.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
}

/// Shorthand for results in this crate.
pub type Result<T> = std::result::Result<T, WireError>;
