//! fedpo's in-process MQTT 3.1.1 broker: the one `simulate` uses by default, and the one
//! `serve --embedded-broker` runs, so a fleet needs nothing installed.
//!
//! It is small and made for fedpo's traffic rather than general use:
//! - **Memory bounded by limits, not by traffic.** Each client has an outgoing queue
//!   bounded in bytes ([`BrokerLimits::queue_bytes`], raised to one whole transfer by
//!   [`EmbeddedBroker::fit_transfer`]). A publish is read only when every subscriber's
//!   queue has room for it, so a fast publisher is slowed down by TCP instead of being
//!   buffered, and a payload is stored once however many subscribers it goes to, and
//!   freed as soon as the last of them has been written it. A subscriber that makes no
//!   room for [`BrokerLimits::stall`] is disconnected.
//! - **No retained messages**: a retained publish is delivered once, like any other, and
//!   never stored. fedpo does not use them.
//! - **QoS 0 and 1**: subscriptions are granted at most QoS 1; a QoS 2 publish is
//!   acknowledged and delivered at QoS 1.
//! - **Clean sessions only**: nothing is kept for a client that has gone.
//! - **Logins and access rules** ([`access`]): without logins the broker is open, so it
//!   listens on loopback only; with logins every client must log in, a device publishes
//!   only on its own uplink and reads only downlinks, and sessions are kept apart per
//!   user, so no device can take over or squat another's client id.
//!
//! The layout follows rumqttc's: [`router`] decides, [`session`] does the I/O.

mod access;
mod frames;
mod passwords;
mod queue;
mod router;
mod session;

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

pub use passwords::read_password_file;

use crate::error::{Result, TransportError};
use crate::throttle::WarnThrottle;
use crate::url::{BrokerUrl, Scheme};
use crate::MAX_PACKET_BYTES;
use access::Access;
use router::Router;
use session::Client;

/// What the embedded broker holds at most.
#[derive(Debug, Clone)]
pub struct BrokerLimits {
    /// Connections at once; further clients are refused. A device uses two.
    pub max_connections: usize,
    /// The largest packet a client may send.
    pub max_packet_bytes: usize,
    /// Bytes waiting to be written to one client before its publishers are held. The
    /// payloads are shared between queues, so a broadcast to every device costs one copy.
    pub queue_bytes: usize,
    /// How long a publisher is held by one subscriber's full queue before that
    /// subscriber is disconnected.
    pub stall: Duration,
    /// How long a new connection has to send its CONNECT.
    pub connect_timeout: Duration,
}

impl Default for BrokerLimits {
    fn default() -> Self {
        Self {
            max_connections: 2 * 10_000 + 100,
            max_packet_bytes: MAX_PACKET_BYTES,
            queue_bytes: 4 * MAX_PACKET_BYTES,
            stall: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// How the embedded broker is set up.
#[derive(Debug, Clone, Default)]
pub struct BrokerConfig {
    /// User name → password, as [`read_password_file`] reads them; `None` lets anyone in
    /// and is refused beyond loopback.
    pub logins: Option<HashMap<String, String>>,
    /// The one user (listed in `logins`) with every right: the aggregator. Every other
    /// user is a device.
    pub admin: Option<String>,
    pub limits: BrokerLimits,
}

/// What every connection of one broker shares.
#[derive(Debug)]
struct Shared {
    router: Mutex<Router<Arc<Client>>>,
    access: Access,
    limits: BrokerLimits,
    /// Every client queue's limit in bytes; see [`EmbeddedBroker::fit_transfer`].
    queue_limit: Arc<AtomicUsize>,
    throttle: Mutex<WarnThrottle>,
    /// Sockets accepted and not yet closed.
    open: AtomicUsize,
}

impl Shared {
    fn router(&self) -> MutexGuard<'_, Router<Arc<Client>>> {
        self.router.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A warning about what a client did, at most one per client and kind every 10 s.
    fn warn(&self, client: &str, kind: &'static str, message: &str) {
        let allowed = self.throttle.lock().unwrap_or_else(|e| e.into_inner()).allow(client, kind);
        if let Some(held_back) = allowed {
            tracing::warn!(client, held_back, "{message}");
        }
    }
}

/// A running in-process broker. It lives until the process exits, which is fine for a
/// simulation, a test or an aggregator that hosts it.
#[derive(Debug, Clone)]
pub struct EmbeddedBroker {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl EmbeddedBroker {
    /// Starts an open broker listening on `addr` (loopback only). Port 0 picks a free
    /// port (see [`EmbeddedBroker::addr`]).
    pub fn start(addr: SocketAddr) -> Result<Self> {
        Self::start_with(addr, BrokerConfig::default())
    }

    /// Starts a broker on a free loopback port.
    pub fn start_on_free_port() -> Result<Self> {
        Self::start(SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// Starts a broker on `addr` as `config` says; it accepts connections on return.
    pub fn start_with(addr: SocketAddr, config: BrokerConfig) -> Result<Self> {
        let err = |reason: String| TransportError::Broker { addr: addr.to_string(), reason };
        if config.logins.is_none() && !addr.ip().is_loopback() {
            return Err(err(
                "the embedded broker has no credentials, so it listens on loopback only (127.0.0.1 or ::1); \
                 give it a password file to listen beyond this machine"
                    .into(),
            ));
        }
        if config.logins.as_ref().is_some_and(HashMap::is_empty) {
            return Err(err("the password file lists no user: no client could log in".into()));
        }
        if let Some(admin) = &config.admin {
            if !config.logins.as_ref().is_some_and(|l| l.contains_key(admin)) {
                return Err(err(format!("the administrator `{admin}` has no login")));
            }
        }
        let listener = TcpListener::bind(addr).map_err(|e| err(format!("cannot listen: {e}")))?;
        let addr = listener.local_addr().map_err(|e| err(e.to_string()))?;
        listener.set_nonblocking(true).map_err(|e| err(e.to_string()))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| err(format!("cannot start its runtime: {e}")))?;
        let shared = Arc::new(Shared {
            router: Mutex::default(),
            access: Access::new(config.logins, config.admin),
            queue_limit: Arc::new(AtomicUsize::new(config.limits.queue_bytes)),
            limits: config.limits,
            throttle: Mutex::default(),
            open: AtomicUsize::new(0),
        });
        let listener = {
            let _entered = runtime.enter();
            tokio::net::TcpListener::from_std(listener).map_err(|e| err(e.to_string()))?
        };
        let serving = shared.clone();
        std::thread::Builder::new()
            .name("mqtt-broker".into())
            .spawn(move || runtime.block_on(accept(serving, listener)))
            .map_err(|e| err(e.to_string()))?;
        tracing::info!(%addr, "embedded MQTT broker listening");
        Ok(Self { addr, shared })
    }

    /// Raises every client queue's limit to hold one transfer of `bytes` whole, so a
    /// device that is slower than the rest holds up the others only once it is a whole
    /// transfer behind. Never lowers it.
    pub fn fit_transfer(&self, bytes: usize) {
        let wanted = bytes.saturating_add(self.shared.limits.max_packet_bytes);
        self.shared.queue_limit.fetch_max(wanted, Ordering::Relaxed);
    }

    /// The current per-client queue limit in bytes.
    pub fn queue_limit(&self) -> usize {
        self.shared.queue_limit.load(Ordering::Relaxed)
    }

    /// Bytes waiting in client queues or being written, over every client.
    pub fn queued_bytes(&self) -> usize {
        self.shared.router().clients().map(|c| c.queue.bytes()).sum()
    }

    /// Connections past their handshake.
    pub fn connections(&self) -> usize {
        self.shared.router().len()
    }

    /// The listen address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The URL clients connect to.
    pub fn url(&self) -> BrokerUrl {
        BrokerUrl {
            scheme: Scheme::Mqtt,
            host: self.addr.ip().to_string(),
            port: self.addr.port(),
            username: None,
            password: None,
        }
    }
}

/// Closes the count of one accepted socket when its connection ends.
struct Open(Arc<Shared>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn accept(shared: Arc<Shared>, listener: tokio::net::TcpListener) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of file descriptors, most likely: let some connections close.
                shared.warn("broker", "accept", &format!("embedded broker cannot accept: {e}"));
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Past twice the limit not even a refusal is written: the socket is just closed.
        if shared.open.fetch_add(1, Ordering::Relaxed) >= 2 * shared.limits.max_connections {
            shared.open.fetch_sub(1, Ordering::Relaxed);
            continue;
        }
        let open = Open(shared.clone());
        tokio::spawn(async move {
            session::serve(open.0.clone(), stream).await;
            drop(open);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_open_broker_is_refused_beyond_loopback() {
        let e = EmbeddedBroker::start("0.0.0.0:0".parse().unwrap()).unwrap_err().to_string();
        assert!(e.contains("loopback only") && e.contains("password file"), "{e}");
    }
}
