//! Matmuls handed straight to gemm, with strides, for the shapes where going through
//! candle's `matmul` costs.
//!
//! candle's CPU matmul zero-fills its output before gemm overwrites it and cannot add into
//! an existing buffer. At the tied head's shapes it also ran well below gemm's own speed
//! (`hidden @ wte^T` and the embedding gradient `dlogits^T @ hidden`). These helpers write
//! every output element exactly once, or add into an accumulator in the same pass.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, InplaceOp3, Layout, Shape, Tensor, WithDType};

use rayon::prelude::*;

use super::bf16_gemm::{self, Bf16Engine};
use super::f16_gemm::F16Engine;
use super::f16_pack::{rounded_copy, Lanes};
use super::matmul_precision::{self, MatmulPrecision};
use super::operand::Operand;
use super::send_ptr::SendPtr;
use super::{contiguous_slice, CResult};

/// `dst[m x n] = scale * lhs @ rhs`, or with `accumulate`, `dst += scale * lhs @ rhs`;
/// each operand is a pointer with its (row, column) strides. `threads > 1` splits the work
/// over rayon (see [`split_over_threads`]). An f32 product at `MatmulPrecision::Bf16`
/// large enough to gain goes to [`half_product`] instead; so does one at
/// `MatmulPrecision::F16`.
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
    precision: MatmulPrecision,
) {
    if T::DTYPE == DType::F32 && matmul_precision::takes(precision, (m, n, k)) {
        let engine = match precision {
            MatmulPrecision::F16 => HalfEngine::F16(F16Engine::detect()),
            _ => HalfEngine::Bf16(Bf16Engine::detect()),
        };
        // SAFETY: T is f32 (checked), so the casts are identities; the contract is ours.
        unsafe {
            half_product(
                engine,
                (m, n, k),
                dst.cast(),
                dst_rs,
                accumulate,
                lhs.cast(),
                (lhs_rs, lhs_cs),
                rhs.cast(),
                (rhs_rs, rhs_cs),
                scale.to_f64() as f32,
                threads,
            )
        };
        return;
    }
    let one_thread = |(m, n, k): (usize, usize, usize),
                      dst: *mut T,
                      dst_rs: usize,
                      accumulate: bool,
                      lhs: *const T,
                      rhs: *const T| {
        // SAFETY: the caller's contract is gemm's (for a slab, a sub-matrix of it); gemm
        // computes dst = alpha dst + beta lhs rhs and reads dst only with read_dst.
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
                gemm::Parallelism::None,
            );
        }
    };
    match split_over_threads((m, n, k), threads) {
        None => one_thread((m, n, k), dst, dst_rs, accumulate, lhs, rhs),
        Some(split) if split.along == Along::Inner => {
            // Part 0 goes to dst, the others to buffers of their own, added in after.
            let mut partials: Vec<Vec<T>> = (1..split.parts).map(|_| vec![T::zero(); m * n]).collect();
            let partial_ptrs: Vec<SendPtr<T>> = partials.iter_mut().map(|p| SendPtr(p.as_mut_ptr())).collect();
            let (dst_ptr, lhs, rhs) = (SendPtr(dst), SendPtr(lhs.cast_mut()), SendPtr(rhs.cast_mut()));
            (0..split.parts).into_par_iter().for_each(|part| {
                let (start, len) = split.slab(part);
                let (lhs, rhs) = (lhs.get().cast_const(), rhs.get().cast_const());
                // SAFETY: part `part` is columns `start..start + len` of lhs and rows of
                // rhs, inside the caller's matrices; it writes dst (part 0, whose slab is
                // never empty: parts <= k / MIN_SLAB) or its own [m, n] buffer.
                unsafe {
                    let (lhs, rhs) = (lhs.add(start * lhs_cs), rhs.add(start * rhs_rs));
                    match part {
                        0 => one_thread((m, n, len), dst_ptr.get(), dst_rs, accumulate, lhs, rhs),
                        _ => one_thread((m, n, len), partial_ptrs[part - 1].get(), n, false, lhs, rhs),
                    }
                }
            });
            for partial in &partials {
                for (i, row) in partial.chunks_exact(n).enumerate() {
                    for (j, &v) in row.iter().enumerate() {
                        // SAFETY: (i, j) is inside the caller's [m, n] dst.
                        unsafe { *dst.add(i * dst_rs + j) += v };
                    }
                }
            }
        }
        Some(split) => {
            let (dst, lhs, rhs) = (SendPtr(dst), SendPtr(lhs.cast_mut()), SendPtr(rhs.cast_mut()));
            (0..split.parts).into_par_iter().for_each(|part| {
                let (start, len) = split.slab(part);
                if len == 0 {
                    return;
                }
                let (dst, lhs, rhs) = (dst.get(), lhs.get().cast_const(), rhs.get().cast_const());
                // SAFETY: slab `part` is rows (or columns) `start..start + len` of dst and
                // of lhs (or rhs), inside the caller's matrices; the slabs' dst regions are
                // disjoint, so no two tasks write one element.
                unsafe {
                    match split.along {
                        Along::Rows => one_thread(
                            (len, n, k),
                            dst.add(start * dst_rs),
                            dst_rs,
                            accumulate,
                            lhs.add(start * lhs_rs),
                            rhs,
                        ),
                        Along::Columns => {
                            one_thread((m, len, k), dst.add(start), dst_rs, accumulate, lhs, rhs.add(start * rhs_cs))
                        }
                        Along::Inner => unreachable!("handled above"),
                    }
                }
            });
        }
    }
}

/// The engine of a half-precision product: bf16 or f16 operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HalfEngine {
    Bf16(Bf16Engine),
    F16(F16Engine),
}

/// `dst[m x n] (+)= scale * lhs @ rhs` with both operands rounded to bf16 or f16, on
/// `engine`: the packed kernels where the CPU has them, else the rounded operands through
/// this file's f32 gemm (f32 accumulation, at f32's speed). Arguments as [`gemm_into`]'s.
///
/// # Safety
/// As [`gemm_into`]'s, for f32; `engine` is one [`Bf16Engine::available`] or
/// [`F16Engine::available`] lists.
#[allow(clippy::too_many_arguments)]
unsafe fn half_product(
    engine: HalfEngine,
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    dst_rs: usize,
    accumulate: bool,
    lhs: *const f32,
    lhs_strides: (usize, usize),
    rhs: *const f32,
    rhs_strides: (usize, usize),
    scale: f32,
    threads: usize,
) {
    let a = Operand { ptr: lhs, row_stride: lhs_strides.0, col_stride: lhs_strides.1, rows: m, cols: k };
    let b = Operand { ptr: rhs, row_stride: rhs_strides.0, col_stride: rhs_strides.1, rows: k, cols: n };
    // The emulations' rounded operands and their (row, column) strides.
    // SAFETY (all arms): the operands' strides address [m, k] and [k, n] (the caller's
    // contract); the engine is one this CPU runs.
    let ((a, a_strides), (b, b_strides)) = match engine {
        #[cfg(target_arch = "x86_64")]
        HalfEngine::Bf16(engine @ (Bf16Engine::Amx | Bf16Engine::Avx512Bf16)) => {
            let amx = engine == Bf16Engine::Amx;
            return unsafe { bf16_gemm::native_gemm(amx, a, b, (dst, dst_rs), accumulate, scale, threads) };
        }
        #[cfg(target_arch = "aarch64")]
        HalfEngine::F16(F16Engine::NeonFp16) => {
            return unsafe { super::f16_gemm::native_gemm(a, b, (dst, dst_rs), accumulate, scale, threads) };
        }
        HalfEngine::Bf16(_) => unsafe {
            (
                (bf16_gemm::rounded_copy(lhs, lhs_strides, m, k), (k, 1)),
                (bf16_gemm::rounded_copy(rhs, rhs_strides, k, n), (n, 1)),
            )
        },
        HalfEngine::F16(_) => {
            let (rows, columns) = unsafe { (rounded_copy(&Lanes::rows_of(&a)), rounded_copy(&Lanes::columns_of(&b))) };
            (
                (rows.values, (rows.lane_stride, rows.inner_stride)),
                (columns.values, (columns.inner_stride, columns.lane_stride)),
            )
        }
    };
    // SAFETY: a is [m, k] at a_strides, b is [k, n] at b_strides; dst is the caller's.
    unsafe {
        gemm_into(
            (m, n, k),
            dst,
            dst_rs,
            accumulate,
            a.as_ptr(),
            a_strides,
            b.as_ptr(),
            b_strides,
            scale,
            threads,
            MatmulPrecision::F32,
        )
    }
}

/// Which of the output's dimensions a parallel matmul is cut along.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Along {
    Rows,
    Columns,
    /// The inner dimension: each part a product over its share of it, summed after.
    Inner,
}

/// A matmul's output cut into `parts` slabs of whole rows or columns, one single-threaded
/// gemm call each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Split {
    along: Along,
    extent: usize,
    parts: usize,
}

impl Split {
    /// The first row (or column) of slab `part` and how many it has.
    fn slab(&self, part: usize) -> (usize, usize) {
        let (base, extra) = (self.extent / self.parts, self.extent % self.parts);
        let start = part * base + part.min(extra);
        (start, base + usize::from(part < extra))
    }
}

/// Below this many multiply-adds a matmul runs on one thread: splitting it costs more
/// than it saves.
const MIN_PARALLEL_MACS: usize = 1 << 21;
/// Fewer rows or columns than this per slab and gemm's micro-kernel runs on edge tiles.
const MIN_SLAB: usize = 32;
/// Long sides (the head's 50,257) are cut into slabs of about this many, more slabs than
/// threads, so that rayon balances them when one core runs slower; each slab re-packs only
/// the short operand. At the head's shapes this beat one slab per thread.
const LONG_SLAB: usize = 4096;
/// An inner dimension this many times the output's longer side is cut instead: the head's
/// hidden-state gradient `e @ wte` (inner 50,257) cut by rows had each thread pack the
/// whole of `wte`, cut by the inner dimension each packs half, and the partial sums
/// (`[512, 768]` at most) cost one small add.
const INNER_SPLIT_RATIO: usize = 16;

/// How to spread an `[m, n]`-output matmul over `threads` threads, if at all.
///
/// gemm's own rayon mode (`Parallelism::Rayon`) scaled poorly on two cores at the step's
/// narrow and skinny shapes (the MLP's `dx = dy W^T`, the head's `e @ wte` and `e^T @ h`)
/// against one single-threaded gemm call per part of the output; square and wide shapes
/// ran the same either way. Each slab packs its own share of the cut operand and the
/// whole of the other, which is why the cut goes along the longer side (columns are
/// preferred until rows outnumber them twice: at `dx`'s 1024 x 768 they measured faster).
fn split_over_threads((m, n, k): (usize, usize, usize), threads: usize) -> Option<Split> {
    if threads < 2 || m.saturating_mul(n).saturating_mul(k) < MIN_PARALLEL_MACS {
        return None;
    }
    if k >= LONG_SLAB && k >= INNER_SPLIT_RATIO * m.max(n) {
        let parts = threads.min(k / MIN_SLAB);
        return Some(Split { along: Along::Inner, extent: k, parts });
    }
    let (along, extent) = if n.saturating_mul(2) >= m { (Along::Columns, n) } else { (Along::Rows, m) };
    let parts = threads.max(extent / LONG_SLAB).min(extent / MIN_SLAB);
    (parts >= 2).then_some(Split { along, extent, parts })
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
        gemm_into(
            (m, n, k),
            out.as_mut_ptr(),
            n,
            false,
            a.as_ptr(),
            (k, 1),
            b.as_ptr(),
            (1, k),
            T::one(),
            threads(),
            MatmulPrecision::current(),
        );
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
    unsafe {
        gemm_into(
            (m, n, k),
            dst,
            n,
            accumulate,
            a.as_ptr(),
            (1, m),
            b.as_ptr(),
            (n, 1),
            T::one(),
            threads(),
            MatmulPrecision::current(),
        )
    }
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
                MatmulPrecision::current(),
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

/// `a @ b` as a new tensor, for row-major `a: [m, k]` and `b: [k, n]` (no gradient): the
/// head's hidden-state gradient from its softmax numerators, through [`gemm_into`]'s
/// threading rather than candle's matmul (which zero-fills first).
pub(super) struct MatmulNn;

impl CustomOp2 for MatmulNn {
    fn name(&self) -> &'static str {
        "matmul-nn"
    }

    fn cpu_fwd(&self, sa: &CpuStorage, la: &Layout, sb: &CpuStorage, lb: &Layout) -> CResult<(CpuStorage, Shape)> {
        let ((m, k), (k2, n)) = (la.shape().dims2()?, lb.shape().dims2()?);
        if k != k2 {
            candle_core::bail!("{}: [{m}, {k}] @ [{k2}, {n}] do not fit", self.name());
        }
        let out = map_float_storage!(sa, self.name(), T => {
            let (a, b) = (contiguous_slice::<T>(sa, la, self.name())?, contiguous_slice::<T>(sb, lb, self.name())?);
            mm_new((m, n, k), (a, k, 1), (b, n, 1), T::from_f64(1.0))?
        });
        Ok((out, Shape::from((m, n))))
    }
}

/// `a @ b` for 2-D f32 or f64 tensors on the CPU, through the same threaded gemm calls as
/// the model's fused ops (no gradient). `fedpo-device bench --gemm` times it beside
/// candle's `matmul`, so that the compute bound it reports is the faster of the two.
pub fn matmul(a: &Tensor, b: &Tensor) -> CResult<Tensor> {
    a.contiguous()?.apply_op2_no_bwd(&b.contiguous()?, &MatmulNn)
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
mod bf16_tests;

#[cfg(test)]
mod f16_tests;

#[cfg(test)]
mod tests {
    use super::super::tests::{max_abs_diff, randn};
    use super::*;
    use candle_core::Device;

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

    /// `dst (+)= lhs @ rhs` by the definition, the reference for the threaded matmuls.
    fn naive_matmul(dst: &mut [f64], (m, n, k): (usize, usize, usize), lhs: Strided<'_, f64>, rhs: Strided<'_, f64>) {
        for i in 0..m {
            for j in 0..n {
                let dot: f64 = (0..k).map(|p| lhs.0[i * lhs.1 + p * lhs.2] * rhs.0[p * rhs.1 + j * rhs.2]).sum();
                dst[i * n + j] += dot;
            }
        }
    }

    #[test]
    fn matmuls_split_over_threads_match_the_definition_in_every_layout() {
        let values = |len: usize, seed: u64| randn(&[len], seed).to_vec1::<f64>().unwrap();
        // cut along columns, along rows, and along rows into three uneven slabs
        for ((m, n, k), threads, along) in [
            ((64, 160, 256), 2, Along::Columns),
            ((300, 40, 192), 2, Along::Rows),
            ((301, 40, 192), 3, Along::Rows),
            ((24, 24, 4099), 2, Along::Inner),
            ((25, 23, 4099), 3, Along::Inner),
        ] {
            assert_eq!(split_over_threads((m, n, k), threads).map(|s| (s.along, s.parts)), Some((along, threads)));
            let (lhs, rhs, start) = (values(m * k, 70), values(k * n, 71), values(m * n, 72));
            for (lhs_transposed, rhs_transposed, accumulate) in
                [(false, false, false), (true, false, true), (false, true, true), (true, true, false)]
            {
                let lhs_strides = if lhs_transposed { (1, m) } else { (k, 1) };
                let rhs_strides = if rhs_transposed { (1, k) } else { (n, 1) };
                let mut expected = if accumulate { start.clone() } else { vec![0.0; m * n] };
                naive_matmul(
                    &mut expected,
                    (m, n, k),
                    (&lhs, lhs_strides.0, lhs_strides.1),
                    (&rhs, rhs_strides.0, rhs_strides.1),
                );
                // stale values where nothing accumulates: gemm must overwrite them
                let mut ours = if accumulate { start.clone() } else { vec![f64::NAN; m * n] };
                // SAFETY: the strides address [m, k] and [k, n] inside lhs and rhs; ours is [m, n].
                unsafe {
                    gemm_into(
                        (m, n, k),
                        ours.as_mut_ptr(),
                        n,
                        accumulate,
                        lhs.as_ptr(),
                        lhs_strides,
                        rhs.as_ptr(),
                        rhs_strides,
                        1.0,
                        threads,
                        MatmulPrecision::F32,
                    );
                }
                let err = ours.iter().zip(&expected).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
                assert!(err < 1e-9, "[{m}, {n}, {k}] {lhs_transposed} {rhs_transposed} {accumulate}: off by {err}");
            }
        }
    }

    #[test]
    fn the_public_matmul_matches_candles_at_a_shape_it_splits_and_on_a_transposed_view() {
        let (m, k, n) = (96, 160, 200);
        assert!(split_over_threads((m, n, k), 2).is_some());
        let (a, b) = (randn(&[m, k], 73), randn(&[k, n], 74));
        let err = max_abs_diff(&matmul(&a, &b).unwrap(), &a.matmul(&b).unwrap());
        assert!(err < 1e-9, "off by {err}");
        let bt = randn(&[n, k], 75).t().unwrap();
        let err = max_abs_diff(&matmul(&a, &bt).unwrap(), &a.matmul(&bt).unwrap());
        assert!(err < 1e-9, "transposed view off by {err}");
        let err = matmul(&a, &randn(&[k + 1, n], 76)).unwrap_err().to_string();
        assert!(err.contains("[96, 160] @ [161, 200] do not fit"), "{err}");
    }

    #[test]
    fn the_steps_matmuls_are_cut_along_their_longer_side_and_small_ones_not_at_all() {
        let cut = |mnk, threads| split_over_threads(mnk, threads).map(|s| s.along);
        // the head's logits, its hidden-state and embedding gradients, and dx = dy W^T
        assert_eq!(cut((512, 50257, 768), 2), Some(Along::Columns));
        assert_eq!(cut((512, 128, 50257), 2), Some(Along::Inner));
        assert_eq!(cut((512, 768, 50257), 2), Some(Along::Inner));
        assert_eq!(cut((50257, 128, 512), 2), Some(Along::Rows));
        assert_eq!(cut((1024, 768, 3072), 2), Some(Along::Columns));
        assert_eq!(cut((512, 50257, 768), 1), None, "one thread");
        assert_eq!(cut((7, 5, 3), 2), None, "too few multiply-adds");
        assert_eq!(cut((40, 40, 2000), 2), None, "slabs would be narrower than a micro-kernel tile");
    }

    #[test]
    fn slabs_cover_every_row_once_for_any_thread_count() {
        for extent in [64, 65, 97, 1000] {
            for parts in 2..=5 {
                let split = Split { along: Along::Rows, extent, parts };
                let mut next = 0;
                for part in 0..parts {
                    let (start, len) = split.slab(part);
                    assert_eq!(start, next, "slab {part} of {parts} over {extent}");
                    assert!(len == extent / parts || len == extent / parts + 1);
                    next += len;
                }
                assert_eq!(next, extent);
            }
        }
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
