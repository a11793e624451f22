//! The local DPO trainer: E optimizer steps over a device's pairs.
//!
//! One step draws `batch_pairs` pairs (a seeded shuffle, reshuffled every epoch), runs them
//! in micro-batches of `micro_batch_pairs` (one concatenated chosen+rejected forward each),
//! accumulates the exact mean-loss gradient and applies one optimizer update.

use std::collections::HashMap;
use std::time::Instant;

use candle_core::{Tensor, Var};
use fedpo_data::{collate, TokenizedPair};
use fedpo_model::{BackwardPass, Policy};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

use crate::algorithms::{add_scaled, LocalTerms};
use crate::error::{Result, TrainError};
use crate::logps::{sequence_logps, sequence_logps_values, BatchTensors};
use crate::loss::{check_loss_settings, preference_loss, LossKind, PairLogps};
use crate::loss_on_device::{preference_loss_on_device, read_values, StepTotals};
use crate::optim::{OptimConfig, Optimizer};
use crate::reference::SequenceLogps;

/// Tokenized pairs with their reference log-probs.
#[derive(Debug, Clone)]
pub struct PreferenceSet {
    /// The pairs.
    pub pairs: Vec<TokenizedPair>,
    /// Reference log-probs, aligned with `pairs`.
    pub reference: SequenceLogps,
}

/// Loss and batching settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DpoSettings {
    /// DPO's beta.
    pub beta: f64,
    /// Which loss.
    pub loss: LossKind,
    /// Pairs per optimizer step.
    pub batch_pairs: usize,
    /// Pairs per forward pass; gradients accumulate over `batch_pairs / micro_batch_pairs`.
    pub micro_batch_pairs: usize,
    /// Padding token.
    pub pad_id: u32,
}

impl DpoSettings {
    fn validate(&self) -> Result<()> {
        check_loss_settings(self.loss, self.beta)?;
        if self.batch_pairs == 0 || self.micro_batch_pairs == 0 {
            return Err(TrainError::Invalid("batch and micro-batch sizes must be at least 1".into()));
        }
        Ok(())
    }
}

/// What one optimizer step measured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// 1-based optimizer step.
    pub step: u64,
    /// Mean DPO loss over the step's pairs.
    pub loss: f64,
    /// Share of pairs whose chosen implicit reward beats the rejected one.
    pub reward_acc: f64,
    /// Mean `reward_chosen - reward_rejected`.
    pub margin: f64,
    /// Global norm of the gradient the optimizer applied (DPO plus the local terms),
    /// before clipping.
    pub grad_norm: f64,
    /// Value of the local terms (FedProx's and FedGA's penalties) at the step's start.
    pub penalty: f64,
    /// Wall time of the step.
    pub seconds: f64,
}

/// Metrics of a whole set, without training.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EvalMetrics {
    /// Mean loss.
    pub loss: f64,
    /// Reward accuracy.
    pub reward_acc: f64,
    /// Mean reward margin.
    pub margin: f64,
    /// Pairs evaluated.
    pub pairs: usize,
}

#[derive(Default)]
struct Totals {
    loss: f64,
    correct: usize,
    margin: f64,
    pairs: usize,
    /// What micro-batches evaluated on the device added, not yet read.
    on_device: StepTotals,
}

fn loss_on_chunk(
    settings: &DpoSettings,
    values: &[f64],
    pairs: &[TokenizedPair],
    reference: (&[f64], &[f64]),
) -> crate::loss::LossOutput {
    let p = pairs.len();
    let chosen_lens: Vec<usize> = pairs.iter().map(|x| x.chosen.len()).collect();
    let rejected_lens: Vec<usize> = pairs.iter().map(|x| x.rejected.len()).collect();
    preference_loss(
        settings.loss,
        settings.beta,
        PairLogps {
            policy_chosen: &values[..p],
            policy_rejected: &values[p..],
            ref_chosen: reference.0,
            ref_rejected: reference.1,
            chosen_lens: &chosen_lens,
            rejected_lens: &rejected_lens,
        },
    )
}

/// The micro-batch's reference log-probs (chosen, then rejected) beside `logps`: f64 for an
/// f64 model, else f32, converted on the host (Metal has no f64).
fn reference_tensor(refs: &(Vec<f64>, Vec<f64>), logps: &Tensor) -> Result<Tensor> {
    let values = refs.0.iter().chain(&refs.1);
    let t = if logps.dtype() == candle_core::DType::F64 {
        Tensor::from_vec(values.copied().collect::<Vec<f64>>(), logps.dims(), logps.device())?
    } else {
        Tensor::from_vec(values.map(|&v| v as f32).collect::<Vec<f32>>(), logps.dims(), logps.device())?
    };
    Ok(t.to_dtype(logps.dtype())?)
}

/// Trains a policy on one device's pairs.
pub struct LocalTrainer {
    settings: DpoSettings,
    optimizer: Optimizer,
    rng: StdRng,
    order: Vec<usize>,
    cursor: usize,
    terms: LocalTerms,
    /// Whether a step keeps its loss and norm on the model's device ([`crate::loss_on_device`]);
    /// `None`: off the CPU only.
    on_device: Option<bool>,
}

impl LocalTrainer {
    /// A trainer with a fresh optimizer.
    pub fn new(settings: DpoSettings, optim: OptimConfig, seed: u64) -> Result<Self> {
        settings.validate()?;
        Ok(Self {
            settings,
            optimizer: Optimizer::new(optim)?,
            rng: StdRng::seed_from_u64(seed),
            order: Vec::new(),
            cursor: 0,
            terms: LocalTerms::default(),
            on_device: None,
        })
    }

    /// Keeps each step's loss, gradient norm and clipping on the model's device, with one
    /// read of the step's metrics at its end (`true`), or evaluates the loss on the host
    /// in f64 per micro-batch (`false`). By default a model on the CPU uses the host path
    /// and any other the device path; forcing it lets tests compare the two on the CPU.
    pub fn with_step_on_device(mut self, on: bool) -> Self {
        self.on_device = Some(on);
        self
    }

    fn step_on_device(&self, policy: &Policy) -> bool {
        self.on_device.unwrap_or_else(|| !policy.model_device().is_cpu())
    }

    /// The optimizer, e.g. to save or restore its state.
    pub fn optimizer_mut(&mut self) -> &mut Optimizer {
        &mut self.optimizer
    }

    /// Adds a federated algorithm's terms to the local objective.
    pub fn with_terms(mut self, terms: LocalTerms) -> Self {
        self.terms = terms;
        self
    }

    /// The local terms, e.g. to read SCAFFOLD's new control variate after the round.
    pub fn terms(&self) -> &LocalTerms {
        &self.terms
    }

    /// The settings.
    pub fn settings(&self) -> &DpoSettings {
        &self.settings
    }

    fn next_indices(&mut self, n: usize, count: usize) -> Vec<usize> {
        let mut picked = Vec::with_capacity(count);
        while picked.len() < count.min(n) {
            if self.cursor >= self.order.len() {
                self.order = (0..n).collect();
                self.order.shuffle(&mut self.rng);
                self.cursor = 0;
            }
            picked.push(self.order[self.cursor]);
            self.cursor += 1;
        }
        picked
    }

    /// The exact gradient of the mean loss over `indices`, by parameter name, plus totals.
    fn gradient(
        &self,
        policy: &Policy,
        data: &PreferenceSet,
        indices: &[usize],
    ) -> Result<(HashMap<String, Tensor>, Totals)> {
        let trainable: Vec<(&str, &Var)> =
            policy.params.trainable().filter_map(|p| p.var().map(|v| (p.name.as_str(), v))).collect();
        let (dtype, device) = (policy.model_dtype(), policy.model_device());
        let mut grads: HashMap<String, Tensor> = HashMap::new();
        let mut totals = Totals::default();
        let on_device = self.step_on_device(policy);
        let passes = indices.len().div_ceil(self.settings.micro_batch_pairs);
        for (pass, chunk) in indices.chunks(self.settings.micro_batch_pairs).enumerate() {
            let pairs: Vec<TokenizedPair> = chunk.iter().map(|&i| data.pairs[i].clone()).collect();
            let refs: (Vec<f64>, Vec<f64>) =
                chunk.iter().map(|&i| (data.reference.chosen[i], data.reference.rejected[i])).unzip();
            let batch = BatchTensors::new(&collate(&pairs.iter().collect::<Vec<_>>(), self.settings.pad_id), policy)?;
            let logps = sequence_logps(policy, &batch)?;
            // Surrogate whose gradient is d(mean loss over the whole step)/d(params).
            let scale = 1.0 / indices.len() as f64;
            let coeffs = if on_device {
                let reference = reference_tensor(&refs, &logps)?;
                let lens: Vec<usize> =
                    pairs.iter().map(|x| x.chosen.len()).chain(pairs.iter().map(|x| x.rejected.len())).collect();
                let out = preference_loss_on_device(
                    self.settings.loss,
                    self.settings.beta,
                    &logps.detach(),
                    &reference,
                    &lens,
                )?;
                totals.on_device.add(&out.totals, chunk.len())?;
                (out.grad * scale)?.to_dtype(dtype)?
            } else {
                let values: Vec<f64> = logps.detach().to_dtype(candle_core::DType::F64)?.to_vec1()?;
                let out = loss_on_chunk(&self.settings, &values, &pairs, (&refs.0, &refs.1));
                if !out.loss_sum.is_finite() {
                    return Err(TrainError::NonFinite { what: "loss", step: self.optimizer.steps_taken() + 1 });
                }
                totals.loss += out.loss_sum;
                totals.correct += out.correct;
                totals.margin += out.margin_sum;
                totals.pairs += chunk.len();
                let coeffs: Vec<f64> = out.grad_chosen.iter().chain(&out.grad_rejected).map(|g| g * scale).collect();
                Tensor::from_vec(coeffs, logps.dims(), &device)?.to_dtype(dtype)?
            };
            // The model sums the gradients it buffers itself (the embedding's and the
            // blocks') over the passes; the rest is summed here.
            let surrogate = (logps * coeffs)?.sum_all()?;
            let store = policy.model.backward_pass(&surrogate, BackwardPass::of(pass, passes))?;
            for (name, var) in &trainable {
                if let Some(g) = store.get(var.as_tensor()) {
                    let acc = match grads.remove(*name) {
                        // The first micro-batch's gradient becomes the accumulator: its
                        // store is dropped before the next micro-batch adds into it.
                        Some(prev) => crate::optimizer_ops::accumulate(prev, g)?,
                        None => g.clone(),
                    };
                    grads.insert(name.to_string(), acc);
                }
            }
        }
        Ok((grads, totals))
    }

    /// One optimizer step on `batch_pairs` pairs drawn from `data`.
    pub fn step(&mut self, policy: &Policy, data: &PreferenceSet) -> Result<StepMetrics> {
        if data.pairs.is_empty() {
            return Err(TrainError::Invalid("no training pairs".into()));
        }
        let start = Instant::now();
        let indices = self.next_indices(data.pairs.len(), self.settings.batch_pairs);
        let (mut grads, mut totals) = self.gradient(policy, data, &indices)?;
        let mut penalty = 0.0;
        if let Some(scaffold) = self.terms.scaffold.as_mut() {
            scaffold.observe(&grads)?;
        }
        if let Some(alignment) = &self.terms.alignment {
            let regrad = || Ok(self.gradient(policy, data, &indices)?.0);
            let (value, extra) = alignment.penalty_gradient(policy, &grads, &regrad)?;
            penalty += value;
            add_scaled(&mut grads, &extra, 1.0)?;
        }
        if let Some(proximal) = &self.terms.proximal {
            penalty += proximal.value(policy)?;
            proximal.apply(policy, &mut grads)?;
        }
        if let Some(scaffold) = &self.terms.scaffold {
            scaffold.apply(&mut grads)?;
        }
        let trainable: Vec<(&str, &Var)> =
            policy.params.trainable().filter_map(|p| p.var().map(|v| (p.name.as_str(), v))).collect();
        let grad_norm = if self.step_on_device(policy) {
            let norm = self.optimizer.step_on_device(&trainable, &grads)?;
            self.read_step_metrics(policy, &mut totals, norm)?
        } else {
            self.optimizer.step(&trainable, &grads)?
        };
        let n = totals.pairs as f64;
        Ok(StepMetrics {
            step: self.optimizer.steps_taken(),
            loss: totals.loss / n,
            reward_acc: totals.correct as f64 / n,
            margin: totals.margin / n,
            grad_norm,
            penalty,
            seconds: start.elapsed().as_secs_f64(),
        })
    }

    /// The step's one read from the device: the loss totals and the gradient norm,
    /// checked for being finite (after the update, see [`Optimizer::step_on_device`]).
    fn read_step_metrics(&self, policy: &Policy, totals: &mut Totals, norm: Option<Tensor>) -> Result<f64> {
        let sums = totals.on_device.sums(&policy.model_device())?;
        let mut read = vec![sums.clone()];
        if let Some(norm) = norm {
            read.push(norm.to_dtype(sums.dtype())?.unsqueeze(0)?);
        }
        let values = read_values(&Tensor::cat(&read, 0)?)?;
        let step = self.optimizer.steps_taken();
        if !values[0].is_finite() {
            return Err(TrainError::NonFinite { what: "loss", step });
        }
        totals.loss += values[0];
        totals.correct += values[1].round() as usize;
        totals.margin += values[2];
        totals.pairs += totals.on_device.pairs();
        let norm = values.get(3).copied().unwrap_or(0.0);
        if !norm.is_finite() {
            return Err(TrainError::NonFinite { what: "gradient norm", step });
        }
        Ok(norm)
    }

    /// The full-data gradient at the current parameters (no update): the per-device
    /// gradient the federated diagnostics need.
    pub fn full_gradient(&self, policy: &Policy, data: &PreferenceSet) -> Result<HashMap<String, Tensor>> {
        let all: Vec<usize> = (0..data.pairs.len()).collect();
        Ok(self.gradient(policy, data, &all)?.0)
    }
}

/// Loss, reward accuracy and margin of `policy` on a set, `micro_batch_pairs` at a time
/// (a forward pass holds as much memory as a training one).
pub fn evaluate(policy: &Policy, data: &PreferenceSet, settings: &DpoSettings) -> Result<EvalMetrics> {
    let mut t = Totals::default();
    let per_pass = settings.micro_batch_pairs.clamp(1, settings.batch_pairs.max(1));
    for (k, chunk) in data.pairs.chunks(per_pass).enumerate() {
        let offset = k * per_pass;
        let batch = BatchTensors::new(&collate(&chunk.iter().collect::<Vec<_>>(), settings.pad_id), policy)?;
        let values = sequence_logps_values(policy, &batch)?;
        let range = offset..offset + chunk.len();
        let out = loss_on_chunk(
            settings,
            &values,
            chunk,
            (&data.reference.chosen[range.clone()], &data.reference.rejected[range]),
        );
        t.loss += out.loss_sum;
        t.correct += out.correct;
        t.margin += out.margin_sum;
        t.pairs += chunk.len();
    }
    let n = t.pairs.max(1) as f64;
    Ok(EvalMetrics { loss: t.loss / n, reward_acc: t.correct as f64 / n, margin: t.margin / n, pairs: t.pairs })
}
