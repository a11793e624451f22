//! The device's side of a secure-aggregation round: advertise keys when the plan arrives,
//! share when the key list does, and upload the masked update once both training and the
//! relay of everyone's shares are done; answer the unmasking request at the end.

use fedpo_model::SharedTensor;
use fedpo_secagg::{Client, Party};
use fedpo_wire::{
    EncodedPayload, Message, RoundPlan, SecAggMessage, SecAggPlan, TensorPayload, UpdateMetrics, WireTensor,
    DEFAULT_CHUNK_BYTES,
};

use super::{Participant, ParticipantError};
use crate::state_dir::JobProgress;

/// This device's secure-aggregation state for one round.
pub(super) struct SecureRound {
    round: u64,
    party: Party,
    client: Client,
    settings: SecAggPlan,
    /// The parties whose shares went out (from the relay).
    sharing: Option<Vec<Party>>,
    /// A trained update waiting for the relay.
    waiting: Option<Trained>,
}

/// A trained round, ready to be masked and sent.
pub(super) struct Trained {
    pub(super) values: Vec<f32>,
    pub(super) global_digest: String,
    pub(super) metrics: UpdateMetrics,
    pub(super) progress: JobProgress,
}

impl Participant {
    /// A secure-aggregation plan selected this device: advertise this round's keys (the
    /// same ones again when the plan is resent).
    pub(super) fn secure_plan(&mut self, plan: &RoundPlan, settings: SecAggPlan) -> Result<(), ParticipantError> {
        if self.secure.as_ref().is_none_or(|s| s.round != plan.round) {
            let party = plan.selected.iter().position(|d| d == &self.cfg.id).ok_or_else(|| {
                ParticipantError::Protocol(format!("round {}: a secure plan that does not select us", plan.round))
            })?;
            let client = Client::new(plan.round, party as Party, usize::from(settings.threshold));
            self.secure = Some(SecureRound {
                round: plan.round,
                party: party as Party,
                client,
                settings,
                sharing: None,
                waiting: None,
            });
        }
        let s = self.secure.as_ref().expect("just set");
        let keys = SecAggMessage::Keys { round: s.round, device: self.cfg.id.clone(), keys: s.client.public_keys() };
        self.send(&Message::SecAgg(keys))
    }

    /// Whether this device trained `round` and holds its update until the relay arrives.
    pub(super) fn secure_round_trained(&self, round: u64) -> bool {
        self.secure.as_ref().is_some_and(|s| s.round == round && s.waiting.is_some())
    }

    /// A protocol step from the aggregator for the current secure round.
    pub(super) fn secure_message(&mut self, msg: SecAggMessage) -> Result<(), ParticipantError> {
        let id = self.cfg.id.clone();
        let Some(s) = self.secure.as_mut().filter(|s| s.round == msg.round()) else { return Ok(()) };
        let round = s.round;
        match msg {
            SecAggMessage::KeyList { keys, .. } => {
                let bundles = s.client.share(&keys)?;
                tracing::info!(round, peers = bundles.len(), "secure aggregation: shares sent");
                self.send(&Message::SecAgg(SecAggMessage::Shares { round, device: id, bundles }))?;
            }
            SecAggMessage::Relay { bundles, sharing, .. } => {
                for b in bundles.iter().filter(|b| b.to == s.party) {
                    if let Err(e) = s.client.receive(b) {
                        tracing::warn!(round, error = %e, "secure aggregation: a share was refused");
                    }
                }
                s.sharing = Some(sharing);
                if let Some(trained) = s.waiting.take() {
                    self.send_masked(trained)?;
                }
            }
            SecAggMessage::Unmask { request, .. } => {
                let response = s.client.unmask(&request)?;
                self.send(&Message::SecAgg(SecAggMessage::Unmasked { round, device: id, response }))?;
            }
            SecAggMessage::Keys { .. } | SecAggMessage::Shares { .. } | SecAggMessage::Unmasked { .. } => {}
        }
        Ok(())
    }

    /// After training in a secure round: the update, weighted by this device's pair count
    /// and clamped to the plan's range, in the order of the plan's model; masked and sent
    /// now if the relay is in, else when it arrives.
    pub(super) fn secure_update(
        &mut self,
        plan: &RoundPlan,
        delta: &[SharedTensor],
        global_digest: String,
        metrics: UpdateMetrics,
        progress: JobProgress,
    ) -> Result<(), ParticipantError> {
        let Some(s) = self.secure.as_mut().filter(|s| s.round == plan.round) else {
            return Err(ParticipantError::Protocol(format!("round {}: no secure-aggregation keys", plan.round)));
        };
        let weight = self.train.len() as f32;
        let range = s.settings.fixed_point.range;
        let mut values = Vec::new();
        for info in &plan.global_model.tensors {
            if let Some(t) = delta.iter().find(|t| t.name() == info.name) {
                values.extend(t.values().iter().map(|v| v * weight));
            }
        }
        let clamped = values.iter().filter(|v| v.abs() > range).count();
        if clamped > 0 {
            tracing::warn!(
                round = plan.round,
                clamped,
                range,
                "secure aggregation: values clamped to the plan's range"
            );
        }
        values.iter_mut().for_each(|v| *v = v.clamp(-range, range));
        let trained = Trained { values, global_digest, metrics, progress };
        if s.sharing.is_some() {
            self.send_masked(trained)
        } else {
            tracing::info!(round = plan.round, "trained; waiting for the other devices' shares");
            s.waiting = Some(trained);
            Ok(())
        }
    }

    fn send_masked(&mut self, trained: Trained) -> Result<(), ParticipantError> {
        let s = self.secure.as_ref().expect("a secure round");
        let sharing = s.sharing.as_deref().unwrap_or_default();
        let words = s.client.masked_input(&trained.values, &s.settings.fixed_point, sharing)?;
        let payload = TensorPayload { tensors: vec![WireTensor::masked(&words)] };
        let encoded = EncodedPayload::new(&payload, DEFAULT_CHUNK_BYTES);
        let round = s.round;
        self.send_update(round, trained.global_digest, encoded, Vec::new(), trained.metrics, trained.progress, None)
    }
}
