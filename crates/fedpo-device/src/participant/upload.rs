//! An update's way out, after training: encoded in the plan's codec (with error feedback
//! where the codec has it), split into chunks, the copy kept for resending, the round
//! recorded as done, and the publishes.

use std::time::Instant;

use fedpo_transport::MqttLink;
use fedpo_wire::{
    split_payload, EncodedPayload, Message, Residual, RoundPlan, TensorPayload, Update, WireDType, DEFAULT_CHUNK_BYTES,
};

use super::{Participant, ParticipantError};
use crate::local_round::RoundOutcome;
use crate::state_dir::{JobProgress, SentUpdate};

impl Participant {
    /// Encodes a trained round's delta and sections and sends them ([`Self::send_update`]).
    pub(super) fn encode_and_send(
        &mut self,
        plan: &RoundPlan,
        outcome: RoundOutcome,
        model_digest: String,
        progress: JobProgress,
    ) -> Result<(), ParticipantError> {
        let encoding = Instant::now();
        let codec = plan.update_codec;
        let (encoded, residual) = if codec.uses_error_feedback() {
            let mut residual = self.state.residual(progress.last_round)?;
            let payload = residual.compress(&outcome.delta, codec);
            tracing::debug!(owed = format_args!("{:.4}", residual.norm()), %codec, "error feedback");
            (self.rewritten(payload), Some(residual))
        } else if self.cfg.rewrite_update.is_some() {
            (self.rewritten(TensorPayload::compress(&outcome.delta, codec)), None)
        } else {
            // Straight from the delta's buffers into the chunks.
            (EncodedPayload::compress(&outcome.delta, codec, DEFAULT_CHUNK_BYTES), None)
        };
        drop(outcome.delta);
        let sections = outcome
            .sections
            .iter()
            .map(|(name, tensors)| (name.clone(), TensorPayload::encode(tensors, WireDType::F32)))
            .collect();
        tracing::debug!(seconds = format_args!("{:.3}", encoding.elapsed().as_secs_f64()), %codec, "update encoded");
        self.send_update(plan.round, model_digest, encoded, sections, outcome.metrics, progress, residual)
    }

    /// The chunks of an update payload, after the configuration's rewrite, if any.
    pub(super) fn rewritten(&self, payload: TensorPayload) -> EncodedPayload {
        let payload = match &self.cfg.rewrite_update {
            Some(rewrite) => rewrite(&payload),
            None => payload,
        };
        EncodedPayload::new(&payload, DEFAULT_CHUNK_BYTES)
    }

    /// Splits an update and its sections into chunks, saves it for resending, records the
    /// round as done (with the error-feedback residual it leaves, if any) and publishes it.
    ///
    /// Without error feedback the update goes out while its resend copy is written and
    /// synced: the aggregator needs only the chunks, and the copy (the size of the model)
    /// took as long as the upload itself. A crash before the round is recorded then costs a
    /// retrained round, whose second update the aggregator ignores if the first one arrived
    /// whole. With error feedback the residual must match the update that was counted, so
    /// everything is durable before anything is sent.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn send_update(
        &mut self,
        round: u64,
        global_digest: String,
        encoded: EncodedPayload,
        sections: Vec<(String, TensorPayload)>,
        metrics: fedpo_wire::UpdateMetrics,
        mut progress: JobProgress,
        residual: Option<Residual>,
    ) -> Result<(), ParticipantError> {
        let sending = Instant::now();
        let transfer = format!("r{round}/{}", self.cfg.id);
        let (manifest, mut chunks) = encoded.into_transfer(&transfer);
        let mut manifests = std::collections::BTreeMap::new();
        for (name, payload) in &sections {
            let (m, c) = split_payload(&format!("{transfer}/{name}"), payload, DEFAULT_CHUNK_BYTES);
            manifests.insert(name.clone(), m);
            chunks.extend(c);
        }
        drop(sections);
        let update = Update {
            round,
            device: self.cfg.id.clone(),
            pairs: self.train.len() as u64,
            metrics,
            update: manifest,
            sections: manifests,
        };
        let sent = SentUpdate { global_digest, update, chunks };
        progress.last_round = round;
        let state = &self.state;
        let record = || -> Result<(), ParticipantError> {
            state.save_last_update(&sent)?;
            if let Some(residual) = &residual {
                state.stage_residual(round, residual)?;
            }
            state.save_progress(&progress)?;
            if residual.is_some() {
                state.commit_residual()?;
            }
            Ok(())
        };
        let (sent_bytes, recorded) = if residual.is_some() {
            record()?;
            (publish_update(&self.link, &self.topics.up(&self.cfg.id), &sent)?, Ok(()))
        } else {
            std::thread::scope(|scope| {
                let recording = scope.spawn(record);
                let published = publish_update(&self.link, &self.topics.up(&self.cfg.id), &sent);
                let recorded = recording.join().unwrap_or_else(|_| {
                    Err(ParticipantError::State("saving the update for resending panicked".into()))
                });
                published.map(|bytes| (bytes, recorded))
            })?
        };
        self.summary.bytes_up += sent_bytes;
        self.session.handle(super::session::Event::UpdateSent { round }, Instant::now());
        recorded?;
        self.summary.rounds.push(round);
        tracing::info!(round, seconds = format_args!("{:.3}", sending.elapsed().as_secs_f64()), "update sent");
        Ok(())
    }
}

/// Publishes an update's announcement and chunks; returns the chunk bytes sent.
pub(super) fn publish_update(link: &MqttLink, topic: &str, sent: &SentUpdate) -> Result<u64, ParticipantError> {
    link.publish(topic, Message::Update(sent.update.clone()).encode())?;
    let mut bytes = 0;
    for c in &sent.chunks {
        bytes += c.bytes.len() as u64;
        link.publish(topic, Message::encode_chunk(c))?;
    }
    Ok(bytes)
}
