//! A device's round logic, without I/O.
//!
//! [`Session`] decides what a device does with each thing that happens to it: which plans
//! it follows, when it says hello again, when it resends an update instead of training,
//! when a plan is a duplicate, when a round's model may be downloaded and when it is
//! complete, and when to decline. It never publishes, reads a file or waits: events go in,
//! [`Action`]s come out, and `Participant`'s loop (the driver) carries them out over MQTT
//! and on disk. So every rule here is tested without a broker, next to the code, as
//! rumqttc tests its `state.rs` apart from its event loop.
//!
//! What the device has on disk (the run it follows, the last round it sent) comes in with
//! each plan as a [`Standing`] read by the driver, rather than mirrored here: the state
//! directory stays the one record, and a crash between the two cannot leave them apart.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fedpo_transport::WarnThrottle;
use fedpo_wire::RoundPlan;

use super::admission::{admit, Admission};
use super::download::check_download;

/// Until the aggregator answers, the device says hello this often: it may start later.
pub(crate) const HELLO_EVERY: Duration = Duration::from_secs(2);

/// What the device's state says when a plan or a result arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Standing {
    /// The run the state directory follows, if any.
    pub(crate) run: Option<u64>,
    /// The last round whose update the device recorded as sent.
    pub(crate) last_round: u64,
    /// This device trained the plan's round of secure aggregation and holds its masked
    /// update until the other devices' shares are relayed.
    pub(crate) holds_secure_update: bool,
}

/// Something that happened to the device.
#[derive(Debug)]
pub(crate) enum Event {
    /// The driver starts: the first hello goes out.
    Started,
    /// The driver looked at the clock (after every wait for a message).
    Tick,
    /// The link (re)connected to the broker.
    Connected,
    /// The link lost the broker; it reconnects on its own.
    Disconnected(String),
    /// A plan whose signature verified (or no key is pinned).
    Plan(Arc<RoundPlan>, Standing),
    /// A result whose signature verified, for `(job, run)`.
    Result { round: u64, finished: bool, job: String, run: u64, standing: Standing },
    /// A plan or result that is not the aggregator's: `what` it was and why.
    Unauthentic { what: &'static str, why: String },
    /// The pending round's transfers could not be started (the driver's bundle refused).
    ReceiveFailed { round: u64, why: String },
    /// A chunk of the pending round's transfers failed verification.
    TransferFailed(String),
    /// The pending round's transfers are complete and verified.
    ModelReceived,
    /// Training or sending `round` failed.
    /// `needs_model`: it failed because the round's deltas did not apply to the model the
    /// device holds.
    RoundFailed { round: u64, reason: String, needs_model: bool },
    /// `round`'s update went out on the current connection (sent or resent).
    UpdateSent { round: u64 },
}

/// What the driver is to do.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Action {
    /// Publish a hello with [`Session::connection`].
    SendHello,
    /// Record in the state directory that the device follows `run`; `restart_rounds`:
    /// it followed another before, and its round count starts again.
    BindRun { run: u64, restart_rounds: bool },
    /// Resend the update kept for `round`, if it was made from the model `global_digest`.
    Resend { round: u64, global_digest: String },
    /// Plan the round's micro-batch under the memory budget; a model that cannot fit ends
    /// the device's part in the job.
    FitMemory(Arc<RoundPlan>),
    /// Advertise this round's secure-aggregation keys (the same ones again on a resend).
    AdvertiseKeys(Arc<RoundPlan>),
    /// Start receiving the plan's transfers, replacing any pending ones.
    Receive(Arc<RoundPlan>),
    /// Train the round on the received model and send the update.
    Train(Arc<RoundPlan>),
    /// Tell the aggregator not to wait for this device's update of `round`.
    /// Tell the aggregator not to wait for this device's update of `round` (and, with
    /// `needs_model`, that its next plan must carry the whole model).
    Decline { round: u64, reason: String, needs_model: bool },
    /// The job is finished: say goodbye and leave.
    Finish,
}

/// A device's part in a job, between I/O.
#[derive(Debug)]
pub(crate) struct Session {
    id: String,
    job: String,
    /// `--rejoin`, until a new run has been joined.
    rejoin: bool,
    /// Connections to the broker so far, sent with every hello.
    connection: u32,
    /// Whether the first `Connected` (the one the first hello went out on) was seen.
    connected_once: bool,
    /// Whether a plan or result of the aggregator's arrived: hellos stop repeating.
    heard_aggregator: bool,
    last_hello: Instant,
    /// The `sender_epoch` of the latest plan that selected this device.
    plan_epoch: u64,
    /// The round, the aggregator's epoch and our connection when this process last sent
    /// an update: a plan for that round under the same two asks for nothing new.
    sent_under: Option<(u64, u64, u32)>,
    /// The plan whose transfers are being received, and since when.
    receiving: Option<(Arc<RoundPlan>, Instant)>,
    /// Warnings about refused messages, rate-limited.
    refused: WarnThrottle,
}

impl Session {
    /// Device `id` of `job`, at `now`; `rejoin` lets the first plan of a new run rebind it.
    pub(crate) fn new(id: &str, job: &str, rejoin: bool, now: Instant) -> Self {
        Self {
            id: id.to_string(),
            job: job.to_string(),
            rejoin,
            connection: 1,
            connected_once: false,
            heard_aggregator: false,
            last_hello: now,
            plan_epoch: 0,
            sent_under: None,
            receiving: None,
            refused: WarnThrottle::default(),
        }
    }

    /// Connections to the broker so far, counting this one: each hello carries it.
    pub(crate) fn connection(&self) -> u32 {
        self.connection
    }

    /// The round whose transfers are being received, if any.
    #[cfg(test)]
    pub(crate) fn receiving(&self) -> Option<u64> {
        self.receiving.as_ref().map(|(p, _)| p.round)
    }

    /// Takes in one event at `now`; returns what to do, in order.
    pub(crate) fn handle(&mut self, event: Event, now: Instant) -> Vec<Action> {
        let mut actions = Vec::new();
        match event {
            Event::Started => actions.push(Action::SendHello),
            Event::Tick => {
                if !self.heard_aggregator && now.saturating_duration_since(self.last_hello) > HELLO_EVERY {
                    actions.push(Action::SendHello);
                    self.last_hello = now;
                }
            }
            Event::Connected if !self.connected_once => self.connected_once = true,
            Event::Connected => {
                // After a reconnect, plans, chunks or our own update may have been lost: a
                // hello with a new connection number asks for the plan again.
                self.connection += 1;
                actions.push(Action::SendHello);
            }
            Event::Disconnected(reason) => tracing::warn!(%reason, "lost the broker; reconnecting"),
            Event::Plan(plan, standing) => self.on_plan(plan, standing, now, &mut actions),
            Event::Result { round, finished, job, run, standing } => {
                match admit(&self.job, standing.run, false, &job, run) {
                    Admission::Refuse(why) => {
                        self.refused.warn("aggregator", "result", &format!("refusing round {round}'s result: {why}"))
                    }
                    // A result never binds: it carries no model to follow.
                    Admission::Follow | Admission::Join => {
                        self.heard_aggregator = true;
                        if finished {
                            tracing::info!(round, "job finished");
                            actions.push(Action::Finish);
                        }
                    }
                }
            }
            Event::Unauthentic { what, why } => {
                self.refused.warn("aggregator", what, &format!("refusing a {what} that is not the aggregator's: {why}"))
            }
            Event::ReceiveFailed { round, why } => {
                tracing::warn!(round, "ignoring a plan whose transfers cannot be received: {why}");
                self.receiving = None;
            }
            Event::TransferFailed(why) => {
                tracing::warn!(error = %why, "global model transfer failed; asking again");
                actions.push(Action::SendHello);
            }
            Event::ModelReceived => {
                if let Some((plan, since)) = self.receiving.take() {
                    tracing::debug!(
                        round = plan.round,
                        seconds = format_args!("{:.3}", now.saturating_duration_since(since).as_secs_f64()),
                        "model received"
                    );
                    actions.push(Action::Train(plan));
                }
            }
            Event::RoundFailed { round, reason, needs_model } => {
                // A round that cannot run (a model that does not fit, a non-finite loss)
                // costs this round only: the device stays in the job and the aggregator's
                // deadline moves on.
                tracing::error!(round, error = %reason, "round failed; waiting for the next plan");
                actions.push(Action::Decline { round, reason, needs_model });
            }
            Event::UpdateSent { round } => self.sent_under = Some((round, self.plan_epoch, self.connection)),
        }
        actions
    }

    fn on_plan(&mut self, plan: Arc<RoundPlan>, standing: Standing, now: Instant, actions: &mut Vec<Action>) {
        let mut last_round = standing.last_round;
        match admit(&self.job, standing.run, self.rejoin, &plan.job, plan.run) {
            Admission::Follow => {}
            Admission::Join => {
                let restart_rounds = standing.run.is_some();
                if let Some(old) = standing.run {
                    tracing::warn!(
                        old_run = %format!("{old:016x}"),
                        run = %format!("{:016x}", plan.run),
                        last_round,
                        "rejoining the job in a new run; its rounds count from 1 again"
                    );
                    last_round = 0;
                } else {
                    tracing::info!(run = %format!("{:016x}", plan.run), "following the job's run");
                }
                actions.push(Action::BindRun { run: plan.run, restart_rounds });
                self.rejoin = false;
            }
            Admission::Refuse(why) => {
                self.refused.warn("aggregator", "plan", &format!("refusing round {}'s plan: {why}", plan.round));
                return;
            }
        }
        self.heard_aggregator = true;
        if !plan.selected.iter().any(|d| d == &self.id) {
            return;
        }
        self.plan_epoch = plan.sender_epoch;
        if plan.round < last_round {
            let why =
                format!("ignoring round {}'s plan: this device trained round {last_round} of the run", plan.round);
            self.refused.warn("aggregator", "old round", &why);
            return;
        }
        if standing.holds_secure_update {
            // Resent while this device waits for the others' shares: it trained already;
            // its keys may have been lost, so send them again.
            if plan.secagg.is_some() {
                actions.push(Action::AdvertiseKeys(plan));
            }
            return;
        }
        if plan.round == last_round {
            if self.sent_under == Some((plan.round, plan.sender_epoch, self.connection)) {
                // Resent for another device: ours is on its way, or arrived.
                return;
            }
            // The aggregator restarted or reconnected mid-round, or we did, or this
            // process never sent it: send the same update again.
            let global_digest = hex::encode(plan.model_digest());
            actions.push(Action::Resend { round: plan.round, global_digest });
            return;
        }
        if self.receiving.as_ref().is_some_and(|(p, _)| p.round == plan.round && p.global_model == plan.global_model) {
            // The same plan again, e.g. resent for another device; the keys may have been
            // lost with it.
            if plan.secagg.is_some() {
                actions.push(Action::AdvertiseKeys(plan));
            }
            return;
        }
        actions.push(Action::FitMemory(plan.clone()));
        if plan.secagg.is_some() {
            actions.push(Action::AdvertiseKeys(plan.clone()));
        }
        // Whoever can publish on the down topic can announce any size: a plan is followed
        // only for a transfer its own model spec accounts for.
        if let Err(why) = check_download(&plan) {
            tracing::warn!(round = plan.round, "ignoring a plan whose transfers do not fit it: {why}");
            return;
        }
        tracing::info!(round = plan.round, bytes = plan.global_model.bytes, "selected; receiving the model");
        actions.push(Action::Receive(plan.clone()));
        self.receiving = Some((plan, now));
    }
}

#[cfg(test)]
mod tests;
