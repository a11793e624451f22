//! Warnings about what peers send, rate-limited.
//!
//! Anything on the network can send the same bad message ten thousand times a second; one
//! warning line each would bury the log (and the disk) while telling the operator nothing
//! new. A [`WarnThrottle`] writes the first warning of each (peer, kind) at once, then at
//! most one per interval, each saying how many were held back since the last. Peers are
//! named by the network, so the number of tracked keys is capped too: beyond it, every
//! new peer shares one key.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Keys tracked before new peers are pooled.
const MAX_KEYS: usize = 1024;
/// The peer name new peers share once [`MAX_KEYS`] is reached.
const OTHER_PEERS: &str = "(other peers)";

#[derive(Debug)]
struct Window {
    last_written: Instant,
    held_back: u64,
}

/// Rate-limited warnings per (peer, kind).
#[derive(Debug)]
pub struct WarnThrottle {
    interval: Duration,
    windows: HashMap<(String, &'static str), Window>,
    /// Warnings held back over the throttle's life.
    total_held_back: u64,
}

impl Default for WarnThrottle {
    fn default() -> Self {
        Self::new(Duration::from_secs(10))
    }
}

impl WarnThrottle {
    /// At most one line per (peer, kind) every `interval`.
    pub fn new(interval: Duration) -> Self {
        Self { interval, windows: HashMap::new(), total_held_back: 0 }
    }

    /// Whether a warning of `kind` about `peer` may be written now: `Some(n)` with the
    /// number held back since the last one written, or `None` to hold this one back.
    pub fn allow(&mut self, peer: &str, kind: &'static str) -> Option<u64> {
        let now = Instant::now();
        let peer = if self.windows.len() >= MAX_KEYS && !self.windows.contains_key(&(peer.to_string(), kind)) {
            OTHER_PEERS
        } else {
            peer
        };
        match self.windows.get_mut(&(peer.to_string(), kind)) {
            None => {
                self.windows.insert((peer.to_string(), kind), Window { last_written: now, held_back: 0 });
                Some(0)
            }
            Some(w) if now.duration_since(w.last_written) >= self.interval => {
                w.last_written = now;
                Some(std::mem::take(&mut w.held_back))
            }
            Some(w) => {
                w.held_back += 1;
                self.total_held_back += 1;
                None
            }
        }
    }

    /// Writes `message` as a warning about `peer`, unless the throttle holds it back.
    pub fn warn(&mut self, peer: &str, kind: &'static str, message: &str) {
        if let Some(held_back) = self.allow(peer, kind) {
            if held_back > 0 {
                tracing::warn!(peer, kind, held_back, "{message}");
            } else {
                tracing::warn!(peer, kind, "{message}");
            }
        }
    }

    /// Warnings held back so far.
    pub fn held_back(&self) -> u64 {
        self.total_held_back
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_of_one_kind_from_one_peer_writes_one_line_per_interval_and_counts_the_rest() {
        let mut t = WarnThrottle::new(Duration::from_millis(200));
        assert_eq!(t.allow("dev-1", "undecodable"), Some(0), "the first is written");
        for _ in 0..9_999 {
            assert_eq!(t.allow("dev-1", "undecodable"), None);
        }
        assert_eq!(t.allow("dev-2", "undecodable"), Some(0), "another peer is not held back by the first");
        assert_eq!(t.allow("dev-1", "late update"), Some(0), "nor another kind");
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(t.allow("dev-1", "undecodable"), Some(9_999), "the next line counts what was held back");
        assert_eq!(t.held_back(), 9_999);
    }

    #[test]
    fn peers_beyond_the_cap_share_one_window() {
        let mut t = WarnThrottle::new(Duration::from_secs(60));
        for k in 0..MAX_KEYS {
            assert_eq!(t.allow(&format!("dev-{k}"), "hello"), Some(0));
        }
        assert_eq!(t.allow("one-more", "hello"), Some(0), "the pooled window's first line");
        assert_eq!(t.allow("and-another", "hello"), None, "new peers share it");
        assert_eq!(t.windows.len(), MAX_KEYS + 1, "memory stays bounded");
    }
}
