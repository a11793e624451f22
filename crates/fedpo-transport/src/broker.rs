//! rumqttd in-process: the broker `simulate` uses by default, so a fleet runs on a fresh
//! machine with nothing installed.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use rumqttd::{Broker, Config, ConnectionSettings, RouterConfig, ServerSettings};

use crate::error::{Result, TransportError};
use crate::url::{BrokerUrl, Scheme};
use crate::MAX_PACKET_BYTES;

/// A running in-process MQTT 3.1.1 broker. It lives until the process exits: rumqttd has
/// no shutdown, which is fine for a simulation or a test.
#[derive(Debug, Clone)]
pub struct EmbeddedBroker {
    addr: SocketAddr,
}

fn config(addr: SocketAddr) -> Config {
    let connections = ConnectionSettings {
        connection_timeout_ms: 60_000,
        max_payload_size: MAX_PACKET_BYTES,
        max_inflight_count: 256,
        auth: None,
        external_auth: None,
        dynamic_filters: true,
    };
    let server =
        ServerSettings { name: "fedpo-v4".into(), listen: addr, tls: None, next_connection_delay_ms: 1, connections };
    Config {
        router: RouterConfig {
            max_connections: 10_010,
            max_outgoing_packet_count: 200,
            // rumqttd keeps one log per subscription filter, so the aggregator's `up/#`
            // holds every device's uploads together; past 32 segments of 64 MiB the oldest
            // is dropped, unread or not. 2 GiB of lag covers six DistilGPT-2 updates in
            // f32 (328 MB each) sent at once; with 8 segments, two such uploads at once
            // lost chunks and stalled the round. Segments hold only what is queued.
            max_segment_size: 64 << 20,
            max_segment_count: 32,
            ..RouterConfig::default()
        },
        v4: Some(HashMap::from([("1".to_string(), server)])),
        ..Config::default()
    }
}

/// A port the OS says is free on `addr`'s interface.
fn free_port(addr: SocketAddr) -> Result<SocketAddr> {
    let err = |e: std::io::Error| TransportError::Broker { addr: addr.to_string(), reason: e.to_string() };
    let probe = TcpListener::bind(addr).map_err(err)?;
    probe.local_addr().map_err(err)
}

impl EmbeddedBroker {
    /// Starts a broker listening on `addr` and waits until it accepts connections. Port 0
    /// picks a free port (see [`EmbeddedBroker::addr`]).
    pub fn start(addr: SocketAddr) -> Result<Self> {
        let addr = if addr.port() == 0 { free_port(addr)? } else { addr };
        let err = |reason: String| TransportError::Broker { addr: addr.to_string(), reason };
        // rumqttd only logs a failed bind from its own thread; check first so the user
        // sees why.
        drop(TcpListener::bind(addr).map_err(|e| err(format!("cannot listen: {e}")))?);
        let cfg = config(addr);
        std::thread::Builder::new()
            .name("mqtt-broker".into())
            .spawn(move || {
                if let Err(e) = Broker::new(cfg).start() {
                    tracing::error!(error = %e, "embedded MQTT broker stopped");
                }
            })
            .map_err(|e| err(e.to_string()))?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            if Instant::now() > deadline {
                return Err(err("not accepting connections after 10 s".into()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        tracing::info!(%addr, "embedded MQTT broker listening");
        Ok(Self { addr })
    }

    /// Starts a broker on a free loopback port.
    pub fn start_on_free_port() -> Result<Self> {
        let probe = TcpListener::bind("127.0.0.1:0")
            .map_err(|e| TransportError::Broker { addr: "127.0.0.1:0".into(), reason: e.to_string() })?;
        let addr = probe
            .local_addr()
            .map_err(|e| TransportError::Broker { addr: "127.0.0.1:0".into(), reason: e.to_string() })?;
        drop(probe);
        Self::start(addr)
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
