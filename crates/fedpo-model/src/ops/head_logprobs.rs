//! The tied head and the target tokens' log-probabilities as one op.
//!
//! The logits (`[tokens, 50257]`, 103 MB at the DistilGPT-2 step) are the largest tensor of
//! the step. Through separate ops, backward makes their gradient, then candle sums it into
//! a fresh zero tensor: three logits-sized buffers at once, which set the frozen-base peak.
//! Here forward keeps the logits inside the op, and backward turns them into their own
//! gradient in place (`g * (onehot - softmax)`) before the two matmuls read it. The
//! embedding's gradient goes to the model's [`TiedGradient`](super::TiedGradient) buffer.

use std::sync::{Mutex, PoisonError};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Device, Layout, Shape, Tensor};

use super::tied_embedding::{head_backward, head_logits_cpu, Slot};
use super::token_logprobs::{check_targets, logits_into_grad, token_logprobs_cpu, RowMath};
use super::{contiguous_slice, CResult};

pub(super) struct HeadLogProbs {
    pub(super) slot: Slot,
    /// The logits of forward, consumed by backward.
    logits: Mutex<Option<CpuStorage>>,
}

impl HeadLogProbs {
    pub(super) fn new(slot: Slot) -> Self {
        Self { slot, logits: Mutex::new(None) }
    }
}

/// `g * (onehot - softmax)` in place of the logits, as a tensor of its own.
fn grad_tensor<T: RowMath>(
    mut logits: Vec<T>,
    targets: &[u32],
    res: &Tensor,
    grad: &Tensor,
    vocab: usize,
) -> CResult<Tensor> {
    let (res, grad) = (res.to_vec1::<T>()?, grad.to_vec1::<T>()?);
    logits_into_grad(&mut logits, targets, &res, &grad, vocab);
    Tensor::from_vec(logits, (targets.len(), vocab), &Device::Cpu)
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
        let logits = head_logits_cpu(self.name(), sh, lh, sw, lw)?;
        let out = map_float_storage!(&logits, self.name(), T =>
            token_logprobs_cpu(logits.as_slice::<T>()?, targets, vocab)?);
        *self.logits.lock().unwrap_or_else(PoisonError::into_inner) = Some(logits);
        Ok((out, Shape::from(n)))
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        wte: &Tensor,
        targets: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Some(logits) = self.logits.lock().unwrap_or_else(PoisonError::into_inner).take() else {
            candle_core::bail!("{}: backward ran twice over one forward", self.name());
        };
        let vocab = wte.dim(0)?;
        let ids = targets.to_vec1::<u32>()?;
        let dlogits = match logits {
            CpuStorage::F32(l) => grad_tensor(l, &ids, res, grad, vocab)?,
            CpuStorage::F64(l) => grad_tensor(l, &ids, res, grad, vocab)?,
            other => candle_core::bail!("{}: unsupported dtype {:?}", self.name(), other.dtype()),
        };
        Ok((head_backward(&self.slot, hidden, wte, &dlogits)?, None, None))
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
    fn a_target_outside_the_vocabulary_is_an_error_naming_it() {
        let tied = TiedGradient::default();
        let targets = Tensor::new(&[3u32], &Device::Cpu).unwrap();
        let err = tied.head_logprobs(&randn(&[1, 2], 95), &randn(&[3, 2], 96), &targets).unwrap_err().to_string();
        assert!(err.contains("token id 3") && err.contains("vocabulary of 3"), "{err}");
    }
}
