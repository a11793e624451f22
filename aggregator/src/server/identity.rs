//! One id, one device: telling a restarted device from two devices that claim one id.
//!
//! Every hello carries the instance number its process drew at start. A restart shows up
//! as a new instance that replaces the old one for good. Two live processes with one id
//! (a copied configuration, a cloned board or certificate) keep alternating: the broker
//! lets only one MQTT session per client id live, so each reconnect takes over from the
//! other and says hello again, and sooner or later a replaced instance speaks again. That
//! id is then left out of the job, since no update under it can be attributed to one
//! device's data.

use std::collections::{BTreeMap, HashMap};

/// What a hello says about its id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Claim {
    /// The first instance heard under this id, the same one again, or a device too old
    /// to send an instance.
    Known,
    /// A new instance replaced the last one: the device restarted.
    Restarted,
    /// A replaced instance spoke again: two processes share the id (the two instances).
    Conflict(u64, u64),
    /// The id was already found shared.
    Conflicted,
}

/// The instances heard under each id.
#[derive(Debug, Default)]
pub(super) struct Identities {
    /// Id → (current instance, the instance it replaced).
    instances: HashMap<String, (u64, Option<u64>)>,
    /// Ids two processes claim, with their instances.
    conflicted: BTreeMap<String, (u64, u64)>,
}

impl Identities {
    /// Records a hello from `device` with `instance`.
    pub(super) fn observe(&mut self, device: &str, instance: u64) -> Claim {
        if self.conflicted.contains_key(device) {
            return Claim::Conflicted;
        }
        if instance == 0 {
            return Claim::Known;
        }
        let Some((current, replaced)) = self.instances.get_mut(device) else {
            self.instances.insert(device.to_string(), (instance, None));
            return Claim::Known;
        };
        if *current == instance {
            Claim::Known
        } else if *replaced == Some(instance) {
            let pair = (*current, instance);
            self.conflicted.insert(device.to_string(), pair);
            Claim::Conflict(pair.0, pair.1)
        } else {
            *replaced = Some(*current);
            *current = instance;
            Claim::Restarted
        }
    }

    /// The instance last heard under `device`.
    pub(super) fn current(&self, device: &str) -> Option<u64> {
        self.instances.get(device).map(|(current, _)| *current)
    }

    pub(super) fn is_conflicted(&self, device: &str) -> bool {
        self.conflicted.contains_key(device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restart_replaces_the_instance_and_an_alternation_is_a_conflict() {
        let mut ids = Identities::default();
        assert_eq!(ids.observe("pi", 7), Claim::Known);
        assert_eq!(ids.observe("pi", 7), Claim::Known);
        assert_eq!(ids.observe("pi", 8), Claim::Restarted);
        assert_eq!(ids.observe("pi", 9), Claim::Restarted, "a second restart is still a restart");
        assert_eq!(ids.observe("pi", 8), Claim::Conflict(9, 8), "8 was replaced and came back");
        assert!(ids.is_conflicted("pi"));
        assert_eq!(ids.observe("pi", 9), Claim::Conflicted);
        assert_eq!(ids.observe("other", 8), Claim::Known, "instances are per id");
        assert!(!ids.is_conflicted("other"));
    }

    #[test]
    fn devices_without_an_instance_are_taken_at_their_word() {
        let mut ids = Identities::default();
        for _ in 0..3 {
            assert_eq!(ids.observe("old", 0), Claim::Known);
        }
    }
}
