//! The token embedding and the output head that shares its matrix, with one gradient buffer.
//!
//! GPT-2's head is tied to `wte` (50257 x 768, 154 MB in f32). Through candle's own ops the
//! embedding's gradient is built several times over: the head's matmul yields it transposed,
//! candle sums it into a fresh zero tensor, the transpose node sums it again into another,
//! and the lookup's backward copies the result once more to scatter its rows in. Each copy
//! lands at the end of backward, when every activation is still alive, so it sets the peak.
//!
//! Here both ops add into one [`TiedGradient`] buffer owned by the model: the head's
//! backward creates it, the lookup's backward scatters its rows into it in place, and
//! [`TiedGradient::collect`] moves it into the gradient store once backward is done. The
//! gradient exists exactly once.

use std::sync::PoisonError;

use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};

use super::head_logprobs::HeadLogProbs;
use super::tied_head::{head_backward, head_logits_cpu, ScatterAddRows, Slot};
use super::{contiguous_slice, CResult};

/// Where the tied embedding's gradient collects during one backward pass.
///
/// A copy of the model gets a buffer of its own: two copies training on two threads must
/// not add into each other's gradient.
#[derive(Debug, Default)]
pub struct TiedGradient(Slot);

impl Clone for TiedGradient {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl TiedGradient {
    /// Empties the buffer; call before backward so that a pass that failed halfway leaves
    /// nothing behind.
    pub fn clear(&self) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take();
    }

    /// Moves the collected gradient into `grads` as `wte`'s, adding to any gradient `wte`
    /// received through other ops.
    pub fn collect(&self, wte: &Tensor, grads: &mut GradStore) -> CResult<()> {
        let Some(collected) = self.0.lock().unwrap_or_else(PoisonError::into_inner).take() else {
            return Ok(());
        };
        let total = match grads.remove(wte) {
            Some(other) => (other + collected)?,
            None => collected,
        };
        grads.insert(wte, total);
        Ok(())
    }

    /// Whether [`lookup`](Self::lookup) and [`head`](Self::head) can route `wte`'s
    /// gradient here: an embedding that trains, on the CPU, in f32 or f64 (the in-place
    /// kernels' dtypes). Off that path the model uses candle's own ops.
    pub fn routes(wte: &Tensor) -> bool {
        wte.device().is_cpu() && wte.is_variable() && super::full_precision(wte)
    }

    /// Rows `ids` of `wte`; the gradient goes to this buffer.
    pub fn lookup(&self, wte: &Tensor, ids: &Tensor) -> CResult<Tensor> {
        wte.apply_op2(ids, Lookup { slot: self.0.clone() })
    }

    /// `hidden @ wte^T`; `wte`'s gradient goes to this buffer.
    pub fn head(&self, hidden: &Tensor, wte: &Tensor) -> CResult<Tensor> {
        hidden.apply_op2(wte, Head { slot: self.0.clone() })
    }

    /// `log softmax(hidden @ wte^T)[i, targets[i]]` without a logits tensor in the graph
    /// (see [`super::head_logprobs`]); `wte`'s gradient, if it trains, goes to this buffer.
    /// CPU, f32 or f64, `hidden` in `wte`'s dtype.
    pub fn head_logprobs(&self, hidden: &Tensor, wte: &Tensor, targets: &Tensor) -> CResult<Tensor> {
        hidden.contiguous()?.apply_op3(wte, &targets.contiguous()?, HeadLogProbs::new(self.0.clone()))
    }
}

struct Lookup {
    slot: Slot,
}

impl CustomOp2 for Lookup {
    fn name(&self) -> &'static str {
        "tied-embedding-lookup"
    }

    fn cpu_fwd(&self, sw: &CpuStorage, lw: &Layout, si: &CpuStorage, li: &Layout) -> CResult<(CpuStorage, Shape)> {
        let (vocab, d) = lw.shape().dims2()?;
        let ids: &[u32] = contiguous_slice(si, li, self.name())?;
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            candle_core::bail!("{}: token id {bad} is outside the vocabulary of {vocab}", self.name());
        }
        Ok((sw.index_select(si, lw, li, 0)?, Shape::from((ids.len(), d))))
    }

    fn bwd(
        &self,
        wte: &Tensor,
        ids: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let mut guard = self.slot.lock().unwrap_or_else(PoisonError::into_inner);
        let acc = match guard.take() {
            Some(acc) => acc,
            None => wte.zeros_like()?,
        };
        acc.inplace_op3(ids, &grad.contiguous()?, &ScatterAddRows)?;
        *guard = Some(acc);
        Ok((None, None))
    }
}

struct Head {
    slot: Slot,
}

impl CustomOp2 for Head {
    fn name(&self) -> &'static str {
        "tied-head"
    }

    fn cpu_fwd(&self, sh: &CpuStorage, lh: &Layout, sw: &CpuStorage, lw: &Layout) -> CResult<(CpuStorage, Shape)> {
        let logits = head_logits_cpu(self.name(), sh, lh, sw, lw)?;
        Ok((logits, Shape::from((lh.dims()[0], lw.dims()[0]))))
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        wte: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        Ok((head_backward(&self.slot, hidden, wte, &grad.detach())?, None))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::super::tests::{max_abs_diff, randn};
    use super::*;

    /// Embedding lookup, two layers of mixing and the tied head, through candle's own ops and
    /// through the shared buffer; the loss weights every logit differently.
    fn tied_model_loss(wte: &Tensor, ids: &Tensor, tied: Option<&TiedGradient>) -> Tensor {
        let dtype = wte.dtype();
        let upstream = randn(&[ids.dim(0).unwrap(), wte.dim(0).unwrap()], 51).to_dtype(dtype).unwrap();
        let mix = randn(&[wte.dim(1).unwrap(), wte.dim(1).unwrap()], 52).to_dtype(dtype).unwrap();
        let x = match tied {
            Some(t) => t.lookup(wte, ids).unwrap(),
            None => wte.index_select(ids, 0).unwrap(),
        };
        let hidden = x.matmul(&mix).unwrap().tanh().unwrap();
        let logits = match tied {
            Some(t) => t.head(&hidden, wte).unwrap(),
            None => hidden.matmul(&wte.t().unwrap()).unwrap(),
        };
        (logits * upstream).unwrap().sum_all().unwrap()
    }

    #[test]
    fn tied_buffer_gives_the_same_embedding_gradient_as_candles_ops() {
        let wte = Var::from_tensor(&randn(&[11, 4], 50)).unwrap();
        let ids = Tensor::new(&[3u32, 0, 3, 10, 7], &Device::Cpu).unwrap();
        let reference = tied_model_loss(wte.as_tensor(), &ids, None).backward().unwrap();

        let tied = TiedGradient::default();
        let loss = tied_model_loss(wte.as_tensor(), &ids, Some(&tied));
        let expected_loss = tied_model_loss(wte.as_tensor(), &ids, None);
        assert!(max_abs_diff(&loss, &expected_loss) < 1e-12);
        tied.clear();
        let mut grads = loss.backward().unwrap();
        assert!(grads.get(wte.as_tensor()).is_none(), "the ops themselves hand candle no gradient");
        tied.collect(wte.as_tensor(), &mut grads).unwrap();
        let (ours, theirs) = (grads.get(wte.as_tensor()).unwrap(), reference.get(wte.as_tensor()).unwrap());
        assert!(max_abs_diff(ours, theirs) < 1e-12, "differs by {}", max_abs_diff(ours, theirs));
        tied.collect(wte.as_tensor(), &mut grads).unwrap();
        assert!(max_abs_diff(grads.get(wte.as_tensor()).unwrap(), theirs) < 1e-12, "a second collect adds nothing");
    }

    #[test]
    fn collect_adds_to_a_gradient_that_reached_the_embedding_another_way() {
        let wte = Var::from_tensor(&randn(&[6, 3], 60)).unwrap();
        let ids = Tensor::new(&[1u32, 5], &Device::Cpu).unwrap();
        let tied = TiedGradient::default();
        let extra = (wte.as_tensor().sqr().unwrap().sum_all().unwrap() * 0.5).unwrap();
        let loss = (tied_model_loss(wte.as_tensor(), &ids, Some(&tied)) + extra).unwrap();
        let mut grads = loss.backward().unwrap();
        tied.collect(wte.as_tensor(), &mut grads).unwrap();
        let reference_loss = (tied_model_loss(wte.as_tensor(), &ids, None)
            + (wte.as_tensor().sqr().unwrap().sum_all().unwrap() * 0.5).unwrap())
        .unwrap();
        let reference = reference_loss.backward().unwrap();
        let (ours, theirs) = (grads.get(wte.as_tensor()).unwrap(), reference.get(wte.as_tensor()).unwrap());
        assert!(max_abs_diff(ours, theirs) < 1e-12);
    }

    #[test]
    fn a_copied_buffer_starts_empty_and_f32_tracks_f64() {
        let wte64 = randn(&[9, 5], 70);
        let ids = Tensor::new(&[8u32, 2, 2], &Device::Cpu).unwrap();
        let tied = TiedGradient::default();
        let wte = Var::from_tensor(&wte64.to_dtype(DType::F32).unwrap()).unwrap();
        let loss = tied_model_loss(wte.as_tensor(), &ids, Some(&tied)).to_dtype(DType::F64).unwrap();
        let mut grads = loss.backward().unwrap();
        tied.clone().collect(wte.as_tensor(), &mut grads).unwrap();
        assert!(grads.get(wte.as_tensor()).is_none(), "a copy must not share the original's buffer");
        tied.collect(wte.as_tensor(), &mut grads).unwrap();
        let ours = grads.get(wte.as_tensor()).unwrap().to_dtype(DType::F64).unwrap();

        let wte64 = Var::from_tensor(&wte64).unwrap();
        let reference = tied_model_loss(wte64.as_tensor(), &ids, None).backward().unwrap();
        let exact = reference.get(wte64.as_tensor()).unwrap();
        let scale = exact.abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
        let err = max_abs_diff(&ours, exact) / scale;
        assert!(err < 1e-5, "f32 gradient off by {err} of the largest entry");
    }

    #[test]
    fn an_out_of_vocabulary_token_is_an_error_naming_it() {
        let wte = Var::from_tensor(&randn(&[4, 2], 80)).unwrap();
        let ids = Tensor::new(&[1u32, 4], &Device::Cpu).unwrap();
        let err = TiedGradient::default().lookup(wte.as_tensor(), &ids).unwrap_err().to_string();
        assert!(err.contains("token id 4") && err.contains("vocabulary of 4"), "{err}");
    }
}
