//! One local round: build the policy from the received global model and the private
//! adapter, evaluate it, train E steps and compute the shared delta.

use std::collections::BTreeMap;
use std::time::Instant;

use candle_core::{DType, Device};
use fedpo_data::{fingerprint, TokenizedPair};
use fedpo_model::checkpoint::{load_adapter, save_adapter};
use fedpo_model::{ParamRole, Policy, PolicySpec, SharedTensor, SpilledStart, TensorSource};
use fedpo_train::{
    evaluate, load_or_score_pairs, score_pairs, DpoSettings, LocalTrainer, LossKind, OptimConfig, OptimKind,
    PreferenceSet,
};
use fedpo_wire::{keys, Limits, RoundPlan, TensorPayload, UpdateMetrics};

use crate::algorithms::{shared_anchor, terms_for, upload_sections};
use crate::error::ParticipantError;
use crate::state_dir::{JobProgress, StateDir, REFERENCE_MODEL};
use fedpo_process::usage::peak_rss_mib;

/// The scratch file of a round whose starting model waits on disk.
const START_FILE: &str = "round-start.f32";

/// Where the model a round started from waits for the delta.
enum RoundStart {
    InMemory(TensorSource),
    OnDisk(SpilledStart),
}

/// What a round produced.
pub(crate) struct RoundOutcome {
    pub(crate) metrics: UpdateMetrics,
    /// The shared delta; empty in an evaluation-only round.
    pub(crate) delta: Vec<SharedTensor>,
    /// Named extra uploads: SCAFFOLD's `Δc_i`, the diagnostic gradient.
    pub(crate) sections: Vec<(String, Vec<SharedTensor>)>,
    /// The model the round started from waited on disk while it trained.
    pub(crate) start_was_on_disk: bool,
}

pub(crate) struct RoundInputs<'a> {
    pub(crate) plan: &'a RoundPlan,
    /// Owned so that its bytes are freed once the model is built from them.
    pub(crate) global: TensorPayload,
    pub(crate) global_digest: &'a str,
    /// The plan's sections, decoded.
    pub(crate) sections: &'a BTreeMap<String, TensorPayload>,
    pub(crate) train: &'a [TokenizedPair],
    pub(crate) heldout: &'a [TokenizedPair],
    pub(crate) pad_id: u32,
    /// One past the largest token id in the pairs.
    pub(crate) vocab_needed: usize,
    pub(crate) seed: u64,
    pub(crate) compute: &'a Device,
    /// Pairs per forward pass, when a memory budget set it.
    pub(crate) micro_batch_pairs: Option<usize>,
    /// Keep the model the round starts from on disk while training, when a memory budget
    /// needs it (and no local term holds it anyway).
    pub(crate) start_on_disk: bool,
    /// Dtype of matmuls and activations.
    pub(crate) compute_dtype: DType,
    /// What a kept reference model may take when it is decoded again.
    pub(crate) limits: &'a Limits,
}

/// The reference policy rebuilt from the kept reference model: that model with a
/// fresh, zero-effect private adapter (or its own adapter weights, without a private
/// one), as when the reference was first computed.
fn reference_policy(
    spec: &PolicySpec,
    digest: &str,
    private_adapter: bool,
    build: &PolicyBuild<'_>,
    state: &StateDir,
) -> Result<Policy, ParticipantError> {
    let Some(bytes) = state.kept_reference_model(digest)? else {
        return Err(ParticipantError::State(format!(
            "the reference log-probs are missing or stale, this round's model is not the reference model {digest}, \
             and {} does not hold it; they cannot be rebuilt",
            state.path(REFERENCE_MODEL).display()
        )));
    };
    let payload = TensorPayload::from_shared(bytes, build.limits, true)?;
    let model = TensorSource::from_wire(&payload.tensors, "the kept reference model", build.compute)?;
    drop(payload);
    let adapter = if private_adapter { None } else { Some(&model) };
    let mut policy = Policy::build(spec.clone(), Some(&model), adapter, build.seed, DType::F32, build.compute)?;
    policy.set_compute_dtype(build.compute_dtype)?;
    Ok(policy)
}

/// How a round builds its policies.
struct PolicyBuild<'a> {
    compute: &'a Device,
    seed: u64,
    compute_dtype: DType,
    limits: &'a Limits,
}

/// Trains one round. Saves the private adapter before returning, so an update is never
/// uploaded for an adapter that a crash could lose.
pub(crate) fn train_round(
    input: RoundInputs<'_>,
    state: &StateDir,
    progress: &mut JobProgress,
) -> Result<RoundOutcome, ParticipantError> {
    let started = Instant::now();
    let plan = input.plan;
    let spec: PolicySpec = serde_json::from_str(&plan.model_spec)
        .map_err(|e| ParticipantError::Protocol(format!("round {}: unreadable model spec: {e}", plan.round)))?;
    if spec.config.vocab_size < input.vocab_needed {
        // A token id past the embedding would fail deep in the forward pass instead.
        return Err(ParticipantError::Protocol(format!(
            "round {}: the job's model has {} tokens but this device's pairs use token id {}; a job on a \
             trimmed vocabulary needs each device to have its vocabulary file (--vocab)",
            plan.round,
            spec.config.vocab_size,
            input.vocab_needed - 1
        )));
    }
    let global = TensorSource::from_wire(
        &input.global.tensors,
        &format!("the global model of round {}", plan.round),
        input.compute,
    )?;
    // On a small device every model-sized copy counts: the wire form is no longer needed.
    drop(input.global);
    let private_adapter = spec.partition.uses_adapter() && spec.partition.adapter_role() == ParamRole::Private;
    let saved = if private_adapter && state.adapter_path().exists() {
        Some(load_adapter(&state.adapter_path(), input.compute)?)
    } else {
        None
    };
    let adapter_source = match (&saved, private_adapter) {
        (Some(a), _) => Some(&a.tensors),
        (None, true) => None, // a fresh adapter, seeded by the device id
        (None, false) => Some(&global),
    };
    let mut policy = Policy::build(spec.clone(), Some(&global), adapter_source, input.seed, DType::F32, input.compute)?;
    policy.set_compute_dtype(input.compute_dtype)?;

    let batch_pairs = plan.hyper.batch_pairs.max(1) as usize;
    let settings = DpoSettings {
        beta: plan.hyper.beta,
        loss: LossKind::Sigmoid { label_smoothing: 0.0 },
        batch_pairs,
        micro_batch_pairs: input.micro_batch_pairs.unwrap_or(batch_pairs).clamp(1, batch_pairs),
        pad_id: input.pad_id,
    };
    // The reference is the first global model this device trained from (with a fresh,
    // zero-effect adapter): fixed for the device's whole life, cached in the state dir.
    let reference_model = progress.reference_model.clone().unwrap_or_else(|| input.global_digest.to_string());
    // Only the reference model itself may fill a missing cache: this round's model with a
    // fresh adapter, when it is the model the reference was taken from, or else the kept
    // copy of that model.
    let policy_is_reference = reference_model == input.global_digest && saved.is_none();
    let kept = std::cell::RefCell::new(None);
    let build = PolicyBuild {
        compute: input.compute,
        seed: input.seed,
        compute_dtype: input.compute_dtype,
        limits: input.limits,
    };
    let score = |pairs: &[TokenizedPair], file: &str| {
        load_or_score_pairs(&state.path(file), &reference_model, &fingerprint(pairs), || {
            if policy_is_reference {
                return score_pairs(&policy, pairs, settings.micro_batch_pairs, settings.pad_id);
            }
            let mut kept = kept.borrow_mut();
            if kept.is_none() {
                let rebuilt = reference_policy(&spec, &reference_model, private_adapter, &build, state)
                    .map_err(|e| fedpo_train::TrainError::Invalid(format!("{}: {e}", state.path(file).display())))?;
                *kept = Some(rebuilt);
            }
            tracing::warn!(file, "rebuilding reference log-probs from the kept reference model");
            score_pairs(kept.as_ref().expect("just built"), pairs, settings.micro_batch_pairs, settings.pad_id)
        })
        .map(|(logps, _)| logps)
    };
    let train = PreferenceSet { pairs: input.train.to_vec(), reference: score(input.train, "ref_train.json")? };
    let heldout = if input.heldout.is_empty() {
        None
    } else {
        Some(PreferenceSet { pairs: input.heldout.to_vec(), reference: score(input.heldout, "ref_heldout.json")? })
    };
    if progress.reference_model.is_none() {
        progress.reference_model = Some(reference_model);
        state.save_progress(progress)?;
    }

    // Held-out accuracy of the model the device holds at the start of the round: the new
    // global base with its own adapter, which is what a user of the device would get.
    let heldout_acc = match &heldout {
        Some(h) if plan.strategy.get(keys::HELDOUT_EVAL) != Some(&0.0) => {
            Some(evaluate(&policy, h, &settings)?.reward_acc)
        }
        _ => None,
    };

    let steps = plan.hyper.local_steps;
    let mut sections = Vec::new();
    let training = steps > 0;
    let anchor = shared_anchor(&policy, &global);
    let terms = if training {
        terms_for(plan, input.sections, &policy, &anchor, state, input.compute)?
    } else {
        Default::default()
    };
    let mut trainer = LocalTrainer::new(
        settings,
        OptimConfig::new(OptimKind::Sgd, plan.hyper.lr),
        input.seed ^ plan.round.wrapping_mul(0x9e37_79b9_7f4a_7c15),
    )?
    .with_terms(terms);
    if training && plan.strategy.get(keys::DIAGNOSTICS) == Some(&1.0) {
        // ∇F_i at the received model, over all training pairs, before any local step.
        let gradient = trainer.full_gradient(&policy, &train)?;
        sections.push((keys::DIAGNOSTIC_GRADIENT.to_string(), policy.shared_values(&gradient)?));
    }
    // FedProx and FedGA measure the distance to the start while training: they hold it.
    let terms_hold_start = trainer.terms().proximal.is_some() || trainer.terms().alignment.is_some();
    drop(anchor);
    let start = if training && input.start_on_disk && !terms_hold_start {
        let spilled = SpilledStart::write(&state.path(START_FILE), &policy, &global)?;
        drop(global);
        tracing::debug!(file = %spilled.path().display(), "the round's starting model set aside on disk");
        RoundStart::OnDisk(spilled)
    } else {
        RoundStart::InMemory(global)
    };
    let (mut loss_sum, mut acc_sum, mut grad_norm) = (0.0, 0.0, 0.0);
    for step in 0..steps {
        let m = trainer.step(&policy, &train)?;
        loss_sum += m.loss;
        acc_sum += m.reward_acc;
        if step == 0 {
            grad_norm = m.grad_norm; // at the received model, before any local update
        }
        tracing::debug!(round = plan.round, step = m.step, loss = m.loss, acc = m.reward_acc, "local step");
    }
    // Training accuracy: in a training round, over the batches the local steps saw (as
    // TRL reports it; a full pass would cost more than the training); in an
    // evaluation-only round, over every training pair.
    let (train_loss, reward_acc) = if steps == 0 {
        let e = evaluate(&policy, &train, &settings)?;
        (e.loss, e.reward_acc)
    } else {
        (loss_sum / f64::from(steps), acc_sum / f64::from(steps))
    };
    if private_adapter && steps > 0 {
        save_adapter(&policy, &state.adapter_path())?;
        if !progress.adapter_saved {
            progress.adapter_saved = true;
            state.save_progress(progress)?;
        }
    }
    sections.extend(upload_sections(trainer.terms(), &policy, state)?);
    let start_was_on_disk = matches!(start, RoundStart::OnDisk(_));
    let delta = match start {
        _ if steps == 0 => Vec::new(),
        RoundStart::InMemory(global) => policy.shared_delta(&global)?,
        RoundStart::OnDisk(spilled) => spilled.delta(&policy)?,
    };
    Ok(RoundOutcome {
        metrics: UpdateMetrics {
            train_loss,
            reward_acc,
            heldout_acc,
            grad_norm,
            seconds: started.elapsed().as_secs_f64(),
            peak_rss_mib: Some(peak_rss_mib()),
        },
        delta,
        sections,
        start_was_on_disk,
    })
}
