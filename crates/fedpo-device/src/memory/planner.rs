//! Fitting training into a memory budget (`--max-memory MB`).
//!
//! The planner gives up things in the order that changes training least:
//! 1. smaller micro-batches (gradient accumulation: the same optimizer step, slower);
//! 2. in a federated round, the model the round started from kept on disk until the delta
//!    is formed ([`fedpo_model::SpilledStart`]: the same training, one write and one read
//!    of the shared tensors more per round);
//! 3. frozen token and position embeddings (less trains; off in a federated job, where the
//!    aggregator's plan fixes what is shared);
//! 4. shorter sequences (truncation loses tokens; off where the data is already tokenized).
//!
//! A budget nothing fits is refused before anything is allocated, with the smallest
//! footprint fedpo could reach and what it would take.

use std::fmt;

use fedpo_data::TokenizedPair;
use fedpo_model::{Gpt2Config, LoraConfig, Partition};
use fedpo_train::OptimKind;
use thiserror::Error;

use super::footprint::{Estimate, ParamCounts, StepKernels, Workload};

/// Sequences are never shortened below this many tokens.
pub const MIN_SEQ_LEN: usize = 32;

/// What to fit.
#[derive(Debug, Clone)]
pub struct PlanRequest {
    /// The model's shape.
    pub config: Gpt2Config,
    /// The adapter, if the partition has one.
    pub lora: Option<LoraConfig>,
    /// What trains and what is shared.
    pub partition: Partition,
    /// The optimizer.
    pub optimizer: OptimKind,
    /// Pairs per optimizer step (fixed: it is part of the method).
    pub batch_pairs: usize,
    /// The most pairs one forward pass may take (`--micro-batch-pairs`); the planner may
    /// take fewer. Clamped to `1..=batch_pairs`.
    pub max_micro_batch_pairs: usize,
    /// Tokens of the longest tokenized sequence.
    pub seq_len: usize,
    /// Response tokens of the longest response (where logits are taken).
    pub response_len: usize,
    /// A federated round (it also holds the global model and the upload).
    pub federated: bool,
    /// Whether a federated round's starting model may, or must, stay on disk.
    pub start_on_disk: StartOnDisk,
    /// The planner may freeze the embeddings.
    pub may_freeze_embeddings: bool,
    /// The planner may shorten sequences.
    pub may_shorten: bool,
    /// The kernels training runs on.
    pub kernels: StepKernels,
}

/// Where a federated round keeps the model it started from while it trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartOnDisk {
    /// In memory, whatever the budget.
    Never,
    /// On disk when nothing else the planner may do first fits the budget.
    WhenNeeded,
    /// On disk in every round (`fedpo-device run --start-on-disk`): every estimate counts
    /// it, so the planner keeps the largest micro-batch that fits with it.
    Always,
}

/// A configuration that fits.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryPlan {
    /// Pairs per forward pass.
    pub micro_batch_pairs: usize,
    /// Whether the embeddings must be frozen (only when the request allowed it).
    pub freeze_embeddings: bool,
    /// The sequence length to truncate to, when shorter than the request's.
    pub max_len: Option<usize>,
    /// Whether a federated round keeps the model it started from on disk.
    pub start_on_disk: bool,
    /// The expected peak, MiB, with the safety margin.
    pub estimate_mib: f64,
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.micro_batch_pairs;
        write!(f, "{n} pair{} per pass", if n == 1 { "" } else { "s" })?;
        if self.freeze_embeddings {
            write!(f, ", frozen embeddings")?;
        }
        if self.start_on_disk {
            write!(f, ", the round's starting model on disk")?;
        }
        if let Some(len) = self.max_len {
            write!(f, ", sequences cut to {len} tokens")?;
        }
        write!(f, " (expected peak {:.0} MiB)", self.estimate_mib)
    }
}

/// Why a budget cannot be met.
#[derive(Debug, Error, PartialEq)]
pub enum PlanError {
    /// Even the smallest configuration the request allows needs more.
    #[error(
        "{budget} cannot hold this training: the smallest configuration allowed here \
         ({smallest}) needs about {needed_mib:.0} MiB, of which {parameters_mib:.0} MiB are weights, \
         gradients and optimizer state.{hint}"
    )]
    DoesNotFit {
        /// The budget, and what set it.
        budget: super::Budget,
        /// The smallest plan tried.
        smallest: String,
        /// Its estimate.
        needed_mib: f64,
        /// Its parameter share.
        parameters_mib: f64,
        /// What else would fit, if anything.
        hint: String,
    },
    /// Nonsense input.
    #[error("memory planning: {0}")]
    Invalid(String),
}

impl PlanRequest {
    fn workload(&self, micro_batch_pairs: usize, at: Settings) -> Workload {
        let Settings { freeze: freeze_embeddings, seq_len, start_on_disk } = at;
        let partition =
            Partition { freeze_embeddings: self.partition.freeze_embeddings || freeze_embeddings, ..self.partition };
        Workload {
            config: self.config.clone(),
            params: ParamCounts::of(&self.config, self.lora.as_ref(), partition),
            micro_batch_pairs,
            batch_pairs: self.batch_pairs,
            seq_len,
            logit_positions: self.response_len.min(seq_len),
            optimizer: self.optimizer,
            federated: self.federated,
            start_on_disk,
            embeddings_train: partition.base_role("wte.weight").is_trainable(),
            kernels: self.kernels,
            shared_prompt: fedpo_train::logps::shares_prompts(),
        }
    }

    fn estimate(&self, micro: usize, at: Settings) -> Estimate {
        self.workload(micro, at).estimate()
    }

    /// The micro-batches the planner may choose from, largest first; always at least 1.
    fn micro_batches(&self) -> impl Iterator<Item = usize> {
        (1..=self.max_micro_batch_pairs.min(self.batch_pairs).max(1)).rev()
    }

    /// The largest micro-batch that fits at these settings, if any. It need not be the one
    /// with the smallest footprint: a batch split over several passes holds a gradient
    /// accumulation buffer, which can outweigh the activations it saves.
    fn largest_micro_batch(&self, budget: f64, at: Settings) -> Option<(usize, f64)> {
        self.micro_batches().map(|m| (m, self.estimate(m, at).peak_mib())).find(|(_, mib)| *mib <= budget)
    }

    /// The micro-batch with the smallest footprint at these settings, and its estimate.
    fn smallest_footprint(&self, at: Settings) -> (usize, Estimate) {
        self.micro_batches()
            .map(|m| (m, self.estimate(m, at)))
            .min_by(|(_, a), (_, b)| a.peak_mib().total_cmp(&b.peak_mib()))
            .unwrap_or_else(|| (1, self.estimate(1, at)))
    }

    /// Where a plan may keep the round's start, in the order the planner tries them: only a
    /// federated round has one.
    fn start_options(&self) -> &'static [bool] {
        match (self.federated, self.start_on_disk) {
            (false, _) | (true, StartOnDisk::Never) => &[false],
            (true, StartOnDisk::WhenNeeded) => &[false, true],
            (true, StartOnDisk::Always) => &[true],
        }
    }

    /// The start's place in the planner's last resort, and in its hints.
    fn start_on_disk_at_the_least(&self) -> bool {
        self.start_options().last().copied().unwrap_or(false)
    }

    /// The settings at `seq_len` with embeddings as they are and the start in memory.
    #[cfg(test)]
    fn at_length(&self, seq_len: usize) -> Settings {
        Settings { freeze: false, seq_len, start_on_disk: false }
    }
}

/// What the planner may change besides the micro-batch.
#[derive(Debug, Clone, Copy)]
struct Settings {
    freeze: bool,
    seq_len: usize,
    start_on_disk: bool,
}

/// The longest sequence (prompt + response) and the longest response among `pairs`: every
/// batch is padded to at most the first and takes logits at most at the second.
pub fn longest(pairs: &[TokenizedPair]) -> (usize, usize) {
    pairs.iter().fold((0, 0), |(seq, resp), p| {
        let r = p.chosen.len().max(p.rejected.len());
        (seq.max(p.prompt.len() + r), resp.max(r))
    })
}

/// Fits `request` into `budget` (MiB of `--max-memory`, or a [`super::Budget`] naming
/// what set it).
pub fn plan(request: &PlanRequest, budget: impl Into<super::Budget>) -> Result<MemoryPlan, PlanError> {
    let budget_of = budget.into();
    if request.batch_pairs == 0 || request.max_micro_batch_pairs == 0 || request.seq_len == 0 {
        return Err(PlanError::Invalid("batch pairs, micro-batch pairs and sequence length must be positive".into()));
    }
    let budget = budget_of.mib as f64;
    let already_frozen = request.partition.freeze_embeddings;
    let mut freeze_options = vec![false];
    if request.may_freeze_embeddings && !already_frozen {
        freeze_options.push(true);
    }
    let mut lengths = vec![request.seq_len];
    if request.may_shorten {
        let mut len = request.seq_len / 2;
        while len >= MIN_SEQ_LEN {
            lengths.push(len);
            len /= 2;
        }
        if request.seq_len > MIN_SEQ_LEN && !lengths.contains(&MIN_SEQ_LEN) {
            lengths.push(MIN_SEQ_LEN);
        }
    }
    for &seq_len in &lengths {
        for &freeze in &freeze_options {
            for &start_on_disk in request.start_options() {
                let at = Settings { freeze, seq_len, start_on_disk };
                if let Some((micro, estimate_mib)) = request.largest_micro_batch(budget, at) {
                    return Ok(MemoryPlan {
                        micro_batch_pairs: micro,
                        freeze_embeddings: freeze,
                        max_len: (seq_len < request.seq_len).then_some(seq_len),
                        start_on_disk,
                        estimate_mib,
                    });
                }
            }
        }
    }

    let at = Settings {
        freeze: *freeze_options.last().unwrap_or(&false),
        seq_len: *lengths.last().unwrap_or(&request.seq_len),
        start_on_disk: request.start_on_disk_at_the_least(),
    };
    let (micro, smallest) = request.smallest_footprint(at);
    let smallest_plan = MemoryPlan {
        micro_batch_pairs: micro,
        freeze_embeddings: at.freeze,
        max_len: (at.seq_len < request.seq_len).then_some(at.seq_len),
        start_on_disk: at.start_on_disk,
        estimate_mib: smallest.peak_mib(),
    };
    Err(PlanError::DoesNotFit {
        budget: budget_of,
        smallest: smallest_plan.to_string().split(" (").next().unwrap_or_default().to_string(),
        needed_mib: smallest.peak_mib(),
        parameters_mib: smallest.parameters_mib,
        hint: hint(request, budget),
    })
}

/// What the request forbade the planner to try, when that would fit.
fn hint(request: &PlanRequest, budget: f64) -> String {
    let mut hints = Vec::new();
    // What the planner would also do: the start on disk, where allowed.
    let start_on_disk = request.start_on_disk_at_the_least();
    if !request.may_freeze_embeddings && !request.partition.freeze_embeddings {
        let at = Settings { freeze: true, seq_len: request.seq_len, start_on_disk };
        if let Some((micro, mib)) = request.largest_micro_batch(budget, at) {
            hints.push(format!(
                "with frozen embeddings (the aggregator's --freeze-embeddings), at {micro} pairs per pass ({mib:.0} MiB)"
            ));
        }
    }
    if !request.may_shorten {
        let mut len = request.seq_len / 2;
        while len >= MIN_SEQ_LEN {
            if let Some((micro, mib)) =
                request.largest_micro_batch(budget, Settings { freeze: false, seq_len: len, start_on_disk })
            {
                hints.push(format!("with --max-len {len}, at {micro} pairs per pass ({mib:.0} MiB)"));
                break;
            }
            len /= 2;
        }
    }
    if hints.is_empty() {
        " Use a smaller model or a device with more memory.".to_string()
    } else {
        format!(" It would fit {}.", hints.join("; or "))
    }
}

#[cfg(test)]
mod tests {
    use fedpo_model::PartitionPreset;

    use super::*;

    fn distilgpt2_request() -> PlanRequest {
        PlanRequest {
            config: Gpt2Config::distilgpt2(),
            lora: Some(LoraConfig::default()),
            partition: Partition::new(PartitionPreset::Pfeddpo),
            optimizer: OptimKind::Sgd,
            batch_pairs: 8,
            max_micro_batch_pairs: 8,
            seq_len: 128,
            response_len: 64,
            federated: true,
            start_on_disk: StartOnDisk::Never,
            may_freeze_embeddings: false,
            may_shorten: false,
            kernels: StepKernels::Fused,
        }
    }

    /// Long pairs, where the activations outweigh the accumulation buffer.
    fn long_pairs_request() -> PlanRequest {
        PlanRequest { seq_len: 512, response_len: 256, ..distilgpt2_request() }
    }

    #[test]
    fn a_generous_budget_keeps_the_whole_batch_in_one_pass() {
        let p = plan(&distilgpt2_request(), 64 * 1024).unwrap();
        assert_eq!((p.micro_batch_pairs, p.freeze_embeddings, p.max_len), (8, false, None));
    }

    #[test]
    fn a_tight_budget_splits_a_batch_of_long_pairs_and_stays_under_it() {
        let request = long_pairs_request();
        let whole = request.estimate(8, request.at_length(512)).peak_mib();
        let budget = whole - 200.0;
        let p = plan(&request, budget as u64).unwrap();
        assert!(p.micro_batch_pairs < 8 && p.micro_batch_pairs >= 1, "{p}");
        assert!(p.estimate_mib <= budget);
        // The next larger micro-batch would not have fitted: the planner takes the largest.
        assert!(request.estimate(p.micro_batch_pairs + 1, request.at_length(512)).peak_mib() > budget);
    }

    #[test]
    fn the_synthetic_pairs_split_under_a_budget_one_pass_exceeds() {
        // The synthetic personas' longest pair: 71 tokens, 55 of them response. Passes of
        // one pair measured lower in a round than one pass of eight (benchmark-log.md).
        let request = PlanRequest { seq_len: 71, response_len: 55, ..distilgpt2_request() };
        let whole = request.estimate(8, request.at_length(71)).peak_mib();
        let p = plan(&request, (whole - 1.0) as u64).unwrap();
        assert!(p.micro_batch_pairs < 8 && p.estimate_mib < whole, "{p}");
    }

    #[test]
    fn very_short_pairs_are_not_split_where_the_accumulation_buffer_costs_more_than_it_saves() {
        let request = PlanRequest { seq_len: 8, response_len: 4, ..distilgpt2_request() };
        let whole = request.estimate(8, request.at_length(8)).peak_mib();
        assert!(request.estimate(1, request.at_length(8)).peak_mib() > whole);
        let err = plan(&request, (whole - 1.0) as u64).unwrap_err().to_string();
        assert!(err.contains("(8 pairs per pass) needs about"), "{err}");
    }

    #[test]
    fn a_round_keeps_its_start_on_disk_only_when_passes_of_one_pair_do_not_fit() {
        // The synthetic personas' pairs, as a device in a federated job plans them.
        let request = PlanRequest {
            seq_len: 71,
            response_len: 55,
            start_on_disk: StartOnDisk::WhenNeeded,
            ..distilgpt2_request()
        };
        let in_memory = request.estimate(1, request.at_length(71)).peak_mib();
        let on_disk = request.estimate(1, Settings { start_on_disk: true, ..request.at_length(71) }).peak_mib();
        // the received model's 1.25 embedding tables (38.6 M values), with the margin
        let table_mib = 50_257.0 * 768.0 * 4.0 / (1024.0 * 1024.0);
        assert!(
            (in_memory - on_disk - 1.25 * table_mib * super::super::footprint::SAFETY_MARGIN).abs() < 1.0,
            "{in_memory} vs {on_disk}"
        );

        let p = plan(&request, in_memory.ceil() as u64).unwrap();
        assert_eq!((p.micro_batch_pairs, p.start_on_disk), (1, false), "splitting comes first: {p}");
        let p = plan(&request, (in_memory - 1.0) as u64).unwrap();
        assert!(p.start_on_disk && p.estimate_mib < in_memory - 1.0, "{p}");
        assert!(p.to_string().contains("starting model on disk"), "{p}");
        // with the start on disk the planner again takes the largest micro-batch that fits
        let next = request.estimate(p.micro_batch_pairs + 1, Settings { start_on_disk: true, ..request.at_length(71) });
        assert!(p.micro_batch_pairs == 8 || next.peak_mib() > in_memory - 1.0, "{p}");

        let refused = PlanRequest { start_on_disk: StartOnDisk::Never, ..request.clone() };
        assert!(plan(&refused, (in_memory - 1.0) as u64).is_err());
        let local = PlanRequest { federated: false, ..request };
        assert!(!plan(&local, 300_000).unwrap().start_on_disk, "local training has no round start");
    }

    #[test]
    fn a_round_asked_to_keep_its_start_on_disk_is_planned_with_it_from_the_first_estimate() {
        let when_needed = PlanRequest {
            seq_len: 71,
            response_len: 55,
            start_on_disk: StartOnDisk::WhenNeeded,
            ..distilgpt2_request()
        };
        let always = PlanRequest { start_on_disk: StartOnDisk::Always, ..when_needed.clone() };
        let on_disk = |m| always.estimate(m, Settings { start_on_disk: true, ..always.at_length(71) }).peak_mib();
        let in_memory = |m| always.estimate(m, always.at_length(71)).peak_mib();
        // a budget that holds one pass of 8 pairs only with the start on disk
        let budget = on_disk(8).ceil();
        assert!(in_memory(8) > budget);
        let p = plan(&always, budget as u64).unwrap();
        assert_eq!((p.micro_batch_pairs, p.start_on_disk), (8, true), "{p}");
        assert!((p.estimate_mib - on_disk(8)).abs() < 1e-9, "{p}");
        // left to choose, the planner splits the batch before it goes to disk
        let q = plan(&when_needed, budget as u64).unwrap();
        assert!(q.micro_batch_pairs < 8 && !q.start_on_disk, "{q}");
        // with room to spare the start still goes to disk, and the plan says so
        let roomy = plan(&always, 64 * 1024).unwrap();
        assert!(roomy.start_on_disk && roomy.micro_batch_pairs == 8, "{roomy}");
        assert!(roomy.to_string().contains("starting model on disk"), "{roomy}");
        // a budget nothing fits is refused at the smallest footprint with the start on disk
        let Err(PlanError::DoesNotFit { smallest, .. }) = plan(&always, 500) else { panic!("500 MiB fits") };
        assert!(smallest.contains("on disk"), "{smallest}");
        // local training has no round start to keep
        assert!(!plan(&PlanRequest { federated: false, ..always }, 64 * 1024).unwrap().start_on_disk);
    }

    #[test]
    fn a_micro_batch_cap_is_kept_and_its_accumulation_buffer_counted() {
        let request = PlanRequest { max_micro_batch_pairs: 2, ..distilgpt2_request() };
        let p = plan(&request, 64 * 1024).unwrap();
        assert_eq!(p.micro_batch_pairs, 2);
        let uncapped = distilgpt2_request();
        // Passes of two pairs hold more than one pass of eight beside the model's own
        // gradient buffers, which the passes add into (about 0.45 trainable copies, measured).
        let params = |r: &PlanRequest, m| r.estimate(m, r.at_length(128)).parameters_mib;
        assert!(params(&request, 2) > params(&uncapped, 8) + 100.0);
    }

    #[test]
    fn an_impossible_budget_is_refused_with_the_smallest_footprint_and_a_way_out() {
        let err = plan(&distilgpt2_request(), 1200).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("--max-memory 1200 MiB"), "{text}");
        assert!(text.contains(" per pass) needs about"), "{text}");
        match err {
            PlanError::DoesNotFit { needed_mib, .. } => assert!(needed_mib > 1200.0),
            other => panic!("{other:?}"),
        }
        // 300 MiB is below even the weights' copies: no hint can rescue it.
        let tiny_budget = plan(&distilgpt2_request(), 300).unwrap_err().to_string();
        assert!(tiny_budget.contains("smaller model"), "{tiny_budget}");
    }

    #[test]
    fn a_federated_device_is_told_that_frozen_embeddings_would_fit() {
        // Frozen embeddings drop 39 M trainable parameters; find a budget where only that helps.
        let request = distilgpt2_request();
        let unfrozen = request.smallest_footprint(request.at_length(128)).1.peak_mib();
        let frozen = request.smallest_footprint(Settings { freeze: true, ..request.at_length(128) }).1.peak_mib();
        assert!(frozen < unfrozen);
        let budget = ((frozen + unfrozen) / 2.0) as u64;
        let text = plan(&request, budget).unwrap_err().to_string();
        assert!(text.contains("--freeze-embeddings"), "{text}");

        let allowed = PlanRequest { may_freeze_embeddings: true, ..request };
        let p = plan(&allowed, budget).unwrap();
        assert!(p.freeze_embeddings, "{p}");
        assert!(p.estimate_mib <= budget as f64);
    }

    #[test]
    fn shortening_is_the_last_resort_and_never_goes_below_the_floor() {
        let request =
            PlanRequest { may_freeze_embeddings: true, may_shorten: true, federated: false, ..long_pairs_request() };
        let frozen_short =
            request.smallest_footprint(Settings { freeze: true, ..request.at_length(MIN_SEQ_LEN) }).1.peak_mib();
        let p = plan(&request, frozen_short.ceil() as u64).unwrap();
        assert!(p.freeze_embeddings);
        assert_eq!(p.max_len, Some(MIN_SEQ_LEN));
        assert!(plan(&request, (frozen_short - 1.0) as u64).is_err());
    }

    #[test]
    fn the_composed_kernels_are_planned_with_their_own_larger_footprint() {
        let fused = distilgpt2_request();
        let composed = PlanRequest { kernels: StepKernels::Composed, ..distilgpt2_request() };
        let at = |r: &PlanRequest| r.estimate(8, r.at_length(128)).peak_mib();
        assert!(at(&composed) > 2.0 * at(&fused), "{} vs {}", at(&composed), at(&fused));
        assert_eq!(StepKernels::for_run(&candle_core::Device::Cpu, candle_core::DType::F32), StepKernels::Fused);
        assert_eq!(StepKernels::for_run(&candle_core::Device::Cpu, candle_core::DType::BF16), StepKernels::Fused);
        assert_eq!(StepKernels::for_run(&candle_core::Device::Cpu, candle_core::DType::F16), StepKernels::Fused);
    }
}
