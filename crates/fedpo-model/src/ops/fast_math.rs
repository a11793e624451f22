//! Branch-free f32 `exp` and lane reductions for the fused kernels.
//!
//! libm's scalar calls cannot be vectorised, and the GELU of a DistilGPT-2 step alone makes
//! about 40 million of them (forward and backward). [`exp_f32`] is straight-line arithmetic
//! and selects, so the compiler vectorises a loop over a slice; it stays within a few ulps of
//! libm (tested below against f64), below the f32 rounding of the matmuls around it.

use super::multiversion::multiversion;

pub(super) const LOG2_E: f32 = std::f32::consts::LOG2_E;
// ln 2 split in a part exact in f32 and the rest (Cody-Waite), so `x - n ln 2` loses nothing.
pub(super) const LN2_HI: f32 = 0.693_145_75;
pub(super) const LN2_LO: f32 = 1.428_606_8e-6;
/// Adding then subtracting 1.5 * 2^23 rounds an f32 of magnitude below 2^22 to the nearest
/// integer without a (non-vectorisable on baseline x86-64) `round` call.
const ROUND_MAGIC: f32 = 12_582_912.0;
/// Inputs are clamped to this range first. Above it `exp` overflows f32; below it the
/// result would be subnormal, which is flushed to zero.
pub(super) const EXP_MAX: f32 = 88.722_84;
pub(super) const EXP_MIN: f32 = -87.336_55;

/// `e^x` in f32: relative error below 3e-7 up to x = 88.3, `inf` from about 88.38 (where
/// the exponent field overflows; f32's own limit is 88.72), `0` below -87.33, NaN kept.
///
/// Written for the loop vectoriser: one clamp, one select, no branches and no fix-up for
/// the top exponent (a version with one ran scalar).
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    let clamped = x.clamp(EXP_MIN, EXP_MAX);
    let shifted = clamped * LOG2_E + ROUND_MAGIC;
    let n = shifted - ROUND_MAGIC;
    let r = clamped - n * LN2_HI - n * LN2_LO;
    // Taylor series of e^r to degree 7 on |r| <= ln2 / 2: truncation error below 1e-8.
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // 2^n in the exponent field: n in [-126, 128] after the clamp, and 128 gives the bits
    // of +inf. `shifted` is 1.5 * 2^23 + n, whose low mantissa bits are n itself, so the
    // exponent comes from integer adds and a shift. (`n as i32` would be shorter, but its
    // saturating NaN and overflow checks keep every loop around this function scalar.)
    // A NaN gives garbage bits here and stays NaN through r.
    let scale = f32::from_bits(shifted.to_bits().wrapping_sub(ROUND_MAGIC.to_bits()).wrapping_add(127) << 23);
    // Zero below the range through the factor, not the result: a select on the result
    // keeps the lane sums below scalar.
    p * if x < EXP_MIN { 0.0 } else { scale }
}

/// Independent accumulators in the lane loops: one AVX-512 register of f32, and the order
/// the sums are taken in, whichever version runs.
const LANES: usize = 16;

multiversion! {
    /// `sum(e^(x - shift))` over a slice, in sixteen lanes the compiler vectorises, added up
    /// in f64 at the end.
    pub(crate) fn sum_exp_shifted / sum_exp_shifted_at(xs: &[f32], shift: f32) -> f64 {
        let mut lanes = [0f32; LANES];
        let mut chunks = xs.chunks_exact(LANES);
        for chunk in &mut chunks {
            // indexed, not zipped: the zipped form stayed scalar
            for k in 0..LANES {
                lanes[k] += exp_f32(chunk[k] - shift);
            }
        }
        let tail: f64 = chunks.remainder().iter().map(|&v| exp_f32(v - shift) as f64).sum();
        lanes.iter().map(|&v| v as f64).sum::<f64>() + tail
    }
}

multiversion! {
    /// The maximum of a slice (NaN if any element is NaN), in sixteen independent lanes
    /// that the compiler vectorises.
    pub(crate) fn max_f32 / max_f32_at(xs: &[f32]) -> f32 {
        let mut lanes = [f32::NEG_INFINITY; LANES];
        let mut chunks = xs.chunks_exact(LANES);
        let mut nan = false;
        for chunk in &mut chunks {
            for (lane, &v) in lanes.iter_mut().zip(chunk) {
                nan |= v.is_nan();
                *lane = if v > *lane { v } else { *lane };
            }
        }
        for &v in chunks.remainder() {
            nan |= v.is_nan();
            lanes[0] = if v > lanes[0] { v } else { lanes[0] };
        }
        if nan {
            return f32::NAN;
        }
        lanes.into_iter().fold(f32::NEG_INFINITY, f32::max)
    }
}

multiversion! {
    /// `row[j] = e^(row[j] - shift)` in place, returning their sum (lane sums added up in
    /// f64): a row turned into its softmax's numerators while it is still in cache.
    pub(crate) fn exp_shifted_in_place / exp_shifted_in_place_at(row: &mut [f32], shift: f32) -> f64 {
        let mut lanes = [0f32; LANES];
        let mut chunks = row.chunks_exact_mut(LANES);
        for chunk in &mut chunks {
            for k in 0..LANES {
                chunk[k] = exp_f32(chunk[k] - shift);
                lanes[k] += chunk[k];
            }
        }
        let mut tail = 0f64;
        for v in chunks.into_remainder() {
            *v = exp_f32(*v - shift);
            tail += *v as f64;
        }
        lanes.iter().map(|&v| v as f64).sum::<f64>() + tail
    }
}

multiversion! {
    /// `row[j] = -g * e^(row[j] - lse)`, in place: a log-softmax row turned into its
    /// gradient, before the target's `+g`.
    pub(crate) fn scaled_softmax_f32 / scaled_softmax_f32_at(row: &mut [f32], lse: f32, g: f32) {
        for v in row.iter_mut() {
            *v = -g * exp_f32(*v - lse);
        }
    }
}

multiversion! {
    /// `row = softmax(row)` in place: the maximum, the shifted exponentials written back
    /// ([`exp_shifted_in_place`]), then one scaling pass.
    pub(crate) fn softmax_in_place_f32 / softmax_in_place_f32_at(row: &mut [f32]) {
        let max = max_f32(row);
        let sum = exp_shifted_in_place(row, max);
        let inv = (1.0 / sum) as f32;
        row.iter_mut().for_each(|v| *v *= inv);
    }
}

multiversion! {
    /// `grad = p * (grad - sum(p * grad))` in place: a softmax row's input gradient from
    /// its output `p` and the output's gradient, the dot in sixteen lanes added up in f64.
    pub(crate) fn softmax_backward_f32 / softmax_backward_f32_at(p: &[f32], grad: &mut [f32]) {
        let mut lanes = [0f32; LANES];
        let (mut ps, mut gs) = (p.chunks_exact(LANES), grad.chunks_exact(LANES));
        for (p, g) in (&mut ps).zip(&mut gs) {
            for k in 0..LANES {
                lanes[k] += p[k] * g[k];
            }
        }
        let tail: f64 = ps.remainder().iter().zip(gs.remainder()).map(|(&p, &g)| p as f64 * g as f64).sum();
        let dot = (lanes.iter().map(|&v| v as f64).sum::<f64>() + tail) as f32;
        for (g, &p) in grad.iter_mut().zip(p) {
            *g = p * (*g - dot);
        }
    }
}

/// `e^x` at the type's speed: [`exp_f32`] for f32, libm for f64 (the tests' reference).
pub(crate) trait FastExp: candle_core::WithDType {
    fn fast_exp(self) -> Self;

    /// `row = softmax(row)` in place.
    fn softmax_in_place(row: &mut [Self]) {
        let max = row.iter().fold(Self::from_f64(f64::NEG_INFINITY), |m, &v| if v > m { v } else { m });
        let mut sum = 0f64;
        for v in row.iter_mut() {
            *v = (*v - max).fast_exp();
            sum += v.to_f64();
        }
        let inv = Self::from_f64(1.0 / sum);
        row.iter_mut().for_each(|v| *v *= inv);
    }

    /// `grad = p * (grad - sum(p * grad))` in place, for a softmax row `p`.
    fn softmax_backward(p: &[Self], grad: &mut [Self]) {
        let dot: f64 = p.iter().zip(grad.iter()).map(|(p, g)| p.to_f64() * g.to_f64()).sum();
        let dot = Self::from_f64(dot);
        for (g, &p) in grad.iter_mut().zip(p) {
            *g = p * (*g - dot);
        }
    }
}

impl FastExp for f32 {
    #[inline(always)]
    fn fast_exp(self) -> f32 {
        exp_f32(self)
    }

    fn softmax_in_place(row: &mut [f32]) {
        softmax_in_place_f32(row)
    }

    fn softmax_backward(p: &[f32], grad: &mut [f32]) {
        softmax_backward_f32(p, grad)
    }
}

impl FastExp for f64 {
    #[inline(always)]
    fn fast_exp(self) -> f64 {
        self.exp()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid(lo: f32, hi: f32, n: usize) -> impl Iterator<Item = f32> {
        (0..=n).map(move |i| lo + (hi - lo) * i as f32 / n as f32)
    }

    #[test]
    fn exp_f32_is_within_three_tenths_of_a_micro_relative_across_its_range() {
        let mut worst = 0f64;
        for x in grid(-87.0, 88.3, 400_000).chain([0.0, -0.0, 1e-30, -1e-30, 88.3, -87.33]) {
            let exact = (x as f64).exp();
            let rel = ((exp_f32(x) as f64 - exact) / exact).abs();
            worst = worst.max(rel);
        }
        assert!(worst < 3e-7, "worst relative error {worst:e}");
    }

    #[test]
    fn exp_f32_saturates_to_inf_and_zero_and_keeps_nan() {
        assert_eq!(exp_f32(89.0), f32::INFINITY);
        assert_eq!(exp_f32(88.5), f32::INFINITY);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_f32(-88.0), 0.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert!(exp_f32(f32::NAN).is_nan());
        assert_eq!(exp_f32(0.0), 1.0);
    }

    #[test]
    fn softmax_backward_matches_the_f64_formula_at_every_vector_width() {
        // a row of 203 (twelve lanes' blocks and a tail) that sums to one
        let raw: Vec<f64> = (0..203).map(|i| 1.0 + ((i * 37 % 101) as f64) / 50.0).collect();
        let total: f64 = raw.iter().sum();
        let p: Vec<f32> = raw.iter().map(|v| (v / total) as f32).collect();
        let grad: Vec<f32> = (0..203).map(|i| ((i * 53 % 89) as f32 - 44.0) / 10.0).collect();
        let dot: f64 = p.iter().zip(&grad).map(|(&p, &g)| p as f64 * g as f64).sum();
        let exact: Vec<f64> = p.iter().zip(&grad).map(|(&p, &g)| p as f64 * (g as f64 - dot)).collect();
        for level in crate::ops::multiversion::supported_levels() {
            let mut ours = grad.clone();
            softmax_backward_f32_at(level, &p, &mut ours);
            let err = ours.iter().zip(&exact).map(|(&o, &e)| (o as f64 - e).abs()).fold(0f64, f64::max);
            assert!(err < 1e-7, "{level:?}: off by {err}");
        }
    }

    #[test]
    fn lane_sum_of_shifted_exponentials_matches_a_sequential_f64_one() {
        let xs: Vec<f32> = (0..50_257).map(|i| ((i * 7919 % 4001) as f32 - 3000.0) / 100.0).collect();
        let exact: f64 = xs.iter().map(|&v| (v as f64 - 10.0).exp()).sum();
        let ours = sum_exp_shifted(&xs, 10.0);
        // f32 lanes of ~6,300 terms each: a few parts in a million, as any f32 sum
        assert!(((ours - exact) / exact).abs() < 1e-5, "{ours} vs {exact}");
    }

    #[test]
    fn every_vector_width_gives_the_baseline_bits() {
        use crate::ops::multiversion::{supported_levels, Level};
        // an odd length, so the tails run too, with the special values mixed in
        let mut xs: Vec<f32> = (0..50_261).map(|i| ((i * 7919 % 4001) as f32 - 3000.0) / 37.0).collect();
        xs[17] = f32::NEG_INFINITY;
        xs[4000] = -200.0;
        xs[4001] = 95.0;
        let base_sum = sum_exp_shifted_at(Level::Baseline, &xs, 10.0);
        let mut base_exps = xs.clone();
        let base_exps_sum = exp_shifted_in_place_at(Level::Baseline, &mut base_exps, 10.0);
        assert_eq!(base_exps_sum.to_bits(), base_sum.to_bits(), "stored and summed-only exponentials agree");
        let base_max = max_f32_at(Level::Baseline, &xs);
        let mut base_rows = xs.clone();
        scaled_softmax_f32_at(Level::Baseline, &mut base_rows, 12.5, 0.75);
        let mut base_softmax = xs[..300].to_vec();
        base_softmax[17] = -1.0;
        let softmax_input = base_softmax.clone();
        softmax_in_place_f32_at(Level::Baseline, &mut base_softmax);
        let total: f64 = base_softmax.iter().map(|&p| p as f64).sum();
        assert!((total - 1.0).abs() < 1e-5, "softmax sums to {total}");
        for level in supported_levels() {
            let mut probs = softmax_input.clone();
            softmax_in_place_f32_at(level, &mut probs);
            assert!(probs.iter().zip(&base_softmax).all(|(a, b)| a.to_bits() == b.to_bits()), "{level:?} softmax");
            assert_eq!(sum_exp_shifted_at(level, &xs, 10.0).to_bits(), base_sum.to_bits(), "{level:?}");
            let mut exps = xs.clone();
            assert_eq!(exp_shifted_in_place_at(level, &mut exps, 10.0).to_bits(), base_sum.to_bits(), "{level:?}");
            assert!(exps.iter().zip(&base_exps).all(|(a, b)| a.to_bits() == b.to_bits()), "{level:?} exponentials");
            assert_eq!(max_f32_at(level, &xs).to_bits(), base_max.to_bits(), "{level:?}");
            let mut rows = xs.clone();
            scaled_softmax_f32_at(level, &mut rows, 12.5, 0.75);
            let same = rows.iter().zip(&base_rows).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{level:?} softmax row differs");
        }
    }

    #[test]
    fn lane_max_matches_a_sequential_one_and_sees_nan() {
        let xs: Vec<f32> = (0..1003).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.25).collect();
        assert_eq!(max_f32(&xs), xs.iter().copied().fold(f32::NEG_INFINITY, f32::max));
        let mut with_nan = xs.clone();
        with_nan[1001] = f32::NAN;
        assert!(max_f32(&with_nan).is_nan());
        assert_eq!(max_f32(&[]), f32::NEG_INFINITY);
    }
}
