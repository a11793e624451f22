//! Closing a round: its record, combining the updates into the new global model,
//! the checkpoint, and the result announced to the devices.

use std::time::Instant;

use anyhow::Result;
use fedpo_wire::{RoundResult, UpdateMetrics};

use super::{Aggregator, OpenRound};
use crate::checkpoint::DownlinkRecord;
use crate::combined_update::CombinedUpdate;
use crate::diagnostics::Diagnostics;
use crate::downlink::DownlinkStream;
use crate::metrics::{mean, RoundRecord};

impl Aggregator {
    pub(super) fn close_round(&mut self, mut open: OpenRound, started: Instant) -> Result<RoundRecord> {
        let participants: Vec<String> = open.collector.reported().keys().cloned().collect();
        let weight: f64 = open.collector.reported().values().map(|(pairs, _)| *pairs as f64).sum::<f64>().max(1.0);
        let weighted = |f: &dyn Fn(&UpdateMetrics) -> f64| {
            open.collector.reported().values().map(|(pairs, m)| *pairs as f64 * f(m)).sum::<f64>() / weight
        };
        let mut record = RoundRecord {
            round: open.collector.round(),
            method: self.job.method.name().into(),
            evaluation: open.collector.evaluation(),
            selected: open.collector.selected().iter().cloned().collect(),
            participants: participants.clone(),
            train_loss: weighted(&|m| m.train_loss),
            reward_acc: open.collector.reported().iter().map(|(d, (_, m))| (d.clone(), m.reward_acc)).collect(),
            heldout_acc: open
                .collector
                .reported()
                .iter()
                .filter_map(|(d, (_, m))| Some((d.clone(), m.heldout_acc?)))
                .collect(),
            peak_rss_mib: open
                .collector
                .reported()
                .iter()
                .filter_map(|(d, (_, m))| Some((d.clone(), m.peak_rss_mib?)))
                .collect(),
            train_seconds: open.collector.reported().iter().map(|(d, (_, m))| (d.clone(), m.seconds)).collect(),
            device_grad_norm: weighted(&|m| m.grad_norm),
            diagnostics_bytes: open.diagnostics.is_some().then_some(open.diagnostics_bytes),
            bytes_up: open.bytes_up,
            bytes_up_by_device: open.bytes_up_by_device.clone(),
            bytes_down: open.bytes_down,
            rejected: open.collector.rejected().clone(),
            ..RoundRecord::default()
        };
        // Each device that reported trained from the round's model: it holds it now.
        let model = hex::encode(open.plan.model_digest());
        for device in &participants {
            if let Some(record) = self.state.devices.get_mut(device) {
                record.holds.clone_from(&model);
            }
        }
        self.state.bytes_up += open.bytes_up;
        self.state.bytes_down += open.bytes_down;
        if !open.collector.evaluation() {
            let secure_sum = open.secure_sum.take();
            let updates = secure_sum.as_ref().map_or(open.updates.count(), CombinedUpdate::count);
            record.clipped = open.updates.clipped();
            let combined = if updates >= self.job.quorum {
                let sum = match secure_sum {
                    Some(sum) => Ok(sum),
                    None => open.updates.finish(&self.global),
                };
                sum.map_err(|e| {
                    tracing::warn!(updates, error = %e, "the round's updates cannot be combined; the global model is unchanged");
                    format!("the updates cannot be combined: {e}")
                })
            } else {
                tracing::warn!(updates, quorum = self.job.quorum, "quorum not met; the global model is unchanged");
                Err(format!("{updates} updates, quorum {}", self.job.quorum))
            };
            let closing = Instant::now();
            match combined {
                Ok(sum) => {
                    let local = self.job.lr * f64::from(self.job.local_steps.max(1));
                    record.grad_norm = sum.norm() / local;
                    record.pseudo_grad_norm = Some(record.grad_norm);
                    if let Some(report) = open.diagnostics.as_ref().map(Diagnostics::report) {
                        record.grad_norm = report.grad_norm.unwrap_or(record.grad_norm);
                        record.kappa2 = report.kappa2;
                        record.layer_cos = report.layer_cos;
                    }
                    // Finite updates can still sum past f32's range; the round's start model
                    // is kept so that such a round is dropped rather than published.
                    let previous = self.global.clone();
                    record.update_norm = self.strategy.aggregate(open.collector.round(), &mut self.global, &sum)?;
                    if let Some(tensor) = self.global.first_non_finite().map(str::to_string) {
                        tracing::warn!(
                            round = open.collector.round(),
                            tensor,
                            "the round would make the global model non-finite; it is dropped and the model stays"
                        );
                        self.global = previous;
                        self.strategy.restore(&self.state.strategy_state)?;
                        record.update_norm = 0.0;
                        record.unchanged = Some(format!("the new model was not finite (`{tensor}`)"));
                    } else {
                        let registered = self.state.devices.len();
                        let previous = self.client_term.needs_previous_model().then_some(&previous);
                        self.client_term.after_round(previous, &self.global, registered);
                        if let Some(acc) = self.state.privacy.as_mut() {
                            acc.add_round(open.collector.selected().len() as f64 / open.population.max(1) as f64);
                        }
                    }
                    self.spent_sum = sum.into_buffers();
                }
                Err(why) => record.unchanged = Some(why),
            }
            self.state.round = open.collector.round();
            let aggregated = Instant::now();
            let encoded = self.global.encode();
            self.state.global_digest = hex::encode(encoded.digest());
            self.encoded_global = Some(encoded);
            let encoded_at = Instant::now();
            self.state.strategy_state = self.strategy.state()?;
            self.state.client_term_state = self.client_term.state()?;
            let public = self.downlink.as_ref().and_then(DownlinkStream::public);
            self.state.downlink = self
                .downlink
                .as_ref()
                .filter(|s| s.public().is_some())
                .map(|s| DownlinkRecord { public_digest: hex::encode(s.digest()), public_file: String::new() });
            self.checkpoints.save(&self.global, &self.state, public)?;
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
            round: open.collector.round(),
            participants,
            train_loss: record.train_loss,
            global_digest: hex::decode(&self.state.global_digest).unwrap_or_default(),
            finished: false,
            ..RoundResult::default()
        };
        self.publish_result(result)?;
        Ok(record)
    }
}

fn print_round(r: &RoundRecord, rounds: u64) {
    let label = if r.evaluation { "final eval".to_string() } else { format!("round {:>3}/{rounds}", r.round) };
    // Rounds that did not measure held-out accuracy (--heldout-every) show a dash, not 0.
    let heldout = if r.heldout_acc.is_empty() { "    -".to_string() } else { format!("{:.3}", mean(&r.heldout_acc)) };
    println!(
        "{label}  devices {}/{}  loss {:.4}  train acc {:.3}  held-out acc {heldout}  |g| {:.4}  up {:.1} MB  down {:.1} MB  {:.1} s",
        r.participants.len(),
        r.selected.len(),
        r.train_loss,
        mean(&r.reward_acc),
        r.grad_norm,
        r.bytes_up as f64 / 1e6,
        r.bytes_down as f64 / 1e6,
        r.seconds
    );
}
