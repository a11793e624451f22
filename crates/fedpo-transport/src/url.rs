//! Broker addresses: `mqtt://[user[:password]@]host[:port]` and `mqtts://...`.

use std::fmt;
use std::path::PathBuf;

use crate::error::{Result, TransportError};

/// Plain TCP or TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// `mqtt://`, port 1883 by default.
    Mqtt,
    /// `mqtts://`, port 8883 by default.
    Mqtts,
}

/// A parsed broker address.
#[derive(Clone, PartialEq, Eq)]
pub struct BrokerUrl {
    /// TCP or TLS.
    pub scheme: Scheme,
    /// Host name or IP address.
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// User name, from the URL or a flag.
    pub username: Option<String>,
    /// Password, from the URL or a flag.
    pub password: Option<String>,
}

/// PEM files for `mqtts://`: the CA to trust and, for mutual TLS, a client certificate
/// and key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// CA certificate(s) the broker's certificate must chain to.
    pub ca: Option<PathBuf>,
    /// Client certificate.
    pub cert: Option<PathBuf>,
    /// Client private key.
    pub key: Option<PathBuf>,
}

impl BrokerUrl {
    /// Parses an address. The error names the address and what is wrong with it.
    pub fn parse(url: &str) -> Result<Self> {
        let bad = |reason: &str| TransportError::BadUrl { url: redact(url), reason: reason.to_string() };
        let (scheme, rest) = if let Some(rest) = url.strip_prefix("mqtt://") {
            (Scheme::Mqtt, rest)
        } else if let Some(rest) = url.strip_prefix("mqtts://") {
            (Scheme::Mqtts, rest)
        } else {
            return Err(bad("expected mqtt://host[:port] or mqtts://host[:port]"));
        };
        let rest = rest.trim_end_matches('/');
        if rest.contains('/') {
            return Err(bad("a broker URL has no path"));
        }
        let (credentials, host_port) = match rest.rsplit_once('@') {
            Some((c, h)) => (Some(c), h),
            None => (None, rest),
        };
        let (username, password) = match credentials {
            None => (None, None),
            Some(c) => match c.split_once(':') {
                Some((u, p)) => (Some(u.to_string()), Some(p.to_string())),
                None => (Some(c.to_string()), None),
            },
        };
        let default_port = match scheme {
            Scheme::Mqtt => 1883,
            Scheme::Mqtts => 8883,
        };
        let (host, port) = if let Some(v6) = host_port.strip_prefix('[') {
            let (h, after) = v6.split_once(']').ok_or_else(|| bad("unclosed `[` in IPv6 address"))?;
            let port = match after.strip_prefix(':') {
                Some(p) => p.parse().map_err(|_| bad("port must be a number from 1 to 65535"))?,
                None if after.is_empty() => default_port,
                None => return Err(bad("unexpected text after the IPv6 address")),
            };
            (h.to_string(), port)
        } else {
            match host_port.rsplit_once(':') {
                Some((h, p)) => (h.to_string(), p.parse().map_err(|_| bad("port must be a number from 1 to 65535"))?),
                None => (host_port.to_string(), default_port),
            }
        };
        if host.is_empty() {
            return Err(bad("missing host"));
        }
        if port == 0 {
            return Err(bad("port must be a number from 1 to 65535"));
        }
        Ok(Self { scheme, host, port, username, password })
    }

    /// `host:port`, for messages.
    pub fn address(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }
}

/// The URL with any password replaced, so it can be logged.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..s + 3], &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

impl fmt::Debug for BrokerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for BrokerUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = match self.scheme {
            Scheme::Mqtt => "mqtt",
            Scheme::Mqtts => "mqtts",
        };
        let user = match (&self.username, &self.password) {
            (Some(u), Some(_)) => format!("{u}:***@"),
            (Some(u), None) => format!("{u}@"),
            _ => String::new(),
        };
        let host = if self.host.contains(':') { format!("[{}]", self.host) } else { self.host.clone() };
        write!(f, "{scheme}://{user}{host}:{}", self.port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_ports_follow_the_scheme() {
        let u = BrokerUrl::parse("mqtt://broker.local").unwrap();
        assert_eq!((u.scheme, u.host.as_str(), u.port), (Scheme::Mqtt, "broker.local", 1883));
        let u = BrokerUrl::parse("mqtts://10.0.0.2").unwrap();
        assert_eq!((u.scheme, u.port), (Scheme::Mqtts, 8883));
    }

    #[test]
    fn credentials_and_ipv6_are_parsed_and_the_password_never_printed() {
        let u = BrokerUrl::parse("mqtts://dev-1:s3cret@[::1]:18883").unwrap();
        assert_eq!(u.host, "::1");
        assert_eq!(u.port, 18883);
        assert_eq!(u.username.as_deref(), Some("dev-1"));
        assert_eq!(u.password.as_deref(), Some("s3cret"));
        assert_eq!(u.to_string(), "mqtts://dev-1:***@[::1]:18883");
        assert!(!format!("{u:?}").contains("s3cret"));
    }

    #[test]
    fn bad_urls_name_the_url_and_the_problem_without_the_password() {
        let cases = [
            ("http://x:1883", "mqtt://"),
            ("mqtt://x:99999", "port"),
            ("mqtt://:1883", "missing host"),
            ("mqtt://x/topic", "no path"),
        ];
        for (url, needle) in cases {
            let err = BrokerUrl::parse(url).unwrap_err().to_string();
            assert!(err.contains(url) && err.contains(needle), "{url}: {err}");
        }
        let err = BrokerUrl::parse("mqtt://u:hunter2@h:0").unwrap_err().to_string();
        assert!(!err.contains("hunter2") && err.contains("u:***@h:0"), "{err}");
    }
}
