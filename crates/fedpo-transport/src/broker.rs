//! rumqttd in-process: the broker `simulate` uses by default, so a fleet runs on a fresh
//! machine with nothing installed.
//!
//! Without credentials it listens on loopback only: anyone who reaches an open broker can
//! join the job under any id, or end it. With credentials (user name → password, as
//! [`read_password_file`] reads them) every client must log in; rumqttd has no topic ACL,
//! so a logged-in client can still publish on another device's topic, which a broker with
//! ACLs (Mosquitto with `security/acl`) prevents; the aggregator checks the tags devices
//! put on their hellos and goodbyes instead (`fedpo_wire::device_tag`).

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

fn config(addr: SocketAddr, credentials: Option<HashMap<String, String>>) -> Config {
    let connections = ConnectionSettings {
        connection_timeout_ms: 60_000,
        max_payload_size: MAX_PACKET_BYTES,
        max_inflight_count: 256,
        auth: credentials,
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
        Self::start_with(addr, None)
    }

    /// Starts a broker on `addr` where every client logs in with one of `credentials`
    /// (user name → password); `None` lets anyone in, and is refused beyond loopback.
    pub fn start_with(addr: SocketAddr, credentials: Option<HashMap<String, String>>) -> Result<Self> {
        let addr = if addr.port() == 0 { free_port(addr)? } else { addr };
        let err = |reason: String| TransportError::Broker { addr: addr.to_string(), reason };
        if credentials.is_none() && !addr.ip().is_loopback() {
            return Err(err(
                "the embedded broker has no credentials, so it listens on loopback only (127.0.0.1 or ::1); \
                 give it a password file to listen beyond this machine"
                    .into(),
            ));
        }
        if credentials.as_ref().is_some_and(HashMap::is_empty) {
            return Err(err("the password file lists no user: no client could log in".into()));
        }
        // rumqttd only logs a failed bind from its own thread; check first so the user
        // sees why.
        drop(TcpListener::bind(addr).map_err(|e| err(format!("cannot listen: {e}")))?);
        let cfg = config(addr, credentials);
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

/// Reads a password file: one `user:password` per line; blank lines and `#` comments are
/// skipped. The password is everything after the first `:`.
pub fn read_password_file(path: &std::path::Path) -> Result<HashMap<String, String>> {
    let err = |reason: String| TransportError::Credentials(format!("{}: {reason}", path.display()));
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    let mut users = HashMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((user, password)) = line.split_once(':') else {
            return Err(err(format!("line {}: expected `user:password`", n + 1)));
        };
        if user.is_empty() || password.is_empty() {
            return Err(err(format!("line {}: an empty user name or password", n + 1)));
        }
        if users.insert(user.to_string(), password.to_string()).is_some() {
            return Err(err(format!("line {}: user `{user}` is listed twice", n + 1)));
        }
    }
    Ok(users)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_open_broker_is_refused_beyond_loopback() {
        let e = EmbeddedBroker::start("0.0.0.0:0".parse().unwrap()).unwrap_err().to_string();
        assert!(e.contains("loopback only") && e.contains("password file"), "{e}");
    }

    #[test]
    fn password_files_name_the_line_they_cannot_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("passwords");
        std::fs::write(&path, "# fleet\npi-1:s3cret:with-colon\n\npi-2:other\n").unwrap();
        let users = read_password_file(&path).unwrap();
        assert_eq!(users["pi-1"], "s3cret:with-colon");
        assert_eq!(users.len(), 2);
        std::fs::write(&path, "pi-1:a\npi-1\n").unwrap();
        let e = read_password_file(&path).unwrap_err().to_string();
        assert!(e.contains("passwords: line 2: expected `user:password`"), "{e}");
        std::fs::write(&path, "pi-1:a\npi-1:b\n").unwrap();
        assert!(read_password_file(&path).unwrap_err().to_string().contains("listed twice"));
    }
}
