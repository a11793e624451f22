//! The tied head's products on the CPU, shared by the plain head ([`super::TiedGradient`]'s
//! `head`) and the head fused with the targets' log-probabilities ([`super::head_logprobs`]):
//! the logits `hidden @ wte^T`, and `wte`'s gradient added into the one buffer the
//! embedding and the head share ([`Slot`]), by the matmul itself or row by row.

use std::sync::{Arc, Mutex, PoisonError};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, InplaceOp3, Layout, Tensor, WithDType};

use super::strided_gemm::{matmul_nt, AddMatmulTn, MatmulTn};
use super::{contiguous_slice, CResult};

/// The tied embedding's gradient buffer: empty until a backward pass adds into it.
pub(super) type Slot = Arc<Mutex<Option<Tensor>>>;

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

/// `wte`'s gradient from [`super::head_logprobs`]'s factors: `exps^T @ scaled_hidden`, added into
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
pub(super) struct ScatterAddRows;

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
