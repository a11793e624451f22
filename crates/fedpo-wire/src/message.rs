//! The messages devices and the aggregator exchange, each inside a versioned envelope.
//!
//! Large content (a global model, an update) never rides in a message itself: the message
//! carries a [`Manifest`] (tensor list, size, chunk count, digest) and the bytes follow as
//! [`TransferChunk`]s, so every MQTT packet stays small.

use std::collections::BTreeMap;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::digest::DIGEST_BYTES;
use crate::error::{Result, WireError};
use crate::limits::{check_name, Limits};
use crate::wire_tensor::{byte_bounds, WireDType};

/// The protocol version this build speaks. Version 2 names transfers by their BLAKE3
/// digest where version 1 used SHA-256; the two refuse each other by name.
pub const PROTOCOL_VERSION: u16 = 2;

/// A device announcing itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceHello {
    /// Device id, unique in the job.
    pub device: String,
    /// Training pairs it holds (FedAvg weight).
    pub pairs: u64,
    /// Compute backend, e.g. `cpu`, `cuda:0`.
    pub backend: String,
    /// Memory available for training, MiB.
    pub memory_mb: u64,
    /// Drawn at random when the device process starts. A restarted device says hello
    /// with a new instance; two processes using one id keep saying hello with two, which
    /// is how the aggregator tells them apart. 0 from devices that predate it.
    #[serde(default)]
    pub instance: u64,
    /// Connections this process has made to the broker. A new number means the device
    /// was offline a while, so whatever was published to it meanwhile may be lost.
    #[serde(default)]
    pub connection: u32,
    /// Digest of the full model the device holds from an earlier round (empty: none), so
    /// that a compressed downlink sends it deltas against that model
    /// ([`crate::Downlink`]).
    #[serde(default, with = "serde_bytes")]
    pub model: Vec<u8>,
    /// HMAC of the rest under the device's broker password, where it has one (see
    /// [`crate::device_tag`]); empty otherwise.
    #[serde(default, with = "serde_bytes")]
    pub tag: Vec<u8>,
}

/// A device leaving: sent on a clean exit, and registered as the MQTT last will so the
/// broker sends it when a device vanishes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceBye {
    /// Device id.
    pub device: String,
    /// Why, for the logs.
    pub reason: String,
    /// The instance of the process leaving (as in [`DeviceHello::instance`]): a goodbye
    /// of an earlier process does not take a later one offline. 0 from older devices.
    #[serde(default)]
    pub instance: u64,
    /// HMAC of the rest under the device's broker password, as in [`DeviceHello::tag`].
    #[serde(default, with = "serde_bytes")]
    pub tag: Vec<u8>,
}

/// A selected device that cannot take part in a round (its training failed, for
/// instance on a non-finite loss): the aggregator stops waiting for it this round instead
/// of until the round's deadline. The device stays in the job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundDeclined {
    /// Device id.
    pub device: String,
    /// The round it declines.
    pub round: u64,
    /// Why, for the logs and the round's record.
    pub reason: String,
    /// The round's downlink deltas did not apply to the model the device holds (it holds
    /// none, another, or the result did not verify): its next plan must carry the whole
    /// model.
    #[serde(default)]
    pub needs_model: bool,
}

impl DeviceBye {
    /// The reason of the goodbye a device registers as its MQTT last will: the broker sent
    /// it, so the device may still be running and come back.
    pub const CONNECTION_LOST: &'static str = "connection lost";

    /// A goodbye whose reason fits the wire (see [`fit_reason`]).
    pub fn new(device: impl Into<String>, reason: &str) -> Self {
        Self { device: device.into(), reason: fit_reason(reason), instance: 0, tag: Vec::new() }
    }

    /// The goodbye a device registers as its last will.
    pub fn last_will(device: impl Into<String>) -> Self {
        Self::new(device, Self::CONNECTION_LOST)
    }

    /// The same goodbye from process `instance`.
    pub fn from_instance(mut self, instance: u64) -> Self {
        self.instance = instance;
        self
    }

    /// Whether the device said this itself, rather than the broker on its behalf.
    pub fn is_deliberate(&self) -> bool {
        self.reason != Self::CONNECTION_LOST
    }
}

impl RoundDeclined {
    /// A decline whose reason fits the wire (see [`fit_reason`]).
    pub fn new(device: impl Into<String>, round: u64, reason: &str) -> Self {
        Self { device: device.into(), round, reason: fit_reason(reason), needs_model: false }
    }
}

/// `reason` cut to the longest text a receiver with the default [`Limits`] accepts (a
/// reason is checked like a name), at a character boundary and ending in `…`. A longer
/// one would make the whole message undecodable, and the aggregator would never learn
/// that the device left or sat the round out; the device logs the whole text itself.
fn fit_reason(reason: &str) -> String {
    const MORE: char = '…';
    let limit = Limits::default().max_name_len;
    if reason.len() <= limit {
        return reason.to_string();
    }
    let mut end = limit - MORE.len_utf8();
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{MORE}", &reason[..end])
}

/// Local training settings a round asks for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hyperparameters {
    /// Method, e.g. `pfeddpo`.
    pub method: String,
    /// Local optimizer steps (E).
    pub local_steps: u32,
    /// Learning rate.
    pub lr: f64,
    /// DPO beta.
    pub beta: f64,
    /// Pairs per step.
    pub batch_pairs: u32,
}

/// Name, dtype and shape of one tensor of a transfer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorInfo {
    /// Checkpoint-style name.
    pub name: String,
    /// Encoding.
    pub dtype: WireDType,
    /// Dimensions.
    pub shape: Vec<u64>,
}

/// What a transfer will deliver, announced before its chunks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Transfer id, unique per job (e.g. `r3/global`, `r3/dev-2`).
    pub transfer: String,
    /// Total payload bytes.
    pub bytes: u64,
    /// Number of chunks.
    pub chunks: u32,
    /// Digest of the whole payload ([`crate::digest`]).
    #[serde(with = "serde_bytes")]
    pub digest: Vec<u8>,
    /// The tensors the payload holds.
    pub tensors: Vec<TensorInfo>,
}

/// One round's instructions to the selected devices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundPlan {
    /// Round number, from 1.
    pub round: u64,
    /// Devices expected to train.
    pub selected: Vec<String>,
    /// Local training settings.
    pub hyper: Hyperparameters,
    /// Strategy-specific named settings (e.g. `proximal_mu`).
    pub strategy: BTreeMap<String, f64>,
    /// The policy's structure (fedpo-model's `PolicySpec` as JSON): layers, widths, the
    /// adapter and which tensors are shared. The device builds its model from it.
    pub model_spec: String,
    /// The global model that follows as chunks.
    pub global_model: Manifest,
    /// Named extra transfers the algorithm needs (e.g. `scaffold.control`,
    /// `fedga.reference`), each followed by its own chunks.
    #[serde(default)]
    pub sections: BTreeMap<String, Manifest>,
    /// The aggregator's Ed25519 signature over the rest of the plan (empty: unsigned); see
    /// [`crate::signing`].
    #[serde(default, with = "serde_bytes")]
    pub signature: Vec<u8>,
    /// Secure aggregation for this round: devices upload masked fixed-point inputs.
    #[serde(default)]
    pub secagg: Option<crate::secagg_messages::SecAggPlan>,
    /// How devices encode their update this round (absent from older plans: f32).
    #[serde(default)]
    pub update_codec: crate::update_codec::UpdateCodec,
    /// Changes whenever the aggregator restarts or reconnects to the broker, when what was
    /// in flight to it may be lost. A device that already sent this round's update sends
    /// it again only if this, or its own connection, changed since: a plan resent for
    /// another device must not make every device still in flight upload twice.
    #[serde(default)]
    pub sender_epoch: u64,
    /// The job the plan belongs to. Signed, so a plan of one job is refused in another.
    #[serde(default)]
    pub job: String,
    /// The run of the job: drawn at random when the aggregator starts a job afresh and
    /// kept across `--resume`. Signed, so a plan of an earlier run is refused by devices
    /// that follow a later one.
    #[serde(default)]
    pub run: u64,
    /// The compressed downlink: when present, `global_model` (and the sections its steps
    /// name) carry deltas against models devices hold, not the model itself.
    #[serde(default)]
    pub downlink: Option<Downlink>,
}

/// A plan's downlink: its model transfer (and the sections named by its steps) holds
/// deltas, not the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Downlink {
    /// The codec of the deltas.
    pub codec: crate::update_codec::UpdateCodec,
    /// The steps, oldest first. The newest is the plan's `global_model` transfer; each
    /// older one is the section it names.
    pub steps: Vec<DeltaStep>,
    /// Digest of the model the whole chain yields, as a full f32 payload: what a device
    /// verifies and then trains from.
    #[serde(with = "serde_bytes")]
    pub model: Vec<u8>,
}

/// One step of a downlink chain.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeltaStep {
    /// Digest of the full model payload this step applies to.
    #[serde(with = "serde_bytes")]
    pub base: Vec<u8>,
    /// The plan section holding it; empty for the newest step, which is the plan's
    /// `global_model` transfer.
    pub section: String,
}

/// What a device measured in its local round.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UpdateMetrics {
    /// Mean DPO loss over the local steps.
    pub train_loss: f64,
    /// Reward accuracy on its training pairs.
    pub reward_acc: f64,
    /// Reward accuracy on its held-out pairs.
    pub heldout_acc: Option<f64>,
    /// Norm of its first local step's gradient: at the received model, before any update.
    pub grad_norm: f64,
    /// Wall time of local training.
    pub seconds: f64,
    /// Peak resident memory of the device process after the round, MiB (absent from
    /// devices that predate it).
    #[serde(default)]
    pub peak_rss_mib: Option<f64>,
}

/// A device's result for a round; the update's tensors follow as chunks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Update {
    /// The round it answers.
    pub round: u64,
    /// The device.
    pub device: String,
    /// Pairs it trained on (FedAvg weight).
    pub pairs: u64,
    /// Local metrics.
    pub metrics: UpdateMetrics,
    /// The shared-parameter delta that follows.
    pub update: Manifest,
    /// Named extra transfers (e.g. `scaffold.control_delta`, `diagnostics.gradient`),
    /// each followed by its own chunks.
    #[serde(default)]
    pub sections: BTreeMap<String, Manifest>,
}

/// A slice of a transfer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransferChunk {
    /// The transfer it belongs to.
    pub transfer: String,
    /// Position, from 0.
    pub index: u32,
    /// Chunks in the transfer.
    pub count: u32,
    /// The bytes: a CBOR byte string on the wire. Decoded by [`Message::decode_shared`],
    /// a slice of the received message.
    pub bytes: Bytes,
}

/// The outcome of a round, for devices and observers.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RoundResult {
    /// The round.
    pub round: u64,
    /// Devices whose updates were aggregated.
    pub participants: Vec<String>,
    /// Weighted mean training loss of the participants.
    pub train_loss: f64,
    /// Digest of the new global model payload.
    #[serde(with = "serde_bytes")]
    pub global_digest: Vec<u8>,
    /// The job is over; devices may exit.
    pub finished: bool,
    /// The job, as in [`RoundPlan::job`].
    #[serde(default)]
    pub job: String,
    /// The run, as in [`RoundPlan::run`].
    #[serde(default)]
    pub run: u64,
    /// The aggregator's Ed25519 signature over the rest of the result (empty: unsigned), so
    /// that devices which pin its key end only when it says so.
    #[serde(default, with = "serde_bytes")]
    pub signature: Vec<u8>,
}

/// Every message kind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Message {
    /// Device registration.
    Hello(DeviceHello),
    /// Round plan.
    Plan(RoundPlan),
    /// Device update announcement.
    Update(Update),
    /// Transfer bytes.
    Chunk(TransferChunk),
    /// Round outcome.
    Result(RoundResult),
    /// Device leaving.
    Bye(DeviceBye),
    /// A secure-aggregation step.
    SecAgg(crate::secagg_messages::SecAggMessage),
    /// A selected device sitting a round out.
    Declined(RoundDeclined),
}

/// What a message decodes from; its `version` was checked first, on its own.
#[derive(Deserialize)]
struct Envelope {
    message: Message,
}

/// [`Envelope`] as it is written: borrowed, so encoding copies nothing but into the output.
#[derive(Serialize)]
struct EnvelopeRef<'a, M> {
    version: u16,
    message: &'a M,
}

/// The chunk variant of [`Message`], borrowed: it serialises byte for byte as
/// `Message::Chunk`, without first cloning the chunk's bytes into a message.
#[derive(Serialize)]
#[serde(rename = "Message", rename_all = "snake_case")]
enum ChunkRef<'a> {
    Chunk(&'a TransferChunk),
}

/// An envelope that holds a chunk, its bytes borrowed; any other message fails to parse.
#[derive(Deserialize)]
struct ChunkEnvelopeView<'a> {
    version: u16,
    #[serde(borrow)]
    message: ChunkView<'a>,
}

/// `Message::Chunk` as it parses, with [`TransferChunk`]'s fields and the bytes borrowed.
#[derive(Deserialize)]
#[serde(rename = "Message", rename_all = "snake_case")]
enum ChunkView<'a> {
    Chunk(#[serde(borrow)] TransferChunkView<'a>),
}

#[derive(Deserialize)]
struct TransferChunkView<'a> {
    transfer: String,
    index: u32,
    count: u32,
    #[serde(borrow)]
    bytes: &'a [u8],
}

fn check_round(round: u64) -> Result<()> {
    if round <= crate::limits::MAX_ROUND {
        Ok(())
    } else {
        Err(WireError::InvalidField {
            field: "round",
            reason: format!("{round} is beyond the highest round a job may reach, {}", crate::limits::MAX_ROUND),
        })
    }
}

fn check_tag_len(tag: &[u8]) -> Result<()> {
    if matches!(tag.len(), 0 | crate::limits::TAG_BYTES) {
        Ok(())
    } else {
        Err(WireError::InvalidField {
            field: "tag",
            reason: format!("{} bytes; a tag has {}", tag.len(), crate::limits::TAG_BYTES),
        })
    }
}

fn check_signature_len(signature: &[u8]) -> Result<()> {
    if matches!(signature.len(), 0 | 64) {
        Ok(())
    } else {
        Err(WireError::InvalidField {
            field: "signature",
            reason: format!("{} bytes; an Ed25519 signature has 64", signature.len()),
        })
    }
}

fn check_finite(field: &'static str, v: f64) -> Result<()> {
    if v.is_finite() {
        Ok(())
    } else {
        Err(WireError::InvalidField { field, reason: format!("must be finite, got {v}") })
    }
}

impl Manifest {
    /// Checks the announced sizes before any chunk is accepted.
    pub fn validate(&self, limits: &Limits) -> Result<()> {
        check_name("transfer", &self.transfer, limits)?;
        if self.tensors.len() > limits.max_tensors {
            return Err(WireError::TooManyTensors { count: self.tensors.len(), max: limits.max_tensors });
        }
        if self.bytes > limits.max_transfer_bytes {
            return Err(WireError::TransferTooLarge { size: self.bytes, max: limits.max_transfer_bytes });
        }
        let mut tensor_bytes: u64 = 0;
        for t in &self.tensors {
            check_name("tensor name", &t.name, limits)?;
            let (least, _) = byte_bounds(&t.shape, t.dtype).unwrap_or((u64::MAX, u64::MAX));
            tensor_bytes = tensor_bytes.saturating_add(least);
        }
        if tensor_bytes > self.bytes {
            return Err(WireError::TransferTooLarge { size: tensor_bytes, max: self.bytes });
        }
        // Exactly as many chunks as full ones carry the bytes: the receiver keeps a slot per
        // chunk, so a count beyond that would cost memory the bytes never justify.
        let chunks = self.bytes.div_ceil(limits.max_chunk_bytes as u64).max(1);
        if u64::from(self.chunks) != chunks {
            return Err(WireError::InvalidField {
                field: "chunks",
                reason: format!(
                    "{} bytes in chunks of {} take {chunks} chunks, not {}",
                    self.bytes, limits.max_chunk_bytes, self.chunks
                ),
            });
        }
        if self.digest.len() != DIGEST_BYTES {
            return Err(WireError::InvalidField {
                field: "digest",
                reason: format!("{} bytes, expected {DIGEST_BYTES}", self.digest.len()),
            });
        }
        Ok(())
    }
}

impl Message {
    /// Encodes the message in a versioned envelope.
    pub fn encode(&self) -> Vec<u8> {
        serde_cbor::to_vec(&EnvelopeRef { version: PROTOCOL_VERSION, message: self }).unwrap_or_default()
    }

    /// Encodes `Message::Chunk(chunk)` without copying the chunk first: a model or an
    /// update is hundreds of chunks, and each copy of them is a pass over the whole model.
    pub fn encode_chunk(chunk: &TransferChunk) -> Vec<u8> {
        // Sized for the chunk and its envelope: grown by doubling, each 1 MiB chunk would be
        // copied several times on its way into the buffer.
        let mut out = Vec::with_capacity(chunk.bytes.len() + chunk.transfer.len() + 64);
        match serde_cbor::to_writer(
            &mut out,
            &EnvelopeRef { version: PROTOCOL_VERSION, message: &ChunkRef::Chunk(chunk) },
        ) {
            Ok(()) => out,
            Err(_) => Vec::new(),
        }
    }

    /// [`Message::decode`] for a received buffer: a chunk's bytes stay a slice of it.
    ///
    /// A model or an update arrives as hundreds of 1 MiB chunks, and decoding each into
    /// an owned chunk was a copy of the whole transfer, on top of the one that joins the
    /// chunks: for the aggregator, 656 MB a round on its one thread with two DistilGPT-2
    /// devices. Every other message, and a chunk in a form that cannot be borrowed,
    /// decodes as [`Message::decode`] does.
    pub fn decode_shared(bytes: &Bytes, limits: &Limits) -> Result<Self> {
        if bytes.len() > limits.max_message_bytes {
            return Err(WireError::MessageTooLarge { size: bytes.len(), max: limits.max_message_bytes });
        }
        let Ok(env) = serde_cbor::from_slice::<ChunkEnvelopeView<'_>>(bytes) else {
            return Self::decode(bytes, limits);
        };
        if env.version != PROTOCOL_VERSION {
            return Err(WireError::UnsupportedVersion { found: env.version, supported: PROTOCOL_VERSION });
        }
        let ChunkView::Chunk(c) = env.message;
        let message = Self::Chunk(TransferChunk {
            transfer: c.transfer,
            index: c.index,
            count: c.count,
            bytes: bytes.slice_ref(c.bytes),
        });
        message.validate(limits)?;
        Ok(message)
    }

    /// Decodes untrusted bytes: the size is checked before parsing, the version and every
    /// announced size after, so nothing is allocated past the limits.
    pub fn decode(bytes: &[u8], limits: &Limits) -> Result<Self> {
        if bytes.len() > limits.max_message_bytes {
            return Err(WireError::MessageTooLarge { size: bytes.len(), max: limits.max_message_bytes });
        }
        #[derive(Deserialize)]
        struct VersionOnly {
            version: u16,
        }
        let head: VersionOnly = serde_cbor::from_slice(bytes).map_err(|e| WireError::Malformed(e.to_string()))?;
        if head.version != PROTOCOL_VERSION {
            return Err(WireError::UnsupportedVersion { found: head.version, supported: PROTOCOL_VERSION });
        }
        let env: Envelope = serde_cbor::from_slice(bytes).map_err(|e| WireError::Malformed(e.to_string()))?;
        env.message.validate(limits)?;
        Ok(env.message)
    }

    fn validate(&self, limits: &Limits) -> Result<()> {
        match self {
            Self::Hello(h) => {
                check_name("device", &h.device, limits)?;
                check_name("backend", &h.backend, limits)?;
                check_digest_len("model", &h.model, true)?;
                check_tag_len(&h.tag)
            }
            Self::Plan(p) => {
                check_round(p.round)?;
                for d in &p.selected {
                    check_name("selected", d, limits)?;
                }
                check_finite("lr", p.hyper.lr)?;
                check_finite("beta", p.hyper.beta)?;
                p.strategy.values().try_for_each(|v| check_finite("strategy", *v))?;
                p.strategy.keys().try_for_each(|k| check_name("strategy key", k, limits))?;
                check_sections(&p.global_model, &p.sections, limits)?;
                p.sections.values().try_for_each(|m| m.validate(limits))?;
                if p.model_spec.len() > limits.max_spec_bytes {
                    return Err(WireError::InvalidField {
                        field: "model_spec",
                        reason: format!("{} bytes exceed the limit of {}", p.model_spec.len(), limits.max_spec_bytes),
                    });
                }
                check_name("job", &p.job, limits)?;
                check_signature_len(&p.signature)?;
                if let Some(secagg) = &p.secagg {
                    secagg.validate()?;
                }
                if let Some(downlink) = &p.downlink {
                    downlink.validate(&p.sections)?;
                }
                p.global_model.validate(limits)
            }
            Self::SecAgg(m) => m.validate(limits),
            Self::Update(u) => {
                check_name("device", &u.device, limits)?;
                check_finite("train_loss", u.metrics.train_loss)?;
                check_finite("grad_norm", u.metrics.grad_norm)?;
                check_sections(&u.update, &u.sections, limits)?;
                u.sections.values().try_for_each(|m| m.validate(limits))?;
                u.update.validate(limits)
            }
            Self::Chunk(c) => {
                check_name("transfer", &c.transfer, limits)?;
                if c.bytes.len() > limits.max_chunk_bytes {
                    return Err(WireError::MessageTooLarge { size: c.bytes.len(), max: limits.max_chunk_bytes });
                }
                if c.index >= c.count {
                    return Err(WireError::BadChunk { index: c.index, count: c.count, expected_count: c.count });
                }
                Ok(())
            }
            Self::Bye(b) => {
                check_name("device", &b.device, limits)?;
                check_name("reason", &b.reason, limits)?;
                check_tag_len(&b.tag)
            }
            Self::Declined(d) => {
                check_name("device", &d.device, limits)?;
                check_name("reason", &d.reason, limits)
            }
            Self::Result(r) => {
                check_round(r.round)?;
                for d in &r.participants {
                    check_name("participants", d, limits)?;
                }
                check_name("job", &r.job, limits)?;
                check_signature_len(&r.signature)
            }
        }
    }
}

/// The most sections one message may carry.
pub const MAX_SECTIONS: usize = 8;

/// Checks a message's section table: bounded, named within limits, ids distinct.
/// A digest field: [`DIGEST_BYTES`] long, or empty where `may_be_empty`.
pub(crate) fn check_digest_len(field: &'static str, digest: &[u8], may_be_empty: bool) -> Result<()> {
    if digest.len() == DIGEST_BYTES || (may_be_empty && digest.is_empty()) {
        return Ok(());
    }
    Err(WireError::InvalidField { field, reason: format!("{} bytes, expected {DIGEST_BYTES}", digest.len()) })
}

pub fn check_sections(main: &Manifest, sections: &BTreeMap<String, Manifest>, limits: &Limits) -> Result<()> {
    if sections.len() > MAX_SECTIONS {
        return Err(WireError::InvalidField {
            field: "sections",
            reason: format!("{} sections exceed the limit of {MAX_SECTIONS}", sections.len()),
        });
    }
    for (name, m) in sections {
        if name.is_empty() || name.len() > limits.max_name_len {
            return Err(WireError::InvalidField {
                field: "section name",
                reason: format!("`{name}` is empty or too long"),
            });
        }
        if m.transfer == main.transfer || sections.iter().any(|(other, o)| other != name && o.transfer == m.transfer) {
            return Err(WireError::InvalidField {
                field: "sections",
                reason: format!("section `{name}` reuses transfer id `{}`", m.transfer),
            });
        }
    }
    Ok(())
}
