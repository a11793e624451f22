//! `x @ w + bias` as one op, for GPT-2's Conv1D projections.
//!
//! Composed, the bias add is a second node: its output is a second activation-sized tensor
//! that the graph keeps alive until backward (the matmul's output, its input, is kept too),
//! and its backward adds the gradient into a fresh zero tensor before the matmul sees it.
//! Fused, forward adds the bias into the matmul's output in place, and backward hands the
//! gradient straight to the two matmuls and the column sum. A weight or bias that is not
//! trained (detached, or never a variable) gets no gradient at all, so a frozen projection
//! costs no weight-sized matmul in backward.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, Layout, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::{contiguous_slice, full_precision, CResult};

/// Elements per parallel task of a pass over whole rows `width` wide: rows in chunks of
/// about 64 KiB keep rayon's per-task overhead small for narrow rows.
pub(super) fn row_chunk(width: usize) -> usize {
    let width = width.max(1);
    (16_384 / width).max(1) * width
}

/// Adds `bias` to every row of `rows` (whole rows of `bias.len()`, row-major), serially.
pub(super) fn add_bias_to_each_row<T: WithDType>(rows: &mut [T], bias: &[T]) {
    for row in rows.chunks_exact_mut(bias.len().max(1)) {
        for (o, &b) in row.iter_mut().zip(bias) {
            *o += b;
        }
    }
}

/// Adds `bias` (length `n`) to every row of `out` (`[m, n]`, row-major).
pub(super) fn add_bias_rows<T: WithDType>(out: &mut [T], bias: &[T]) {
    out.par_chunks_mut(row_chunk(bias.len())).for_each(|rows| add_bias_to_each_row(rows, bias));
}

/// Sums of each column of `m` (`[rows, n]`, row-major): each task owns a band of columns
/// and runs down the rows, so every read is a contiguous run and the sums stay in cache.
pub(super) fn column_sums_cpu<T: WithDType>(m: &[T], n: usize) -> Vec<T> {
    const BAND: usize = 256;
    let mut out = vec![T::zero(); n];
    out.par_chunks_mut(BAND).enumerate().for_each(|(band, acc)| {
        let (start, width) = (band * BAND, acc.len());
        for row in m.chunks_exact(n) {
            for (a, &v) in acc.iter_mut().zip(&row[start..start + width]) {
                *a += v;
            }
        }
    });
    out
}

/// The bias gradient, `grad.sum(0)`: candle reduces over a leading dimension one strided
/// element at a time, slow enough to show in the DistilGPT-2 step's profile.
struct ColumnSums;

impl CustomOp1 for ColumnSums {
    fn name(&self) -> &'static str {
        "column-sums"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let (_, n) = l.shape().dims2()?;
        let out =
            map_float_storage!(s, self.name(), T => column_sums_cpu::<T>(contiguous_slice(s, l, self.name())?, n));
        Ok((out, Shape::from(n)))
    }
}

fn column_sums(m: &Tensor) -> CResult<Tensor> {
    if m.device().is_cpu() && full_precision(m) && m.rank() == 2 {
        m.contiguous()?.apply_op1_no_bwd(&ColumnSums)
    } else {
        m.sum(0)
    }
}

struct LinearBias;

impl CustomOp3 for LinearBias {
    fn name(&self) -> &'static str {
        "linear-bias"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let (m, k) = lx.shape().dims2()?;
        let (k2, n) = lw.shape().dims2()?;
        if k != k2 || lb.shape().dims() != [n] {
            candle_core::bail!(
                "linear-bias: shapes do not fit, {m}x{k} @ {k2}x{n} + {:?} (bias must be [{n}])",
                lb.shape().dims()
            );
        }
        let mut out = sx.matmul(sw, (1, m, n, k), lx, lw)?;
        match &mut out {
            CpuStorage::F32(y) => add_bias_rows(y, contiguous_slice::<f32>(sb, lb, self.name())?),
            CpuStorage::F64(y) => add_bias_rows(y, contiguous_slice::<f64>(sb, lb, self.name())?),
            CpuStorage::BF16(y) => add_bias_rows(y, contiguous_slice(sb, lb, self.name())?),
            CpuStorage::F16(y) => add_bias_rows(y, contiguous_slice(sb, lb, self.name())?),
            other => candle_core::bail!("linear-bias: unsupported dtype {:?}", other.dtype()),
        }
        Ok((out, Shape::from((m, n))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // Gradients are built from tensors that track (x, w), so each would record an op
        // holding `grad` alive; a parameter's gradient lives until the optimizer step, and
        // with it every layer's output gradient. Detached, they hold only their own storage.
        let (want_dx, want_dw, want_db) = (x.track_op(), w.track_op(), bias.track_op());
        let (x, w, grad) = (x.detach(), w.detach(), grad.detach());
        let dx = want_dx.then(|| grad.matmul(&w.t()?)).transpose()?;
        let dw = want_dw.then(|| x.t()?.matmul(&grad)).transpose()?;
        let db = want_db.then(|| column_sums(&grad)).transpose()?;
        Ok((dx, dw, db))
    }
}

/// `x @ w + bias` for a 2-D `x: [m, k]`, `w: [k, n]` and `bias: [n]`.
///
/// Gradients flow to whichever of the three are tracked (variables, or computed from
/// variables); detach a frozen weight to skip its gradient. Off the CPU this is the plain
/// matmul and broadcast add.
pub fn linear_bias(x: &Tensor, w: &Tensor, bias: &Tensor) -> CResult<Tensor> {
    if x.device().is_cpu() {
        x.apply_op3(w, bias, LinearBias)
    } else {
        x.matmul(w)?.broadcast_add(bias)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Var};

    use super::super::tests::{max_abs_diff, randn};
    use super::*;

    fn composed(x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
        x.matmul(w).unwrap().broadcast_add(b).unwrap()
    }

    #[test]
    fn fused_linear_matches_matmul_plus_bias_in_value_and_every_gradient() {
        let x = Var::from_tensor(&randn(&[7, 5], 11)).unwrap();
        let w = Var::from_tensor(&randn(&[5, 9], 12)).unwrap();
        let b = Var::from_tensor(&randn(&[9], 13)).unwrap();
        let upstream = randn(&[7, 9], 14);
        let fused = linear_bias(x.as_tensor(), w.as_tensor(), b.as_tensor()).unwrap();
        let plain = composed(x.as_tensor(), w.as_tensor(), b.as_tensor());
        assert!(max_abs_diff(&fused, &plain) < 1e-12);
        let g_fused = (fused * &upstream).unwrap().sum_all().unwrap().backward().unwrap();
        let g_plain = (plain * &upstream).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&x, &w, &b] {
            let (a, e) = (g_fused.get(v.as_tensor()).unwrap(), g_plain.get(v.as_tensor()).unwrap());
            assert_eq!(a.dims(), v.dims());
            // A gradient that recorded an op would keep the upstream gradient alive with it.
            assert!(!a.track_op(), "gradients must hold no graph");
            assert!(max_abs_diff(a, e) < 1e-12, "gradient differs by {}", max_abs_diff(a, e));
        }
    }

    #[test]
    fn frozen_weight_and_bias_get_no_gradient_and_the_input_still_does() {
        let x = Var::from_tensor(&randn(&[4, 3], 21)).unwrap();
        let w = randn(&[3, 6], 22);
        let b = randn(&[6], 23);
        let y = linear_bias(x.as_tensor(), &w, &b).unwrap();
        let grads = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        assert!(grads.get(&w).is_none() && grads.get(&b).is_none(), "frozen parameters must get no gradient");
        let expected = (composed(x.as_tensor(), &w, &b) * 2.0).unwrap().matmul(&w.t().unwrap()).unwrap();
        assert!(max_abs_diff(grads.get(x.as_tensor()).unwrap(), &expected) < 1e-12);
    }

    #[test]
    fn fused_linear_runs_in_f32_and_bf16_and_takes_a_transposed_weight() {
        let x = randn(&[6, 4], 31);
        let wt = randn(&[5, 4], 32);
        let b = randn(&[5], 33);
        let exact = composed(&x, &wt.t().unwrap(), &b);
        let scale = exact.abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
        for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 2e-2)] {
            let cast = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let y = linear_bias(&cast(&x), &cast(&wt).t().unwrap(), &cast(&b)).unwrap();
            assert_eq!(y.dtype(), dtype);
            let err = max_abs_diff(&y.to_dtype(DType::F64).unwrap(), &exact) / scale;
            assert!(err < tol, "{dtype:?}: off by {err} of the largest output");
        }
    }

    #[test]
    fn column_sums_match_candles_sum_over_rows_across_bands() {
        let m = randn(&[37, 600], 41); // three bands of columns, the last one partial
        let ours = column_sums(&m).unwrap();
        assert_eq!(ours.dims(), [600]);
        assert!(max_abs_diff(&ours, &m.sum(0).unwrap()) < 1e-12);
        let m32 = m.to_dtype(DType::F32).unwrap();
        let err = max_abs_diff(&column_sums(&m32).unwrap().to_dtype(DType::F64).unwrap(), &m.sum(0).unwrap());
        assert!(err < 1e-4, "f32 sums off by {err}");
    }

    #[test]
    fn mismatched_bias_is_an_error_naming_the_shapes() {
        let err = linear_bias(&randn(&[2, 3], 1), &randn(&[3, 4], 2), &randn(&[3], 3)).unwrap_err().to_string();
        assert!(err.contains("2x3 @ 3x4") && err.contains("[4]"), "{err}");
    }
}
