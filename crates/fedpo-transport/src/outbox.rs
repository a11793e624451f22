//! Publishes the broker has not yet acknowledged.
//!
//! rumqttc forgets unacknowledged QoS 1 publishes when it reconnects with a clean session,
//! and it drops requests still queued in its channel. The outbox keeps every publish until
//! its PubAck arrives, so the link can send it again after a reconnect. Receivers dedupe
//! (MQTT's QoS 1 already allows duplicates), so resending too much is safe and resending
//! too little is not.
//!
//! rumqttc does not tell the caller which packet id a publish got. It does report each
//! outgoing publish's id in request order, so ids are matched to publishes first in, first
//! out. That matching holds only within one rumqttc connection: the link gives every broker
//! session a fresh client, and when a session ends every publish of it is *parked* here
//! until the next session replays it. A publish made while no session is ready is parked
//! at once, so the new session's channel holds exactly what the outbox lists as unwritten.

use std::collections::{BTreeMap, VecDeque};

/// A publish waiting for its acknowledgement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pending {
    pub(crate) seq: u64,
    pub(crate) topic: String,
    pub(crate) payload: Vec<u8>,
}

/// Unacknowledged publishes, in the order they were made.
#[derive(Debug, Default)]
pub struct Outbox {
    next_seq: u64,
    /// Handed to the current session's client, not yet written (no packet id yet).
    unassigned: VecDeque<Pending>,
    /// Written with a packet id in the current session, waiting for the PubAck.
    inflight: BTreeMap<u16, Pending>,
    /// Held for the next session: cut off by a dropped connection, or made while none was
    /// ready.
    parked: Vec<Pending>,
    bytes: usize,
}

impl Outbox {
    /// Records a publish about to be handed to the current session's client.
    pub fn queued(&mut self, topic: &str, payload: &[u8]) {
        let p = self.fresh(topic, payload);
        self.unassigned.push_back(p);
    }

    /// Records a publish made while no session is ready to take it.
    pub fn parked(&mut self, topic: &str, payload: &[u8]) {
        let p = self.fresh(topic, payload);
        self.parked.push(p);
    }

    fn fresh(&mut self, topic: &str, payload: &[u8]) -> Pending {
        self.bytes += payload.len();
        self.next_seq += 1;
        Pending { seq: self.next_seq - 1, topic: topic.to_string(), payload: payload.to_vec() }
    }

    /// The client wrote the oldest queued publish with packet id `pkid`.
    pub fn sent(&mut self, pkid: u16) {
        if let Some(p) = self.unassigned.pop_front() {
            if let Some(old) = self.inflight.insert(pkid, p) {
                // A packet id is reused only after its ack; keep the older publish too.
                self.unassigned.push_front(old);
            }
        }
    }

    /// The broker acknowledged packet id `pkid`.
    pub fn acked(&mut self, pkid: u16) {
        if let Some(p) = self.inflight.remove(&pkid) {
            self.bytes -= p.payload.len();
        }
    }

    /// The session ended: nothing it was given can be acknowledged any more, so all of it
    /// waits for the next one.
    pub fn session_ended(&mut self) {
        self.parked.extend(std::mem::take(&mut self.inflight).into_values());
        self.parked.extend(self.unassigned.drain(..));
    }

    /// Everything parked, oldest first. The caller hands each back with
    /// [`Outbox::requeue`] as it gives it to the new session's client.
    pub(crate) fn take_parked(&mut self) -> Vec<Pending> {
        let mut all = std::mem::take(&mut self.parked);
        all.sort_by_key(|p| p.seq);
        all
    }

    /// A parked publish handed to the current session's client again; it keeps its place
    /// in publish order.
    pub(crate) fn requeue(&mut self, p: Pending) {
        self.unassigned.push_back(p);
    }

    /// Publishes taken by [`Outbox::take_parked`] that could not be handed on: they wait for
    /// the next session.
    pub(crate) fn repark(&mut self, rest: impl IntoIterator<Item = Pending>) {
        self.parked.extend(rest);
    }

    /// Whether some publish is still waiting to be written (it has no packet id yet).
    pub fn has_unwritten(&self) -> bool {
        !self.unassigned.is_empty()
    }

    /// Publishes not yet acknowledged.
    pub fn len(&self) -> usize {
        self.unassigned.len() + self.inflight.len() + self.parked.len()
    }

    /// Whether everything was acknowledged.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Payload bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topics(ps: &[Pending]) -> Vec<&str> {
        ps.iter().map(|p| p.topic.as_str()).collect()
    }

    #[test]
    fn acked_publishes_leave_and_the_rest_replay_in_publish_order() {
        let mut o = Outbox::default();
        for t in ["a", "b", "c", "d"] {
            o.queued(t, t.as_bytes());
        }
        o.sent(7);
        o.sent(8);
        o.sent(9);
        o.acked(8);
        assert_eq!(o.len(), 3);
        assert_eq!(o.bytes(), 3);
        o.session_ended();
        assert_eq!(o.len(), 3, "parked publishes still count as unacknowledged");
        assert!(!o.has_unwritten(), "the new session's channel is empty");
        let replay = o.take_parked();
        assert_eq!(topics(&replay), ["a", "c", "d"], "b was acked; d was never written");
    }

    #[test]
    fn publishes_made_between_sessions_replay_after_the_older_ones() {
        let mut o = Outbox::default();
        o.queued("a", b"1");
        o.sent(1);
        o.session_ended();
        o.parked("b", b"2");
        let replay = o.take_parked();
        assert_eq!(topics(&replay), ["a", "b"]);
        for p in replay {
            o.requeue(p);
        }
        o.queued("c", b"3");
        // The new session numbers from its own packet ids; each maps to its own publish.
        o.sent(1);
        o.sent(2);
        o.acked(1);
        o.acked(2);
        assert_eq!(o.len(), 1);
        o.session_ended();
        assert_eq!(topics(&o.take_parked()), ["c"], "only the unwritten publish is left");
        assert_eq!(o.bytes(), 1);
    }

    #[test]
    fn a_replay_cut_short_keeps_the_rest_for_the_next_session() {
        let mut o = Outbox::default();
        for t in ["a", "b", "c"] {
            o.parked(t, t.as_bytes());
        }
        let mut replay = o.take_parked().into_iter();
        o.requeue(replay.next().unwrap());
        o.repark(replay);
        o.session_ended();
        assert_eq!(topics(&o.take_parked()), ["a", "b", "c"]);
        assert_eq!(o.bytes(), 3);
    }

    #[test]
    fn unknown_acks_and_surplus_send_reports_change_nothing() {
        let mut o = Outbox::default();
        o.queued("a", b"x");
        o.acked(1);
        o.sent(1);
        o.sent(2);
        assert_eq!(o.len(), 1);
        o.acked(1);
        assert!(o.is_empty());
    }
}
