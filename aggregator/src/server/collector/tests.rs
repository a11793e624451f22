//! A round's bookkeeping, message by message, without a broker.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use fedpo_wire::{keys, Manifest, Update, UpdateMetrics};

use super::*;

const DEADLINE: Duration = Duration::from_secs(60);

fn devices(ids: &[&str]) -> Vec<String> {
    ids.iter().map(|d| d.to_string()).collect()
}

/// Round 3 of `a`, `b` and `c`, its plan published at `t`.
fn collector(t: Instant) -> RoundCollector {
    let mut c = RoundCollector::new(3, false, &devices(&["a", "b", "c"]), DEADLINE);
    c.published(t);
    c
}

fn expected() -> Expected<'static> {
    Expected {
        required_section: None,
        client_term: "fedavg",
        optional_section: None,
        update_bytes: 1 << 20,
        section_bytes: 1 << 20,
        declared_pairs: 8,
    }
}

fn metrics() -> UpdateMetrics {
    UpdateMetrics {
        train_loss: 0.69,
        reward_acc: 0.5,
        heldout_acc: Some(0.5),
        grad_norm: 1.0,
        seconds: 2.0,
        peak_rss_mib: None,
    }
}

fn manifest(transfer: &str) -> Manifest {
    Manifest { transfer: transfer.into(), bytes: 1024, chunks: 1, digest: vec![1; 32], tensors: Vec::new() }
}

/// `device`'s honest announcement for `round`.
fn update(device: &str, round: u64) -> Update {
    Update {
        round,
        device: device.into(),
        pairs: 8,
        metrics: metrics(),
        update: manifest(&format!("r{round}/{device}")),
        sections: BTreeMap::new(),
    }
}

fn refusal(a: Announcement) -> String {
    match a {
        Announcement::Refused { why, .. } => why,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn accepted(c: &mut RoundCollector, u: Update) -> Update {
    match c.announce(&u.device.clone(), u, None, &expected()) {
        Announcement::Accepted { update, .. } => *update,
        other => panic!("expected acceptance, got {other:?}"),
    }
}

#[test]
fn the_round_closes_once_every_selected_device_reported_or_was_refused() {
    let t = Instant::now();
    let mut c = collector(t);
    let online = |_: &str| true;
    assert_eq!(c.status(t, online), Status::Waiting);
    let u = accepted(&mut c, update("a", 3));
    c.report("a", u.pairs, u.metrics);
    c.decline("b", 3, "out of memory");
    assert_eq!(c.status(t, online), Status::Waiting);
    c.refuse_for_good("c", "update norm too large".into());
    assert_eq!(c.status(t, online), Status::Complete);
    assert_eq!(c.rejected().get("b").map(String::as_str), Some("declined: out of memory"));
    assert!(c.has_reported("a") && !c.has_reported("c"));
}

#[test]
fn the_deadline_closes_the_round_with_the_missing_devices_named() {
    let t = Instant::now();
    let mut c = collector(t + Duration::from_secs(1));
    assert_eq!(c.deadline(), Some(t + Duration::from_secs(1) + DEADLINE));
    c.published(t + Duration::from_secs(30));
    assert_eq!(c.deadline(), Some(t + Duration::from_secs(1) + DEADLINE), "a resend does not move it");
    let u = accepted(&mut c, update("b", 3));
    c.report("b", u.pairs, u.metrics);
    let online = |_: &str| true;
    assert_eq!(c.status(t + DEADLINE, online), Status::Waiting);
    let late = t + DEADLINE + Duration::from_secs(2);
    assert_eq!(c.status(late, online), Status::DeadlinePassed(devices(&["a", "c"])));
}

#[test]
fn a_round_whose_missing_devices_are_all_offline_closes_early() {
    let t = Instant::now();
    let c = collector(t);
    assert_eq!(c.status(t, |d| d == "a"), Status::Waiting);
    assert_eq!(c.status(t, |_| false), Status::MissingOffline(devices(&["a", "b", "c"])));
}

#[test]
fn a_late_update_for_another_round_is_refused_and_the_device_still_awaited() {
    let t = Instant::now();
    let mut c = collector(t);
    let why = refusal(c.announce("a", update("a", 2), None, &expected()));
    assert_eq!(why, "it is for round 2, the open round is 3");
    assert_eq!(c.status(t, |_| true), Status::Waiting);
    assert!(c.rejected().is_empty(), "the device may still send round 3's");
    accepted(&mut c, update("a", 3));
}

#[test]
fn duplicates_of_a_counted_or_arriving_update_are_ignored() {
    let t = Instant::now();
    let mut c = collector(t);
    let u = accepted(&mut c, update("a", 3));
    let in_flight = u.update.clone();
    assert_eq!(c.announce("a", update("a", 3), Some(&in_flight), &expected()), Announcement::Ignore);
    c.report("a", u.pairs, u.metrics);
    assert_eq!(c.announce("a", update("a", 3), None, &expected()), Announcement::Ignore);
    assert_eq!(c.reported().len(), 1);
}

#[test]
fn announcements_that_lie_are_refused_before_a_byte_is_stored() {
    let t = Instant::now();
    let mut c = collector(t);
    assert!(refusal(c.announce("b", update("a", 3), None, &expected())).contains("names device `a`"));
    assert!(refusal(c.announce("z", update("z", 3), None, &expected())).contains("not selected"));
    let mut renamed = update("a", 3);
    renamed.update.transfer = "r3/b".into();
    assert!(refusal(c.announce("a", renamed, None, &expected())).contains("transfer id `r3/b`"));
    let mut stray = update("a", 3);
    stray.sections.insert(keys::DIAGNOSTIC_GRADIENT.into(), manifest("r3/a/diagnostic"));
    assert!(refusal(c.announce("a", stray, None, &expected())).contains("unexpected section"));
    assert_eq!(c.status(t, |_| true), Status::Waiting, "none of these is for good");

    let mut huge = update("b", 3);
    huge.update.bytes = (1 << 20) + 1;
    assert!(refusal(c.announce("b", huge, None, &expected())).contains("announces 1048577 bytes"));
    let mut nan = update("c", 3);
    nan.metrics.train_loss = f64::NAN;
    assert!(refusal(c.announce("c", nan, None, &expected())).contains("train_loss = NaN"));
    assert_eq!(c.rejected().keys().collect::<Vec<_>>(), ["b", "c"], "oversized and non-finite are for good");
}

#[test]
fn an_update_weighs_the_pairs_its_device_declared() {
    let t = Instant::now();
    let mut c = collector(t);
    let mut greedy = update("a", 3);
    greedy.pairs = 1_000_000;
    let Announcement::Accepted { update, clamped } = c.announce("a", greedy, None, &expected()) else {
        panic!("a greedy update is still counted")
    };
    assert_eq!(update.pairs, 8);
    assert!(clamped.is_some_and(|why| why.contains("1000000 pairs")));
}

#[test]
fn a_round_with_a_required_section_refuses_updates_without_it() {
    let t = Instant::now();
    let mut c = collector(t);
    let scaffold = Expected { required_section: Some("scaffold.control"), client_term: "scaffold", ..expected() };
    let why = refusal(c.announce("a", update("a", 3), None, &scaffold));
    assert!(why.contains("runs scaffold") && why.contains("scaffold.control"), "{why}");
    let mut with = update("a", 3);
    with.sections.insert("scaffold.control".into(), manifest("r3/a/scaffold.control"));
    assert!(matches!(c.announce("a", with, None, &scaffold), Announcement::Accepted { .. }));
    // An evaluation round needs no section.
    let mut eval = RoundCollector::new(4, true, &devices(&["a"]), DEADLINE);
    assert!(matches!(eval.announce("a", update("a", 4), None, &scaffold), Announcement::Accepted { .. }));
}

#[test]
fn a_device_asking_again_gets_the_plan_again_a_bounded_number_of_times() {
    let t = Instant::now();
    let mut c = collector(t);
    assert!(!c.asks_again("a", false, t + Duration::from_secs(1)), "a hello right after the plan");
    assert!(c.asks_again("a", true, t + Duration::from_secs(1)), "after a reconnect");
    assert!(c.asks_again("a", false, t + ASK_AGAIN_AFTER * 2), "after waiting");
    assert!(c.asks_again("a", true, t));
    assert!(!c.asks_again("a", true, t), "at most {MAX_RESENDS} times");
    assert!(!c.asks_again("z", true, t), "a device the round did not select");
    let u = accepted(&mut c, update("b", 3));
    c.report("b", u.pairs, u.metrics);
    assert!(!c.asks_again("b", true, t), "a device that reported");
}

#[test]
fn a_decline_counts_once_and_only_for_the_open_round() {
    let t = Instant::now();
    let mut c = collector(t);
    assert_eq!(c.decline("a", 2, "busy"), Decline::NotForThisRound);
    assert_eq!(c.decline("z", 3, "busy"), Decline::NotForThisRound);
    assert_eq!(c.decline("a", 3, "busy"), Decline::Counted);
    assert_eq!(c.decline("a", 3, "busy"), Decline::AlreadySettled);
    let u = accepted(&mut c, update("b", 3));
    c.report("b", u.pairs, u.metrics);
    assert_eq!(c.decline("b", 3, "changed its mind"), Decline::AlreadySettled);
    assert!(c.has_reported("b"), "a counted update stays counted");
}

#[test]
fn an_undecodable_message_stops_the_wait_for_its_device() {
    let t = Instant::now();
    let mut c = collector(t);
    assert!(c.undecodable("a", "truncated CBOR"));
    assert!(!c.undecodable("a", "truncated CBOR"), "once");
    assert!(!c.undecodable("z", "truncated CBOR"), "a device the round does not wait for");
    assert_eq!(c.rejected()["a"], "undecodable message: truncated CBOR");
    c.conflicted("b");
    assert_eq!(c.rejected()["b"], "two devices claim this id");
    c.transfer_failed("c", "digest mismatch".into());
    assert_eq!(c.status(t, |_| true), Status::Waiting, "a failed transfer may be sent again");
}
