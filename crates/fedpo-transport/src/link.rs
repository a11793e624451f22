//! One MQTT connection that survives broker restarts.
//!
//! A background thread drives rumqttc's event loop. After every ConnAck it resubscribes
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

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rumqttc::{Client, LastWill, MqttOptions, QoS, Transport};

use crate::error::{Result, TransportError};
use crate::outbox::Outbox;
use crate::url::{BrokerUrl, Scheme, TlsFiles};
use crate::MAX_PACKET_BYTES;

mod driver;

use driver::{drive, open, DriveLimits};

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

/// The broker session publishes go to.
struct Session {
    client: Client,
    /// Counts sessions, so that a restore outlived by its session gives up.
    id: u64,
    /// Whether the outbox was replayed into this session, so new publishes may follow it.
    ready: bool,
}

struct Shared {
    outbox: Mutex<Outbox>,
    acked: Condvar,
    subscriptions: Mutex<Vec<String>>,
    /// The current session. Its lock also serialises publishers, so the outbox order is
    /// the client's request order.
    session: Mutex<Session>,
    /// The current session's client for subscribing and disconnecting, which must not
    /// wait behind a publisher blocked on a full request queue.
    control: Mutex<Client>,
    connected: AtomicBool,
    stop: AtomicBool,
    /// The latest connection error, for [`TransportError::ConnectTimeout`].
    last_error: Mutex<String>,
    /// Payload bytes on the events channel, and the signal that some were taken.
    inbound: Mutex<usize>,
    taken: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere must not take the connection down with it.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A reconnecting QoS 1 MQTT connection.
pub struct MqttLink {
    shared: Arc<Shared>,
    events: Receiver<LinkEvent>,
    broker: String,
    thread: Option<JoinHandle<()>>,
    /// Disconnects when the event-loop thread returns.
    exited: Receiver<()>,
}

/// How long closing a link waits for its event loop to wind down. A connect attempt in
/// progress does not end early: against a broker that accepts TCP but never answers it
/// runs for the whole `connection_timeout` (60 s by default). Past this grace the thread
/// is left to exit on its own, which it does at its next event, `stop` being set.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

fn read_file(what: &'static str, path: &std::path::Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| TransportError::TlsFile { what, path: path.display().to_string(), source })
}

fn mqtt_options(url: &BrokerUrl, opts: &LinkOptions) -> Result<MqttOptions> {
    let mut o = MqttOptions::new(opts.client_id.clone(), url.host.clone(), url.port);
    o.set_keep_alive(opts.keep_alive)
        .set_max_packet_size(MAX_PACKET_BYTES, MAX_PACKET_BYTES)
        .set_clean_session(true)
        .set_inflight(64)
        .set_request_channel_capacity(16);
    if let Some(user) = &url.username {
        o.set_credentials(user.clone(), url.password.clone().unwrap_or_default());
    }
    if let Some((topic, payload)) = &opts.last_will {
        o.set_last_will(LastWill::new(topic.clone(), payload.clone(), QoS::AtLeastOnce, false));
    }
    if url.scheme == Scheme::Mqtts {
        // rustls needs a process-wide crypto provider; installing twice is harmless.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client_auth = match (&opts.tls.cert, &opts.tls.key) {
            (Some(c), Some(k)) => Some((read_file("client certificate", c)?, read_file("client key", k)?)),
            (None, None) => None,
            _ => {
                return Err(TransportError::BadUrl {
                    url: url.to_string(),
                    reason: "a client certificate needs its key, and a key its certificate".into(),
                })
            }
        };
        let transport = match &opts.tls.ca {
            Some(ca) => Transport::tls(read_file("CA certificate", ca)?, client_auth, None),
            None if client_auth.is_none() => Transport::tls_with_default_config(),
            None => {
                return Err(TransportError::BadUrl {
                    url: url.to_string(),
                    reason: "mutual TLS needs the CA certificate (--ca) as well".into(),
                })
            }
        };
        o.set_transport(transport);
    }
    Ok(o)
}

impl MqttLink {
    /// Connects and waits for the first ConnAck (up to `opts.connect_wait`).
    pub fn connect(url: &BrokerUrl, opts: &LinkOptions) -> Result<Self> {
        let options = mqtt_options(url, opts)?;
        let connection_timeout = opts.connection_timeout.as_secs().max(1);
        let (client, connection) = open(&options, connection_timeout);
        let shared = Arc::new(Shared {
            outbox: Mutex::new(Outbox::default()),
            acked: Condvar::new(),
            subscriptions: Mutex::new(Vec::new()),
            session: Mutex::new(Session { client: client.clone(), id: 0, ready: true }),
            control: Mutex::new(client),
            connected: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            last_error: Mutex::new("no answer".into()),
            inbound: Mutex::new(0),
            taken: Condvar::new(),
        });
        let (tx, events) = mpsc::channel();
        let (first_tx, first_rx) = mpsc::channel();
        let (exited_tx, exited) = mpsc::channel();
        let thread = {
            let shared = shared.clone();
            let limits = DriveLimits {
                options,
                connection_timeout,
                max_backoff: opts.max_backoff,
                inbound_budget: opts.inbound_budget,
            };
            let name = format!("mqtt-{}", opts.client_id);
            std::thread::Builder::new()
                .name(name)
                .spawn(move || {
                    drive(connection, shared, tx, first_tx, limits);
                    drop(exited_tx);
                })
                .map_err(|e| TransportError::Closed { broker: format!("{url}: {e}") })?
        };
        let link = Self { shared, events, broker: url.to_string(), thread: Some(thread), exited };
        match first_rx.recv_timeout(opts.connect_wait) {
            Ok(()) => Ok(link),
            Err(_) => Err(TransportError::ConnectTimeout {
                broker: url.to_string(),
                seconds: opts.connect_wait.as_secs(),
                last_error: lock(&link.shared.last_error).clone(),
            }),
        }
    }

    /// Subscribes at QoS 1 now and after every reconnect.
    pub fn subscribe(&self, filter: &str) -> Result<()> {
        // Listed before it is sent: a session that replaces this client after the send
        // restores it from the list.
        lock(&self.shared.subscriptions).push(filter.to_string());
        let client = lock(&self.shared.control).clone();
        if client.subscribe(filter, QoS::AtLeastOnce).is_err() && self.shared.stop.load(Ordering::SeqCst) {
            return Err(self.closed());
        }
        Ok(())
    }

    /// Publishes at QoS 1; the payload is kept until the broker acknowledges it. Blocks
    /// while rumqttc's request queue is full, which paces large transfers.
    pub fn publish(&self, topic: &str, payload: Vec<u8>) -> Result<()> {
        if payload.len() + topic.len() + 16 > MAX_PACKET_BYTES {
            return Err(TransportError::PacketTooLarge {
                topic: topic.to_string(),
                size: payload.len(),
                max: MAX_PACKET_BYTES,
            });
        }
        if self.shared.stop.load(Ordering::SeqCst) {
            return Err(self.closed());
        }
        let session = lock(&self.shared.session);
        if !session.ready {
            // The outbox is still being replayed into a new session (or none is up): this
            // publish goes after it, in order.
            lock(&self.shared.outbox).parked(topic, &payload);
            return Ok(());
        }
        lock(&self.shared.outbox).queued(topic, &payload);
        // Wake a background thread paused by the inbound budget: this publish needs the
        // event loop.
        self.shared.taken.notify_all();
        // A refused request means its session just ended; the outbox holds the publish for
        // the next one.
        if session.client.publish(topic, QoS::AtLeastOnce, false, payload).is_err()
            && self.shared.stop.load(Ordering::SeqCst)
        {
            return Err(self.closed());
        }
        Ok(())
    }

    /// The next event, waiting up to `timeout`; `Ok(None)` on timeout.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Option<LinkEvent>> {
        match self.events.recv_timeout(timeout) {
            Ok(e) => {
                if let LinkEvent::Message(d) = &e {
                    let mut inbound = lock(&self.shared.inbound);
                    *inbound = inbound.saturating_sub(d.payload.len());
                    self.shared.taken.notify_all();
                }
                Ok(Some(e))
            }
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(self.closed()),
        }
    }

    /// Waits until the broker has acknowledged every publish, up to `timeout`. Returns
    /// whether it did.
    pub fn flush(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut outbox = lock(&self.shared.outbox);
        while !outbox.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            outbox = self.shared.acked.wait_timeout(outbox, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        true
    }

    /// Payload bytes received and not yet taken.
    pub fn inbound_bytes(&self) -> usize {
        *lock(&self.shared.inbound)
    }

    /// Whether the link is connected right now.
    pub fn is_connected(&self) -> bool {
        self.shared.connected.load(Ordering::SeqCst)
    }

    /// Publishes not yet acknowledged.
    pub fn unacked(&self) -> usize {
        lock(&self.shared.outbox).len()
    }

    /// The broker, for messages.
    pub fn broker(&self) -> &str {
        &self.broker
    }

    /// Flushes for up to `linger`, then disconnects cleanly (no last will).
    pub fn close(mut self, linger: Duration) {
        self.flush(linger);
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let _ = lock(&self.shared.control).try_disconnect();
        if let Some(t) = self.thread.take() {
            match self.exited.recv_timeout(SHUTDOWN_GRACE) {
                Err(RecvTimeoutError::Timeout) => {
                    tracing::debug!(broker = %self.broker, "MQTT event loop busy in a connect attempt; not waiting for it");
                }
                _ => {
                    let _ = t.join();
                }
            }
        }
    }

    fn closed(&self) -> TransportError {
        TransportError::Closed { broker: self.broker.clone() }
    }
}

impl Drop for MqttLink {
    fn drop(&mut self) {
        self.shutdown();
    }
}
