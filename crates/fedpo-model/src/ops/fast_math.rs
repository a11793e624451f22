//! Branch-free f32 `exp` and lane reductions for the fused kernels.
//!
//! libm's scalar calls cannot be vectorised, and the GELU of a DistilGPT-2 step alone makes
//! about 40 million of them (forward and backward). [`exp_f32`] is straight-line arithmetic
//! and selects, so the compiler vectorises a loop over a slice; it stays within a few ulps of
//! libm (tested below against f64), below the f32 rounding of the matmuls around it.

const LOG2_E: f32 = std::f32::consts::LOG2_E;
// ln 2 split in a part exact in f32 and the rest (Cody-Waite), so `x - n ln 2` loses nothing.
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// Adding then subtracting 1.5 * 2^23 rounds an f32 of magnitude below 2^22 to the nearest
/// integer without a (non-vectorisable on baseline x86-64) `round` call.
const ROUND_MAGIC: f32 = 12_582_912.0;
/// Inputs are clamped to this range first. Above it `exp` overflows f32; below it the
/// result would be subnormal, which is flushed to zero.
const EXP_MAX: f32 = 88.722_84;
const EXP_MIN: f32 = -87.336_55;

/// `e^x` in f32: relative error below 3e-7 up to x = 88.3, `inf` from about 88.38 (where
/// the exponent field overflows; f32's own limit is 88.72), `0` below -87.33, NaN kept.
///
/// Written for the loop vectoriser: one clamp, one select, no branches and no fix-up for
/// the top exponent (a version with one ran scalar).
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    let clamped = x.clamp(EXP_MIN, EXP_MAX);
    let n = (clamped * LOG2_E + ROUND_MAGIC) - ROUND_MAGIC;
    let r = clamped - n * LN2_HI - n * LN2_LO;
    // Taylor series of e^r to degree 7 on |r| <= ln2 / 2: truncation error below 1e-8.
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // 2^n in the exponent field: n in [-126, 128] after the clamp, and 128 gives the bits
    // of +inf. NaN converts to n = 0 and stays NaN through r.
    let scale = f32::from_bits((((n as i32) + 127) as u32) << 23);
    if x < EXP_MIN {
        0.0
    } else {
        p * scale
    }
}

/// `sum(e^(x - shift))` over a slice, in eight lanes the compiler vectorises, added up in
/// f64 at the end.
#[inline]
pub(crate) fn sum_exp_shifted(xs: &[f32], shift: f32) -> f64 {
    let mut lanes = [0f32; 8];
    let mut chunks = xs.chunks_exact(8);
    for chunk in &mut chunks {
        // indexed, not zipped: the zipped form stayed scalar
        for k in 0..8 {
            lanes[k] += exp_f32(chunk[k] - shift);
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&v| exp_f32(v - shift) as f64).sum();
    lanes.iter().map(|&v| v as f64).sum::<f64>() + tail
}

/// The maximum of a slice (NaN if any element is NaN), in eight independent lanes that
/// the compiler vectorises.
#[inline]
pub(crate) fn max_f32(xs: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let mut chunks = xs.chunks_exact(8);
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

/// `e^x` at the type's speed: [`exp_f32`] for f32, libm for f64 (the tests' reference).
pub(crate) trait FastExp: candle_core::WithDType {
    fn fast_exp(self) -> Self;
}

impl FastExp for f32 {
    #[inline(always)]
    fn fast_exp(self) -> f32 {
        exp_f32(self)
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
    fn lane_sum_of_shifted_exponentials_matches_a_sequential_f64_one() {
        let xs: Vec<f32> = (0..50_257).map(|i| ((i * 7919 % 4001) as f32 - 3000.0) / 100.0).collect();
        let exact: f64 = xs.iter().map(|&v| (v as f64 - 10.0).exp()).sum();
        let ours = sum_exp_shifted(&xs, 10.0);
        // f32 lanes of ~6,300 terms each: a few parts in a million, as any f32 sum
        assert!(((ours - exact) / exact).abs() < 1e-5, "{ours} vs {exact}");
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
