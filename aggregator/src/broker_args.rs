//! Where the aggregator finds its broker: a URL, or one it starts itself.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use fedpo_transport::{read_password_file, BrokerConfig, BrokerUrl, EmbeddedBroker, TlsFiles};

/// Broker flags.
#[derive(Debug, Args, Clone)]
pub(crate) struct BrokerArgs {
    /// An MQTT 3.1.1/5 broker: mqtt://[user[:password]@]host[:port] or mqtts://...
    #[arg(long, conflicts_with = "embedded_broker")]
    pub(crate) broker: Option<String>,
    /// Start fedpo's MQTT broker in-process on this address (e.g. 127.0.0.1:1883).
    /// Without --broker-passwords it listens on loopback only.
    #[arg(long)]
    pub(crate) embedded_broker: Option<SocketAddr>,
    /// The embedded broker's logins: one `user:password` per line, a device's user name
    /// its id (devices connect with mqtt://ID:PASSWORD@HOST:PORT). Every client must log
    /// in, and only the users listed may join the job (unless --devices-file says
    /// otherwise). Needed to listen beyond loopback.
    #[arg(long, value_name = "FILE", requires = "embedded_broker")]
    pub(crate) broker_passwords: Option<PathBuf>,
    /// CA certificate (PEM) for mqtts://.
    #[arg(long)]
    pub(crate) ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS.
    #[arg(long)]
    pub(crate) cert: Option<PathBuf>,
    /// Client key (PEM) for mutual TLS.
    #[arg(long)]
    pub(crate) key: Option<PathBuf>,
    /// MQTT user name (overrides the URL's).
    #[arg(long)]
    pub(crate) username: Option<String>,
    /// MQTT password (overrides the URL's).
    #[arg(long, env = "FEDPO_MQTT_PASSWORD", hide_env_values = true)]
    pub(crate) password: Option<String>,
}

impl BrokerArgs {
    /// The URL to connect to, starting the embedded broker when asked (or when
    /// `embedded_by_default` and no URL was given).
    pub(crate) fn resolve(&self, embedded_by_default: bool) -> Result<(BrokerUrl, Option<EmbeddedBroker>)> {
        let (mut url, broker) = match (&self.broker, self.embedded_broker) {
            (Some(u), _) => (BrokerUrl::parse(u)?, None),
            (None, Some(addr)) => {
                let mut credentials = self.broker_passwords.as_deref().map(read_password_file).transpose()?;
                // The aggregator's own login, known to no one else.
                let own = credentials.as_mut().map(|users| {
                    let login = (
                        format!("fedpo-aggregator-{:08x}", rand::random::<u32>()),
                        hex::encode(rand::random::<[u8; 16]>()),
                    );
                    users.insert(login.0.clone(), login.1.clone());
                    login
                });
                let config = BrokerConfig {
                    logins: credentials,
                    admin: own.as_ref().map(|(user, _)| user.clone()),
                    ..BrokerConfig::default()
                };
                let b = EmbeddedBroker::start_with(addr, config).map_err(|e| match self.broker_passwords {
                    None if !addr.ip().is_loopback() => anyhow::anyhow!(
                        "{e}: pass --broker-passwords FILE (lines `device:password`), or --embedded-broker 127.0.0.1:{}",
                        addr.port()
                    ),
                    _ => e.into(),
                })?;
                let mut url = b.url();
                if let Some((user, password)) = own {
                    url.username = Some(user);
                    url.password = Some(password);
                }
                (url, Some(b))
            }
            (None, None) if embedded_by_default => {
                let b = EmbeddedBroker::start_on_free_port()?;
                (b.url(), Some(b))
            }
            (None, None) => bail!("give --broker URL or --embedded-broker ADDR"),
        };
        if let Some(u) = &self.username {
            url.username = Some(u.clone());
        }
        if let Some(p) = &self.password {
            url.password = Some(p.clone());
        }
        Ok((url, broker))
    }

    /// The logins of --broker-passwords (user → password).
    pub(crate) fn broker_logins(&self) -> Result<Option<std::collections::HashMap<String, String>>> {
        Ok(self.broker_passwords.as_deref().map(read_password_file).transpose()?)
    }

    pub(crate) fn tls(&self) -> TlsFiles {
        TlsFiles { ca: self.ca.clone(), cert: self.cert.clone(), key: self.key.clone() }
    }
}
