//! Packing f32 operands into the bf16 layouts [`super::bf16_kernels`] multiply, rounding
//! on the way: the pack is a copy every blocked matmul makes anyway, so the conversion costs
//! no pass of its own.
//!
//! The step's operands come in three layouts, each packed along memory:
//! - row-major (`x`, `dy`, a weight `[in, out]` on the right): runs along a row;
//! - transposed (`x^T` on the left of a weight gradient, `w^T` on the right of `dx`):
//!   runs along a column, 32 of them at a time for the left operand (one vector per
//!   half) and one whole column at a time for the right;
//! - anything else (a view with two strides) element by element.
//!
//! Out-of-range rows, columns and inner indices are left as the zeros of a fresh buffer, so
//! the kernels always run whole 32 x 32 blocks and whole 32-deep steps. Every function here
//! needs AVX512-BF16 (the engines that use the packs check for it).

use super::bf16_kernels::{round_16, round_interleaved_16, BLOCK};
use super::operand::Operand;

#[inline(always)]
fn bits(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// Packs rows `i0..i0 + 32` and inner indices `p0..p0 + kc` of `a` as 32 rows of `kp` bf16
/// (row `r` at `out[r * kp..]`), zeros past `a`'s edge and past `kc`.
///
/// # Safety
/// `a`'s strides address its `rows x cols` inside its buffer; `p0 + kc <= a.cols`;
/// `kc <= kp`; `out.len() == 32 * kp` and `out` is zeroed; AVX512-BF16 may run.
#[target_feature(enable = "avx512f,avx512bf16,avx512bw")]
pub(super) unsafe fn pack_rows(a: &Operand, i0: usize, p0: usize, kc: usize, kp: usize, out: &mut [u16]) {
    debug_assert_eq!(out.len(), BLOCK * kp);
    let live = a.rows.saturating_sub(i0).min(BLOCK);
    if a.col_stride == 1 {
        for r in 0..live {
            // SAFETY: row i0 + r, columns p0..p0 + kc are inside a (the caller's contract).
            let src = unsafe { a.ptr.add((i0 + r) * a.row_stride + p0) };
            let dst = &mut out[r * kp..r * kp + kc];
            let mut p = 0;
            while p + 16 <= kc {
                // SAFETY: 16 in-range f32 and 16 u16 of dst.
                unsafe { round_16(src.add(p), dst.as_mut_ptr().add(p)) };
                p += 16;
            }
            for (p, d) in dst.iter_mut().enumerate().skip(p) {
                // SAFETY: p < kc.
                *d = bits(unsafe { *src.add(p) });
            }
        }
    } else if a.row_stride == 1 && live == BLOCK {
        // A column of the block is 32 contiguous f32: round them in two vectors, then
        // scatter down the packed rows.
        let mut column = [0u16; BLOCK];
        for p in 0..kc {
            // SAFETY: rows i0..i0 + 32 of column p0 + p are inside a.
            unsafe {
                let src = a.ptr.add(i0 + (p0 + p) * a.col_stride);
                round_16(src, column.as_mut_ptr());
                round_16(src.add(16), column.as_mut_ptr().add(16));
            }
            for (r, &v) in column.iter().enumerate() {
                out[r * kp + p] = v;
            }
        }
    } else {
        for r in 0..live {
            for p in 0..kc {
                // SAFETY: (i0 + r, p0 + p) is inside a.
                out[r * kp + p] = bits(unsafe { a.at(i0 + r, p0 + p) });
            }
        }
    }
}

/// Packs inner indices `p0..p0 + kc` and columns `j0..j0 + 16 * strips` of `b` as `strips`
/// strips, each `kp / 2` pair-rows of 16 column pairs (strip `s` at `out[s * kp * 16..]`),
/// zeros past `b`'s edge and past `kc`.
///
/// # Safety
/// As [`pack_rows`], for `b`'s inner dimension (its rows); `out.len() == strips * kp * 16`
/// and `out` is zeroed.
#[target_feature(enable = "avx512f,avx512bf16,avx512bw")]
pub(super) unsafe fn pack_strips(b: &Operand, p0: usize, kc: usize, j0: usize, kp: usize, out: &mut [u16]) {
    const W: usize = 16;
    let strips = out.len() / (kp * W);
    // Strips whose 16 columns all lie inside b.
    let whole = (b.cols.saturating_sub(j0) / W).min(strips);
    let mut first_left = 0;
    if b.col_stride == 1 && whole > 0 {
        // Row-major: each pair of rows is read once, left to right across every whole
        // strip, so the reads run along memory rather than down a column of strips.
        let mut p = 0;
        while p + 2 <= kc {
            // SAFETY: rows p0 + p and p0 + p + 1, columns j0..j0 + 16 * whole are inside b;
            // pair-row p / 2 of strip s holds 32 u16.
            unsafe {
                let lo = b.ptr.add((p0 + p) * b.row_stride + j0);
                for s in 0..whole {
                    let dst = out.as_mut_ptr().add(s * kp * W + p * W);
                    round_interleaved_16(lo.add(s * W), lo.add(s * W + b.row_stride), dst);
                }
            }
            p += 2;
        }
        if p < kc {
            for s in 0..whole {
                for j in 0..W {
                    // SAFETY: row p0 + p, column j0 + s * 16 + j are inside b.
                    out[s * kp * W + p * W + 2 * j] = bits(unsafe { b.at(p0 + p, j0 + s * W + j) });
                }
            }
        }
        first_left = whole;
    }
    for s in first_left..strips {
        let strip = &mut out[s * kp * W..(s + 1) * kp * W];
        let first = j0 + s * W;
        let live = b.cols.saturating_sub(first).min(W);
        if live == 0 {
            continue;
        }
        if b.row_stride == 1 {
            // Each column's inner run is contiguous: 16 pairs round at once, their u32s
            // going one per pair-row.
            let mut run = [0u16; 32];
            for j in 0..live {
                // SAFETY: column first + j, rows p0..p0 + kc are inside b.
                let src = unsafe { b.ptr.add((first + j) * b.col_stride + p0) };
                let mut p = 0;
                while p + 32 <= kc {
                    // SAFETY: 32 in-range f32.
                    unsafe {
                        round_16(src.add(p), run.as_mut_ptr());
                        round_16(src.add(p + 16), run.as_mut_ptr().add(16));
                    }
                    for (q, pair) in run.chunks_exact(2).enumerate() {
                        let at = (p / 2 + q) * 2 * W + 2 * j;
                        strip[at] = pair[0];
                        strip[at + 1] = pair[1];
                    }
                    p += 32;
                }
                for p in p..kc {
                    // SAFETY: p < kc.
                    strip[(p / 2) * 2 * W + 2 * j + p % 2] = bits(unsafe { *src.add(p) });
                }
            }
        } else {
            for p in 0..kc {
                for j in 0..live {
                    // SAFETY: (p0 + p, first + j) is inside b.
                    strip[(p / 2) * 2 * W + 2 * j + p % 2] = bits(unsafe { b.at(p0 + p, first + j) });
                }
            }
        }
    }
}
