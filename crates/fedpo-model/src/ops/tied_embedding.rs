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

use std::sync::{Arc, Mutex, PoisonError};

use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp2, InplaceOp3, Layout, Shape, Tensor, WithDType};

use super::dense::{matmul_nt, AddMatmulTn, MatmulTn};
use super::head_logprobs::HeadLogProbs;
use super::{contiguous_slice, CResult};

pub(super) type Slot = Arc<Mutex<Option<Tensor>>>;

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

/// `hidden @ wte^T` on the CPU, for `hidden: [n, d]` and `wte: [vocab, d]`.
pub(super) fn head_logits_cpu(
    op: &str,
    sh: &CpuStorage,
    lh: &Layout,
    sw: &CpuStorage,
    lw: &Layout,
) -> CResult<CpuStorage> {
    let (n, d) = lh.shape().dims2()?;
    let (vocab, d2) = lw.shape().dims2()?;
    if d != d2 {
        candle_core::bail!("{op}: hidden size {d} does not match the embedding's {d2}");
    }
    match (sh, sw, lh.is_contiguous() && lw.is_contiguous()) {
        (CpuStorage::F32(_), CpuStorage::F32(_), true) => {
            Ok(CpuStorage::F32(matmul_nt(contiguous_slice(sh, lh, op)?, contiguous_slice(sw, lw, op)?, (n, vocab, d))?))
        }
        (CpuStorage::F64(_), CpuStorage::F64(_), true) => {
            Ok(CpuStorage::F64(matmul_nt(contiguous_slice(sh, lh, op)?, contiguous_slice(sw, lw, op)?, (n, vocab, d))?))
        }
        _ => sh.matmul(sw, (1, n, vocab, d), lh, &lw.transpose(0, 1)?),
    }
}

/// The head's backward from the logits' gradient: `wte`'s part goes to the buffer (if it
/// trains), `hidden`'s is returned (if it tracks). The operands are detached: a gradient
/// built from tracked tensors records an op that holds `dlogits` (103 MB at DistilGPT-2's
/// step) alive.
pub(super) fn head_backward(slot: &Slot, hidden: &Tensor, wte: &Tensor, dlogits: &Tensor) -> CResult<Option<Tensor>> {
    let (want_dhidden, want_dwte) = (hidden.track_op(), wte.track_op());
    let (hidden, wte) = (hidden.detach(), wte.detach());
    if want_dwte {
        let (dlogits, hidden) = (dlogits.contiguous()?, hidden.contiguous()?);
        let mut guard = slot.lock().unwrap_or_else(PoisonError::into_inner);
        match guard.as_ref() {
            // Added into the buffer by the matmul itself, or written straight into a new one.
            // (The buffer is always one this module made, so contiguous.)
            Some(acc) => acc.inplace_op3(&dlogits, &hidden, &AddMatmulTn)?,
            None => *guard = Some(dlogits.apply_op2_no_bwd(&hidden, &MatmulTn)?),
        }
    }
    want_dhidden.then(|| dlogits.matmul(&wte)).transpose()
}

/// `wte`'s gradient from [`HeadLogProbs`]'s factors: `exps^T @ scaled_hidden`, added into
/// the buffer by the matmul itself (or written straight into a new one), then the one-hot
/// part, `onehot_rows[i]` added to row `targets[i]`. All operands are detached.
pub(super) fn add_head_weight_gradient(
    slot: &Slot,
    exps: &Tensor,
    scaled_hidden: &Tensor,
    targets: &Tensor,
    onehot_rows: &Tensor,
) -> CResult<()> {
    let (exps, scaled_hidden) = (exps.contiguous()?, scaled_hidden.contiguous()?);
    let mut guard = slot.lock().unwrap_or_else(PoisonError::into_inner);
    let acc = match guard.take() {
        Some(acc) => {
            acc.inplace_op3(&exps, &scaled_hidden, &AddMatmulTn)?;
            acc
        }
        None => exps.apply_op2_no_bwd(&scaled_hidden, &MatmulTn)?,
    };
    acc.inplace_op3(targets, &onehot_rows.contiguous()?, &ScatterAddRows)?;
    *guard = Some(acc);
    Ok(())
}

fn add_slices<T: WithDType>(acc: &mut [T], src: &[T]) {
    acc.iter_mut().zip(src).for_each(|(a, &s)| *a += s);
}

fn scatter_add_rows<T: WithDType>(acc: &mut [T], ids: &[u32], rows: &[T], d: usize) {
    for (&id, row) in ids.iter().zip(rows.chunks_exact(d)) {
        let start = id as usize * d;
        add_slices(&mut acc[start..start + d], row);
    }
}

/// `acc[ids[i]] += rows[i]` for each row `i`.
struct ScatterAddRows;

impl InplaceOp3 for ScatterAddRows {
    fn name(&self) -> &'static str {
        "scatter-add-rows"
    }

    fn cpu_fwd(
        &self,
        sa: &mut CpuStorage,
        la: &Layout,
        si: &CpuStorage,
        li: &Layout,
        sr: &CpuStorage,
        lr: &Layout,
    ) -> CResult<()> {
        let (vocab, d) = la.shape().dims2()?;
        let Some((a0, a1)) = la.contiguous_offsets() else { candle_core::bail!("scatter-add-rows: contiguous only") };
        let ids: &[u32] = contiguous_slice(si, li, self.name())?;
        if ids.iter().any(|&id| id as usize >= vocab) || lr.shape().dims() != [ids.len(), d] {
            candle_core::bail!("scatter-add-rows: ids or rows do not fit a [{vocab}, {d}] table");
        }
        match sa {
            CpuStorage::F32(acc) => scatter_add_rows(&mut acc[a0..a1], ids, contiguous_slice(sr, lr, self.name())?, d),
            CpuStorage::F64(acc) => scatter_add_rows(&mut acc[a0..a1], ids, contiguous_slice(sr, lr, self.name())?, d),
            other => candle_core::bail!("scatter-add-rows: unsupported dtype {:?}", other.dtype()),
        }
        Ok(())
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
