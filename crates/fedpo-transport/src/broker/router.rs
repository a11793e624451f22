//! The broker's routing table: which connection holds which session, and who subscribed
//! to what. Pure bookkeeping, no I/O, in the manner of rumqttc's `state.rs`: the
//! connections (`session.rs`) ask it and act on the answer.
//!
//! Sessions are keyed by user *and* client id: with logins, one user can neither take
//! over nor squat another user's client id.

use std::collections::HashMap;

use rumqttc::mqttbytes::{matches, QoS};

/// A connection's number, unique for the broker's lifetime.
pub(super) type ConnId = u64;

/// A session's identity: the user it logged in as (none on an open broker) and its
/// client id.
pub(super) type SessionKey = (Option<String>, String);

/// Filters one connection may hold at once: fedpo needs one per connection; the cap
/// bounds what a client can make the broker store.
pub(super) const MAX_FILTERS_PER_CONNECTION: usize = 64;

#[derive(Debug)]
pub(super) struct Router<C> {
    sessions: HashMap<SessionKey, ConnId>,
    connections: HashMap<ConnId, Entry<C>>,
    next: ConnId,
}

#[derive(Debug)]
struct Entry<C> {
    key: SessionKey,
    client: C,
    filters: Vec<(String, QoS)>,
}

impl<C> Default for Router<C> {
    fn default() -> Self {
        Self { sessions: HashMap::new(), connections: HashMap::new(), next: 1 }
    }
}

impl<C: Clone> Router<C> {
    /// Registers a new connection for `key`; returns its id and the client of the
    /// connection it takes over, which the caller must close.
    pub(super) fn connect(&mut self, key: SessionKey, client: impl FnOnce(ConnId) -> C) -> (ConnId, Option<C>) {
        let id = self.next;
        self.next += 1;
        let replaced = self.sessions.insert(key.clone(), id).and_then(|old| self.connections.remove(&old));
        self.connections.insert(id, Entry { key, client: client(id), filters: Vec::new() });
        (id, replaced.map(|e| e.client))
    }

    /// Forgets a connection and its subscriptions (nothing if it was taken over).
    pub(super) fn disconnect(&mut self, id: ConnId) {
        if let Some(entry) = self.connections.remove(&id) {
            if self.sessions.get(&entry.key) == Some(&id) {
                self.sessions.remove(&entry.key);
            }
        }
    }

    /// Adds or replaces a subscription; the QoS granted (at most 1), or `None` when the
    /// connection holds too many filters or is gone.
    pub(super) fn subscribe(&mut self, id: ConnId, filter: &str, qos: QoS) -> Option<QoS> {
        let entry = self.connections.get_mut(&id)?;
        let granted = if qos == QoS::AtMostOnce { QoS::AtMostOnce } else { QoS::AtLeastOnce };
        if let Some(existing) = entry.filters.iter_mut().find(|(f, _)| f == filter) {
            existing.1 = granted;
        } else if entry.filters.len() < MAX_FILTERS_PER_CONNECTION {
            entry.filters.push((filter.to_string(), granted));
        } else {
            return None;
        }
        Some(granted)
    }

    pub(super) fn unsubscribe(&mut self, id: ConnId, filter: &str) {
        if let Some(entry) = self.connections.get_mut(&id) {
            entry.filters.retain(|(f, _)| f != filter);
        }
    }

    /// Every connection a publish on `topic` goes to, once each, at the highest QoS
    /// among its matching filters.
    pub(super) fn route(&self, topic: &str) -> Vec<(C, QoS)> {
        self.connections
            .values()
            .filter_map(|e| {
                let best = e.filters.iter().filter(|(f, _)| matches(topic, f)).map(|(_, q)| *q).reduce(|a, b| {
                    if b > a {
                        b
                    } else {
                        a
                    }
                })?;
                Some((e.client.clone(), best))
            })
            .collect()
    }

    /// Every registered connection's client.
    pub(super) fn clients(&self) -> impl Iterator<Item = &C> {
        self.connections.values().map(|e| &e.client)
    }

    /// Connections registered.
    pub(super) fn len(&self) -> usize {
        self.connections.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(user: Option<&str>, id: &str) -> SessionKey {
        (user.map(String::from), id.to_string())
    }

    #[test]
    fn a_publish_reaches_each_matching_connection_once_at_its_best_qos() {
        let mut r = Router::default();
        let (agg, _) = r.connect(key(None, "agg"), |id| id);
        let (dev, _) = r.connect(key(None, "dev"), |id| id);
        r.subscribe(agg, "fedpo/j/up/+", QoS::AtMostOnce);
        r.subscribe(agg, "fedpo/j/#", QoS::ExactlyOnce);
        r.subscribe(dev, "fedpo/j/down", QoS::AtLeastOnce);
        assert_eq!(r.route("fedpo/j/up/dev"), vec![(agg, QoS::AtLeastOnce)]);
        let mut down = r.route("fedpo/j/down");
        down.sort_by_key(|(id, _)| *id);
        assert_eq!(down, vec![(agg, QoS::AtLeastOnce), (dev, QoS::AtLeastOnce)]);
        r.unsubscribe(agg, "fedpo/j/#");
        assert_eq!(r.route("fedpo/j/down"), vec![(dev, QoS::AtLeastOnce)]);
        assert!(r.route("elsewhere").is_empty());
    }

    #[test]
    fn a_client_id_is_taken_over_only_within_one_user() {
        let mut r = Router::default();
        let (first, none) = r.connect(key(Some("dev-1"), "fedpo-j-dev-1"), |id| id);
        assert!(none.is_none());
        let (_, other_user) = r.connect(key(Some("dev-2"), "fedpo-j-dev-1"), |id| id);
        assert!(other_user.is_none(), "another user's connection replaced dev-1's");
        let (second, replaced) = r.connect(key(Some("dev-1"), "fedpo-j-dev-1"), |id| id);
        assert_eq!(replaced, Some(first));
        r.subscribe(second, "fedpo/j/down", QoS::AtLeastOnce);
        // The old connection winding down must not remove its successor.
        r.disconnect(first);
        assert_eq!(r.route("fedpo/j/down"), vec![(second, QoS::AtLeastOnce)]);
        r.disconnect(second);
        assert!(r.route("fedpo/j/down").is_empty());
        assert_eq!(r.len(), 1);
    }

    #[test]
    fn a_connection_holds_a_bounded_number_of_filters() {
        let mut r = Router::default();
        let (c, _) = r.connect(key(None, "greedy"), |id| id);
        for k in 0..MAX_FILTERS_PER_CONNECTION {
            assert!(r.subscribe(c, &format!("t/{k}"), QoS::AtLeastOnce).is_some());
        }
        assert_eq!(r.subscribe(c, "one/more", QoS::AtLeastOnce), None);
        assert!(r.subscribe(c, "t/0", QoS::AtMostOnce).is_some(), "re-subscribing an existing filter");
    }
}
