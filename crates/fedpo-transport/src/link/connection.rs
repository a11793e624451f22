//! One MQTT connection that survives broker restarts: rumqttc's client and event loop
//! behind a background thread, the outbox, and the inbound budget. [`MqttLink`] uses one
//! each way.
//!
//! [`MqttLink`]: super::MqttLink

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rumqttc::{LastWill, MqttOptions, QoS, Transport};

use super::driver::{drive, open, DriveLimits};
use super::shared::{lock, Session, Shared};
use super::{LinkEvent, LinkOptions};
use crate::error::{Result, TransportError};
use crate::outbox::Outbox;
use crate::url::{BrokerUrl, Scheme};
use crate::MAX_PACKET_BYTES;

/// A reconnecting QoS 1 MQTT connection.
pub(super) struct Connection {
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

/// How long [`Connection::subscribe`] waits for the broker's SubAck.
const SUBACK_WAIT: Duration = Duration::from_secs(10);

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

impl Connection {
    /// Connects and waits for the first ConnAck (up to `opts.connect_wait`).
    pub(super) fn connect(url: &BrokerUrl, opts: &LinkOptions) -> Result<Self> {
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
            subacks: Mutex::new(0),
            subscribed: Condvar::new(),
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
    pub(super) fn subscribe(&self, filter: &str) -> Result<()> {
        // Listed before it is sent: a session that replaces this client after the send
        // restores it from the list.
        lock(&self.shared.subscriptions).push(filter.to_string());
        let before = *lock(&self.shared.subacks);
        let client = lock(&self.shared.control).clone();
        if client.subscribe(filter, QoS::AtLeastOnce).is_err() && self.shared.stop.load(Ordering::SeqCst) {
            return Err(self.closed());
        }
        // Once the broker has it, messages published after this returns reach us, even
        // when they are a reply to something sent on another connection.
        let deadline = Instant::now() + SUBACK_WAIT;
        let mut subacks = lock(&self.shared.subacks);
        while *subacks == before && !self.shared.stop.load(Ordering::SeqCst) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break; // a reconnect will subscribe again; nothing waits on it here
            }
            subacks = self.shared.subscribed.wait_timeout(subacks, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        Ok(())
    }

    /// Publishes at QoS 1; the payload is kept until the broker acknowledges it. Blocks
    /// while rumqttc's request queue is full, which paces large transfers.
    pub(super) fn publish(&self, topic: &str, payload: Vec<u8>) -> Result<()> {
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
    pub(super) fn recv_timeout(&self, timeout: Duration) -> Result<Option<LinkEvent>> {
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
    pub(super) fn flush(&self, timeout: Duration) -> bool {
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
    pub(super) fn inbound_bytes(&self) -> usize {
        *lock(&self.shared.inbound)
    }

    /// Whether the link is connected right now.
    pub(super) fn is_connected(&self) -> bool {
        self.shared.connected.load(Ordering::SeqCst)
    }

    /// Publishes not yet acknowledged.
    pub(super) fn unacked(&self) -> usize {
        lock(&self.shared.outbox).len()
    }

    /// The broker, for messages.
    pub(super) fn broker(&self) -> &str {
        &self.broker
    }

    /// Flushes for up to `linger`, then disconnects cleanly (no last will).
    pub(super) fn close(mut self, linger: Duration) {
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

impl Drop for Connection {
    fn drop(&mut self) {
        self.shutdown();
    }
}
