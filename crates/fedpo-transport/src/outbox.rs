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
//! out.

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
    /// Handed to the client, not yet written (no packet id yet).
    unassigned: VecDeque<Pending>,
    /// Written with a packet id, waiting for the PubAck.
    inflight: BTreeMap<u16, Pending>,
    bytes: usize,
}

impl Outbox {
    /// Records a publish about to be handed to the client.
    pub fn queued(&mut self, topic: &str, payload: &[u8]) {
        self.bytes += payload.len();
        self.unassigned.push_back(Pending { seq: self.next_seq, topic: topic.to_string(), payload: payload.to_vec() });
        self.next_seq += 1;
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

    /// Everything unacknowledged, oldest first, leaving the outbox empty: after a
    /// reconnect each is published again (and so queued again).
    pub(crate) fn take_for_replay(&mut self) -> Vec<Pending> {
        let mut all: Vec<Pending> = std::mem::take(&mut self.inflight).into_values().collect();
        all.extend(self.unassigned.drain(..));
        all.sort_by_key(|p| p.seq);
        self.bytes = 0;
        all
    }

    /// Whether some publish is still waiting to be written (it has no packet id yet).
    pub fn has_unwritten(&self) -> bool {
        !self.unassigned.is_empty()
    }

    /// Publishes not yet acknowledged.
    pub fn len(&self) -> usize {
        self.unassigned.len() + self.inflight.len()
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
        let replay: Vec<String> = o.take_for_replay().into_iter().map(|p| p.topic).collect();
        assert_eq!(replay, ["a", "c", "d"], "b was acked; d was never written");
        assert!(o.is_empty());
        assert_eq!(o.bytes(), 0);
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
