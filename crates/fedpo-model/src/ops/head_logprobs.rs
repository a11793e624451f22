//! The tied head and the target tokens' log-probabilities as one op.
//!
//! The logits (`[tokens, 50257]`, 103 MB at the DistilGPT-2 step) are the largest tensor of
//! the step. Through separate ops, backward makes their gradient, then candle sums it into
//! a fresh zero tensor: three logits-sized buffers at once, which set the frozen-base peak.
//!
//! Here the logits never leave the op, and after forward no pass goes over them again:
//! - forward turns each row, while it is still in cache from its maximum, into the
//!   numerators of its softmax, `e_j = exp(l_j - max)`, keeping their sum `s`;
//! - the logits' gradient is `g * (onehot(t) - e / s)`, so backward never writes it. Its
//!   per-row scale `-g / s` goes onto the `d`-wide side of each matmul (the hidden rows
//!   for the embedding's gradient, the result rows for the hidden states'), and the
//!   one-hot part is one row per token: `g * wte[t]` and `g * hidden` scattered into
//!   `wte`'s gradient at `t`.
//!
//! Against turning the logits into their gradient in backward, that is one exponential
//! and one read and write of the logits fewer per step. The embedding's gradient goes to
//! the model's [`TiedGradient`](super::TiedGradient) buffer.

use std::sync::{Mutex, PoisonError};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::strided_gemm::MatmulNn;
use super::tied_head::{add_head_weight_gradient, head_logits_cpu, Slot};
use super::token_logprobs::{check_targets, RowMath};
use super::{contiguous_slice, CResult};

pub(super) struct HeadLogProbs {
    pub(super) slot: Slot,
    /// What forward leaves for backward.
    saved: Mutex<Option<Saved>>,
}

/// Each row's softmax numerators (in the logits' buffer) and their sums.
struct Saved {
    exps: CpuStorage,
    sums: Vec<f64>,
}

impl HeadLogProbs {
    pub(super) fn new(slot: Slot) -> Self {
        Self { slot, saved: Mutex::new(None) }
    }
}

/// Each row's target log-probability, with the row turned into its softmax numerators in
/// place; returns the log-probabilities and the numerators' sums.
fn logprobs_leaving_exps<T: RowMath>(logits: &mut [T], targets: &[u32], vocab: usize) -> (Vec<T>, Vec<f64>) {
    logits
        .par_chunks_mut(vocab)
        .zip(targets.par_iter())
        .map(|(row, &t)| {
            let picked = row[t as usize].to_f64();
            let (lse, sum) = T::exps_in_place(row);
            (T::from_f64(picked - lse), sum)
        })
        .unzip()
}

impl CustomOp3 for HeadLogProbs {
    fn name(&self) -> &'static str {
        "head-logprobs"
    }

    fn cpu_fwd(
        &self,
        sh: &CpuStorage,
        lh: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        st: &CpuStorage,
        lt: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let ((n, _), (vocab, _)) = (lh.shape().dims2()?, lw.shape().dims2()?);
        let targets = contiguous_slice::<u32>(st, lt, self.name())?;
        if targets.len() != n {
            candle_core::bail!("{}: {n} hidden rows but {} targets", self.name(), targets.len());
        }
        check_targets(targets, vocab)?;
        let mut exps = head_logits_cpu(self.name(), sh, lh, sw, lw)?;
        let (out, sums) = match &mut exps {
            CpuStorage::F32(l) => {
                let (out, sums) = logprobs_leaving_exps(l, targets, vocab);
                (CpuStorage::F32(out), sums)
            }
            CpuStorage::F64(l) => {
                let (out, sums) = logprobs_leaving_exps(l, targets, vocab);
                (CpuStorage::F64(out), sums)
            }
            other => candle_core::bail!("{}: unsupported dtype {:?}", self.name(), other.dtype()),
        };
        *self.saved.lock().unwrap_or_else(PoisonError::into_inner) = Some(Saved { exps, sums });
        Ok((out, Shape::from(n)))
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        wte: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Some(Saved { exps, sums }) = self.saved.lock().unwrap_or_else(PoisonError::into_inner).take() else {
            candle_core::bail!("{}: backward ran twice over one forward", self.name());
        };
        let (n, vocab) = (sums.len(), wte.dim(0)?);
        let exps = match exps {
            CpuStorage::F32(e) => Tensor::from_vec(e, (n, vocab), &Device::Cpu)?,
            CpuStorage::F64(e) => Tensor::from_vec(e, (n, vocab), &Device::Cpu)?,
            other => candle_core::bail!("{}: unsupported dtype {:?}", self.name(), other.dtype()),
        };
        let g = grad.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        let softmax_scale: Vec<f64> = g.iter().zip(&sums).map(|(g, s)| -g / s).collect();
        let column = |values: Vec<f64>| Tensor::from_vec(values, (n, 1), &Device::Cpu)?.to_dtype(exps.dtype());
        let (softmax_scale, g) = (column(softmax_scale)?, column(g)?);
        let (want_dhidden, want_dwte) = (hidden.track_op(), wte.track_op());
        // Detached: a gradient built from tracked tensors would record ops holding the
        // numerators (logits-sized) alive.
        let (hidden, wte, targets) = (hidden.detach(), wte.detach(), targets.contiguous()?);
        if want_dwte {
            let scaled_hidden = hidden.broadcast_mul(&softmax_scale)?;
            let onehot_rows = hidden.broadcast_mul(&g)?;
            add_head_weight_gradient(&self.slot, &exps, &scaled_hidden, &targets, &onehot_rows)?;
        }
        let dhidden = want_dhidden
            .then(|| -> CResult<Tensor> {
                let softmax_part =
                    exps.apply_op2_no_bwd(&wte.contiguous()?, &MatmulNn)?.broadcast_mul(&softmax_scale)?;
                softmax_part + wte.index_select(&targets, 0)?.broadcast_mul(&g)?
            })
            .transpose()?;
        Ok((dhidden, None, None))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Var};

    use super::super::tests::{max_abs_diff, randn};
    use super::super::{token_logprobs, TiedGradient};
    use super::*;

    #[test]
    fn fused_head_logprobs_match_the_head_then_log_softmax_in_value_and_gradients() {
        let hidden = Var::from_tensor(&randn(&[5, 4], 90)).unwrap();
        let wte = Var::from_tensor(&randn(&[13, 4], 91)).unwrap();
        let targets = Tensor::new(&[12u32, 0, 5, 5, 7], &Device::Cpu).unwrap();
        let weights = randn(&[5], 92);
        let tied = TiedGradient::default();
        let fused = tied.head_logprobs(hidden.as_tensor(), wte.as_tensor(), &targets).unwrap();
        let logits = hidden.as_tensor().matmul(&wte.as_tensor().t().unwrap()).unwrap();
        let plain = token_logprobs(&logits, &targets).unwrap();
        assert!(max_abs_diff(&fused, &plain) < 1e-12);

        let mut ours = (fused * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        tied.collect(wte.as_tensor(), &mut ours).unwrap();
        let theirs = (plain * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&hidden, &wte] {
            let (a, b) = (ours.get(v.as_tensor()).unwrap(), theirs.get(v.as_tensor()).unwrap());
            assert!(max_abs_diff(a, b) < 1e-12, "gradient differs by {}", max_abs_diff(a, b));
            assert!(!a.track_op(), "gradients must hold no graph (it would keep the logits' gradient)");
        }
    }

    #[test]
    fn a_frozen_embedding_gets_no_gradient_and_f32_tracks_f64() {
        let hidden64 = randn(&[6, 8], 93);
        let wte64 = randn(&[40, 8], 94);
        let targets = Tensor::new(&[39u32, 1, 2, 3, 0, 17], &Device::Cpu).unwrap();
        let tied = TiedGradient::default();
        let hidden = Var::from_tensor(&hidden64.to_dtype(DType::F32).unwrap()).unwrap();
        let wte = wte64.to_dtype(DType::F32).unwrap();
        let logps = tied.head_logprobs(hidden.as_tensor(), &wte, &targets).unwrap();
        let mut grads = logps.sum_all().unwrap().backward().unwrap();
        tied.collect(&wte, &mut grads).unwrap();
        assert!(grads.get(&wte).is_none(), "a frozen embedding must get no gradient");

        let hidden64 = Var::from_tensor(&hidden64).unwrap();
        let exact = token_logprobs(&hidden64.as_tensor().matmul(&wte64.t().unwrap()).unwrap(), &targets).unwrap();
        let exact_grads = exact.sum_all().unwrap().backward().unwrap();
        let err = max_abs_diff(&logps.to_dtype(DType::F64).unwrap(), &exact);
        assert!(err < 1e-4, "log-probs off by {err}");
        let g = grads.get(hidden.as_tensor()).unwrap().to_dtype(DType::F64).unwrap();
        let err = max_abs_diff(&g, exact_grads.get(hidden64.as_tensor()).unwrap());
        assert!(err < 1e-4, "hidden gradient off by {err}");
    }

    #[test]
    fn logits_beyond_the_range_of_f32_exp_give_finite_log_probs_and_gradients() {
        // logits near +-400: exp of any of them overflows or flushes f32
        let hidden64 = (randn(&[4, 6], 97) * 40.0).unwrap();
        let wte64 = (randn(&[30, 6], 98) * 4.0).unwrap();
        let targets = Tensor::new(&[0u32, 29, 7, 7], &Device::Cpu).unwrap();
        let weights = Tensor::new(&[1.0f64, -0.5, 0.0, 2.0], &Device::Cpu).unwrap();
        let run = |dtype: DType| {
            let hidden = Var::from_tensor(&hidden64.to_dtype(dtype).unwrap()).unwrap();
            let wte = Var::from_tensor(&wte64.to_dtype(dtype).unwrap()).unwrap();
            let tied = TiedGradient::default();
            let logps = tied.head_logprobs(hidden.as_tensor(), wte.as_tensor(), &targets).unwrap();
            let loss = (logps.to_dtype(DType::F64).unwrap() * &weights).unwrap().sum_all().unwrap();
            let mut grads = loss.backward().unwrap();
            tied.collect(wte.as_tensor(), &mut grads).unwrap();
            let as64 = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
            let dh = as64(grads.get(hidden.as_tensor()).unwrap());
            let dw = as64(grads.get(wte.as_tensor()).unwrap());
            (as64(&logps), dh, dw)
        };
        let (exact, exact_dh, exact_dw) = run(DType::F64);
        let (logps, dh, dw) = run(DType::F32);
        for (ours, theirs, what) in
            [(&logps, &exact, "log-probs"), (&dh, &exact_dh, "dhidden"), (&dw, &exact_dw, "dwte")]
        {
            assert!(ours.flatten_all().unwrap().to_vec1::<f64>().unwrap().iter().all(|v| v.is_finite()), "{what}");
            let scale = theirs.abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap().max(1.0);
            let err = max_abs_diff(ours, theirs) / scale;
            assert!(err < 1e-4, "{what} off by {err} of the largest");
        }
    }

    #[test]
    fn a_target_outside_the_vocabulary_is_an_error_naming_it() {
        let tied = TiedGradient::default();
        let targets = Tensor::new(&[3u32], &Device::Cpu).unwrap();
        let err = tied.head_logprobs(&randn(&[1, 2], 95), &randn(&[3, 2], 96), &targets).unwrap_err().to_string();
        assert!(err.contains("token id 3") && err.contains("vocabulary of 3"), "{err}");
    }
}
