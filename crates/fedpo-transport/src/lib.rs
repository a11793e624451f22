//! fedpo's MQTT transport.
//!
//! - [`BrokerUrl`] parses `mqtt://` and `mqtts://` addresses and their credentials.
//! - [`Topics`] names every topic of a job, all under `fedpo/{job}/`.
//! - [`MqttLink`] is one QoS 1 connection that survives broker restarts: it reconnects
//!   with backoff, resubscribes after every ConnAck and republishes whatever the broker had
//!   not acknowledged, from its own [`Outbox`].
//! - [`EmbeddedBroker`] is fedpo's own in-process MQTT 3.1.1 broker: memory bounded by
//!   limits rather than traffic, logins, and the access rules of `security/acl`.
//! - [`WarnThrottle`] rate-limits warnings about what peers send.
//!
//! Everything here moves opaque bytes; fedpo-wire gives them meaning.

mod broker;
mod error;
mod link;
mod outbox;
mod throttle;
mod topics;
mod url;

pub use broker::{read_password_file, BrokerConfig, BrokerLimits, EmbeddedBroker};
pub use error::{Result, TransportError};
pub use link::{Delivery, LinkEvent, LinkOptions, MqttLink, UP_SUFFIX};
pub use outbox::Outbox;
pub use throttle::WarnThrottle;
pub use topics::Topics;
pub use url::{BrokerUrl, Scheme, TlsFiles};

/// Largest MQTT packet fedpo sends or accepts: a 1 MiB chunk, its CBOR envelope and the
/// topic, with room to spare. rumqttc's default (10 KiB) would drop the connection on the
/// first chunk.
pub const MAX_PACKET_BYTES: usize = 2 << 20;
