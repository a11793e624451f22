//! The background thread behind a [`Connection`](super::connection::Connection): rumqttc's event loop,
//! a fresh client for each broker session, the replay of the outbox after every ConnAck,
//! backoff between attempts, and the inbound byte budget.

use std::sync::atomic::Ordering;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rumqttc::{Client, Connection, Event, MqttOptions, Outgoing, Packet, QoS};

use super::shared::{lock, Shared};
use super::{Delivery, LinkEvent};

pub(super) struct DriveLimits {
    /// For the fresh client each new session gets.
    pub(super) options: MqttOptions,
    pub(super) connection_timeout: u64,
    pub(super) max_backoff: Duration,
    pub(super) inbound_budget: Option<usize>,
}

/// Waits, with the event loop paused, until `len` more bytes fit the budget (a message
/// larger than the whole budget passes alone). It never waits while a publish of ours is
/// still to be written: that needs the loop, and a caller blocked in
/// `publish` would otherwise never come back to take what is queued.
fn admit(shared: &Shared, len: usize, budget: Option<usize>) {
    let mut inbound = lock(&shared.inbound);
    if let Some(budget) = budget {
        while *inbound > 0
            && *inbound + len > budget
            && !lock(&shared.outbox).has_unwritten()
            && !shared.stop.load(Ordering::SeqCst)
        {
            inbound =
                shared.taken.wait_timeout(inbound, Duration::from_millis(50)).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
    *inbound += len;
}

/// A client and its event loop, with fedpo's write timeout.
pub(super) fn open(options: &MqttOptions, connection_timeout: u64) -> (Client, Connection) {
    let (client, mut connection) = Client::new(options.clone(), 16);
    let mut network = connection.eventloop.network_options();
    network.set_connection_timeout(connection_timeout);
    connection.eventloop.set_network_options(network);
    (client, connection)
}

/// Ends a session that had connected: drops its event loop (a publisher blocked on its
/// full queue returns at once), parks everything the outbox gave it, and installs a fresh
/// client that nothing is published to until the outbox is replayed.
/// Returns the new event loop and the session's id.
fn next_session(old: Connection, shared: &Shared, limits: &DriveLimits) -> (Connection, u64) {
    drop(old);
    let (client, connection) = open(&limits.options, limits.connection_timeout);
    let mut session = lock(&shared.session);
    lock(&shared.outbox).session_ended();
    *lock(&shared.control) = client.clone();
    session.client = client;
    session.id += 1;
    session.ready = false;
    (connection, session.id)
}

/// The background thread: rumqttc's event loop plus fedpo's reconnect policy.
pub(super) fn drive(
    mut connection: Connection,
    shared: Arc<Shared>,
    tx: Sender<LinkEvent>,
    first: Sender<()>,
    limits: DriveLimits,
) {
    let mut backoff = Duration::from_millis(100);
    let mut first = Some(first);
    let mut connect_failures = 0u32;
    // Kept here rather than read under the session lock, which a publisher blocked on
    // this loop's full queue may hold.
    let mut session_id = 0u64;
    while let Ok(notification) = connection.recv() {
        if shared.stop.load(Ordering::SeqCst) {
            if matches!(notification, Ok(Event::Incoming(Packet::ConnAck(_)))) {
                say_goodbye(&mut connection, &shared);
            }
            break;
        }
        match notification {
            Ok(Event::Incoming(Packet::ConnAck(_))) => {
                shared.connected.store(true, Ordering::SeqCst);
                backoff = Duration::from_millis(100);
                connect_failures = 0;
                restore(shared.clone(), session_id);
                if let Some(f) = first.take() {
                    let _ = f.send(());
                }
                let _ = tx.send(LinkEvent::Connected);
            }
            Ok(Event::Incoming(Packet::Publish(p))) => {
                admit(&shared, p.payload.len(), limits.inbound_budget);
                let _ = tx.send(LinkEvent::Message(Delivery { topic: p.topic, payload: p.payload }));
            }
            Ok(Event::Incoming(Packet::PubAck(ack))) => {
                lock(&shared.outbox).acked(ack.pkid);
                shared.acked.notify_all();
            }
            Ok(Event::Outgoing(Outgoing::Publish(pkid))) => lock(&shared.outbox).sent(pkid),
            Ok(Event::Incoming(Packet::SubAck(_))) => {
                *lock(&shared.subacks) += 1;
                shared.subscribed.notify_all();
            }
            Ok(_) => {}
            Err(e) => {
                if shared.stop.load(Ordering::SeqCst) {
                    break;
                }
                let reason = e.to_string();
                if shared.connected.swap(false, Ordering::SeqCst) {
                    tracing::warn!(error = %reason, "MQTT connection lost; reconnecting");
                    let _ = tx.send(LinkEvent::Disconnected(reason.clone()));
                    (connection, session_id) = next_session(connection, &shared, &limits);
                } else {
                    // A failed connect loses nothing: the client's queue waits for the
                    // next attempt.
                    connect_failures += 1;
                    if connect_failures == 1 || connect_failures.is_power_of_two() {
                        tracing::debug!(error = %reason, attempt = connect_failures, "MQTT connect failed");
                    }
                }
                *lock(&shared.last_error) = reason;
                sleep_unless_stopped(&shared, backoff);
                backoff = (backoff * 2).min(limits.max_backoff);
            }
        }
    }
    shared.connected.store(false, Ordering::SeqCst);
    // Publishers and subscribers now get `Closed` instead of queueing for nobody.
    shared.stop.store(true, Ordering::SeqCst);
}

/// A session that came up after the link was closed (a connect attempt the close did not
/// wait for): sends it a DISCONNECT, so that the broker ends it cleanly rather than
/// publishing the last will of a client that may by now be connected again elsewhere.
fn say_goodbye(connection: &mut Connection, shared: &Shared) {
    let _ = lock(&shared.control).try_disconnect();
    for _ in 0..8 {
        match connection.recv_timeout(Duration::from_millis(500)) {
            Ok(Ok(Event::Outgoing(Outgoing::Disconnect))) | Ok(Err(_)) | Err(_) => return,
            Ok(Ok(_)) => {}
        }
    }
}

/// Sleeps for `pause`, or less once the link is closing.
fn sleep_unless_stopped(shared: &Shared, pause: Duration) {
    let end = Instant::now() + pause;
    while !shared.stop.load(Ordering::SeqCst) {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        std::thread::sleep(left.min(Duration::from_millis(50)));
    }
}

/// After a ConnAck: resubscribe, then republish what the outbox parked, then let new
/// publishes through. Runs on its own thread because both block on rumqttc's request
/// queue, which only the event-loop thread drains.
fn restore(shared: Arc<Shared>, session_id: u64) {
    let spawned = std::thread::Builder::new().name("mqtt-restore".into()).spawn(move || {
        // The control handle, not the session lock, which a blocked publisher may hold.
        // Should the session already be gone, subscribing on its successor is harmless.
        let client = lock(&shared.control).clone();
        let filters = lock(&shared.subscriptions).clone();
        for f in filters {
            if client.subscribe(f, QoS::AtLeastOnce).is_err() {
                return;
            }
        }
        let mut session = lock(&shared.session);
        if session.id != session_id {
            return; // that session is gone; the next one restores
        }
        let replay = lock(&shared.outbox).take_parked();
        if !replay.is_empty() {
            tracing::info!(publishes = replay.len(), "republishing unacknowledged messages after reconnect");
        }
        let mut replay = replay.into_iter();
        while let Some(p) = replay.next() {
            let (topic, payload) = (p.topic.clone(), p.payload.clone());
            lock(&shared.outbox).requeue(p);
            if session.client.publish(topic, QoS::AtLeastOnce, false, payload).is_err() {
                lock(&shared.outbox).repark(replay);
                return;
            }
        }
        session.ready = true;
    });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot restore MQTT subscriptions");
    }
}
