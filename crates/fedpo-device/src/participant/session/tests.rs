//! The device's round logic, event by event, without a broker.

use std::time::{Duration, Instant};

use fedpo_wire::{RoundPlan, SecAggPlan};

use super::*;
use crate::participant::test_plan::plan_announcing;

/// Standing of a device following run 1 that last sent `last_round`.
fn standing(last_round: u64) -> Standing {
    Standing { run: Some(1), last_round, holds_secure_update: false }
}

/// A plan for `round` that `check_download` accepts, selecting `pi-7`.
fn plan(round: u64) -> RoundPlan {
    let mut plan = plan_announcing(1 << 20, None);
    plan.round = round;
    plan.global_model.digest = vec![round as u8; 32];
    plan
}

fn secure(mut plan: RoundPlan) -> RoundPlan {
    plan.secagg = Some(SecAggPlan { threshold: 2, fixed_point: fedpo_secagg::FixedPoint::for_sum(1.0, 3) });
    plan
}

fn session(now: Instant) -> Session {
    let mut s = Session::new("pi-7", "lab", false, now);
    assert_eq!(s.handle(Event::Started, now), vec![Action::SendHello]);
    assert!(s.handle(Event::Connected, now).is_empty(), "the first connection is the one the hello used");
    s
}

fn on_plan(s: &mut Session, plan: RoundPlan, standing: Standing, now: Instant) -> Vec<Action> {
    s.handle(Event::Plan(std::sync::Arc::new(plan), standing), now)
}

/// The names of the actions, for comparing sequences without their plans.
fn kinds(actions: &[Action]) -> Vec<&'static str> {
    actions
        .iter()
        .map(|a| match a {
            Action::SendHello => "hello",
            Action::BindRun { .. } => "bind",
            Action::Resend { .. } => "resend",
            Action::FitMemory(_) => "fit",
            Action::AdvertiseKeys(_) => "keys",
            Action::Receive(_) => "receive",
            Action::Train(_) => "train",
            Action::Decline { .. } => "decline",
            Action::Finish => "finish",
        })
        .collect()
}

#[test]
fn a_selected_plan_is_fitted_received_and_trained_once_complete() {
    let t = Instant::now();
    let mut s = session(t);
    assert_eq!(kinds(&on_plan(&mut s, plan(1), standing(0), t)), ["fit", "receive"]);
    assert_eq!(s.receiving(), Some(1));
    let actions = s.handle(Event::ModelReceived, t + Duration::from_secs(1));
    assert!(matches!(&actions[..], [Action::Train(p)] if p.round == 1), "{actions:?}");
    assert_eq!(s.receiving(), None);
    assert!(s.handle(Event::ModelReceived, t).is_empty(), "a second completion trains nothing");
}

#[test]
fn a_plan_that_does_not_select_the_device_only_stops_its_hellos() {
    let t = Instant::now();
    let mut s = session(t);
    let mut other = plan(1);
    other.selected = vec!["pi-8".into()];
    assert!(on_plan(&mut s, other, standing(0), t).is_empty());
    assert!(s.handle(Event::Tick, t + 2 * HELLO_EVERY).is_empty(), "the aggregator was heard");
}

#[test]
fn until_the_aggregator_answers_hellos_repeat_on_the_timer() {
    let t = Instant::now();
    let mut s = session(t);
    assert!(s.handle(Event::Tick, t + HELLO_EVERY / 2).is_empty());
    let later = t + HELLO_EVERY + Duration::from_millis(1);
    assert_eq!(s.handle(Event::Tick, later), vec![Action::SendHello]);
    assert!(s.handle(Event::Tick, later + Duration::from_millis(1)).is_empty(), "the timer restarted");
}

#[test]
fn a_reconnect_says_hello_with_a_new_connection_number() {
    let t = Instant::now();
    let mut s = session(t);
    assert_eq!(s.connection(), 1);
    s.handle(Event::Disconnected("broker went away".into()), t);
    assert_eq!(s.handle(Event::Connected, t), vec![Action::SendHello]);
    assert_eq!(s.connection(), 2);
}

#[test]
fn a_duplicate_plan_while_receiving_is_not_received_twice() {
    let t = Instant::now();
    let mut s = session(t);
    on_plan(&mut s, plan(1), standing(0), t);
    assert!(on_plan(&mut s, plan(1), standing(0), t).is_empty());
    // A secure plan's keys may have been lost with the first copy.
    let mut s = session(t);
    assert_eq!(kinds(&on_plan(&mut s, secure(plan(1)), standing(0), t)), ["fit", "keys", "receive"]);
    assert_eq!(kinds(&on_plan(&mut s, secure(plan(1)), standing(0), t)), ["keys"]);
    // The same round with another model is a new plan (the aggregator restarted).
    let mut changed = plan(1);
    changed.global_model.digest = vec![9; 32];
    let mut s = session(t);
    on_plan(&mut s, plan(1), standing(0), t);
    assert_eq!(kinds(&on_plan(&mut s, changed, standing(0), t)), ["fit", "receive"]);
}

#[test]
fn a_plan_for_the_round_sent_is_answered_by_a_resend_only_when_something_changed() {
    let t = Instant::now();
    let mut s = session(t);
    on_plan(&mut s, plan(3), standing(2), t);
    s.handle(Event::ModelReceived, t);
    assert!(s.handle(Event::UpdateSent { round: 3 }, t).is_empty());
    // Resent for another device, under the same epoch and connection: nothing to do.
    assert!(on_plan(&mut s, plan(3), standing(3), t).is_empty());
    // After our reconnect the update may have been lost.
    s.handle(Event::Connected, t);
    let actions = on_plan(&mut s, plan(3), standing(3), t);
    let digest = hex::encode([3u8; 32]);
    assert_eq!(actions, vec![Action::Resend { round: 3, global_digest: digest.clone() }]);
    s.handle(Event::UpdateSent { round: 3 }, t);
    assert!(on_plan(&mut s, plan(3), standing(3), t).is_empty(), "resent once per connection");
    // A restarted aggregator has a new epoch.
    let mut restarted = plan(3);
    restarted.sender_epoch = 2;
    assert_eq!(on_plan(&mut s, restarted, standing(3), t), vec![Action::Resend { round: 3, global_digest: digest }]);
}

#[test]
fn a_restarted_device_resends_the_round_its_state_recorded() {
    let t = Instant::now();
    let mut s = session(t);
    assert_eq!(kinds(&on_plan(&mut s, plan(4), standing(4), t)), ["resend"], "this process never sent it");
}

#[test]
fn a_late_plan_for_an_earlier_round_is_ignored() {
    let t = Instant::now();
    let mut s = session(t);
    assert!(on_plan(&mut s, plan(2), standing(5), t).is_empty());
    assert_eq!(s.receiving(), None);
}

#[test]
fn a_failed_round_is_declined_and_the_device_stays() {
    let t = Instant::now();
    let mut s = session(t);
    on_plan(&mut s, plan(1), standing(0), t);
    s.handle(Event::ModelReceived, t);
    let reason = "the loss is not finite".to_string();
    assert_eq!(
        s.handle(Event::RoundFailed { round: 1, reason: reason.clone(), needs_model: true }, t),
        vec![Action::Decline { round: 1, reason, needs_model: true }]
    );
    assert_eq!(kinds(&on_plan(&mut s, plan(2), standing(0), t)), ["fit", "receive"], "the next round goes on");
}

#[test]
fn a_failed_transfer_asks_again_and_keeps_waiting_for_the_round() {
    let t = Instant::now();
    let mut s = session(t);
    on_plan(&mut s, plan(1), standing(0), t);
    assert_eq!(s.handle(Event::TransferFailed("digest mismatch".into()), t), vec![Action::SendHello]);
    assert_eq!(s.receiving(), Some(1));
    s.handle(Event::ReceiveFailed { round: 1, why: "disk full".into() }, t);
    assert_eq!(s.receiving(), None);
    assert!(s.handle(Event::ModelReceived, t).is_empty());
}

#[test]
fn a_plan_announcing_more_than_its_model_is_fitted_but_not_received() {
    let t = Instant::now();
    let mut s = session(t);
    let oversized = plan_announcing((2 << 30) - 1, None);
    assert_eq!(kinds(&on_plan(&mut s, oversized, standing(0), t)), ["fit"]);
    assert_eq!(s.receiving(), None);
}

#[test]
fn a_device_holding_its_secure_update_only_advertises_its_keys_again() {
    let t = Instant::now();
    let mut s = session(t);
    let waiting = Standing { holds_secure_update: true, ..standing(0) };
    assert_eq!(kinds(&on_plan(&mut s, secure(plan(1)), waiting, t)), ["keys"]);
    assert!(on_plan(&mut s, plan(1), waiting, t).is_empty(), "a plain plan has no keys to resend");
}

#[test]
fn the_first_plan_binds_the_run_and_rejoin_restarts_the_round_count() {
    let t = Instant::now();
    let mut s = session(t);
    let fresh = Standing::default();
    assert_eq!(kinds(&on_plan(&mut s, plan(1), fresh, t)), ["bind", "fit", "receive"]);
    assert_eq!(on_plan(&mut s, plan(1), fresh, t)[0], Action::BindRun { run: 1, restart_rounds: false });

    // Another run is refused, and nothing else happens.
    let mut s = session(t);
    let other_run = Standing { run: Some(9), last_round: 7, holds_secure_update: false };
    assert!(on_plan(&mut s, plan(1), other_run, t).is_empty());
    assert_eq!(s.handle(Event::Tick, t + 2 * HELLO_EVERY), vec![Action::SendHello], "a refused plan is not heard");

    // With --rejoin the first plan of the new run binds, and round 1 is trained again.
    let mut s = Session::new("pi-7", "lab", true, t);
    let actions = on_plan(&mut s, plan(1), other_run, t);
    assert_eq!(actions[0], Action::BindRun { run: 1, restart_rounds: true });
    assert_eq!(kinds(&actions), ["bind", "fit", "receive"]);
    let mut another = plan(2);
    another.run = 2;
    assert!(on_plan(&mut s, another, standing(1), t).is_empty(), "--rejoin binds once");
}

#[test]
fn only_a_result_of_the_followed_run_finishes_the_job() {
    let t = Instant::now();
    let mut s = session(t);
    let result = |run| Event::Result { round: 5, finished: true, job: "lab".into(), run, standing: standing(4) };
    assert!(s.handle(result(2), t).is_empty(), "another run's result");
    assert_eq!(s.handle(result(1), t), vec![Action::Finish]);
    let unfinished = Event::Result { round: 5, finished: false, job: "lab".into(), run: 1, standing: standing(4) };
    assert!(s.handle(unfinished, t).is_empty());
}

#[test]
fn an_unauthentic_plan_changes_nothing() {
    let t = Instant::now();
    let mut s = session(t);
    assert!(s.handle(Event::Unauthentic { what: "plan", why: "bad signature".into() }, t).is_empty());
    assert_eq!(s.handle(Event::Tick, t + 2 * HELLO_EVERY), vec![Action::SendHello]);
}
