//! One Conv1D projection of a fused block, forward and backward on slices:
//! `residual + x @ W + b`, with an optional adapter merged into the weight (the base
//! trains) or run beside it at rank `r` (the base is frozen).

use candle_core::WithDType;
use rayon::prelude::*;

use super::linear::{add_bias_to_each_row, column_sums_cpu, row_chunk};
use super::parallel_fill::par_filled;
use super::strided_gemm::{mm_accumulate, mm_new, Strided};
use super::CResult;

/// Parameter gradients by index into the block's flat tensor list.
///
/// When a step's batch runs in several passes, each parameter's gradient from the passes
/// before is `carried` in: this pass adds into it, the weight gradients straight from the
/// matmul, so the step holds one gradient per parameter rather than the sum and a fresh one
/// beside it (about 170 MB for DistilGPT-2's blocks).
pub(super) struct ParamGrads<T> {
    carried: Vec<Option<Vec<T>>>,
    done: Vec<(usize, Vec<T>)>,
}

impl<T: WithDType> ParamGrads<T> {
    /// `carried[i]`: tensor `i`'s gradient from the step's earlier passes, if any.
    pub(super) fn new(carried: Vec<Option<Vec<T>>>) -> Self {
        Self { carried, done: Vec::new() }
    }

    fn take_carried(&mut self, i: usize) -> Option<Vec<T>> {
        self.carried.get_mut(i).and_then(Option::take)
    }

    /// Tensor `i`'s gradient from this pass, `values`: added to a carried one, if any.
    pub(super) fn add(&mut self, i: usize, values: Vec<T>) -> CResult<()> {
        let total = match self.take_carried(i) {
            Some(mut acc) => {
                if acc.len() != values.len() {
                    candle_core::bail!("tensor {i}: a carried gradient of {} values for {}", acc.len(), values.len());
                }
                add_into(&mut acc, &values);
                acc
            }
            None => values,
        };
        self.done.push((i, total));
        Ok(())
    }

    /// Tensor `i`'s gradient from this pass as the product `scale * lhs @ rhs` of shape
    /// `(m, n)`, written by the matmul into a carried gradient if there is one.
    pub(super) fn add_product(
        &mut self,
        i: usize,
        dims: (usize, usize, usize),
        lhs: Strided<'_, T>,
        rhs: Strided<'_, T>,
        scale: T,
    ) -> CResult<()> {
        let total = match self.take_carried(i) {
            Some(mut acc) => {
                if acc.len() != dims.0 * dims.1 {
                    candle_core::bail!("tensor {i}: a carried gradient of {} values for {:?}", acc.len(), dims);
                }
                mm_accumulate(&mut acc, dims, lhs, rhs, scale)?;
                acc
            }
            None => mm_new(dims, lhs, rhs, scale)?,
        };
        self.done.push((i, total));
        Ok(())
    }

    /// The gradients of this pass (carried ones included), by tensor index; carried
    /// gradients this pass did not reach are returned unchanged.
    pub(super) fn into_gradients(self) -> Vec<(usize, Vec<T>)> {
        let mut all = self.done;
        all.extend(self.carried.into_iter().enumerate().filter_map(|(i, g)| g.map(|g| (i, g))));
        all
    }
}

/// `acc += other`, element by element, in parallel chunks.
pub(super) fn add_into<T: WithDType>(acc: &mut [T], other: &[T]) {
    acc.par_chunks_mut(16_384).zip(other.par_chunks(16_384)).for_each(|(a, o)| {
        for (a, &o) in a.iter_mut().zip(o) {
            *a += o;
        }
    });
}

/// What an adapted projection keeps for backward.
pub(super) struct AdapterActs<T> {
    /// `W + s A^T B^T` when the base trains: backward multiplies by it again.
    pub(super) merged: Option<Vec<T>>,
    /// `x A^T` (`[n, r]`) when the base is frozen.
    pub(super) low_rank: Option<Vec<T>>,
}

/// A projection's tensors as slices, and its shape.
pub(super) struct ProjectionView<'a, T> {
    pub(super) weight: &'a [T],
    pub(super) bias: &'a [T],
    pub(super) adapter: Option<(&'a [T], &'a [T], T)>,
    pub(super) fan_in: usize,
    pub(super) fan_out: usize,
    pub(super) rank: usize,
}

/// The residual (or zeros) plus `bias` in every row of an `[n, bias.len()]` matrix: what
/// the matmul then accumulates into, written in one parallel pass.
fn rows_plus_bias<T: WithDType>(residual: Option<&[T]>, bias: &[T], n: usize) -> Vec<T> {
    par_filled(n * bias.len(), row_chunk(bias.len()), |at, out| {
        if let Some(r) = residual {
            out.copy_from_slice(&r[at..at + out.len()]);
        }
        add_bias_to_each_row(out, bias);
    })
}

/// `W + s A^T B^T` for `W: [k, m]`, `A: [r, k]` and `B: [m, r]`, row by row in parallel:
/// each row of `W` plus `r` scaled rows of `B^T`. Through gemm this was a copy and a
/// rank-`r` update whose 6-column tiles cut across the rows, running far below gemm's
/// speed; here it is one read of `W` and one write.
fn merged_weight<T: WithDType>(w: &[T], a: &[T], b: &[T], scale: T, (k, m, r): (usize, usize, usize)) -> Vec<T> {
    let bt = transposed(b, m, r);
    let width = m.max(1);
    par_filled(k * m, row_chunk(m), |at, out| {
        out.copy_from_slice(&w[at..at + out.len()]);
        for (row, dst) in out.chunks_exact_mut(width).enumerate() {
            let i = at / width + row;
            for (j, bt_row) in bt.chunks_exact(width).enumerate() {
                let coef = scale * a[j * k + i];
                for (o, &v) in dst.iter_mut().zip(bt_row) {
                    *o += coef * v;
                }
            }
        }
    })
}

/// `[cols, rows]` from a row-major `[rows, cols]` (the adapters' small matrices).
fn transposed<T: WithDType>(v: &[T], rows: usize, cols: usize) -> Vec<T> {
    (0..cols).flat_map(|c| (0..rows).map(move |i| v[i * cols + c])).collect()
}

/// `out = residual + x @ W + b (+ s x A^T B^T)`, and what backward needs of the adapter.
pub(super) fn projection_forward<T: WithDType>(
    p: &ProjectionView<'_, T>,
    x: &[T],
    n: usize,
    residual: Option<&[T]>,
    merge: bool,
) -> CResult<(Vec<T>, AdapterActs<T>)> {
    let (k, m, r) = (p.fan_in, p.fan_out, p.rank);
    let mut out = rows_plus_bias(residual, p.bias, n);
    let mut acts = AdapterActs { merged: None, low_rank: None };
    match p.adapter {
        Some((a, b, scale)) if merge => {
            let merged = merged_weight(p.weight, a, b, scale, (k, m, r));
            mm_accumulate(&mut out, (n, m, k), (x, k, 1), (&merged, m, 1), T::one())?;
            acts.merged = Some(merged);
        }
        Some((a, b, scale)) => {
            mm_accumulate(&mut out, (n, m, k), (x, k, 1), (p.weight, m, 1), T::one())?;
            let low_rank = mm_new((n, r, k), (x, k, 1), (a, 1, k), T::one())?;
            mm_accumulate(&mut out, (n, m, r), (&low_rank, r, 1), (b, 1, r), scale)?;
            acts.low_rank = Some(low_rank);
        }
        None => mm_accumulate(&mut out, (n, m, k), (x, k, 1), (p.weight, m, 1), T::one())?,
    }
    Ok((out, acts))
}

/// Which of a projection's gradients to form, by index into the flat tensor list.
#[derive(Clone, Copy)]
pub(super) struct Wants {
    pub(super) weight: Option<usize>,
    pub(super) bias: Option<usize>,
    pub(super) a: Option<usize>,
    pub(super) b: Option<usize>,
    /// Whether the input's gradient is wanted: not below the first block's `c_attn` when
    /// nothing there trains (frozen embeddings and `ln_1`), where it is a whole
    /// `c_attn`-sized matmul for nothing.
    pub(super) input: bool,
}

/// `dx` of a projection given `dy: [n, out]` and its input `x: [n, in]` (empty unless
/// `wants.input`); the parameter gradients go to `grads` as (tensor index, values).
pub(super) fn projection_backward<T: WithDType>(
    p: &ProjectionView<'_, T>,
    acts: &AdapterActs<T>,
    x: &[T],
    dy: &[T],
    n: usize,
    wants: Wants,
    grads: &mut ParamGrads<T>,
) -> CResult<Vec<T>> {
    let (k, m, r) = (p.fan_in, p.fan_out, p.rank);
    if let Some(i) = wants.bias {
        grads.add(i, column_sums_cpu(dy, m))?;
    }
    let weight = acts.merged.as_deref().unwrap_or(p.weight);
    let mut dx = if wants.input { mm_new((n, k, m), (dy, m, 1), (weight, 1, m), T::one())? } else { Vec::new() };
    if let (Some(i), None) = (wants.weight, &acts.merged) {
        grads.add_product(i, (k, m, n), (x, 1, k), (dy, m, 1), T::one())?;
    } else if wants.weight.is_some() || acts.merged.is_some() {
        let dw = mm_new((k, m, n), (x, 1, k), (dy, m, 1), T::one())?;
        if let Some((a, b, scale)) = p.adapter.filter(|_| acts.merged.is_some()) {
            // through the merge: dA = s (dW B)^T, dB = s (A dW)^T. The products are formed
            // untransposed, so gemm reads dW along its rows; read down its columns, each
            // was several times slower.
            if let Some(i) = wants.a {
                grads.add(i, transposed(&mm_new((k, r, m), (&dw, m, 1), (b, r, 1), scale)?, k, r))?;
            }
            if let Some(i) = wants.b {
                grads.add(i, transposed(&mm_new((r, m, k), (a, k, 1), (&dw, m, 1), scale)?, r, m))?;
            }
        }
        if let Some(i) = wants.weight {
            grads.add(i, dw)?;
        }
    }
    if let (Some((a, b, scale)), Some(low_rank)) = (p.adapter, &acts.low_rank) {
        // out += s (x A^T) B^T: with v = dy B, dx += s v A, dA = s v^T x, dB = s dy^T (x A^T)
        let v = mm_new((n, r, m), (dy, m, 1), (b, r, 1), T::one())?;
        if wants.input {
            mm_accumulate(&mut dx, (n, k, r), (&v, r, 1), (a, k, 1), scale)?;
        }
        if let Some(i) = wants.a {
            grads.add_product(i, (r, k, n), (&v, 1, r), (x, k, 1), scale)?;
        }
        if let Some(i) = wants.b {
            grads.add_product(i, (m, r, n), (dy, 1, m), (low_rank, r, 1), scale)?;
        }
    }
    Ok(dx)
}
