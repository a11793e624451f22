//! Summed response log-probabilities of a batch, with the head computed only where needed.
//!
//! Response token `j` of a row is scored by the hidden state at `j - 1`. Only those rows of
//! the `[2P x T]` hidden grid go through the `n_embd x vocab` head, so the largest matmul of
//! the model shrinks by the prompt's share of the sequence. The head and the log-softmax +
//! gather run fused ([`fedpo_model::Gpt2::token_logprobs`]): backward turns the logits into
//! their own gradient in place instead of allocating logits-sized tensors.

use std::sync::OnceLock;

use candle_core::{DType, Device, Tensor};
use fedpo_data::PairBatch;
use fedpo_model::ops::{Fork, Forks};
use fedpo_model::Policy;

use crate::error::Result;

/// Whether batches run each pair's prompt through the model once (see [`BatchTensors`]):
/// on unless `FEDPO_SHARED_PROMPT` is `0` or `off`, which lays every pair out as two rows
/// (for comparisons; the results are the same to rounding).
pub fn shares_prompts() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| !matches!(std::env::var("FEDPO_SHARED_PROMPT").as_deref(), Ok("0" | "off")))
}

/// A [`PairBatch`] as tensors on the model's device.
///
/// Where it saves work, each pair is one sequence `prompt ++ chosen ++ rejected` that forks
/// after the prompt ([`Fork`]), so the prompt runs through the blocks once for both
/// responses instead of twice; otherwise each pair is its two rows. The log-probs are the
/// same either way, in the same order.
pub struct BatchTensors {
    /// `[S, T]` token ids: the 2P rows, or P forked sequences.
    pub input_ids: Tensor,
    /// How the sequences of `input_ids` fork, if they do.
    pub forks: Forks,
    /// Flat indices into the `[S * T]` hidden rows that score a response token.
    pub score_rows: Tensor,
    /// The response token each of those rows predicts.
    pub targets: Tensor,
    /// `[2P, N]` 0/1 matrix summing token log-probs into per-row sums.
    pub segments: Tensor,
    /// Response lengths of the 2P rows.
    pub response_lens: Vec<usize>,
    /// Pairs in the batch.
    pub pairs: usize,
}

/// Where one of the 2P responses lies in the sequences the model runs.
struct Placement {
    /// Flat index of its first token.
    start: usize,
    /// Flat index of the hidden row that scores its first token (the prompt's last).
    first_scorer: usize,
}

/// The sequences the model runs for a batch: their ids, width and forks, and where each of
/// the 2P responses lies.
struct Grid {
    ids: Vec<u32>,
    sequences: usize,
    width: usize,
    forks: Forks,
    placements: Vec<Placement>,
}

impl Grid {
    /// The 2P rows as they are.
    fn rows(batch: &PairBatch) -> Self {
        let t = batch.seq_len;
        let placements = (0..batch.rows())
            .map(|row| {
                let start = row * t + batch.prompt_lens[row];
                Placement { start, first_scorer: start - 1 }
            })
            .collect();
        Self { ids: batch.input_ids.clone(), sequences: batch.rows(), width: t, forks: Forks::none(), placements }
    }

    /// One forked sequence per pair, if every pair's two rows share their prompt and the
    /// sequences cost the model less than the rows ([`layout_cost`]). Padding repeats a
    /// sequence's last token: no real token attends to it and none is scored, so any valid
    /// id does.
    ///
    /// A pair's padding takes positions past its rejected response; a layout whose padding
    /// would need positions the model lacks (`n_positions`) is not taken, so that packing
    /// never refuses a batch whose rows fit.
    fn forked(batch: &PairBatch, n_embd: usize, n_positions: usize) -> Option<Self> {
        let (p, t) = (batch.pairs, batch.seq_len);
        let row = |r: usize| &batch.input_ids[r * t..(r + 1) * t];
        let same_prompt = (0..p).all(|i| {
            let len = batch.prompt_lens[i];
            len > 0 && len == batch.prompt_lens[p + i] && row(i)[..len] == row(p + i)[..len]
        });
        let lens = |i: usize| (batch.prompt_lens[i], batch.response_lens[i], batch.response_lens[p + i]);
        let width = (0..p).map(|i| lens(i).0 + lens(i).1 + lens(i).2).max()?;
        // Branch two sits `chosen` tokens later in the row than its positions say.
        let fits = (0..p).all(|i| width - lens(i).1 <= n_positions);
        if !same_prompt || !fits || layout_cost(p, width, n_embd) >= layout_cost(2 * p, t, n_embd) {
            return None;
        }
        let mut ids = Vec::with_capacity(p * width);
        let mut forks = Vec::with_capacity(p);
        for i in 0..p {
            let (prompt, chosen, rejected) = lens(i);
            ids.extend_from_slice(&row(i)[..prompt + chosen]);
            ids.extend_from_slice(&row(p + i)[prompt..prompt + rejected]);
            let last = *ids.last().expect("a prompt has at least one token");
            ids.resize((i + 1) * width, last);
            forks.push(Fork { prefix: prompt, first: chosen });
        }
        let placements = (0..2 * p)
            .map(|r| {
                let (i, rejected) = (r % p, r >= p);
                let (prompt, chosen, _) = lens(i);
                let seq = i * width;
                let start = seq + prompt + if rejected { chosen } else { 0 };
                Placement { start, first_scorer: seq + prompt - 1 }
            })
            .collect();
        Some(Self { ids, sequences: p, width, forks: Forks::new(forks), placements })
    }
}

/// The model's work for `sequences` of `width` tokens, in multiply-adds per embedding
/// channel and layer: the projections' `12 d` per token, and attention's `2 width` per
/// token (the scores and the values of every key, which the kernels compute whole and
/// mask). A forked sequence saves the prompt's projections but attends over both
/// responses, so short prompts with long responses are cheaper as two rows.
fn layout_cost(sequences: usize, width: usize, n_embd: usize) -> u128 {
    let tokens = (sequences * width) as u128;
    tokens * (12 * n_embd as u128 + 2 * width as u128)
}

impl BatchTensors {
    /// Moves a batch onto the policy's device, building the index tensors; pairs share
    /// their prompt where [`shares_prompts`] and it saves work.
    pub fn new(batch: &PairBatch, policy: &Policy) -> Result<Self> {
        let config = &policy.spec.config;
        Self::for_width(batch, (config.n_embd, config.n_positions), policy.model_dtype(), &policy.model_device())
    }

    /// [`BatchTensors::new`] for a model of `(n_embd, n_positions)`, in `dtype` on `device`.
    pub fn for_width(batch: &PairBatch, shape: (usize, usize), dtype: DType, device: &Device) -> Result<Self> {
        let grid = shares_prompts().then(|| Grid::forked(batch, shape.0, shape.1)).flatten();
        Self::from_grid(batch, grid.unwrap_or_else(|| Grid::rows(batch)), dtype, device)
    }

    /// [`BatchTensors::new`] with every pair as its two rows.
    pub fn unshared(batch: &PairBatch, dtype: DType, device: &Device) -> Result<Self> {
        Self::from_grid(batch, Grid::rows(batch), dtype, device)
    }

    fn from_grid(batch: &PairBatch, grid: Grid, dtype: DType, device: &Device) -> Result<Self> {
        let rows = batch.rows();
        let n = batch.response_tokens();
        let mut score_rows = Vec::with_capacity(n);
        let mut targets = Vec::with_capacity(n);
        let mut segments = vec![0f32; rows * n];
        let mut k = 0;
        for (row, place) in grid.placements.iter().enumerate() {
            for j in 0..batch.response_lens[row] {
                let at = place.start + j;
                score_rows.push(if j == 0 { place.first_scorer } else { at - 1 } as u32);
                targets.push(grid.ids[at]);
                segments[row * n + k] = 1.0;
                k += 1;
            }
        }
        Ok(Self {
            input_ids: Tensor::from_vec(grid.ids, (grid.sequences, grid.width), device)?,
            forks: grid.forks,
            score_rows: Tensor::from_vec(score_rows, n, device)?,
            targets: Tensor::from_vec(targets, n, device)?,
            segments: Tensor::from_vec(segments, (rows, n), device)?.to_dtype(dtype)?,
            response_lens: batch.response_lens.clone(),
            pairs: batch.pairs,
        })
    }

    /// The sequences and their width that the model runs for this batch.
    pub fn grid(&self) -> Result<(usize, usize)> {
        Ok(self.input_ids.dims2()?)
    }
}

/// Per-row summed log-probs `[2P]` of the responses (chosen rows first), differentiable
/// with respect to the policy's trainable parameters.
pub fn sequence_logps(policy: &Policy, batch: &BatchTensors) -> Result<Tensor> {
    let rows = batch.segments.dim(0)?;
    let n = batch.targets.dim(0)?;
    let device = batch.input_ids.device();
    if n == 0 {
        return Ok(Tensor::zeros(rows, batch.segments.dtype(), device)?);
    }
    let hidden = policy.model.hidden_states_forked(&batch.input_ids, &batch.forks)?;
    let d = hidden.dim(2)?;
    let hidden = hidden.reshape(((), d))?.index_select(&batch.score_rows, 0)?;
    let token_logps = policy.model.token_logprobs(&hidden, &batch.targets)?;
    Ok(batch.segments.matmul(&token_logps.unsqueeze(1)?)?.squeeze(1)?)
}

/// [`sequence_logps`] as plain numbers, detached from the graph.
pub fn sequence_logps_values(policy: &Policy, batch: &BatchTensors) -> Result<Vec<f64>> {
    Ok(sequence_logps(policy, batch)?.detach().to_dtype(DType::F64)?.to_vec1::<f64>()?)
}
