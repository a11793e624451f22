//! The memory plan of a round: how many pairs one pass may take, and whether the round's
//! starting model waits on disk, so that training fits `--max-memory` (and on a GPU its
//! free memory). Planned from the plan's model spec, before the model is downloaded.

use fedpo_wire::RoundPlan;

use super::{Participant, ParticipantError};
use crate::algorithms::start_placement;
use crate::memory::{self, longest, PlanRequest, StepKernels};

impl Participant {
    /// Plans the round's micro-batch under `--max-memory` (and on a GPU its free memory),
    /// before the model is downloaded. A model that cannot fit is an error: no later round
    /// of the job would fit either.
    pub(super) fn fit_memory(&mut self, plan: &RoundPlan) -> Result<(), ParticipantError> {
        let Some(budget) = memory::training_budget(&self.cfg.compute, self.cfg.max_memory_mib) else {
            self.micro_batch_pairs = self.cfg.max_micro_batch_pairs;
            self.start_on_disk = self.cfg.start_on_disk;
            return Ok(());
        };
        let spec: fedpo_model::PolicySpec = serde_json::from_str(&plan.model_spec)
            .map_err(|e| ParticipantError::Protocol(format!("round {}: unreadable model spec: {e}", plan.round)))?;
        let (seq_len, response_len) = longest(&self.train);
        let (h_seq, h_resp) = longest(&self.heldout);
        let batch_pairs = plan.hyper.batch_pairs.max(1) as usize;
        let request = PlanRequest {
            config: spec.config,
            lora: spec.lora.filter(|_| spec.partition.uses_adapter()),
            partition: spec.partition,
            optimizer: fedpo_train::OptimKind::Sgd,
            batch_pairs,
            max_micro_batch_pairs: self.cfg.max_micro_batch_pairs.unwrap_or(batch_pairs),
            seq_len: seq_len.max(h_seq),
            response_len: response_len.max(h_resp),
            federated: true,
            start_on_disk: start_placement(&plan.strategy, self.cfg.start_on_disk),
            may_freeze_embeddings: false,
            may_shorten: false,
            kernels: StepKernels::for_run(&self.cfg.compute, self.cfg.compute_dtype),
        };
        let fitted =
            memory::plan(&request, budget).map_err(|reason| ParticipantError::Memory { round: plan.round, reason })?;
        if self.micro_batch_pairs != Some(fitted.micro_batch_pairs) || self.start_on_disk != fitted.start_on_disk {
            tracing::info!(
                round = plan.round,
                budget_mib = budget.mib,
                plan = %fitted,
                longest_sequence = request.seq_len,
                longest_response = request.response_len,
                "memory plan"
            );
        }
        self.micro_batch_pairs = Some(fitted.micro_batch_pairs);
        self.start_on_disk = fitted.start_on_disk;
        Ok(())
    }
}
