//! `fedpo-aggregator serve`: registration, rounds, aggregation and checkpoints.
//!
//! Each round: select S devices (seeded), publish the plan and the global model, collect
//! updates until every selected device has reported, every missing one has gone offline,
//! or the deadline passes; fold each verified update into a streaming weighted sum,
//! let the strategy apply it, checkpoint, log the metrics and announce the result.
//! Taking updates in (checks, chunks, verification) lives in [`intake`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use fedpo_transport::{LinkEvent, MqttLink, Topics};
use fedpo_wire::{
    keys, split_payload, Bundle, EncodedPayload, Hyperparameters, Limits, Message, PlanSigner, RoundPlan, RoundResult,
    TransferChunk, Update, UpdateMetrics, DEFAULT_CHUNK_BYTES,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use crate::accumulator::WeightedSum;
use crate::aggregation::RoundUpdates;
use crate::checkpoint::{CheckpointDir, DeviceRecord, ServerState, STATE_FORMAT};
use crate::client_term::ClientTerm;
use crate::diagnostics::Diagnostics;
use crate::global_model::GlobalModel;
use crate::job::JobArgs;
use crate::metrics::{mean, MetricsLog, RoundRecord, Summary};
use crate::privacy::RdpAccountant;
use crate::strategy::Strategy;

mod identity;
mod intake;
mod secure;

use identity::{Claim, Identities};

/// Resend the model to a device that asks again at most this often per round.
const MAX_RESENDS: u32 = 3;

pub(crate) struct Server {
    link: MqttLink,
    topics: Topics,
    job: JobArgs,
    out: PathBuf,
    strategy: Box<dyn Strategy>,
    client_term: ClientTerm,
    global: GlobalModel,
    state: ServerState,
    checkpoints: CheckpointDir,
    metrics: MetricsLog,
    limits: Limits,
    started: Instant,
    /// Signs every published plan (`--signing-key`).
    signer: Option<PlanSigner>,
    /// Which process speaks for each device id.
    identities: Identities,
    /// The plan's `sender_epoch`: random per process, bumped on every broker connection.
    epoch: u64,
    /// The global model's wire encoding, made when a round changed the model: closing the
    /// round needs its hash and the next round its chunks, and each encoding is a pass
    /// over the whole model. `None` when it must be made afresh.
    encoded_global: Option<EncodedPayload>,
    /// The last round's combined sum, whose buffers the next round sums into.
    spent_sum: Option<WeightedSum>,
    /// A simulation's fixed fleet size: once that many devices have said goodbye, none
    /// will come back, and waiting for them would only run out --register-timeout.
    closed_fleet: Option<usize>,
    /// The reason each device gave when it chose to leave, until it says hello again. A
    /// last will is not counted: the device may only have lost its connection.
    farewells: BTreeMap<String, String>,
}

/// A round being collected.
struct OpenRound {
    round: u64,
    evaluation: bool,
    selected: BTreeSet<String>,
    plan: RoundPlan,
    chunks: Vec<TransferChunk>,
    published_at: Instant,
    transfers: HashMap<String, (Update, Bundle)>,
    reported: BTreeMap<String, (u64, UpdateMetrics)>,
    resends: HashMap<String, u32>,
    /// Devices online when the round selected its participants (for DP's sampling rate).
    population: usize,
    updates: RoundUpdates,
    /// SCAFFOLD's Σ Δc_i.
    controls: Option<WeightedSum>,
    diagnostics: Option<Diagnostics>,
    diagnostics_bytes: u64,
    rejected: BTreeMap<String, String>,
    /// Devices whose complete, intact update was refused: resending would send the same
    /// bytes, so the round stops waiting for them.
    refused: BTreeSet<String>,
    bytes_up: u64,
    bytes_up_by_device: BTreeMap<String, u64>,
    bytes_down: u64,
    /// Secure aggregation's state, in a round that uses it.
    secure: Option<secure::SecureCollect>,
    /// The unmasked mean update of a secure round.
    secure_sum: Option<WeightedSum>,
}

/// Refuses to overwrite a job's checkpoint unless resuming it.
pub(crate) fn check_out_dir(out: &Path, resume: bool) -> Result<()> {
    if CheckpointDir::new(out).exists() && !resume {
        bail!("{} holds a checkpoint; pass --resume to continue it, or choose another --out", out.display());
    }
    Ok(())
}

impl Server {
    /// Loads the checkpoint under `out` with `resume`, or starts from the initial model.
    pub(crate) fn new(link: MqttLink, job: JobArgs, out: &Path, resume: bool) -> Result<Self> {
        job.validate()?;
        let topics = Topics::new(&job.job).map_err(anyhow::Error::msg)?;
        std::fs::create_dir_all(out)?;
        let mut checkpoints = CheckpointDir::new(out);
        let mut strategy = job.build_strategy();
        check_out_dir(out, resume)?;
        // Updates in flight wait here, not in memory (a crash leaves only partial
        // transfers, which devices resend).
        let spool = out.join("spool");
        let _ = std::fs::remove_dir_all(&spool);
        std::fs::create_dir_all(&spool).with_context(|| format!("creating {}", spool.display()))?;
        let (global, state) = if checkpoints.exists() {
            let (global, state) = checkpoints.load()?;
            if state.strategy != strategy.name() {
                bail!("the checkpoint was made with --strategy {}, not {}", state.strategy, strategy.name());
            }
            if state.job != job.job || state.method != job.method.name() {
                bail!(
                    "the checkpoint is job `{}` with method {}, not job `{}` with {}",
                    state.job,
                    state.method,
                    job.job,
                    job.method
                );
            }
            strategy.restore(&state.strategy_state)?;
            tracing::info!(round = state.round, digest = %state.global_digest, "resuming from checkpoint");
            (global, state)
        } else {
            if resume {
                tracing::warn!(out = %out.display(), "--resume given but no checkpoint found; starting fresh");
            }
            let global = job.initial_model()?;
            let state = ServerState {
                format: STATE_FORMAT.into(),
                job: job.job.clone(),
                method: job.method.name().into(),
                round: 0,
                global_digest: global.digest_hex(),
                devices: BTreeMap::new(),
                strategy: strategy.name().into(),
                strategy_state: strategy.state()?,
                bytes_up: 0,
                bytes_down: 0,
                client_term_state: Vec::new(),
                privacy: None,
                model_file: String::new(),
            };
            (global, state)
        };
        let mut client_term = job.build_client_term(&global)?;
        if !state.client_term_state.is_empty() {
            client_term.restore(&state.client_term_state)?;
        }
        let mut state = state;
        match (job.aggregation.dp_noise_multiplier, &state.privacy) {
            (Some(sigma), Some(acc)) if acc.noise_multiplier != sigma => bail!(
                "the checkpoint's rounds used --dp-noise-multiplier {}, not {sigma}",
                acc.noise_multiplier
            ),
            (Some(_), None) if state.round > 0 => bail!(
                "the checkpoint's {} rounds ran without --dp-noise-multiplier; their models are already public, so no ε can be stated for this job",
                state.round
            ),
            (Some(sigma), None) => state.privacy = Some(RdpAccountant::new(sigma)),
            (None, Some(_)) => bail!("the checkpoint's rounds ran with --dp-noise-multiplier; give it again to resume"),
            _ => {}
        }
        let metrics = MetricsLog::open(out)?;
        let signer = job.signer()?;
        link.subscribe(&topics.up_all())?;
        Ok(Self {
            signer,
            identities: Identities::default(),
            epoch: rand::random(),
            link,
            topics,
            job,
            out: out.to_path_buf(),
            strategy,
            client_term,
            global,
            state,
            checkpoints,
            metrics,
            limits: Limits::default(),
            started: Instant::now(),
            encoded_global: None,
            spent_sum: None,
            closed_fleet: None,
            farewells: BTreeMap::new(),
        })
    }

    /// Declares the fleet closed: `devices` devices, none joining later and none returning
    /// after a goodbye of its own (a simulation's). When all of them have left, the job
    /// fails with their reasons instead of waiting for devices that will not come.
    pub(crate) fn close_fleet(&mut self, devices: usize) {
        self.closed_fleet = Some(devices);
    }

    /// The error to stop with when every device of a closed fleet has said goodbye.
    fn fleet_gone(&self) -> Option<anyhow::Error> {
        let fleet = self.closed_fleet?;
        if fleet == 0 || self.farewells.len() < fleet {
            return None;
        }
        let mut reasons: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (device, reason) in &self.farewells {
            reasons.entry(reason.as_str()).or_default().push(device.as_str());
        }
        let said = reasons.iter().map(|(reason, devices)| format!("{}: {reason}", devices.join(", ")));
        let who = if fleet == 1 { "the only device".to_string() } else { format!("all {fleet} devices") };
        Some(anyhow::anyhow!("{who} left the job. {}", said.collect::<Vec<_>>().join("; ")))
    }

    /// The current global model (for tests and the simulation's report).
    pub(crate) fn global(&self) -> &GlobalModel {
        &self.global
    }

    /// Runs the remaining rounds, the closing evaluation, and announces the end.
    pub(crate) fn run(&mut self) -> Result<Summary> {
        let mut summary = Summary { method: self.job.method.name().into(), ..Summary::default() };
        while self.state.round < self.job.rounds {
            self.wait_for_devices()?;
            let record = self.run_round(self.state.round + 1, false)?;
            summary.final_train_loss = record.train_loss;
            summary.reward_acc = record.reward_acc.clone();
            summary.heldout_acc = record.heldout_acc.clone();
        }
        if !self.job.no_final_eval {
            self.wait_for_devices()?;
            let record = self.run_round(self.job.rounds + 1, true)?;
            summary.reward_acc = record.reward_acc;
            summary.heldout_acc = record.heldout_acc;
        }
        let done = RoundResult {
            round: self.state.round,
            participants: vec![],
            train_loss: summary.final_train_loss,
            global_digest: hex::decode(&self.state.global_digest).unwrap_or_default(),
            finished: true,
        };
        // Finished means resumable after a power cut too.
        self.checkpoints.wait_durable()?;
        self.link.publish(&self.topics.down(), Message::Result(done).encode())?;
        self.link.flush(Duration::from_secs(30));
        summary.rounds = self.state.round;
        summary.devices = self.state.devices.len();
        summary.reward_acc_mean = mean(&summary.reward_acc);
        summary.heldout_acc_mean = mean(&summary.heldout_acc);
        summary.bytes_up_total = self.state.bytes_up;
        summary.bytes_down_total = self.state.bytes_down;
        summary.seconds = self.started.elapsed().as_secs_f64();
        summary.global_digest = self.state.global_digest.clone();
        summary.peak_rss_mib = fedpo_device::memory::peak_rss_mib();
        let path = self.out.join("summary.json");
        fedpo_model::io::write_atomic(&path, &serde_json::to_vec_pretty(&summary)?)?;
        match crate::plots::read_records(&self.out)
            .and_then(|records| crate::plots::write_plots(&self.out, self.job.method.name(), &records))
        {
            Ok(()) => tracing::info!(out = %self.out.display(), "wrote loss.png, accuracy.png and grad_norm.png"),
            Err(e) => tracing::warn!(error = %e, "could not write the plots"),
        }
        Ok(summary)
    }

    fn online(&self) -> Vec<String> {
        self.state.devices.iter().filter(|(_, d)| d.online).map(|(id, _)| id.clone()).collect()
    }

    /// Waits until --min-devices are online (or, with none given, the devices known from a
    /// checkpoint or at least one), up to --register-timeout.
    fn wait_for_devices(&mut self) -> Result<()> {
        let want = self.job.min_devices.unwrap_or(1).max(1);
        let deadline = Instant::now() + Duration::from_secs(self.job.register_timeout);
        let mut last_report = Instant::now();
        while self.online().len() < want {
            if let Some(gone) = self.fleet_gone() {
                return Err(gone);
            }
            if Instant::now() > deadline {
                bail!(
                    "only {} of the {want} devices needed registered within --register-timeout {} s",
                    self.online().len(),
                    self.job.register_timeout
                );
            }
            if last_report.elapsed() > Duration::from_secs(10) {
                tracing::info!(online = self.online().len(), want, "waiting for devices");
                last_report = Instant::now();
            }
            self.poll(Duration::from_millis(200), None)?;
        }
        Ok(())
    }

    fn select(&self, round: u64, evaluation: bool) -> Vec<String> {
        let mut online = self.online();
        if evaluation || self.job.per_round >= online.len() {
            return online;
        }
        let mut rng = StdRng::seed_from_u64(self.job.seed ^ round.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        online.shuffle(&mut rng);
        online.truncate(self.job.per_round);
        online.sort();
        online
    }

    fn run_round(&mut self, round: u64, evaluation: bool) -> Result<RoundRecord> {
        let span = tracing::info_span!("round", round);
        let _enter = span.enter();
        let started = Instant::now();
        let population = self.online().len();
        let selected = self.select(round, evaluation);
        let encoded = self.encoded_global.take().unwrap_or_else(|| self.global.encode());
        let (manifest, mut chunks) = encoded.into_transfer(&format!("r{round}/global"));
        let mut strategy = self.strategy.configure_round(round);
        let mut sections = BTreeMap::new();
        if !evaluation {
            self.client_term.configure(&mut strategy);
            if self.job.diagnostics {
                strategy.insert(keys::DIAGNOSTICS.into(), 1.0);
            }
            for (name, payload) in self.client_term.plan_sections() {
                let (m, c) = split_payload(&format!("r{round}/{name}"), &payload, DEFAULT_CHUNK_BYTES);
                sections.insert(name, m);
                chunks.extend(c);
            }
        }
        let secure = if !evaluation && self.job.secure_aggregation {
            let max_pairs = selected.iter().filter_map(|d| self.state.devices.get(d)).map(|d| d.pairs).max();
            Some(secure::SecureCollect::new(
                round,
                &selected,
                &self.global,
                self.job.secagg_threshold,
                self.job.secagg_range,
                max_pairs.unwrap_or(1),
            )?)
        } else {
            None
        };
        let plan = RoundPlan {
            round,
            selected: selected.clone(),
            hyper: Hyperparameters {
                method: self.job.method.name().into(),
                local_steps: if evaluation { 0 } else { self.job.local_steps },
                lr: self.job.lr,
                beta: self.job.beta,
                batch_pairs: self.job.batch_pairs,
            },
            strategy,
            model_spec: serde_json::to_string(&self.global.spec)?,
            global_model: manifest,
            sections,
            signature: Vec::new(), // signed as published
            secagg: secure.as_ref().map(|s| s.settings),
            update_codec: self.job.update_codec,
            sender_epoch: self.epoch,
        };
        let training = !evaluation;
        let mut open = OpenRound {
            round,
            evaluation,
            selected: selected.iter().cloned().collect(),
            plan,
            chunks,
            published_at: Instant::now(),
            transfers: HashMap::new(),
            reported: BTreeMap::new(),
            resends: HashMap::new(),
            population,
            updates: RoundUpdates::new(&self.global, &self.job.aggregation, self.spent_sum.take()),
            controls: (training && self.client_term.required_section().is_some())
                .then(|| WeightedSum::new(&self.global)),
            diagnostics: (training && self.job.diagnostics).then(|| Diagnostics::new(&self.global)),
            diagnostics_bytes: 0,
            rejected: BTreeMap::new(),
            refused: BTreeSet::new(),
            bytes_up: 0,
            bytes_up_by_device: BTreeMap::new(),
            bytes_down: 0,
            secure,
            secure_sum: None,
        };
        tracing::info!(selected = ?selected, evaluation, "round starts");
        self.publish_plan(&mut open)?;
        let deadline = Instant::now() + Duration::from_secs(self.job.round_deadline);
        loop {
            let missing: Vec<&String> = open
                .selected
                .iter()
                .filter(|d| !open.reported.contains_key(*d) && !open.refused.contains(*d))
                .collect();
            if missing.is_empty() {
                break;
            }
            if missing.iter().all(|d| !self.state.devices.get(*d).is_some_and(|r| r.online)) {
                tracing::warn!(missing = ?missing, "every missing device went offline; closing the round");
                break;
            }
            if Instant::now() > deadline {
                tracing::warn!(missing = ?missing, "round deadline passed");
                break;
            }
            self.poll(Duration::from_millis(200), Some(&mut open))?;
            self.secure_progress(&mut open)?;
        }
        if open.secure.is_some() {
            match self.secure_unmask(&mut open, deadline) {
                Ok(sum) => open.secure_sum = Some(sum),
                Err(e) => tracing::warn!(error = %e, "secure aggregation could not unmask the sum"),
            }
        }
        self.close_round(open, started)
    }

    /// Publishes the plan and the model. A resent plan names only the devices still
    /// missing, so those that already reported do not send their update again.
    fn publish_plan(&mut self, open: &mut OpenRound) -> Result<()> {
        let mut plan = open.plan.clone();
        plan.selected.retain(|d| !open.reported.contains_key(d));
        plan.sender_epoch = self.epoch;
        if let Some(signer) = &self.signer {
            signer.sign(&mut plan);
        }
        let publishing = Instant::now();
        self.link.publish(&self.topics.down(), Message::Plan(plan).encode())?;
        for c in &open.chunks {
            open.bytes_down += c.bytes.len() as u64;
            self.link.publish(&self.topics.down(), Message::encode_chunk(c))?;
        }
        open.published_at = Instant::now();
        tracing::debug!(
            chunks = open.chunks.len(),
            seconds = format_args!("{:.3}", publishing.elapsed().as_secs_f64()),
            "plan and model handed to the link"
        );
        Ok(())
    }

    fn close_round(&mut self, mut open: OpenRound, started: Instant) -> Result<RoundRecord> {
        let participants: Vec<String> = open.reported.keys().cloned().collect();
        let weight: f64 = open.reported.values().map(|(pairs, _)| *pairs as f64).sum::<f64>().max(1.0);
        let weighted = |f: &dyn Fn(&UpdateMetrics) -> f64| {
            open.reported.values().map(|(pairs, m)| *pairs as f64 * f(m)).sum::<f64>() / weight
        };
        let mut record = RoundRecord {
            round: open.round,
            method: self.job.method.name().into(),
            evaluation: open.evaluation,
            selected: open.selected.iter().cloned().collect(),
            participants: participants.clone(),
            train_loss: weighted(&|m| m.train_loss),
            reward_acc: open.reported.iter().map(|(d, (_, m))| (d.clone(), m.reward_acc)).collect(),
            heldout_acc: open.reported.iter().filter_map(|(d, (_, m))| Some((d.clone(), m.heldout_acc?))).collect(),
            peak_rss_mib: open.reported.iter().filter_map(|(d, (_, m))| Some((d.clone(), m.peak_rss_mib?))).collect(),
            train_seconds: open.reported.iter().map(|(d, (_, m))| (d.clone(), m.seconds)).collect(),
            device_grad_norm: weighted(&|m| m.grad_norm),
            diagnostics_bytes: open.diagnostics_bytes,
            bytes_up: open.bytes_up,
            bytes_up_by_device: open.bytes_up_by_device.clone(),
            bytes_down: open.bytes_down,
            rejected: open.rejected.clone(),
            ..RoundRecord::default()
        };
        self.state.bytes_up += open.bytes_up;
        self.state.bytes_down += open.bytes_down;
        if !open.evaluation {
            let secure_sum = open.secure_sum.take();
            let updates = secure_sum.as_ref().map_or(open.updates.count(), WeightedSum::count);
            record.clipped = open.updates.clipped();
            let combined = if updates >= self.job.quorum {
                let sum = match secure_sum {
                    Some(sum) => Ok(sum),
                    None => open.updates.finish(&self.global),
                };
                sum.map_err(|e| {
                    tracing::warn!(updates, error = %e, "the round's updates cannot be combined; the global model is unchanged");
                })
            } else {
                tracing::warn!(updates, quorum = self.job.quorum, "quorum not met; the global model is unchanged");
                Err(())
            };
            let closing = Instant::now();
            if let Ok(sum) = combined {
                let local = self.job.lr * f64::from(self.job.local_steps.max(1));
                record.grad_norm = sum.mean_norm() / local;
                if let Some(report) = open.diagnostics.as_ref().map(Diagnostics::report) {
                    record.grad_norm = report.grad_norm.unwrap_or(record.grad_norm);
                    record.kappa2 = report.kappa2;
                    record.layer_cos = report.layer_cos;
                }
                let previous = self.client_term.needs_previous_model().then(|| self.global.clone());
                record.update_norm = self.strategy.aggregate(open.round, &mut self.global, &sum)?;
                let registered = self.state.devices.len();
                self.client_term.after_round(previous.as_ref(), &self.global, open.controls.as_ref(), registered);
                if let Some(acc) = self.state.privacy.as_mut() {
                    acc.add_round(open.selected.len() as f64 / open.population.max(1) as f64);
                }
                self.spent_sum = Some(sum);
            }
            self.state.round = open.round;
            let aggregated = Instant::now();
            let encoded = self.global.encode();
            self.state.global_digest = hex::encode(encoded.digest());
            self.encoded_global = Some(encoded);
            let encoded_at = Instant::now();
            self.state.strategy_state = self.strategy.state()?;
            self.state.client_term_state = self.client_term.state()?;
            self.checkpoints.save(&self.global, &self.state)?;
            tracing::debug!(
                aggregate_s = format_args!("{:.3}", (aggregated - closing).as_secs_f64()),
                encode_s = format_args!("{:.3}", (encoded_at - aggregated).as_secs_f64()),
                checkpoint_s = format_args!("{:.3}", encoded_at.elapsed().as_secs_f64()),
                "round closed"
            );
        }
        // Every record carries the privacy spent so far, evaluation rounds included.
        if let Some(acc) = &self.state.privacy {
            let (epsilon, order) = acc.epsilon(self.job.aggregation.dp_delta);
            tracing::info!(epsilon, delta = self.job.aggregation.dp_delta, order, rounds = acc.rounds, "privacy spent");
            record.dp_epsilon = Some(epsilon);
            record.dp_delta = Some(self.job.aggregation.dp_delta);
        }
        record.seconds = started.elapsed().as_secs_f64();
        self.metrics.append(&record)?;
        print_round(&record, self.job.rounds);
        let result = RoundResult {
            round: open.round,
            participants,
            train_loss: record.train_loss,
            global_digest: hex::decode(&self.state.global_digest).unwrap_or_default(),
            finished: false,
        };
        self.link.publish(&self.topics.down(), Message::Result(result).encode())?;
        Ok(record)
    }

    /// Handles link events for up to `wait`.
    fn poll(&mut self, wait: Duration, mut open: Option<&mut OpenRound>) -> Result<()> {
        let Some(event) = self.link.recv_timeout(wait)? else { return Ok(()) };
        let delivery = match event {
            LinkEvent::Message(d) => d,
            LinkEvent::Connected => {
                self.epoch = self.epoch.wrapping_add(1);
                // Back after losing the broker: whatever was in flight may be gone, so the
                // devices still missing get the plan again (those that already trained
                // answer with the same update).
                if let Some(open) = open {
                    tracing::info!(round = open.round, "reconnected to the broker; publishing the plan again");
                    self.publish_plan(open)?;
                }
                return Ok(());
            }
            LinkEvent::Disconnected(reason) => {
                tracing::warn!(%reason, "lost the broker; reconnecting");
                return Ok(());
            }
        };
        let Some(device) = self.topics.device_of(&delivery.topic).map(str::to_string) else { return Ok(()) };
        let msg = match Message::decode_shared(&delivery.payload, &self.limits) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(%device, error = %e, "ignoring undecodable message");
                return Ok(());
            }
        };
        match msg {
            Message::Hello(h) => {
                if h.device != device {
                    tracing::warn!(topic_device = %device, claimed = %h.device, "hello names another device; ignored");
                    return Ok(());
                }
                match self.identities.observe(&device, h.instance) {
                    Claim::Conflicted => return Ok(()),
                    Claim::Conflict(a, b) => {
                        tracing::error!(
                            %device,
                            instances = format_args!("{a:016x} and {b:016x}"),
                            "two devices claim this id; it is left out of the job (give each device its own --id)"
                        );
                        if let Some(d) = self.state.devices.get_mut(&device) {
                            d.online = false;
                        }
                        if let Some(open) = open {
                            open.transfers.remove(&device);
                            if open.selected.contains(&device) && !open.reported.contains_key(&device) {
                                open.rejected.insert(device.clone(), "two devices claim this id".into());
                            }
                        }
                        return Ok(());
                    }
                    Claim::Restarted => tracing::info!(%device, "device restarted"),
                    Claim::Known => {}
                }
                let previous = self.state.devices.get(&device);
                let known = previous.is_some_and(|d| d.online);
                // A new connection number: the device was cut off, and what was published
                // to it meanwhile (the plan, chunks) may be lost.
                let reconnected = previous.is_some_and(|d| d.connection != h.connection);
                if !known {
                    tracing::info!(%device, pairs = h.pairs, backend = %h.backend, "device registered");
                }
                self.farewells.remove(&device);
                let record =
                    DeviceRecord { pairs: h.pairs, backend: h.backend, online: true, connection: h.connection };
                self.state.devices.insert(device.clone(), record);
                if let Some(open) = open.as_deref_mut() {
                    let waiting = open.selected.contains(&device) && !open.reported.contains_key(&device);
                    let resends = open.resends.entry(device.clone()).or_default();
                    let asked_again = reconnected || open.published_at.elapsed() > Duration::from_secs(5);
                    if waiting && asked_again && *resends < MAX_RESENDS {
                        *resends += 1;
                        tracing::info!(%device, reconnected, "device asked again; resending the plan and model");
                        self.publish_plan(open)?;
                    }
                }
            }
            Message::Bye(b) => {
                if b.is_deliberate() {
                    self.farewells.insert(device.clone(), b.reason.clone());
                }
                if let Some(d) = self.state.devices.get_mut(&device) {
                    if d.online {
                        tracing::warn!(%device, reason = %b.reason, "device offline");
                    }
                    d.online = false;
                }
            }
            Message::Update(_) | Message::Chunk(_) | Message::SecAgg(_) | Message::Declined(_)
                if self.identities.is_conflicted(&device) => {}
            Message::Declined(d) => match open {
                Some(open) if d.device == device && d.round == open.round && open.selected.contains(&device) => {
                    if !open.reported.contains_key(&device) && open.refused.insert(device.clone()) {
                        tracing::warn!(%device, reason = %d.reason, "device sits this round out");
                        open.transfers.remove(&device);
                        open.rejected.insert(device, format!("declined: {}", d.reason));
                    }
                }
                _ => tracing::debug!(%device, round = d.round, "a decline for no round of this device's; ignored"),
            },
            Message::SecAgg(m) => {
                if let Some(open) = open {
                    self.secure_message(open, &device, m);
                }
            }
            Message::Update(u) => {
                if let Some(open) = open {
                    self.start_update(open, &device, u);
                } else {
                    tracing::warn!(%device, round = u.round, "update outside a round; ignored");
                }
            }
            Message::Chunk(c) => {
                if let Some(open) = open {
                    self.accept_chunk(open, &device, c);
                }
            }
            Message::Plan(_) | Message::Result(_) => {
                tracing::warn!(%device, "a device published an aggregator message; ignored");
            }
        }
        Ok(())
    }
}

fn print_round(r: &RoundRecord, rounds: u64) {
    let label = if r.evaluation { "final eval".to_string() } else { format!("round {:>3}/{rounds}", r.round) };
    println!(
        "{label}  devices {}/{}  loss {:.4}  train acc {:.3}  held-out acc {:.3}  |g| {:.4}  up {:.1} MB  down {:.1} MB  {:.1} s",
        r.participants.len(),
        r.selected.len(),
        r.train_loss,
        mean(&r.reward_acc),
        mean(&r.heldout_acc),
        r.grad_norm,
        r.bytes_up as f64 / 1e6,
        r.bytes_down as f64 / 1e6,
        r.seconds
    );
}
