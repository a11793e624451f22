//! Scaling f32 operands and rounding them to f16, and packing them into the layout
//! [`super::f16_kernels`] multiplies.
//!
//! f16 keeps 11 significant bits where bf16 keeps 8, but only 5 exponent bits: its normal
//! range is 6.1e-5 to 65,504. A step's operands span far more: a DPO gradient's entries for
//! a vocabulary's unlikely tokens are 1e-7 and smaller, and rounded as they are they would
//! flush to zero. So each *lane* (a row of the left operand, a column of the right) is
//! multiplied by the power of two that brings its largest magnitude into [16, 32) before
//! rounding, and the product is unscaled in f32. Powers of two scale exactly, so f16's
//! rounding, relative to each lane's largest entry, is the only error, and a product's
//! scale factors out of it: `(s_i a_i) . (t_j b_j) = s_i t_j (a_i . b_j)`. This takes the
//! place of loss scaling, which needs a guess, an overflow check and skipped steps.

use rayon::prelude::*;

use super::operand::Operand;
use super::send_ptr::SendPtr;

/// An operand seen as lanes along its inner dimension: the rows of a left operand or the
/// columns of a right one.
#[derive(Clone, Copy)]
pub(super) struct Lanes {
    pub ptr: *const f32,
    /// Distance between consecutive lanes.
    pub lane_stride: usize,
    /// Distance between consecutive inner indices within a lane.
    pub inner_stride: usize,
    pub lanes: usize,
    pub inner: usize,
}

impl Lanes {
    /// The rows of `a`, the left operand of `a @ b`.
    pub(super) fn rows_of(a: &Operand) -> Self {
        Self { ptr: a.ptr, lane_stride: a.row_stride, inner_stride: a.col_stride, lanes: a.rows, inner: a.cols }
    }

    /// The columns of `b`, the right operand of `a @ b`.
    pub(super) fn columns_of(b: &Operand) -> Self {
        Self { ptr: b.ptr, lane_stride: b.col_stride, inner_stride: b.row_stride, lanes: b.cols, inner: b.rows }
    }

    /// Element `p` of lane `l`.
    ///
    /// # Safety
    /// `l < lanes`, `p < inner`, and the strides address the operand's buffer.
    #[inline(always)]
    unsafe fn at(&self, l: usize, p: usize) -> f32 {
        // SAFETY: the caller's contract.
        unsafe { *self.ptr.add(l * self.lane_stride + p * self.inner_stride) }
    }
}

/// The power of two that brings `max_abs`, a lane's largest magnitude, into [16, 32): with
/// at most 16 products of two such values summed in f16, a run stays under 16,384. Zero and
/// non-finite maxima scale by 1, so infinities and NaN reach the product as they are.
pub(super) fn scale_for(max_abs: f32) -> f32 {
    if max_abs == 0.0 || !max_abs.is_finite() {
        return 1.0;
    }
    // floor(log2(max_abs)) for a normal max; a subnormal one takes the largest scale,
    // which still leaves it under 2.
    let exponent = (max_abs.to_bits() >> 23) as i32 - 127;
    let e = (4 - exponent).clamp(-126, 127);
    f32::from_bits(((e + 127) as u32) << 23)
}

/// Each lane's scale and its inverse (both exact powers of two), over the whole inner
/// dimension, so every slice a pack takes of a lane shares its scale.
///
/// # Safety
/// The lanes' strides address their buffer.
pub(super) unsafe fn lane_scales(lanes: &Lanes) -> (Vec<f32>, Vec<f32>) {
    // 64 lanes per task: one pass over the operand, in parallel.
    const CHUNK: usize = 64;
    let mut max = vec![0f32; lanes.lanes];
    let (ptr, Lanes { lane_stride, inner_stride, lanes: count, inner, .. }) = (SendPtr(lanes.ptr.cast_mut()), *lanes);
    max.par_chunks_mut(CHUNK).enumerate().for_each(|(c, max)| {
        let lanes = Lanes { ptr: ptr.get().cast_const(), lane_stride, inner_stride, lanes: count, inner };
        let first = c * CHUNK;
        if lanes.inner_stride == 1 || lanes.lane_stride != 1 {
            for (l, m) in max.iter_mut().enumerate() {
                // SAFETY: first + l < lanes, p < inner.
                *m = (0..lanes.inner).fold(0f32, |m, p| m.max(unsafe { lanes.at(first + l, p) }.abs()));
            }
        } else {
            // Lanes contiguous at each inner index: read along memory.
            for p in 0..lanes.inner {
                for (l, m) in max.iter_mut().enumerate() {
                    // SAFETY: first + l < lanes, p < inner.
                    *m = m.max(unsafe { lanes.at(first + l, p) }.abs());
                }
            }
        }
    });
    let scales: Vec<f32> = max.into_iter().map(scale_for).collect();
    let inverse = scales.iter().map(|s| 1.0 / s).collect();
    (scales, inverse)
}

/// An operand's scaled, rounded and unscaled values in f32, with the strides that address
/// lane `l`, inner index `p` at `values[l * lane_stride + p * inner_stride]`.
pub(super) struct Rounded {
    pub values: Vec<f32>,
    pub lane_stride: usize,
    pub inner_stride: usize,
}

/// Each element scaled by its lane's scale, rounded to f16 (nearest, ties to even) and
/// unscaled: the f16 operand as f32 values, laid out in the order the operand's memory
/// runs (lane by lane, or inner index by inner index when the lanes are contiguous), so
/// both the reads and the conversions run along memory.
///
/// # Safety
/// The lanes' strides address their buffer.
pub(super) unsafe fn rounded_copy(lanes: &Lanes) -> Rounded {
    use half::slice::HalfFloatSliceExt;
    // SAFETY: the caller's contract.
    let (scales, inverse) = unsafe { lane_scales(lanes) };
    let by_inner = lanes.lane_stride == 1 && lanes.inner_stride != 1;
    let (outer, run) = if by_inner { (lanes.inner, lanes.lanes) } else { (lanes.lanes, lanes.inner) };
    let mut values = vec![0f32; outer * run];
    if run > 0 {
        let ptr = SendPtr(lanes.ptr.cast_mut());
        let (lane_stride, inner_stride) = (lanes.lane_stride, lanes.inner_stride);
        let (scales, inverse) = (&scales, &inverse);
        values.par_chunks_mut(run).enumerate().for_each_init(
            || vec![half::f16::ZERO; run],
            |halves, (o, out)| {
                let at = |i: usize| {
                    let (l, p) = if by_inner { (i, o) } else { (o, i) };
                    // SAFETY: l < lanes and p < inner (the chunk's extent); the caller's
                    // strides address the buffer.
                    (unsafe { *ptr.get().add(l * lane_stride + p * inner_stride) }, l)
                };
                for (i, v) in out.iter_mut().enumerate() {
                    let (x, l) = at(i);
                    *v = x * scales[l];
                }
                halves.convert_from_f32_slice(out);
                halves.convert_to_f32_slice(out);
                if by_inner {
                    out.iter_mut().zip(inverse.iter()).for_each(|(v, s)| *v *= s);
                } else {
                    let s = inverse[o];
                    out.iter_mut().for_each(|v| *v *= s);
                }
            },
        );
    }
    let (lane_stride, inner_stride) = if by_inner { (1, lanes.lanes) } else { (lanes.inner, 1) };
    Rounded { values, lane_stride, inner_stride }
}

/// Packs lanes `first..first + width` (zeros past the operand's last), inner indices
/// `p0..p0 + kc`, scaled and rounded to f16, inner-index-major: index `p`'s `width` lanes
/// at `out[p * width..]`, zeros past `kc`.
///
/// # Safety
/// The lanes' strides address their buffer; `p0 + kc <= inner`; `kc <= kp`;
/// `out.len() == kp * width` and `out` is zeroed; `width` is a multiple of 8; `scales`
/// holds every lane's scale.
#[cfg(target_arch = "aarch64")]
pub(super) unsafe fn pack(
    lanes: &Lanes,
    first: usize,
    width: usize,
    (p0, kc): (usize, usize),
    scales: &[f32],
    out: &mut [u16],
) {
    use super::f16_kernels::round_8;
    debug_assert!(width.is_multiple_of(8) && out.len().is_multiple_of(width) && kc <= out.len() / width);
    let live = lanes.lanes.saturating_sub(first).min(width);
    let round = |x: f32, s: f32| half::f16::from_f32(x * s).to_bits();
    if lanes.lane_stride == 1 && live == width {
        // Each inner index's lanes are contiguous: round them 8 at a time in place.
        for p in 0..kc {
            for v in (0..width).step_by(8) {
                // SAFETY: lanes first + v..first + v + 8 at inner index p0 + p are inside
                // the operand; out and scales hold those 8 at the offsets used.
                unsafe {
                    let src = lanes.ptr.add((p0 + p) * lanes.inner_stride + first + v);
                    round_8(src, scales[first + v..].as_ptr(), out.as_mut_ptr().add(p * width + v));
                }
            }
        }
    } else if lanes.inner_stride == 1 {
        // Each lane is contiguous along the inner dimension: round 8 inner indices at a
        // time and scatter them down the pack.
        let mut run = [0u16; 8];
        for l in 0..live {
            let s = [scales[first + l]; 8];
            // SAFETY: lane first + l, inner indices p0..p0 + kc are inside the operand.
            let src = unsafe { lanes.ptr.add((first + l) * lanes.lane_stride + p0) };
            let mut p = 0;
            while p + 8 <= kc {
                // SAFETY: 8 in-range f32; run and s hold 8.
                unsafe { round_8(src.add(p), s.as_ptr(), run.as_mut_ptr()) };
                for (q, &h) in run.iter().enumerate() {
                    out[(p + q) * width + l] = h;
                }
                p += 8;
            }
            for p in p..kc {
                // SAFETY: p < kc.
                out[p * width + l] = round(unsafe { *src.add(p) }, s[0]);
            }
        }
    } else {
        for p in 0..kc {
            for l in 0..live {
                // SAFETY: lane first + l < lanes, inner index p0 + p < inner.
                out[p * width + l] = round(unsafe { lanes.at(first + l, p0 + p) }, scales[first + l]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lane_scale_brings_its_largest_magnitude_into_16_to_32_by_a_power_of_two() {
        for max in [1.0f32, 31.99, 32.0, 16.0, 1e-7, 3.5e-12, 6.0e4, 3.0e38, 1e-40, 0.7] {
            let s = scale_for(max);
            assert_eq!(s.to_bits() & 0x007f_ffff, 0, "{max}: scale {s} is not a power of two");
            let scaled = max * s;
            if max >= f32::MIN_POSITIVE {
                assert!((16.0..32.0).contains(&scaled), "{max} scaled by {s} to {scaled}");
            } else {
                // a subnormal max takes the largest scale and stays under 2
                assert!(scaled > 0.0 && scaled < 2.0, "{max} scaled by {s} to {scaled}");
            }
        }
        for max in [0.0, f32::INFINITY, f32::NAN] {
            assert_eq!(scale_for(max), 1.0);
        }
    }

    #[test]
    fn a_rounded_copy_scales_each_lane_on_its_own() {
        // Row 0 is a million times row 1: row 1 keeps f16's relative precision anyway.
        let a = [1.0e3f32, 333.3, -123.4, 3.333e-10, -1.111e-9, 2.0e-9];
        let op = Operand { ptr: a.as_ptr(), row_stride: 3, col_stride: 1, rows: 2, cols: 3 };
        // SAFETY: the strides address 2 x 3 inside a.
        let rounded = unsafe { rounded_copy(&Lanes::rows_of(&op)) };
        assert_eq!((rounded.lane_stride, rounded.inner_stride), (3, 1), "row by row, as the operand");
        let rounded = rounded.values;
        for (x, r) in a.iter().zip(&rounded) {
            let rel = ((r - x) / x).abs();
            assert!(rel <= 2f32.powi(-11) * 1.01, "{x} rounded to {r}");
        }
        // the columns of the same matrix as the right operand's lanes: [n, k] = [3, 2]
        // SAFETY: as above.
        let columns = unsafe { rounded_copy(&Lanes::columns_of(&Operand { rows: 2, cols: 3, ..op })) };
        // the columns are contiguous at each inner index (a row of the matrix): the copy
        // keeps the operand's row-major order
        assert_eq!((columns.lane_stride, columns.inner_stride), (1, 3));
        // lane 0 of the columns is (a[0], a[3]): a[3] is 3e12 times under the lane's scale
        assert_eq!(columns.values[0], rounded[0]);
        assert_eq!(columns.values[3], 0.0, "a[3] against a[0]'s scale");
        assert_eq!(columns.values[2], rounded[2]);
    }
}
