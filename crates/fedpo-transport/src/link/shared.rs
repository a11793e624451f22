//! What a connection's caller and its background thread share: the session publishes go
//! to, the outbox, the subscriptions and the signals between them.

use std::sync::atomic::AtomicBool;
use std::sync::{Condvar, Mutex, MutexGuard};

use rumqttc::Client;

use crate::outbox::Outbox;

/// The broker session publishes go to.
pub(super) struct Session {
    pub(super) client: Client,
    /// Counts sessions, so that a restore outlived by its session gives up.
    pub(super) id: u64,
    /// Whether the outbox was replayed into this session, so new publishes may follow it.
    pub(super) ready: bool,
}

pub(super) struct Shared {
    pub(super) outbox: Mutex<Outbox>,
    pub(super) acked: Condvar,
    pub(super) subscriptions: Mutex<Vec<String>>,
    /// The current session. Its lock also serialises publishers, so the outbox order is
    /// the client's request order.
    pub(super) session: Mutex<Session>,
    /// The current session's client for subscribing and disconnecting, which must not
    /// wait behind a publisher blocked on a full request queue.
    pub(super) control: Mutex<Client>,
    pub(super) connected: AtomicBool,
    pub(super) stop: AtomicBool,
    /// The latest connection error, for [`TransportError::ConnectTimeout`].
    pub(super) last_error: Mutex<String>,
    /// Payload bytes on the events channel, and the signal that some were taken.
    pub(super) inbound: Mutex<usize>,
    pub(super) taken: Condvar,
    /// SubAcks received, and the signal that one came.
    pub(super) subacks: Mutex<u64>,
    pub(super) subscribed: Condvar,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere must not take the connection down with it.
    m.lock().unwrap_or_else(|e| e.into_inner())
}
