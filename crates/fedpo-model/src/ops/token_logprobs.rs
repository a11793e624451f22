//! Fused log-softmax + gather: `log softmax(logits)[i, targets[i]]`.
//!
//! The `[tokens x vocab]` grid is read twice and written once in backward instead of
//! materialised five times by the composed ops. f32 rows run on the vectorised
//! [`exp_f32`] with lane sums; f64 keeps libm as the reference. On an NVIDIA GPU the same
//! two passes are CUDA kernels ([`super::cuda`]), so the logits' gradient is the only
//! vocabulary-sized tensor backward makes there too.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::fast_math::{max_f32, scaled_softmax_f32, sum_exp_shifted};
use super::row_exps::{exps_in_place_f32, non_finite_exps};
use super::{contiguous_slice, full_precision, log_softmax_last_dim, CResult};

/// The per-row arithmetic, fast for f32 and exact-as-libm for f64.
pub(super) trait RowMath: WithDType {
    /// `log sum exp(row)`, in f64.
    fn row_logsumexp(row: &[Self]) -> f64;
    /// `row[j] = -g * exp(row[j] - lse)`, in place.
    fn scaled_softmax(row: &mut [Self], lse: f64, g: f64);
    /// `row[j] = exp(row[j] - shift)` in place for a shift that keeps them finite, returning
    /// `(lse, sum)`: the row's log-sum-exp and the sum of what it now holds, so that
    /// `row / sum` is its softmax.
    fn exps_in_place(row: &mut [Self]) -> (f64, f64);
}

impl RowMath for f32 {
    fn row_logsumexp(row: &[f32]) -> f64 {
        let max = max_f32(row);
        if !max.is_finite() {
            // all -inf, or a NaN or +inf in the row: the plain formula gives the right
            // non-finite answer (NaN for NaN, inf for inf, -inf for an all -inf row).
            return row.iter().map(|&v| (v as f64).exp()).sum::<f64>().ln();
        }
        let sum = sum_exp_shifted(row, max);
        max as f64 + sum.ln()
    }

    fn scaled_softmax(row: &mut [f32], lse: f64, g: f64) {
        scaled_softmax_f32(row, lse as f32, g as f32);
    }

    fn exps_in_place(row: &mut [f32]) -> (f64, f64) {
        exps_in_place_f32(row)
    }
}

impl RowMath for f64 {
    fn row_logsumexp(row: &[f64]) -> f64 {
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v));
        let sum: f64 = row.iter().map(|&v| (v - max).exp()).sum();
        max + sum.ln()
    }

    fn scaled_softmax(row: &mut [f64], lse: f64, g: f64) {
        for v in row.iter_mut() {
            *v = -g * (*v - lse).exp();
        }
    }

    fn exps_in_place(row: &mut [f64]) -> (f64, f64) {
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v));
        if !max.is_finite() {
            return non_finite_exps(row);
        }
        let mut sum = 0.0;
        for v in row.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        (max + sum.ln(), sum)
    }
}

struct TokenLogProbs;

pub(super) fn check_targets(targets: &[u32], vocab: usize) -> CResult<()> {
    if let Some(&bad) = targets.iter().find(|&&t| t as usize >= vocab) {
        candle_core::bail!("token id {bad} is outside the vocabulary of {vocab}");
    }
    Ok(())
}

pub(super) fn token_logprobs_cpu<T: RowMath>(logits: &[T], targets: &[u32], vocab: usize) -> CResult<Vec<T>> {
    check_targets(targets, vocab)?;
    Ok(logits
        .par_chunks(vocab)
        .zip(targets.par_iter())
        .map(|(row, &t)| T::from_f64(row[t as usize].to_f64() - T::row_logsumexp(row)))
        .collect())
}

impl CustomOp2 for TokenLogProbs {
    fn name(&self) -> &'static str {
        "token-logprobs"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> CResult<(CpuStorage, Shape)> {
        let (rows, vocab) = l1.shape().dims2()?;
        let targets = contiguous_slice::<u32>(s2, l2, self.name())?;
        if targets.len() != rows {
            candle_core::bail!("token-logprobs: {rows} logit rows but {} targets", targets.len());
        }
        let out = map_float_storage!(s1, self.name(), T =>
            token_logprobs_cpu(contiguous_slice::<T>(s1, l1, self.name())?, targets, vocab)?);
        Ok((out, Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        super::cuda::token_logprobs(s1, l1, s2, l2)
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let grad_logits = logits.apply_op3_no_bwd(targets, &Tensor::stack(&[res, grad], 0)?, &TokenLogProbsGrad)?;
        Ok((Some(grad_logits), None))
    }
}

/// Backward of [`TokenLogProbs`]: `d/dlogits = g * (onehot(t) - softmax(logits))`, with the
/// row's log-sum-exp recovered from the forward result (`lse = logit[t] - res`).
struct TokenLogProbsGrad;

/// Turns `logits` into `d/dlogits` in place, row by row: `g * (onehot(t) - softmax(row))`.
pub(super) fn logits_into_grad<T: RowMath>(logits: &mut [T], targets: &[u32], res: &[T], grad: &[T], vocab: usize) {
    logits.par_chunks_mut(vocab).enumerate().for_each(|(i, row)| {
        let t = targets[i] as usize;
        let lse = row[t].to_f64() - res[i].to_f64();
        let g = grad[i].to_f64();
        T::scaled_softmax(row, lse, g);
        row[t] = T::from_f64(row[t].to_f64() + g);
    });
}

fn token_logprobs_grad_cpu<T: RowMath>(logits: &[T], targets: &[u32], res_and_grad: &[T], vocab: usize) -> Vec<T> {
    let (res, grad) = res_and_grad.split_at(targets.len());
    let mut out = logits.to_vec();
    logits_into_grad(&mut out, targets, res, grad, vocab);
    out
}

impl CustomOp3 for TokenLogProbsGrad {
    fn name(&self) -> &'static str {
        "token-logprobs-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let (_, vocab) = l1.shape().dims2()?;
        let targets = contiguous_slice::<u32>(s2, l2, self.name())?;
        let out = map_float_storage!(s1, self.name(), T => token_logprobs_grad_cpu::<T>(
            contiguous_slice(s1, l1, self.name())?,
            targets,
            contiguous_slice(s3, l3, self.name())?,
            vocab,
        ));
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> CResult<(candle_core::CudaStorage, Shape)> {
        super::cuda::token_logprobs_grad(s1, l1, s2, l2, s3, l3)
    }
}

/// `log softmax(logits)[i, targets[i]]` for `logits: [N, V]` and `targets: [N]` (u32).
pub fn token_logprobs(logits: &Tensor, targets: &Tensor) -> CResult<Tensor> {
    if fused_on(logits) {
        logits.contiguous()?.apply_op2(&targets.contiguous()?, TokenLogProbs)
    } else {
        log_softmax_last_dim(logits)?.gather(&targets.unsqueeze(1)?, 1)?.squeeze(1)
    }
}

/// Whether the fused op has a kernel for these logits: f32 or f64 on the CPU, f32 on an
/// NVIDIA GPU (`kernels/token_logprobs.cu`, in a `cuda` build). The rest is composed.
fn fused_on(logits: &Tensor) -> bool {
    match logits.device() {
        candle_core::Device::Cpu => full_precision(logits),
        candle_core::Device::Cuda(_) => cfg!(feature = "cuda") && logits.dtype() == candle_core::DType::F32,
        candle_core::Device::Metal(_) => false,
    }
}
