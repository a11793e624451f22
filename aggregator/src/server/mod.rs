//! `fedpo-aggregator serve`: registration, rounds, aggregation and checkpoints.
//!
//! Each round: select S devices (seeded), publish the plan and the global model, collect
//! updates until every selected device has reported, every missing one has gone offline,
//! or the deadline passes; fold each verified update into a streaming weighted sum,
//! let the strategy apply it, checkpoint, log the metrics and announce the result.
//! Who is in the job (hello, goodbye, waiting for devices) lives in [`membership`], taking
//! updates in (checks, chunks, verification) in [`intake`], and closing a round (combining,
//! checkpointing, announcing) in [`closing`].

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use fedpo_transport::{LinkEvent, MqttLink, Topics, WarnThrottle};
use fedpo_wire::{
    keys, split_payload, Bundle, EncodedPayload, Hyperparameters, Limits, Manifest, Message, RoundPlan, RoundResult,
    Signer, TransferChunk, Update, DEFAULT_CHUNK_BYTES,
};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use crate::algorithms::client_term::ClientTerm;
use crate::algorithms::dp::RdpAccountant;
use crate::algorithms::strategy::Strategy;
use crate::checkpoint::{CheckpointDir, ServerState, STATE_FORMAT};
use crate::combine::RoundUpdates;
use crate::combined_update::CombinedUpdate;
use crate::diagnostics::Diagnostics;
use crate::downlink::{DownlinkStream, RoundDownload};
use crate::global_model::GlobalModel;
use crate::job_args::JobArgs;
use crate::metrics::{mean, MetricsLog, RoundRecord, Summary};
use crate::weighted_sum::WeightedSum;

mod closing;
mod collector;
mod identity;
mod intake;
mod membership;
mod secure_collect;

use collector::{Decline, RoundCollector, Status};
use identity::Identities;

pub(crate) struct Aggregator {
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
    signer: Option<Signer>,
    /// Which process speaks for each device id.
    identities: Identities,
    /// Warnings about what devices send, rate-limited per device and kind.
    warnings: WarnThrottle,
    /// The devices that may join (--devices-file, or the broker's users); `None`: any.
    allowed: Option<std::collections::BTreeSet<String>>,
    /// The embedded broker's logins: a device listed must tag its hellos and goodbyes
    /// with its password (see `fedpo_wire::device_tag`).
    device_passwords: Option<std::collections::HashMap<String, String>>,
    /// The plan's `sender_epoch`: random per process, bumped on every broker connection.
    epoch: u64,
    /// The global model's wire encoding, made when a round changed the model: closing the
    /// round needs its hash and the next round its chunks, and each encoding is a pass
    /// over the whole model. `None` when it must be made afresh.
    encoded_global: Option<EncodedPayload>,
    /// The last round's combined sum, whose buffers the next round sums into.
    spent_sum: Option<WeightedSum>,
    /// The compressed downlink's public model and chain (`--downlink-codec`); `None`: the
    /// whole model goes down every round.
    downlink: Option<DownlinkStream>,
    /// A simulation's fixed fleet size: once that many devices have said goodbye, none
    /// will come back, and waiting for them would only run out --register-timeout.
    closed_fleet: Option<usize>,
    /// The reason each device gave when it chose to leave, until it says hello again. A
    /// last will is not counted: the device may only have lost its connection.
    farewells: BTreeMap<String, String>,
}

/// A round being collected: its bookkeeping, and the plan, transfers and sums the
/// bookkeeping decides about.
struct OpenRound {
    collector: RoundCollector,
    plan: RoundPlan,
    chunks: Vec<TransferChunk>,
    transfers: HashMap<String, (Update, Bundle)>,
    /// Devices online when the round selected its participants (for DP's sampling rate).
    population: usize,
    updates: RoundUpdates,
    diagnostics: Option<Diagnostics>,
    diagnostics_bytes: u64,
    bytes_up: u64,
    bytes_up_by_device: BTreeMap<String, u64>,
    bytes_down: u64,
    /// Secure aggregation's state, in a round that uses it.
    secure: Option<secure_collect::SecureCollect>,
    /// The unmasked mean update of a secure round.
    secure_sum: Option<CombinedUpdate>,
}

/// Refuses to overwrite a job's checkpoint unless resuming it.
pub(crate) fn check_out_dir(out: &Path, resume: bool) -> Result<()> {
    if CheckpointDir::new(out).exists() && !resume {
        bail!("{} holds a checkpoint; pass --resume to continue it, or choose another --out", out.display());
    }
    Ok(())
}

impl Aggregator {
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
            let mut state = state;
            if state.run == 0 {
                state.run = new_run();
                tracing::info!(run = %format!("{:016x}", state.run), "the checkpoint predates runs; this is a new one");
            }
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
                run: new_run(),
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
                downlink: None,
            };
            // The run is fixed from here on: a crash before the first round closes
            // resumes it, rather than starting one its devices would refuse.
            checkpoints.save(&global, &state, None)?;
            (global, state)
        };
        tracing::info!(run = %format!("{:016x}", state.run), round = state.round, "job run");
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
        let downlink = job.downlink().map(|codec| {
            let public = checkpoints.load_public(&state, &global);
            match (public, state.downlink.as_ref().and_then(|d| hex::decode(&d.public_digest).ok())) {
                (Some(public), Some(digest)) => DownlinkStream::resumed(codec, public, digest),
                _ => DownlinkStream::new(codec),
            }
        });
        let metrics = MetricsLog::open(out)?;
        let signer = job.signer()?;
        link.subscribe(&topics.up_all())?;
        Ok(Self {
            signer,
            identities: Identities::default(),
            warnings: WarnThrottle::default(),
            allowed: job.devices_file.as_deref().map(crate::job_args::read_devices_file).transpose()?,
            device_passwords: None,
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
            downlink,
            closed_fleet: None,
            farewells: BTreeMap::new(),
        })
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
            ..RoundResult::default()
        };
        // Finished means resumable after a power cut too.
        self.checkpoints.wait_durable()?;
        self.publish_result(done)?;
        self.link.flush(Duration::from_secs(30));
        summary.rounds = self.state.round;
        summary.devices = self.state.devices.len();
        summary.reward_acc_mean = mean(&summary.reward_acc);
        summary.heldout_acc_mean = mean(&summary.heldout_acc);
        summary.bytes_up_total = self.state.bytes_up;
        summary.bytes_down_total = self.state.bytes_down;
        summary.seconds = self.started.elapsed().as_secs_f64();
        summary.global_digest = self.state.global_digest.clone();
        summary.peak_rss_mib = fedpo_process::usage::peak_rss_mib();
        let path = self.out.join("summary.json");
        fedpo_process::files::write_atomic(&path, &serde_json::to_vec_pretty(&summary)?)?;
        match crate::plots::read_records(&self.out)
            .and_then(|records| crate::plots::write_plots(&self.out, self.job.method.name(), &records))
        {
            Ok(()) => tracing::info!(out = %self.out.display(), "wrote loss.png, accuracy.png and grad_norm.png"),
            Err(e) => tracing::warn!(error = %e, "could not write the plots"),
        }
        Ok(summary)
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
        let (manifest, mut chunks, mut sections, downlink) = self.round_download(round, &selected);
        let mut strategy = self.strategy.configure_round(round);
        if !evaluation {
            self.client_term.begin_round(&self.global);
            self.client_term.configure(&mut strategy);
            if self.job.diagnoses(round) {
                strategy.insert(keys::DIAGNOSTICS.into(), 1.0);
            }
            if !self.job.evaluates_heldout(round) {
                strategy.insert(keys::HELDOUT_EVAL.into(), 0.0);
            }
            for (name, payload) in self.client_term.plan_sections() {
                let (m, c) = split_payload(&format!("r{round}/{name}"), &payload, DEFAULT_CHUNK_BYTES);
                sections.insert(name, m);
                chunks.extend(c);
            }
        }
        let secure = if !evaluation && self.job.secure_aggregation {
            let max_pairs = selected.iter().filter_map(|d| self.state.devices.get(d)).map(|d| d.pairs).max();
            Some(secure_collect::SecureCollect::new(
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
            downlink,
            sender_epoch: self.epoch,
            job: self.job.job.clone(),
            run: self.state.run,
        };
        let training = !evaluation;
        let mut open = OpenRound {
            collector: RoundCollector::new(round, evaluation, &selected, Duration::from_secs(self.job.round_deadline)),
            plan,
            chunks,
            transfers: HashMap::new(),
            population,
            updates: RoundUpdates::new(&self.global, &self.job.aggregation, self.spent_sum.take()),
            diagnostics: (training && self.job.diagnoses(round)).then(|| Diagnostics::new(&self.global)),
            diagnostics_bytes: 0,
            bytes_up: 0,
            bytes_up_by_device: BTreeMap::new(),
            bytes_down: 0,
            secure,
            secure_sum: None,
        };
        tracing::info!(selected = ?selected, evaluation, "round starts");
        self.publish_plan(&mut open)?;
        loop {
            let online = |d: &str| self.state.devices.get(d).is_some_and(|r| r.online);
            match open.collector.status(Instant::now(), online) {
                Status::Waiting => {}
                Status::Complete => break,
                Status::MissingOffline(missing) => {
                    tracing::warn!(missing = ?missing, "every missing device went offline; closing the round");
                    break;
                }
                Status::DeadlinePassed(missing) => {
                    tracing::warn!(missing = ?missing, "round deadline passed");
                    break;
                }
            }
            self.poll(Duration::from_millis(200), Some(&mut open))?;
            self.secure_progress(&mut open)?;
        }
        let deadline = open.collector.deadline().unwrap_or_else(Instant::now);
        if open.secure.is_some() {
            match self.secure_unmask(&mut open, deadline) {
                Ok(sum) => open.secure_sum = Some(sum),
                Err(e) => tracing::warn!(error = %e, "secure aggregation could not unmask the sum"),
            }
        }
        self.close_round(open, started)
    }

    /// What round `round` sends down to the `selected` devices: the whole model, or with a
    /// compressed downlink the chain of deltas from the oldest model one of them holds.
    fn round_download(
        &mut self,
        round: u64,
        selected: &[String],
    ) -> (Manifest, Vec<TransferChunk>, BTreeMap<String, Manifest>, Option<fedpo_wire::Downlink>) {
        let encoded = self.encoded_global.take().unwrap_or_else(|| self.global.encode());
        let mut sections = BTreeMap::new();
        let Some(stream) = self.downlink.as_mut() else {
            let (manifest, chunks) = encoded.into_transfer(&format!("r{round}/global"));
            return (manifest, chunks, sections, None);
        };
        let held: Vec<Vec<u8>> = selected
            .iter()
            .map(|d| self.state.devices.get(d).and_then(|r| hex::decode(&r.holds).ok()).unwrap_or_default())
            .collect();
        let held: Vec<&[u8]> = held.iter().map(Vec::as_slice).collect();
        match stream.download(round, &self.global, encoded.digest(), &held) {
            RoundDownload::Full => {
                tracing::info!(codec = %stream.codec(), "downlink: the whole model, which the selected devices do not all hold");
                let (manifest, chunks) = encoded.into_transfer(&format!("r{round}/global"));
                (manifest, chunks, sections, None)
            }
            RoundDownload::Chain(downlink, payloads) => {
                let mut main = None;
                let mut chunks = Vec::new();
                for (section, payload) in payloads {
                    if section.is_empty() {
                        let (m, c) = payload.into_transfer(&format!("r{round}/global"));
                        main = Some(m);
                        chunks.extend(c);
                    } else {
                        let (m, c) = payload.into_transfer(&format!("r{round}/{section}"));
                        sections.insert(section, m);
                        chunks.extend(c);
                    }
                }
                tracing::info!(codec = %downlink.codec, steps = downlink.steps.len(), "downlink: deltas");
                self.encoded_global = Some(encoded);
                let main = main.expect("a chain ends in the model transfer");
                (main, chunks, sections, Some(downlink))
            }
        }
    }

    /// Publishes a round's result, naming the job and the run, signed when the job has
    /// a signing key: devices that pin it end only on a result it signed for their run.
    pub(super) fn publish_result(&self, mut result: RoundResult) -> Result<()> {
        result.job = self.job.job.clone();
        result.run = self.state.run;
        if let Some(signer) = &self.signer {
            signer.sign(&mut result);
        }
        self.link.publish(&self.topics.down(), Message::Result(result).encode())?;
        Ok(())
    }

    /// Publishes the plan and the model. A resent plan names only the devices still
    /// missing, so those that already reported do not send their update again.
    fn publish_plan(&mut self, open: &mut OpenRound) -> Result<()> {
        let mut plan = open.plan.clone();
        plan.selected.retain(|d| !open.collector.has_reported(d));
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
        open.collector.published(Instant::now());
        tracing::debug!(
            chunks = open.chunks.len(),
            seconds = format_args!("{:.3}", publishing.elapsed().as_secs_f64()),
            "plan and model handed to the link"
        );
        Ok(())
    }

    /// Handles link events for up to `wait`.
    fn poll(&mut self, wait: Duration, open: Option<&mut OpenRound>) -> Result<()> {
        let Some(event) = self.link.recv_timeout(wait)? else { return Ok(()) };
        let delivery = match event {
            LinkEvent::Message(d) => d,
            LinkEvent::Connected => {
                self.epoch = self.epoch.wrapping_add(1);
                // Back after losing the broker: whatever was in flight may be gone, so the
                // devices still missing get the plan again (those that already trained
                // answer with the same update).
                if let Some(open) = open {
                    tracing::info!(
                        round = open.collector.round(),
                        "reconnected to the broker; publishing the plan again"
                    );
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
                self.warnings.warn(&device, "undecodable", &format!("ignoring undecodable message: {e}"));
                // An honest device never sends one (sizes are checked as a message is
                // decoded): a device the round waits for is not waited for any longer.
                if let Some(open) = open {
                    if open.collector.undecodable(&device, &e.to_string()) {
                        open.transfers.remove(&device);
                    }
                }
                return Ok(());
            }
        };
        match msg {
            Message::Hello(h) => self.on_hello(device, h, open)?,
            Message::Bye(b) => self.on_bye(device, &b),
            Message::Update(_) | Message::Chunk(_) | Message::SecAgg(_) | Message::Declined(_)
                if self.identities.is_conflicted(&device) => {}
            Message::Declined(d) => {
                if d.needs_model && d.device == device {
                    tracing::warn!(%device, round = d.round, "the device's model is not the one the downlink assumed; it gets the whole model next");
                    if let Some(record) = self.state.devices.get_mut(&device) {
                        record.holds.clear();
                    }
                }
                let decline = match open {
                    Some(open) if d.device == device => {
                        let decline = open.collector.decline(&device, d.round, &d.reason);
                        if decline == Decline::Counted {
                            tracing::warn!(%device, reason = %d.reason, "device sits this round out");
                            open.transfers.remove(&device);
                        }
                        decline
                    }
                    _ => Decline::NotForThisRound,
                };
                if decline == Decline::NotForThisRound {
                    tracing::debug!(%device, round = d.round, "a decline for no round of this device's; ignored");
                }
            }
            Message::SecAgg(m) => {
                if let Some(open) = open {
                    self.secure_message(open, &device, m);
                }
            }
            Message::Update(u) => {
                if let Some(open) = open {
                    self.start_update(open, &device, u);
                } else {
                    self.warnings.warn(
                        &device,
                        "update",
                        &format!("round {}: update outside a round; ignored", u.round),
                    );
                }
            }
            Message::Chunk(c) => {
                if let Some(open) = open {
                    self.accept_chunk(open, &device, c);
                }
            }
            Message::Plan(_) | Message::Result(_) => {
                self.warnings.warn(&device, "aggregator message", "a device published an aggregator message; ignored");
            }
        }
        Ok(())
    }
}

/// A run id: random, never 0 (what states from before runs hold).
fn new_run() -> u64 {
    rand::random::<u64>().max(1)
}
