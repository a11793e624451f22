//! Summed response log-probabilities of a batch, with the head computed only where needed.
//!
//! Response token `j` of a row is scored by the hidden state at `j - 1`. Only those rows of
//! the `[2P x T]` hidden grid go through the `n_embd x vocab` head, so the largest matmul of
//! the model shrinks by the prompt's share of the sequence. The head and the log-softmax +
//! gather run fused ([`fedpo_model::Gpt2::token_logprobs`]): backward turns the logits into
//! their own gradient in place instead of allocating logits-sized tensors.

use candle_core::{DType, Device, Tensor};
use fedpo_data::PairBatch;
use fedpo_model::Policy;

use crate::error::Result;

/// A [`PairBatch`] as tensors on the model's device.
pub struct BatchTensors {
    /// `[2P, T]` token ids.
    pub input_ids: Tensor,
    /// Flat indices into the `[2P * T]` hidden rows that score a response token.
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

impl BatchTensors {
    /// Moves a batch onto `device`, building the index tensors.
    pub fn new(batch: &PairBatch, dtype: DType, device: &Device) -> Result<Self> {
        let (rows, t) = (batch.rows(), batch.seq_len);
        let n = batch.response_tokens();
        let mut score_rows = Vec::with_capacity(n);
        let mut targets = Vec::with_capacity(n);
        let mut segments = vec![0f32; rows * n];
        let mut k = 0;
        for row in 0..rows {
            let start = batch.prompt_lens[row];
            for j in start..start + batch.response_lens[row] {
                score_rows.push((row * t + j - 1) as u32);
                targets.push(batch.input_ids[row * t + j]);
                segments[row * n + k] = 1.0;
                k += 1;
            }
        }
        Ok(Self {
            input_ids: Tensor::from_slice(&batch.input_ids, (rows, t), device)?,
            score_rows: Tensor::from_vec(score_rows, n, device)?,
            targets: Tensor::from_vec(targets, n, device)?,
            segments: Tensor::from_vec(segments, (rows, n), device)?.to_dtype(dtype)?,
            response_lens: batch.response_lens.clone(),
            pairs: batch.pairs,
        })
    }
}

/// Per-row summed log-probs `[2P]` of the responses (chosen rows first), differentiable
/// with respect to the policy's trainable parameters.
pub fn sequence_logps(policy: &Policy, batch: &BatchTensors) -> Result<Tensor> {
    let rows = batch.input_ids.dim(0)?;
    let n = batch.targets.dim(0)?;
    let device = batch.input_ids.device();
    if n == 0 {
        return Ok(Tensor::zeros(rows, batch.segments.dtype(), device)?);
    }
    let hidden = policy.model.hidden_states(&batch.input_ids)?;
    let d = hidden.dim(2)?;
    let hidden = hidden.reshape(((), d))?.index_select(&batch.score_rows, 0)?;
    let token_logps = policy.model.token_logprobs(&hidden, &batch.targets)?;
    Ok(batch.segments.matmul(&token_logps.unsqueeze(1)?)?.squeeze(1)?)
}

/// [`sequence_logps`] as plain numbers, detached from the graph.
pub fn sequence_logps_values(policy: &Policy, batch: &BatchTensors) -> Result<Vec<f64>> {
    Ok(sequence_logps(policy, batch)?.detach().to_dtype(DType::F64)?.to_vec1::<f64>()?)
}
