//! A client's way to the broker: two MQTT connections that survive broker restarts, one
//! for what it publishes and one for what it receives.
//!
//! Two, because rumqttc and rumqttd each stop reading a connection while a write to it
//! is blocked. On one connection, a client that publishes a large transfer while a large
//! one is delivered to it (the aggregator sending a model as updates arrive, a device
//! resending its update as the model reaches it) can end with both sides writing into full
//! buffers, each waiting for the other to read, until the write timeout drops the
//! connection and the broker discards what it had queued for it. On a connection that
//! only publishes, the broker writes nothing but acknowledgements; on one that only
//! receives, the client writes nothing but acknowledgements; neither write can block for
//! long. The last will goes with the receiving connection, whose loss is what costs
//! messages.
//!
//! Behind each connection a background thread drives rumqttc's event loop. After every ConnAck it resubscribes
//! (a clean session forgets subscriptions) and republishes the outbox; after every failure
//! it waits with exponential backoff and reconnects. Incoming publishes arrive on a
//! channel as [`LinkEvent`]s, so a device can train for minutes without the connection
//! timing out: pings keep flowing from the background thread.
//!
//! Each broker session gets a fresh rumqttc client. rumqttc's own event loop would keep
//! what it still holds from a lost session (stale write reports, requests that reached its
//! channel after the drop) and mix it with the replay, and the outbox's first-in,
//! first-out matching of packet ids to publishes would then credit an ack to the wrong
//! publish and lose one. A new client starts with an empty channel, and publishes made
//! before the new session is restored wait in the outbox.
//!
//! A receiver that consumes without pause (the aggregator) can bound that channel by
//! bytes ([`LinkOptions::inbound_budget`]): when it is full the background thread stops
//! reading, TCP pushes back, and the broker holds what a thousand uploading devices send
//! instead of this process's memory.

use std::time::Duration;

use bytes::Bytes;

use crate::error::Result;
use crate::url::{BrokerUrl, TlsFiles};

mod connection;
mod driver;
mod shared;

use connection::Connection;

/// A message received on a subscribed topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    /// The topic it was published on.
    pub topic: String,
    /// Its bytes, as the client received them (no copy is made on the way to the caller).
    pub payload: Bytes,
}

/// What the link reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkEvent {
    /// Connected (again); subscriptions and unacknowledged publishes are being restored.
    Connected,
    /// The connection dropped; the link is reconnecting.
    Disconnected(String),
    /// A message arrived.
    Message(Delivery),
}

/// Connection settings beyond the URL.
#[derive(Debug, Clone)]
pub struct LinkOptions {
    /// MQTT client id; the broker allows one connection per id.
    pub client_id: String,
    /// Published by the broker if this client vanishes: (topic, payload).
    pub last_will: Option<(String, Vec<u8>)>,
    /// TLS files for `mqtts://`.
    pub tls: TlsFiles,
    /// Every packet write must finish within this, or rumqttc drops the connection. Sized
    /// for a 1 MiB chunk on a slow link, not rumqttc's 5 s default.
    pub connection_timeout: Duration,
    /// MQTT keep-alive.
    pub keep_alive: Duration,
    /// How long [`MqttLink::connect`] waits for the first ConnAck.
    pub connect_wait: Duration,
    /// Longest wait between reconnect attempts.
    pub max_backoff: Duration,
    /// Most payload bytes received but not yet taken by [`MqttLink::recv_timeout`]; past
    /// it the link stops reading from the broker until the receiver catches up, except
    /// while a publish of its own waits to be written. `None`:
    /// unbounded, for a receiver that may pause for long (a device training), since a
    /// link that stops reading also stops its keep-alive pings.
    pub inbound_budget: Option<usize>,
}

impl LinkOptions {
    /// Defaults for a client id.
    pub fn new(client_id: impl Into<String>) -> Self {
        Self {
            client_id: client_id.into(),
            last_will: None,
            tls: TlsFiles::default(),
            connection_timeout: Duration::from_secs(60),
            keep_alive: Duration::from_secs(30),
            connect_wait: Duration::from_secs(30),
            max_backoff: Duration::from_secs(10),
            inbound_budget: None,
        }
    }
}

/// Appended to a link's client id for its publishing connection.
pub const UP_SUFFIX: &str = ".up";

/// A reconnecting QoS 1 MQTT client: publishes go out on one connection, subscriptions
/// come in on another (see the module documentation for why).
pub struct MqttLink {
    /// Subscriptions, deliveries and the last will.
    down: Connection,
    /// Publishes.
    up: Connection,
}

impl MqttLink {
    /// Connects both connections, each waiting for its first ConnAck (up to
    /// `opts.connect_wait`). The publishing one's client id is `opts.client_id` + `.up`
    /// (MQTT brokers refuse `/` in client ids).
    pub fn connect(url: &BrokerUrl, opts: &LinkOptions) -> Result<Self> {
        let down = Connection::connect(url, opts)?;
        let up_opts = LinkOptions {
            client_id: format!("{}{UP_SUFFIX}", opts.client_id),
            last_will: None,
            inbound_budget: None,
            ..opts.clone()
        };
        let up = Connection::connect(url, &up_opts)?;
        Ok(Self { down, up })
    }

    /// Subscribes at QoS 1 now and after every reconnect. Returns once the broker has
    /// acknowledged it (or after 10 s), so that replies to what is published next arrive.
    pub fn subscribe(&self, filter: &str) -> Result<()> {
        self.down.subscribe(filter)
    }

    /// Publishes at QoS 1; the payload is kept until the broker acknowledges it. Blocks
    /// while rumqttc's request queue is full, which paces large transfers.
    pub fn publish(&self, topic: &str, payload: Vec<u8>) -> Result<()> {
        self.up.publish(topic, payload)
    }

    /// The next event of the receiving connection, waiting up to `timeout`; `Ok(None)` on
    /// timeout. The publishing connection's reconnects are not reported: its outbox
    /// republishes what was not acknowledged, so nothing is lost with it.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Option<LinkEvent>> {
        while let Ok(Some(event)) = self.up.recv_timeout(Duration::ZERO) {
            tracing::debug!(?event, "publishing connection");
        }
        self.down.recv_timeout(timeout)
    }

    /// Waits until the broker has acknowledged every publish, up to `timeout`. Returns
    /// whether it did.
    pub fn flush(&self, timeout: Duration) -> bool {
        self.up.flush(timeout)
    }

    /// Payload bytes received and not yet taken.
    pub fn inbound_bytes(&self) -> usize {
        self.down.inbound_bytes()
    }

    /// Whether both connections are up right now.
    pub fn is_connected(&self) -> bool {
        self.down.is_connected() && self.up.is_connected()
    }

    /// Publishes not yet acknowledged.
    pub fn unacked(&self) -> usize {
        self.up.unacked()
    }

    /// The broker, for messages.
    pub fn broker(&self) -> &str {
        self.down.broker()
    }

    /// Flushes for up to `linger`, then disconnects both cleanly (no last will).
    pub fn close(self, linger: Duration) {
        self.up.close(linger);
        self.down.close(Duration::ZERO);
    }
}
