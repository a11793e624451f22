//! One round's bookkeeping on the aggregator, without I/O.
//!
//! [`RoundCollector`] knows whom a round selected and what became of each: reported,
//! refused, declined, still missing; it judges each update's announcement before a byte
//! of it is stored, decides when a device that asks again gets the plan again, and when
//! the round may close. It never publishes, verifies tensors or reads the clock: the
//! `Aggregator` (the driver) feeds it what arrives, with the time, and carries out what it
//! decides. So the round's rules are tested without a broker, next to the code.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use fedpo_wire::{Manifest, Update, UpdateMetrics};

/// Resend the plan to a device that asks again at most this often per round.
pub(super) const MAX_RESENDS: u32 = 3;
/// A device waiting this long after the plan went out may ask for it again without
/// having reconnected: the plan or its chunks were lost.
pub(super) const ASK_AGAIN_AFTER: Duration = Duration::from_secs(5);

/// What a round expects of an update's announcement.
#[derive(Debug, Clone, Copy)]
pub(super) struct Expected<'a> {
    /// The section every update must carry (SCAFFOLD's control), if any.
    pub(super) required_section: Option<&'a str>,
    /// What the client term is called, for the refusal of an update missing its section.
    pub(super) client_term: &'a str,
    /// A section an update may carry, if any (the diagnostic gradient, in a round that
    /// asked for it).
    pub(super) optional_section: Option<&'a str>,
    /// The most bytes the update's transfer may announce.
    pub(super) update_bytes: u64,
    /// The most bytes a section's transfer may announce.
    pub(super) section_bytes: u64,
    /// The pairs the device declared when it joined: its weight, whatever the update says.
    pub(super) declared_pairs: u64,
}

/// What to do with an update's announcement.
#[derive(Debug, PartialEq)]
pub(super) enum Announcement {
    /// Nothing: a duplicate of one counted or being received.
    Ignore,
    /// Refused, and why; whether for good is recorded in the round.
    Refused { round: u64, why: String },
    /// Receive its transfers; `clamped` says why its pair count was lowered, if it was.
    Accepted { update: Box<Update>, clamped: Option<String> },
}

/// What became of a decline.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Decline {
    /// It names no round this device is waited for in.
    NotForThisRound,
    /// The round stops waiting for the device.
    Counted,
    /// The device had reported or was refused already.
    AlreadySettled,
}

/// Whether the round may close.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Status {
    /// Some selected device may still report.
    Waiting,
    /// Every selected device reported or was refused.
    Complete,
    /// The devices still missing are all offline.
    MissingOffline(Vec<String>),
    /// The deadline passed with these devices missing.
    DeadlinePassed(Vec<String>),
}

/// A round being collected.
#[derive(Debug)]
pub(super) struct RoundCollector {
    round: u64,
    evaluation: bool,
    selected: BTreeSet<String>,
    reported: BTreeMap<String, (u64, UpdateMetrics)>,
    /// Devices whose complete, intact update was refused (or who declined): resending
    /// would send the same bytes, so the round stops waiting for them.
    refused: BTreeSet<String>,
    rejected: BTreeMap<String, String>,
    resends: HashMap<String, u32>,
    published_at: Option<Instant>,
    /// How long the round waits after its plan first went out.
    deadline_after: Duration,
    deadline: Option<Instant>,
}

impl RoundCollector {
    /// `round` (an evaluation-only one if `evaluation`) of the `selected` devices, closing
    /// at the latest `deadline_after` its plan first went out.
    pub(super) fn new(round: u64, evaluation: bool, selected: &[String], deadline_after: Duration) -> Self {
        Self {
            round,
            evaluation,
            selected: selected.iter().cloned().collect(),
            reported: BTreeMap::new(),
            refused: BTreeSet::new(),
            rejected: BTreeMap::new(),
            resends: HashMap::new(),
            published_at: None,
            deadline_after,
            deadline: None,
        }
    }

    pub(super) fn round(&self) -> u64 {
        self.round
    }

    pub(super) fn evaluation(&self) -> bool {
        self.evaluation
    }

    pub(super) fn selected(&self) -> &BTreeSet<String> {
        &self.selected
    }

    /// Pairs and metrics of each device whose update was counted.
    pub(super) fn reported(&self) -> &BTreeMap<String, (u64, UpdateMetrics)> {
        &self.reported
    }

    /// Why each device's update was not counted.
    pub(super) fn rejected(&self) -> &BTreeMap<String, String> {
        &self.rejected
    }

    /// When the round stops waiting; `None` until the plan went out.
    pub(super) fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Whether `device`'s update was counted.
    pub(super) fn has_reported(&self, device: &str) -> bool {
        self.reported.contains_key(device)
    }

    /// The plan (and the model) went out at `now`; the first time starts the deadline.
    pub(super) fn published(&mut self, now: Instant) {
        self.published_at = Some(now);
        self.deadline.get_or_insert(now + self.deadline_after);
    }

    /// Whether the round may close at `now`, given which devices are `online`.
    pub(super) fn status(&self, now: Instant, online: impl Fn(&str) -> bool) -> Status {
        let missing: Vec<String> = self
            .selected
            .iter()
            .filter(|d| !self.reported.contains_key(*d) && !self.refused.contains(*d))
            .cloned()
            .collect();
        if missing.is_empty() {
            Status::Complete
        } else if missing.iter().all(|d| !online(d)) {
            Status::MissingOffline(missing)
        } else if self.deadline.is_some_and(|deadline| now > deadline) {
            Status::DeadlinePassed(missing)
        } else {
            Status::Waiting
        }
    }

    /// Whether to publish the plan again for `device`, which said hello: it must still be
    /// waited for, and have reconnected or waited long enough, and not have asked too often.
    pub(super) fn asks_again(&mut self, device: &str, reconnected: bool, now: Instant) -> bool {
        let waiting = self.selected.contains(device) && !self.reported.contains_key(device);
        let resends = self.resends.entry(device.to_string()).or_default();
        let waited = self.published_at.is_some_and(|at| now.saturating_duration_since(at) > ASK_AGAIN_AFTER);
        if waiting && (reconnected || waited) && *resends < MAX_RESENDS {
            *resends += 1;
            return true;
        }
        false
    }

    /// Judges `device`'s announcement of `u`; `in_flight` is the transfer already being
    /// received from it, if any.
    pub(super) fn announce(
        &mut self,
        device: &str,
        mut u: Update,
        in_flight: Option<&Manifest>,
        expected: &Expected,
    ) -> Announcement {
        let round = u.round;
        let refused = |why: String| Announcement::Refused { round, why };
        if u.device != device {
            return refused(format!("it names device `{}` but came on {device}'s topic", u.device));
        }
        if u.round != self.round {
            return refused(format!("it is for round {}, the open round is {}", u.round, self.round));
        }
        if !self.selected.contains(device) {
            return refused("the device was not selected this round".into());
        }
        if self.reported.contains_key(device) {
            return Announcement::Ignore; // a duplicate delivery or a resend of an update already counted
        }
        if in_flight == Some(&u.update) {
            return Announcement::Ignore; // the same update announced again while its chunks are arriving
        }
        if let Err(why) = check_metrics(&u.metrics) {
            return self.refuse_for_good(device, why);
        }
        let clamped = (u.pairs > expected.declared_pairs).then(|| {
            let why =
                format!("update claims {} pairs, its hello {}; counted as declared", u.pairs, expected.declared_pairs);
            u.pairs = expected.declared_pairs;
            why
        });
        let transfer = format!("r{}/{device}", self.round);
        if u.update.transfer != transfer {
            return refused(format!("transfer id `{}` is not {transfer}", u.update.transfer));
        }
        let required = expected.required_section.filter(|_| !self.evaluation);
        for (name, m) in &u.sections {
            let wanted = Some(name.as_str()) == required || Some(name.as_str()) == expected.optional_section;
            if !wanted {
                return refused(format!("unexpected section `{name}`"));
            }
            if m.transfer != format!("{transfer}/{name}") {
                return refused(format!("section `{name}` has transfer id `{}`, not {transfer}/{name}", m.transfer));
            }
        }
        // Sizes are bounded by the shared set before a byte is stored: the transfer's
        // buffer is reserved, or its chunks spooled, on the word of the announcement.
        let oversized = std::iter::once(("update", u.update.bytes, expected.update_bytes))
            .chain(u.sections.iter().map(|(name, m)| (name.as_str(), m.bytes, expected.section_bytes)))
            .find(|(_, bytes, bound)| bytes > bound);
        if let Some((what, bytes, bound)) = oversized {
            let why = format!("its {what} announces {bytes} bytes, more than the shared set takes ({bound} at most)");
            return self.refuse_for_good(device, why);
        }
        if let Some(name) = required.filter(|n| !u.sections.contains_key(*n)) {
            self.rejected.insert(device.to_string(), format!("no `{name}` section"));
            return refused(format!("the job runs {} but the update has no `{name}` section", expected.client_term));
        }
        Announcement::Accepted { update: Box::new(u), clamped }
    }

    /// Refuses `device`'s update for good: the same one again would be refused again, so
    /// the round stops waiting for it.
    pub(super) fn refuse_for_good(&mut self, device: &str, why: String) -> Announcement {
        self.rejected.insert(device.to_string(), why.clone());
        self.refused.insert(device.to_string());
        Announcement::Refused { round: self.round, why }
    }

    /// `device`'s update arrived whole and verified.
    pub(super) fn report(&mut self, device: &str, pairs: u64, metrics: UpdateMetrics) {
        self.reported.insert(device.to_string(), (pairs, metrics));
    }

    /// `device`'s transfer failed; it may send it again.
    pub(super) fn transfer_failed(&mut self, device: &str, why: String) {
        self.rejected.insert(device.to_string(), why);
    }

    /// `device` declined `round`.
    pub(super) fn decline(&mut self, device: &str, round: u64, reason: &str) -> Decline {
        if round != self.round || !self.selected.contains(device) {
            return Decline::NotForThisRound;
        }
        if self.reported.contains_key(device) || !self.refused.insert(device.to_string()) {
            return Decline::AlreadySettled;
        }
        self.rejected.insert(device.to_string(), format!("declined: {reason}"));
        Decline::Counted
    }

    /// `device` sent a message that did not decode. An honest device never does (sizes
    /// are checked as a message is decoded), so a device the round waits for is not
    /// waited for any longer; returns whether that happened now.
    pub(super) fn undecodable(&mut self, device: &str, why: &str) -> bool {
        if !self.selected.contains(device)
            || self.reported.contains_key(device)
            || !self.refused.insert(device.to_string())
        {
            return false;
        }
        self.rejected.insert(device.to_string(), format!("undecodable message: {why}"));
        true
    }

    /// Two processes claim `device`'s id: it is left out of the job.
    pub(super) fn conflicted(&mut self, device: &str) {
        if self.selected.contains(device) && !self.reported.contains_key(device) {
            self.rejected.insert(device.to_string(), "two devices claim this id".into());
        }
    }
}

/// What a device reports must be a measurement: finite, accuracies within [0, 1], the
/// rest not negative. Anything else would reach `metrics.jsonl` and the summary as null.
fn check_metrics(m: &UpdateMetrics) -> Result<(), String> {
    let fields = [
        ("train_loss", Some(m.train_loss), f64::INFINITY),
        ("reward_acc", Some(m.reward_acc), 1.0),
        ("heldout_acc", m.heldout_acc, 1.0),
        ("grad_norm", Some(m.grad_norm), f64::INFINITY),
        ("seconds", Some(m.seconds), f64::INFINITY),
        ("peak_rss_mib", m.peak_rss_mib, f64::INFINITY),
    ];
    for (name, value, most) in fields {
        if let Some(v) = value.filter(|v| !(v.is_finite() && (0.0..=most).contains(v))) {
            let range = if most == 1.0 { "within [0, 1]" } else { "finite and not negative" };
            return Err(format!("its metric {name} = {v} is not {range}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
