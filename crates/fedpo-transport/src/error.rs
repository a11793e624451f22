//! Transport errors.

use thiserror::Error;

/// Result alias for the transport.
pub type Result<T> = std::result::Result<T, TransportError>;

/// What can go wrong talking to a broker.
#[derive(Debug, Error)]
pub enum TransportError {
    /// The broker address could not be understood.
    #[error("invalid broker URL `{url}`: {reason}")]
    BadUrl {
        /// The address as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A TLS file could not be read.
    #[error("cannot read {what} `{path}`: {source}")]
    TlsFile {
        /// CA, certificate or key.
        what: &'static str,
        /// The path.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The link is closed, e.g. after [`crate::MqttLink::close`].
    #[error("MQTT link to {broker} is closed")]
    Closed {
        /// The broker's address.
        broker: String,
    },
    /// No connection could be made in time.
    #[error("could not connect to MQTT broker {broker} within {seconds} s: {last_error}")]
    ConnectTimeout {
        /// The broker's address.
        broker: String,
        /// How long we tried.
        seconds: u64,
        /// The last failure seen.
        last_error: String,
    },
    /// A payload is larger than any broker would accept from us.
    #[error("payload of {size} bytes on `{topic}` exceeds the packet limit of {max} bytes")]
    PacketTooLarge {
        /// The topic.
        topic: String,
        /// Payload size.
        size: usize,
        /// The limit.
        max: usize,
    },
    /// A password file that cannot be used.
    #[error("credentials: {0}")]
    Credentials(String),
    /// The embedded broker failed to start.
    #[error("embedded MQTT broker on {addr}: {reason}")]
    Broker {
        /// Listen address.
        addr: String,
        /// What failed.
        reason: String,
    },
}
