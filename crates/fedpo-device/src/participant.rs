//! A device taking part in a federated job.
//!
//! The device says hello, then waits. For each round plan that selects it, it collects
//! the global model's chunks (verified by their digest), trains with its private adapter,
//! saves the adapter, and uploads the shared delta as an update followed by chunks. It
//! leaves when the aggregator announces the job finished, or when told to stop.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Device;
use fedpo_data::{fingerprint, tokenize_pairs, PreferencePair, TokenizedPair};
use fedpo_model::Gpt2Tokenizer;
use fedpo_transport::{BrokerUrl, LinkEvent, LinkOptions, MqttLink, TlsFiles, Topics};
use fedpo_wire::{
    Bundle, BundleProgress, DeviceBye, DeviceHello, Limits, Message, RoundDeclined, RoundPlan, TensorPayload,
    TrustedKey,
};

use crate::local_round::{train_round, RoundInputs};

use crate::state_dir::StateDir;

mod admission;
mod download;
mod memory_plan;
mod secure_round;
mod session;
mod slots;
#[cfg(test)]
mod test_plan;
mod upload;

pub use slots::{Slot, TrainingSlots};

use download::{receive, Received};
use session::{Action, Event, Session, Standing};
use upload::publish_update;

pub use crate::error::ParticipantError;

/// A rewrite of a device's update payload ([`ParticipantConfig::rewrite_update`]).
pub type UpdateRewrite = Arc<dyn Fn(&TensorPayload) -> TensorPayload + Send + Sync>;

/// Everything a participant needs.
pub struct ParticipantConfig {
    /// The broker.
    pub broker: BrokerUrl,
    /// TLS files for `mqtts://`.
    pub tls: TlsFiles,
    /// Job name (the topic prefix).
    pub job: String,
    /// Device id, unique in the job.
    pub id: String,
    /// Where the adapter, reference cache and progress live.
    pub state_dir: PathBuf,
    /// Training pairs.
    pub train: Vec<PreferencePair>,
    /// Held-out pairs, for the held-out reward accuracy.
    pub heldout: Vec<PreferencePair>,
    /// Tokens per sequence after truncation.
    pub max_len: usize,
    /// The job's trimmed vocabulary (`simulate --trim-vocab`): the pairs are tokenized into
    /// it, and the job's model must have as many tokens. `None`: GPT-2's whole vocabulary.
    pub vocab: Option<Arc<fedpo_model::TrimmedVocab>>,
    /// Where the model computes.
    pub compute: Device,
    /// Memory budget for training, MiB: each round's micro-batch is planned to fit it, and a
    /// model that cannot fit makes the device leave the job before downloading it.
    pub max_memory_mib: Option<u64>,
    /// The most pairs one forward pass takes (`--micro-batch-pairs`): a round's batch of
    /// more is trained in several passes with gradient accumulation. `--max-memory` may
    /// plan fewer; `None` leaves it to the budget, or runs the whole batch in one pass.
    pub max_micro_batch_pairs: Option<usize>,
    /// Keep each round's starting model on disk while it trains (`--start-on-disk`), not
    /// beside the gradients; `--max-memory` also asks for it when a round needs it.
    pub start_on_disk: bool,
    /// Dtype of matmuls and activations (f32, or bf16/f16 for mixed precision).
    pub compute_dtype: candle_core::DType,
    /// The aggregator's pinned public key: plans (and so models) and results whose
    /// signature does not verify are refused. `None` accepts any.
    pub trusted_key: Option<TrustedKey>,
    /// Follow a new run of the job even though the state directory followed another
    /// (`--rejoin`, after the aggregator started the job afresh): its rounds count anew.
    pub rejoin: bool,
    /// Start a fresh private adapter when the one this device saved is missing
    /// (`--reset-adapter`); without it, that is an error naming the file.
    pub reset_adapter: bool,
    /// This device is alone in its process (`fedpo-device run`), so the process's peak
    /// resident memory is its own and goes with each update. Devices simulated in one
    /// process leave it out rather than each report the whole process's.
    pub alone_in_process: bool,
    /// Shared by the devices of one process to limit how many train at once; `None`: no
    /// limit.
    pub training_slots: Option<Arc<TrainingSlots>>,
    /// Rewrites every update after training, before it is encoded: a simulated attacker
    /// (`simulate --attackers`) or a test's. `None` on a real device.
    pub rewrite_update: Option<UpdateRewrite>,
    /// Set to stop the participant between rounds.
    pub stop: Arc<AtomicBool>,
}

/// What a participant did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ParticipantSummary {
    /// Rounds it trained (or evaluated) in this run.
    pub rounds: Vec<u64>,
    /// Bytes of updates it published.
    pub bytes_up: u64,
    /// Bytes of global models it received.
    pub bytes_down: u64,
    /// Rounds that kept their starting model on disk while training.
    pub rounds_with_start_on_disk: Vec<u64>,
}

/// `message` tagged with the device's broker password, where its URL has one: an
/// aggregator hosting a broker without per-topic ACLs tells it from a forgery by that.
fn tagged<M: fedpo_wire::device_tag::Tagged>(mut message: M, broker: &BrokerUrl) -> M {
    if let Some(password) = &broker.password {
        fedpo_wire::device_tag::tag(&mut message, password);
    }
    message
}

/// A seed from the device id, so every device's fresh adapter differs.
fn device_seed(id: &str) -> u64 {
    id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

struct Participant {
    cfg: ParticipantConfig,
    topics: Topics,
    state: StateDir,
    /// Where a device that takes turns to train keeps each round's model until its turn;
    /// `None`: a device alone in its process receives the model in memory.
    incoming: Option<PathBuf>,
    link: MqttLink,
    train: Vec<TokenizedPair>,
    heldout: Vec<TokenizedPair>,
    pad_id: u32,
    /// One past the largest token id in this device's pairs: the job's model needs at
    /// least that many tokens.
    vocab_needed: usize,
    limits: Limits,
    summary: ParticipantSummary,
    /// The micro-batch the memory budget allows for the pending round's model.
    micro_batch_pairs: Option<usize>,
    /// Whether the pending round keeps its starting model on disk: asked for
    /// (`--start-on-disk`), or needed by the memory budget.
    start_on_disk: bool,
    /// This process's instance number, sent with every hello.
    instance: u64,
    /// The round logic: what to do with each event.
    session: Session,
    /// The pending round's transfers, while they arrive.
    bundle: Option<Bundle>,
    /// The pending round's transfers, complete, until the session says to train.
    received: Option<Received>,
    /// The current round's secure-aggregation state, if its plan asked for it.
    secure: Option<secure_round::SecureRound>,
}

/// Joins the job and takes part until the aggregator finishes it or `cfg.stop` is set.
pub fn run(cfg: ParticipantConfig) -> Result<ParticipantSummary, ParticipantError> {
    let topics = Topics::new(&cfg.job).map_err(ParticipantError::Config)?;
    if topics.device_of(&topics.up(&cfg.id)) != Some(cfg.id.as_str()) || cfg.id.contains(['/', '+', '#']) {
        return Err(ParticipantError::Config(format!("device id `{}` cannot be an MQTT topic level", cfg.id)));
    }
    if cfg.id.ends_with(fedpo_transport::UP_SUFFIX) {
        // Device `x`'s publishing connection already has that client id.
        return Err(ParticipantError::Config(format!(
            "device id `{}` cannot end in `{}`",
            cfg.id,
            fedpo_transport::UP_SUFFIX
        )));
    }
    if cfg.train.is_empty() {
        return Err(ParticipantError::Config(format!("device `{}` has no training pairs", cfg.id)));
    }
    let tokenizer = match &cfg.vocab {
        Some(vocab) => Gpt2Tokenizer::gpt2()?.with_trimmed_vocab(vocab.clone())?,
        None => Gpt2Tokenizer::gpt2()?,
    };
    let tok =
        |pairs: &[PreferencePair]| tokenize_pairs(pairs, |s| tokenizer.encode(s), cfg.max_len, tokenizer.eos_id());
    let (train, heldout) = (tok(&cfg.train)?, tok(&cfg.heldout)?);
    let state = StateDir::open(&cfg.state_dir)?;
    // Before the hello: a device whose state cannot carry on must not be counted in.
    let references: Vec<(&str, String)> = std::iter::once(("ref_train.json", fingerprint(&train)))
        .chain((!heldout.is_empty()).then(|| ("ref_heldout.json", fingerprint(&heldout))))
        .collect();
    state.check(cfg.reset_adapter, &references)?;
    let incoming = cfg.training_slots.is_some().then(|| state.fresh_incoming()).transpose()?;
    let mut opts = LinkOptions::new(format!("fedpo-{}-{}", cfg.job, cfg.id));
    opts.tls = cfg.tls.clone();
    let instance = rand::random::<u64>().max(1);
    let will = Message::Bye(tagged(DeviceBye::last_will(cfg.id.clone()).from_instance(instance), &cfg.broker));
    opts.last_will = Some((topics.up(&cfg.id), will.encode()));
    let link = MqttLink::connect(&cfg.broker, &opts)?;
    link.subscribe(&topics.down())?;
    let pad_id = tokenizer.eos_id();
    let vocab_needed = train
        .iter()
        .chain(&heldout)
        .flat_map(|p| p.prompt.iter().chain(&p.chosen).chain(&p.rejected))
        .chain(std::iter::once(&pad_id))
        .max()
        .map_or(0, |&id| id as usize + 1);
    let (cfg_id, cfg_job, cfg_rejoin) = (cfg.id.clone(), cfg.job.clone(), cfg.rejoin);
    let mut p = Participant {
        cfg,
        topics,
        state,
        incoming,
        link,
        train,
        heldout,
        pad_id,
        vocab_needed,
        limits: Limits::default(),
        summary: ParticipantSummary::default(),
        micro_batch_pairs: None,
        start_on_disk: false,
        instance,
        session: Session::new(&cfg_id, &cfg_job, cfg_rejoin, Instant::now()),
        bundle: None,
        received: None,
        secure: None,
    };
    let span = tracing::info_span!("device", id = %p.cfg.id);
    let _enter = span.enter();
    if let Err(e) = p.event_loop() {
        if matches!(e, ParticipantError::Memory { .. }) {
            let bye = DeviceBye::new(p.cfg.id.clone(), &e.to_string()).from_instance(p.instance);
            let bye = Message::Bye(tagged(bye, &p.cfg.broker));
            let _ = p.link.publish(&p.topics.up(&p.cfg.id), bye.encode());
            p.link.close(Duration::from_secs(10));
        }
        return Err(e);
    }
    let bye = Message::Bye(tagged(DeviceBye::new(p.cfg.id.clone(), "done").from_instance(p.instance), &p.cfg.broker));
    let _ = p.link.publish(&p.topics.up(&p.cfg.id), bye.encode());
    let summary = p.summary.clone();
    p.link.close(Duration::from_secs(10));
    Ok(summary)
}

impl Participant {
    fn send(&self, msg: &Message) -> Result<(), ParticipantError> {
        Ok(self.link.publish(&self.topics.up(&self.cfg.id), msg.encode())?)
    }

    /// Tells the aggregator not to wait for this device's update this round.
    fn decline(&self, round: u64, reason: &str, needs_model: bool) -> Result<(), ParticipantError> {
        let decline = RoundDeclined { needs_model, ..RoundDeclined::new(self.cfg.id.clone(), round, reason) };
        self.send(&Message::Declined(decline))
    }

    fn hello(&self) -> Result<(), ParticipantError> {
        let hello = DeviceHello {
            device: self.cfg.id.clone(),
            pairs: self.train.len() as u64,
            backend: format!("{:?}", self.cfg.compute).to_lowercase(),
            memory_mb: self.cfg.max_memory_mib.or_else(fedpo_process::usage::available_mib).unwrap_or(0),
            instance: self.instance,
            connection: self.session.connection(),
            model: self.state.latest_model_digest(&self.cfg.job),
            tag: Vec::new(),
        };
        self.send(&Message::Hello(tagged(hello, &self.cfg.broker)))
    }

    /// The driver: waits for the link, turns what arrives into the session's events, and
    /// carries out the actions the session returns.
    fn event_loop(&mut self) -> Result<(), ParticipantError> {
        if self.apply(Event::Started)? {
            return Ok(());
        }
        loop {
            if self.cfg.stop.load(Ordering::SeqCst) {
                tracing::info!("stopping on request");
                return Ok(());
            }
            let event = self.link.recv_timeout(Duration::from_millis(200))?;
            if self.apply(Event::Tick)? {
                return Ok(());
            }
            let event = match event {
                None => continue,
                Some(LinkEvent::Connected) => Event::Connected,
                Some(LinkEvent::Disconnected(reason)) => Event::Disconnected(reason.to_string()),
                Some(LinkEvent::Message(delivery)) => match Message::decode_shared(&delivery.payload, &self.limits) {
                    Ok(msg) => match self.event_of(msg)? {
                        Some(event) => event,
                        None => continue,
                    },
                    Err(e) => {
                        tracing::warn!(topic = %delivery.topic, error = %e, "ignoring undecodable message");
                        continue;
                    }
                },
            };
            if self.apply(event)? {
                return Ok(());
            }
        }
    }

    /// The session's event for a message from the aggregator, after the checks that need
    /// the device's keys and state; `None` for messages the session has no part in.
    fn event_of(&mut self, msg: Message) -> Result<Option<Event>, ParticipantError> {
        Ok(Some(match msg {
            Message::Plan(plan) => match self.authenticate(&plan) {
                Err(why) => Event::Unauthentic { what: "plan", why },
                Ok(()) => {
                    let standing = self.standing(plan.round)?;
                    Event::Plan(Arc::new(plan), standing)
                }
            },
            Message::Result(result) => match self.authenticate(&result) {
                Err(why) => Event::Unauthentic { what: "result", why },
                Ok(()) => Event::Result {
                    round: result.round,
                    finished: result.finished,
                    standing: self.standing(result.round)?,
                    job: result.job,
                    run: result.run,
                },
            },
            Message::Chunk(chunk) => {
                let Some(bundle) = self.bundle.as_mut() else { return Ok(None) };
                let received = match bundle.accept(chunk) {
                    Ok(BundleProgress::Complete(bytes)) => Received::Bytes(bytes),
                    Ok(BundleProgress::Kept(kept)) => Received::Kept(kept),
                    Ok(_) => return Ok(None),
                    Err(e) => return Ok(Some(Event::TransferFailed(e.to_string()))),
                };
                self.bundle = None;
                self.received = Some(received);
                Event::ModelReceived
            }
            Message::SecAgg(m) => {
                if let Err(e) = self.secure_message(m) {
                    tracing::error!(error = %e, "secure aggregation step failed");
                }
                return Ok(None);
            }
            Message::Hello(_) | Message::Update(_) | Message::Bye(_) | Message::Declined(_) => return Ok(None),
        }))
    }

    /// Whether a plan or result is signed by the pinned key, if one is.
    fn authenticate<M: fedpo_wire::Signed>(&self, message: &M) -> Result<(), String> {
        match &self.cfg.trusted_key {
            Some(key) => key.verify(message).map_err(|e| e.to_string()),
            None => Ok(()),
        }
    }

    /// What the state directory and the secure round say, for a message about `round`.
    fn standing(&self, round: u64) -> Result<Standing, ParticipantError> {
        let progress = self.state.progress()?;
        Ok(Standing {
            run: progress.run,
            last_round: progress.last_round,
            holds_secure_update: self.secure_round_trained(round),
        })
    }

    /// Feeds `event` to the session and carries out its actions, and those of the events
    /// they lead to; returns whether the job is finished.
    fn apply(&mut self, event: Event) -> Result<bool, ParticipantError> {
        let mut events = std::collections::VecDeque::from([event]);
        while let Some(event) = events.pop_front() {
            for action in self.session.handle(event, Instant::now()) {
                match action {
                    Action::SendHello => self.hello()?,
                    Action::BindRun { run, restart_rounds } => {
                        let mut progress = self.state.progress()?;
                        progress.run = Some(run);
                        if restart_rounds {
                            progress.last_round = 0;
                        }
                        self.state.save_progress(&progress)?;
                    }
                    Action::Resend { round, global_digest } => match self.state.last_update() {
                        Some(sent) if sent.update.round == round && sent.global_digest == global_digest => {
                            tracing::info!(round, "resending this round's update");
                            let topic = self.topics.up(&self.cfg.id);
                            self.summary.bytes_up += publish_update(&self.link, &topic, &sent)?;
                            events.push_back(Event::UpdateSent { round });
                        }
                        _ => tracing::warn!(round, "plan for a round already trained; ignoring"),
                    },
                    Action::FitMemory(plan) => self.fit_memory(&plan)?,
                    Action::AdvertiseKeys(plan) => {
                        if let Some(settings) = plan.secagg {
                            self.secure_plan(&plan, settings)?;
                        }
                    }
                    Action::Receive(plan) => match receive(&plan, &self.limits, self.incoming.as_deref()) {
                        Ok(bundle) => self.bundle = Some(bundle),
                        Err(why) => {
                            self.bundle = None;
                            events.push_back(Event::ReceiveFailed { round: plan.round, why });
                        }
                    },
                    Action::Train(plan) => {
                        let Some(received) = self.received.take() else { continue };
                        self.summary.bytes_down += received.len();
                        if let Err(e) = self.train_and_send(&plan, received) {
                            let needs_model = matches!(e, ParticipantError::Downlink(_));
                            let reason = e.to_string();
                            events.push_back(Event::RoundFailed { round: plan.round, reason, needs_model });
                        }
                    }
                    Action::Decline { round, reason, needs_model } => self.decline(round, &reason, needs_model)?,
                    Action::Finish => return Ok(true),
                }
            }
        }
        Ok(false)
    }

    fn train_and_send(&mut self, plan: &RoundPlan, received: Received) -> Result<(), ParticipantError> {
        let span = tracing::info_span!("round", round = plan.round);
        let _enter = span.enter();
        let slots = self.cfg.training_slots.clone();
        let _slot = slots.as_deref().map(|s| {
            let waited = Instant::now();
            let slot = s.acquire();
            tracing::debug!(seconds = format_args!("{:.1}", waited.elapsed().as_secs_f64()), "training slot");
            slot
        });
        // Read only now: a device waiting for its turn holds the model on disk.
        let bytes = received.into_bytes()?;
        let bytes = match &plan.downlink {
            Some(downlink) => download::rebuild(downlink, bytes, &self.state, &self.limits)?,
            None => bytes,
        };
        let mut progress = self.state.progress()?;
        if progress.reference_model.is_none() {
            // This model becomes the reference: keep it, to rebuild the reference
            // log-probs from should their cache ever be damaged.
            self.state.keep_reference_model(&bytes.main)?;
        }
        // Kept for `generate` and `export`: the closing evaluation's is the job's final model.
        let latest = crate::state_dir::LatestModel {
            round: plan.round,
            digest: hex::encode(plan.model_digest()),
            model_spec: plan.model_spec.clone(),
            job: plan.job.clone(),
        };
        self.state.keep_latest_model(&bytes.main, &latest)?;
        let decoding = Instant::now();
        // In place: the tensors are slices of the received bytes, freed once the model is built.
        let global = TensorPayload::from_shared(bytes.main, &self.limits, true)?;
        let sections = bytes
            .sections
            .into_iter()
            .map(|(name, b)| Ok((name, TensorPayload::from_shared(b, &self.limits, true)?)))
            .collect::<Result<_, ParticipantError>>()?;
        tracing::debug!(seconds = format_args!("{:.3}", decoding.elapsed().as_secs_f64()), "model decoded");
        let model_digest = hex::encode(plan.model_digest());
        let mut outcome = train_round(
            RoundInputs {
                plan,
                global,
                global_digest: &model_digest,
                sections: &sections,
                train: &self.train,
                heldout: &self.heldout,
                pad_id: self.pad_id,
                vocab_needed: self.vocab_needed,
                seed: device_seed(&self.cfg.id),
                compute: &self.cfg.compute,
                micro_batch_pairs: self.micro_batch_pairs,
                start_on_disk: self.start_on_disk,
                compute_dtype: self.cfg.compute_dtype,
                limits: &self.limits,
            },
            &self.state,
            &mut progress,
        )?;
        if outcome.start_was_on_disk {
            self.summary.rounds_with_start_on_disk.push(plan.round);
        }
        if !self.cfg.alone_in_process {
            outcome.metrics.peak_rss_mib = None;
        }
        tracing::info!(
            peak_rss_mib = %outcome.metrics.peak_rss_mib.map_or("shared".into(), |m| format!("{m:.0}")),
            loss = format_args!("{:.4}", outcome.metrics.train_loss),
            train_acc = format_args!("{:.3}", outcome.metrics.reward_acc),
            heldout_acc = %outcome.metrics.heldout_acc.map_or("none".into(), |a| format!("{a:.3}")),
            seconds = format_args!("{:.1}", outcome.metrics.seconds),
            start_on_disk = outcome.start_was_on_disk,
            "round trained"
        );
        if plan.secagg.is_some() && !outcome.delta.is_empty() {
            return self.secure_update(plan, &outcome.delta, model_digest, outcome.metrics, progress);
        }
        self.encode_and_send(plan, outcome, model_digest, progress)
    }
}
