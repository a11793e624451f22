//! Matmuls handed straight to gemm, with strides, for the shapes where going through
//! candle's `matmul` costs.
//!
//! candle's CPU matmul zero-fills its output before gemm overwrites it and cannot add into
//! an existing buffer. At the tied head's shapes it also ran well below gemm's own speed:
//! on the DistilGPT-2 step, `hidden @ wte^T` (512 x 768 x 50257) measured 360 GFLOP/s
//! through candle and 454 called directly, and the embedding gradient `dlogits^T @ hidden`
//! 277 against 441 (the 2048^3 figure is about 480). These helpers write every output
//! element exactly once, or add into an accumulator in the same pass.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, InplaceOp3, Layout, Shape, WithDType};

use super::{contiguous_slice, CResult};

/// `dst[m x n] = scale * lhs @ rhs`, or with `accumulate`, `dst += scale * lhs @ rhs`;
/// each operand is a pointer with its (row, column) strides. `threads > 1` lets gemm split
/// the work over rayon.
///
/// # Safety
/// Every element the strides address must lie inside its buffer, `dst` must not alias the
/// operands, and `T` must be f32 or f64.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn gemm_into<T: WithDType>(
    (m, n, k): (usize, usize, usize),
    dst: *mut T,
    dst_rs: usize,
    accumulate: bool,
    lhs: *const T,
    (lhs_rs, lhs_cs): (usize, usize),
    rhs: *const T,
    (rhs_rs, rhs_cs): (usize, usize),
    scale: T,
    threads: usize,
) {
    let parallelism = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: the caller's contract is gemm's; gemm computes dst = alpha dst + beta lhs rhs
    // and reads dst only with read_dst.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            accumulate,
            lhs,
            lhs_cs as isize,
            lhs_rs as isize,
            rhs,
            rhs_cs as isize,
            rhs_rs as isize,
            T::one(),
            scale,
            false,
            false,
            false,
            parallelism,
        );
    }
}

fn check_float<T: WithDType>(op: &str) -> CResult<()> {
    if !matches!(T::DTYPE, DType::F32 | DType::F64) {
        candle_core::bail!("{op}: gemm is called for f32 and f64 only, not {:?}", T::DTYPE);
    }
    Ok(())
}

pub(super) fn threads() -> usize {
    rayon::current_num_threads()
}

/// `a @ b^T` for row-major `a: [m, k]` and `b: [n, k]`: the head's logits from the hidden
/// states and the embedding, without a transposed copy.
pub(super) fn matmul_nt<T: WithDType>(a: &[T], b: &[T], (m, n, k): (usize, usize, usize)) -> CResult<Vec<T>> {
    check_float::<T>("matmul-nt")?;
    if a.len() != m * k || b.len() != n * k {
        candle_core::bail!("matmul-nt: {} and {} values for [{m}, {k}] @ [{n}, {k}]^T", a.len(), b.len());
    }
    if k == 0 {
        return Ok(vec![T::zero(); m * n]);
    }
    let mut out: Vec<T> = Vec::with_capacity(m * n);
    // SAFETY: a is [m, k] and b [n, k] row-major (checked above), out has room for [m, n];
    // without `accumulate` gemm writes every element of out and reads none, so the
    // length can be set after it.
    unsafe {
        gemm_into((m, n, k), out.as_mut_ptr(), n, false, a.as_ptr(), (k, 1), b.as_ptr(), (1, k), T::one(), threads());
        out.set_len(m * n);
    }
    Ok(out)
}

fn check_tn<T: WithDType>(a: &[T], b: &[T], dst_len: usize, (m, n, k): (usize, usize, usize)) -> CResult<()> {
    check_float::<T>("matmul-tn")?;
    if a.len() != k * m || b.len() != k * n || dst_len != m * n {
        candle_core::bail!(
            "matmul-tn: {}, {} and {} values for [{k}, {m}]^T @ [{k}, {n}] into [{m}, {n}]",
            a.len(),
            b.len(),
            dst_len
        );
    }
    Ok(())
}

/// `dst (+)= a^T @ b` for row-major `a: [k, m]`, `b: [k, n]` and `dst: [m, n]`.
///
/// # Safety
/// [`check_tn`] passed for these lengths, and `dst` holds `m * n` elements.
unsafe fn tn_into<T: WithDType>(dst: *mut T, accumulate: bool, a: &[T], b: &[T], (m, n, k): (usize, usize, usize)) {
    // SAFETY: the lengths fit (the caller's contract); a^T's (row, col) is a's (col, row).
    unsafe { gemm_into((m, n, k), dst, n, accumulate, a.as_ptr(), (1, m), b.as_ptr(), (n, 1), T::one(), threads()) }
}

/// `a^T @ b` for row-major `a: [k, m]` and `b: [k, n]`: the embedding's gradient from the
/// logits' gradient and the hidden states, written without a zero fill first.
pub(super) fn matmul_tn<T: WithDType>(a: &[T], b: &[T], (m, n, k): (usize, usize, usize)) -> CResult<Vec<T>> {
    check_tn(a, b, m * n, (m, n, k))?;
    if k == 0 {
        return Ok(vec![T::zero(); m * n]);
    }
    let mut out: Vec<T> = Vec::with_capacity(m * n);
    // SAFETY: checked above; without `accumulate` gemm writes every element of out and
    // reads none, so the length can be set after it.
    unsafe {
        tn_into(out.as_mut_ptr(), false, a, b, (m, n, k));
        out.set_len(m * n);
    }
    Ok(out)
}

/// `dst += a^T @ b`, the product added by the matmul itself.
pub(super) fn add_matmul_tn<T: WithDType>(
    dst: &mut [T],
    a: &[T],
    b: &[T],
    (m, n, k): (usize, usize, usize),
) -> CResult<()> {
    check_tn(a, b, dst.len(), (m, n, k))?;
    if k > 0 {
        // SAFETY: checked above.
        unsafe { tn_into(dst.as_mut_ptr(), true, a, b, (m, n, k)) };
    }
    Ok(())
}

/// A matrix operand: its values and its (row, column) strides.
pub(super) type Strided<'a, T> = (&'a [T], usize, usize);

/// Checks that an `rows x cols` operand's strides stay inside its values.
fn check_strided<T>((values, rs, cs): Strided<'_, T>, rows: usize, cols: usize, what: &str) -> CResult<()> {
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let last = (rows - 1) * rs + (cols - 1) * cs;
    if last >= values.len() {
        candle_core::bail!(
            "gemm: the {what} [{rows}, {cols}] with strides ({rs}, {cs}) needs {} values, has {}",
            last + 1,
            values.len()
        );
    }
    Ok(())
}

/// `dst (+)= scale * lhs @ rhs` for `lhs: [m, k]` and `rhs: [k, n]` given by strides, into
/// a row-major `dst: [m, n]` of at least `m * n` elements.
///
/// # Safety
/// `dst` points at `m * n` writable elements that alias neither operand; when not
/// `accumulate`, they may be uninitialised.
unsafe fn strided_into<T: WithDType>(
    dst: *mut T,
    accumulate: bool,
    (m, n, k): (usize, usize, usize),
    lhs: Strided<'_, T>,
    rhs: Strided<'_, T>,
    scale: T,
) -> CResult<()> {
    check_float::<T>("gemm")?;
    check_strided(lhs, m, k, "left operand")?;
    check_strided(rhs, k, n, "right operand")?;
    if m > 0 && n > 0 && k > 0 {
        // SAFETY: the operands' strides stay inside their values (checked above), and dst is
        // the caller's.
        unsafe {
            gemm_into(
                (m, n, k),
                dst,
                n,
                accumulate,
                lhs.0.as_ptr(),
                (lhs.1, lhs.2),
                rhs.0.as_ptr(),
                (rhs.1, rhs.2),
                scale,
                threads(),
            )
        };
    }
    Ok(())
}

/// `scale * lhs @ rhs` as a new row-major `[m, n]`, written once (no zero fill first).
pub(super) fn mm_new<T: WithDType>(
    (m, n, k): (usize, usize, usize),
    lhs: Strided<'_, T>,
    rhs: Strided<'_, T>,
    scale: T,
) -> CResult<Vec<T>> {
    if k == 0 {
        return Ok(vec![T::zero(); m * n]);
    }
    let mut out: Vec<T> = Vec::with_capacity(m * n);
    // SAFETY: out has room for m * n elements and is fresh; without `accumulate` gemm
    // writes every one of them and reads none, so the length is set only after it returns
    // successfully.
    unsafe {
        strided_into(out.as_mut_ptr(), false, (m, n, k), lhs, rhs, scale)?;
        out.set_len(m * n);
    }
    Ok(out)
}

/// `dst += scale * lhs @ rhs`, for a row-major `dst: [m, n]`.
pub(super) fn mm_accumulate<T: WithDType>(
    dst: &mut [T],
    (m, n, k): (usize, usize, usize),
    lhs: Strided<'_, T>,
    rhs: Strided<'_, T>,
    scale: T,
) -> CResult<()> {
    if dst.len() < m * n {
        candle_core::bail!("gemm: {} values for a [{m}, {n}] product", dst.len());
    }
    // SAFETY: dst holds m * n initialised elements, borrowed mutably, so no operand aliases it.
    unsafe { strided_into(dst.as_mut_ptr(), true, (m, n, k), lhs, rhs, scale) }
}

/// `a^T @ b` as a new tensor, for `a: [k, m]` and `b: [k, n]` (no gradient).
pub(super) struct MatmulTn;

impl CustomOp2 for MatmulTn {
    fn name(&self) -> &'static str {
        "matmul-tn"
    }

    fn cpu_fwd(&self, sa: &CpuStorage, la: &Layout, sb: &CpuStorage, lb: &Layout) -> CResult<(CpuStorage, Shape)> {
        let ((k, m), (k2, n)) = (la.shape().dims2()?, lb.shape().dims2()?);
        if k != k2 {
            candle_core::bail!("{}: [{k}, {m}]^T @ [{k2}, {n}] do not fit", self.name());
        }
        let out = map_float_storage!(sa, self.name(), T => matmul_tn::<T>(
            contiguous_slice(sa, la, self.name())?,
            contiguous_slice(sb, lb, self.name())?,
            (m, n, k),
        )?);
        Ok((out, Shape::from((m, n))))
    }
}

/// `acc += a^T @ b`, in place, for `acc: [m, n]`, `a: [k, m]`, `b: [k, n]`.
pub(super) struct AddMatmulTn;

impl InplaceOp3 for AddMatmulTn {
    fn name(&self) -> &'static str {
        "add-matmul-tn"
    }

    fn cpu_fwd(
        &self,
        sacc: &mut CpuStorage,
        lacc: &Layout,
        sa: &CpuStorage,
        la: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> CResult<()> {
        let ((k, m), (_, n)) = (la.shape().dims2()?, lb.shape().dims2()?);
        let Some((start, end)) = lacc.contiguous_offsets() else {
            candle_core::bail!("{}: the accumulator must be contiguous", self.name())
        };
        let (name, dims) = (self.name(), (m, n, k));
        match sacc {
            CpuStorage::F32(acc) => add_matmul_tn(
                &mut acc[start..end],
                contiguous_slice(sa, la, name)?,
                contiguous_slice(sb, lb, name)?,
                dims,
            ),
            CpuStorage::F64(acc) => add_matmul_tn(
                &mut acc[start..end],
                contiguous_slice(sa, la, name)?,
                contiguous_slice(sb, lb, name)?,
                dims,
            ),
            other => candle_core::bail!("{}: unsupported dtype {:?}", name, other.dtype()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{max_abs_diff, randn};
    use super::*;
    use candle_core::{Device, Tensor};

    #[test]
    fn direct_matmuls_agree_with_candle_in_every_layout() {
        let (m, n, k) = (7, 5, 3);
        let a = randn(&[m, k], 61);
        let b = randn(&[n, k], 62);
        let nt = matmul_nt(
            &a.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
            &b.flatten_all().unwrap().to_vec1().unwrap(),
            (m, n, k),
        )
        .unwrap();
        let nt = Tensor::from_vec(nt, (m, n), &Device::Cpu).unwrap();
        assert!(max_abs_diff(&nt, &a.matmul(&b.t().unwrap()).unwrap()) < 1e-12);

        let at = randn(&[k, m], 63);
        let bt = randn(&[k, n], 64);
        let expected = at.t().unwrap().matmul(&bt).unwrap();
        let fresh = at.apply_op2_no_bwd(&bt, &MatmulTn).unwrap();
        assert!(max_abs_diff(&fresh, &expected) < 1e-12);
        let acc = randn(&[m, n], 65);
        let before = acc.copy().unwrap();
        acc.inplace_op3(&at, &bt, &AddMatmulTn).unwrap();
        assert!(max_abs_diff(&acc, &(before + expected).unwrap()) < 1e-12);
    }

    #[test]
    fn direct_matmuls_refuse_operands_that_do_not_fit() {
        let err = matmul_nt(&[1f32; 6], &[1f32; 5], (2, 2, 3)).unwrap_err().to_string();
        assert!(err.contains("6 and 5 values"), "{err}");
        let mut dst = [0f32; 4];
        let err = add_matmul_tn(&mut dst, &[1f32; 6], &[1f32; 6], (2, 3, 3)).unwrap_err().to_string();
        assert!(err.contains("into [2, 3]"), "{err}");
        let err = matmul_nt(&[1u32; 1], &[1u32; 1], (1, 1, 1)).unwrap_err().to_string();
        assert!(err.contains("f32 and f64 only"), "{err}");
    }
}
