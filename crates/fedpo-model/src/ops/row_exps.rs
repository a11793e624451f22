//! A row's softmax numerators, `e_j = exp(l_j - shift)`, in one pass over memory.
//!
//! The head's logit rows (50,257 wide, 201 KB each, 103 MB for a 512-token step) leave the
//! matmul in DRAM. Taking each row's maximum first and exponentiating after reads every row
//! from memory twice.
//!
//! Here the shift is the maximum of the row's first [`FIRST`] logits, a lower bound on the
//! row's, and one pass exponentiates the row in place. The pass stops at the first vector
//! holding a logit more than [`SHIFT_SLACK`] above the shift; the shift is raised to the
//! maximum of what lies ahead, what is already written is rescaled, and the pass goes on
//! (rare for real logits; exact for any). So the shift is always one of the row's values:
//! every numerator is at most `e^SHIFT_SLACK` and their sum at least 1.
//!
//! The kernel is written for each x86 vector width with FMA (AVX-512's `roundscale` and
//! `scalef` do the exponent's range reduction and reassembly in one instruction each);
//! elsewhere it is [`exp_f32`]. Against maximum-then-exponentiate it saves most of the
//! second pass, and what is left is mostly the memory traffic of one.

use super::fast_math::{exp_f32, max_f32};
use super::multiversion::{self, Level};

/// Logits whose maximum is the first shift (and the look-ahead when it is raised): 8 KB,
/// in L1 when the pass comes back to them.
const FIRST: usize = 2048;
/// How far above the shift a logit may lie before the shift is raised: the numerators
/// stay below `e^16` (9e6), their f32 lane sums far from overflow.
const SHIFT_SLACK: f32 = 16.0;

/// `row[j] = exp(row[j] - shift)` in place for a shift that is one of the row's values,
/// returning `(lse, sum)`: the row's log-sum-exp and the sum of what it now holds, so that
/// `row / sum` is its softmax. A row whose maximum is not finite (NaN, `+inf`, or all
/// `-inf`) gets [`non_finite_exps`]'s answer.
pub(super) fn exps_in_place_f32(row: &mut [f32]) -> (f64, f64) {
    exps_in_place_f32_at(multiversion::level(), row)
}

/// [`exps_in_place_f32`] with the kernel for `level` (the tests compare them).
pub(super) fn exps_in_place_f32_at(level: Level, row: &mut [f32]) -> (f64, f64) {
    let mut shift = max_f32(&row[..row.len().min(FIRST)]);
    if shift == f32::NEG_INFINITY {
        // first logits of -inf only (or an empty row): the whole row's maximum decides
        shift = max_f32(row);
    }
    if !shift.is_finite() {
        return non_finite_exps(row);
    }
    let mut sum = 0f64;
    let mut done = 0;
    loop {
        let (part_sum, stop) = exp_until_at(level, &mut row[done..], shift, shift + SHIFT_SLACK);
        sum += part_sum;
        done += stop;
        if done == row.len() {
            break;
        }
        // row[done..] starts with a vector holding a logit above the slack, or +inf.
        let ahead = max_f32(&row[done..(done + FIRST).min(row.len())]);
        if !ahead.is_finite() {
            return non_finite_rest(row, done, sum);
        }
        // In f64: the shifts' difference exactly, the factor without underflow.
        let factor = (f64::from(shift) - f64::from(ahead)).exp();
        row[..done].iter_mut().for_each(|v| *v = (f64::from(*v) * factor) as f32);
        sum *= factor;
        shift = ahead;
    }
    if sum.is_nan() {
        // a NaN logit, exponentiated into the sum
        return non_finite_rest(row, row.len(), sum);
    }
    (f64::from(shift) + sum.ln(), sum)
}

/// [`non_finite_exps`]'s answer for a row whose `row[..done]` are numerators (summing to
/// `sum`) of finite or `-inf` logits, or of a NaN (then `sum` is NaN), and whose
/// `row[done..]` are logits with a NaN or `+inf` among them.
fn non_finite_rest(row: &mut [f32], done: usize, sum: f64) -> (f64, f64) {
    if sum.is_nan() {
        row.fill(f32::NAN);
        return (f64::NAN, 1.0);
    }
    // Finite logits before leave the log-sum-exp to the rest, and each e^(l - lse) is 0
    // (or NaN, for a NaN lse).
    let (lse, rest_sum) = non_finite_exps(&mut row[done..]);
    row[..done].fill(if lse.is_nan() { f32::NAN } else { 0.0 });
    (lse, rest_sum)
}

/// The answer for a row whose maximum is not finite (NaN, `+inf`, or all `-inf`): the
/// plain formulas give the right non-finite log-sum-exp, and the row becomes
/// `exp(row - lse)` (NaN where it has no meaning) with a sum of one.
pub(super) fn non_finite_exps<T: candle_core::WithDType>(row: &mut [T]) -> (f64, f64) {
    let lse = row.iter().map(|v| v.to_f64().exp()).sum::<f64>().ln();
    row.iter_mut().for_each(|v| *v = T::from_f64((v.to_f64() - lse).exp()));
    (lse, 1.0)
}

/// `xs[j] = exp(xs[j] - shift)` in place up to the first vector that holds a value above
/// `limit` (NaN is not above it, and is exponentiated into NaN). Returns the sum of what
/// was written and where it stopped: `xs.len()` if nothing was above `limit`.
fn exp_until_at(level: Level, xs: &mut [f32], shift: f32, limit: f32) -> (f64, usize) {
    #[cfg(target_arch = "x86_64")]
    match level.min(multiversion::level()) {
        // SAFETY: `level()` saw AVX-512 F.
        Level::Avx512 => return unsafe { x86::exp_until_avx512(xs, shift, limit) },
        // SAFETY: `level()` saw AVX2 and FMA.
        Level::Avx2 => return unsafe { x86::exp_until_avx2(xs, shift, limit) },
        Level::Baseline => {}
    }
    let _ = level;
    exp_until_portable(xs, shift, limit)
}

/// Independent accumulators of the portable kernel, so that the compiler vectorises it.
const LANES: usize = 16;
/// Values per f32 lane sum before it is added into f64: a whole row in f32 lanes drifted
/// by parts in a million on the 8-lane AVX2 kernel.
const SUM_BLOCK: usize = 1024;

fn exp_until_portable(xs: &mut [f32], shift: f32, limit: f32) -> (f64, usize) {
    let (mut total, mut sums) = (0f64, [0f32; LANES]);
    let whole = xs.len() / LANES * LANES;
    for (i, block) in xs[..whole].chunks_exact_mut(LANES).enumerate() {
        if (i * LANES).is_multiple_of(SUM_BLOCK) {
            total += lane_total(&sums);
            sums = [0f32; LANES];
        }
        if block.iter().fold(false, |over, &x| over | (x > limit)) {
            return (total + lane_total(&sums), i * LANES);
        }
        // indexed, not zipped: the zipped form stayed scalar
        for k in 0..LANES {
            block[k] = exp_f32(block[k] - shift);
            sums[k] += block[k];
        }
    }
    let (tail, stop) = exp_until_scalar(&mut xs[whole..], shift, limit);
    (total + lane_total(&sums) + tail, whole + stop)
}

fn lane_total(sums: &[f32]) -> f64 {
    sums.iter().map(|&v| f64::from(v)).sum()
}

/// The kernels' tail, element by element.
fn exp_until_scalar(xs: &mut [f32], shift: f32, limit: f32) -> (f64, usize) {
    let mut sum = 0f64;
    for (j, x) in xs.iter_mut().enumerate() {
        if *x > limit {
            return (sum, j);
        }
        *x = exp_f32(*x - shift);
        sum += f64::from(*x);
    }
    (sum, xs.len())
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! `e^d = 2^k e^r` with `k = round(d / ln 2)` and `r = d - k ln 2` (Cody-Waite, two FMAs),
    //! `e^r` by its Taylor series to degree 7 in Horner form, as [`super::exp_f32`] but with
    //! every multiply-add fused. Inputs below `EXP_MIN` give 0, NaN stays NaN, and the top
    //! of the range overflows to `inf` as [`super::exp_f32`] does.

    use std::arch::x86_64::*;

    use super::{exp_until_scalar, lane_total, SUM_BLOCK};
    use crate::ops::fast_math::{EXP_MAX, EXP_MIN, LN2_HI, LN2_LO, LOG2_E};

    /// Taylor coefficients of `e^r`, highest degree first.
    const TAYLOR: [f32; 8] = [1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0];

    /// # Safety
    /// The CPU must have AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp_until_avx512(xs: &mut [f32], shift: f32, limit: f32) -> (f64, usize) {
        const W: usize = 16;
        let whole = xs.len() / W * W;
        let (shift_v, limit_v) = (_mm512_set1_ps(shift), _mm512_set1_ps(limit));
        let (log2e, min) = (_mm512_set1_ps(LOG2_E), _mm512_set1_ps(EXP_MIN));
        let (ln2_hi, ln2_lo) = (_mm512_set1_ps(-LN2_HI), _mm512_set1_ps(-LN2_LO));
        let taylor = TAYLOR.map(|c| _mm512_set1_ps(c));
        let lanes_total = |sums: __m512| {
            let mut lanes = [0f32; W];
            // SAFETY: the array holds W floats.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), sums) };
            lane_total(&lanes)
        };
        let (mut total, mut sums) = (0f64, _mm512_setzero_ps());
        for i in (0..whole).step_by(W) {
            if i % SUM_BLOCK == 0 {
                total += lanes_total(sums);
                sums = _mm512_setzero_ps();
            }
            // SAFETY: i + W <= whole <= xs.len().
            let x = unsafe { _mm512_loadu_ps(xs.as_ptr().add(i)) };
            if _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, limit_v) != 0 {
                return (total + lanes_total(sums), i);
            }
            let d = _mm512_sub_ps(x, shift_v);
            // "not less than", true for NaN: NaN flows through, below-range lanes are zeroed
            let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(d, min);
            let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(d, log2e));
            let r = _mm512_fmadd_ps(k, ln2_lo, _mm512_fmadd_ps(k, ln2_hi, d));
            let p = taylor[1..].iter().fold(taylor[0], |p, &c| _mm512_fmadd_ps(p, r, c));
            let e = _mm512_maskz_scalef_ps(keep, p, k);
            // SAFETY: as for the load.
            unsafe { _mm512_storeu_ps(xs.as_mut_ptr().add(i), e) };
            sums = _mm512_add_ps(sums, e);
        }
        let (tail, stop) = exp_until_scalar(&mut xs[whole..], shift, limit);
        (total + lanes_total(sums) + tail, whole + stop)
    }

    /// # Safety
    /// The CPU must have AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_until_avx2(xs: &mut [f32], shift: f32, limit: f32) -> (f64, usize) {
        const W: usize = 8;
        let whole = xs.len() / W * W;
        let (shift_v, limit_v, log2e) = (_mm256_set1_ps(shift), _mm256_set1_ps(limit), _mm256_set1_ps(LOG2_E));
        let (min, max) = (_mm256_set1_ps(EXP_MIN), _mm256_set1_ps(EXP_MAX));
        let (ln2_hi, ln2_lo) = (_mm256_set1_ps(-LN2_HI), _mm256_set1_ps(-LN2_LO));
        let taylor = TAYLOR.map(|c| _mm256_set1_ps(c));
        let bias = _mm256_set1_epi32(127);
        let lanes_total = |sums: __m256| {
            let mut lanes = [0f32; W];
            // SAFETY: the array holds W floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sums) };
            lane_total(&lanes)
        };
        let (mut total, mut sums) = (0f64, _mm256_setzero_ps());
        for i in (0..whole).step_by(W) {
            if i % SUM_BLOCK == 0 {
                total += lanes_total(sums);
                sums = _mm256_setzero_ps();
            }
            // SAFETY: i + W <= whole <= xs.len().
            let x = unsafe { _mm256_loadu_ps(xs.as_ptr().add(i)) };
            if _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_GT_OQ>(x, limit_v)) != 0 {
                return (total + lanes_total(sums), i);
            }
            let d = _mm256_sub_ps(x, shift_v);
            let keep = _mm256_cmp_ps::<_CMP_NLT_UQ>(d, min);
            // max_ps and min_ps return their second operand when either is NaN: NaN stays
            let clamped = _mm256_min_ps(max, _mm256_max_ps(min, d));
            let k = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(clamped, log2e));
            let r = _mm256_fmadd_ps(k, ln2_lo, _mm256_fmadd_ps(k, ln2_hi, clamped));
            let p = taylor[1..].iter().fold(taylor[0], |p, &c| _mm256_fmadd_ps(p, r, c));
            // 2^k from the exponent field: k in [-126, 128] after the clamp, 128 giving the
            // bits of +inf (NaN gives garbage bits, and p is NaN already)
            let scale = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(k), bias)));
            let e = _mm256_and_ps(_mm256_mul_ps(p, scale), keep);
            // SAFETY: as for the load.
            unsafe { _mm256_storeu_ps(xs.as_mut_ptr().add(i), e) };
            sums = _mm256_add_ps(sums, e);
        }
        let (tail, stop) = exp_until_scalar(&mut xs[whole..], shift, limit);
        (total + lanes_total(sums) + tail, whole + stop)
    }
}

#[cfg(test)]
mod tests {
    use super::super::multiversion::supported_levels;
    use super::*;

    /// What the numerators and their sum stand for, in f64 with libm: each row's softmax
    /// and log-sum-exp.
    fn exact(row: &[f32]) -> (Vec<f64>, f64) {
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
        let sum: f64 = row.iter().map(|&v| (f64::from(v) - max).exp()).sum();
        let softmax = row.iter().map(|&v| (f64::from(v) - max).exp() / sum).collect();
        (softmax, max + sum.ln())
    }

    /// Runs every kernel this CPU has on `row` and checks the softmax and log-sum-exp.
    fn assert_matches_exact(row: &[f32], what: &str) {
        let (softmax, lse) = exact(row);
        for level in supported_levels() {
            let mut ours = row.to_vec();
            let (our_lse, sum) = exps_in_place_f32_at(level, &mut ours);
            assert!((our_lse - lse).abs() < 1e-5 * lse.abs().max(1.0), "{what} {level:?}: lse {our_lse} vs {lse}");
            assert!(sum >= 1.0, "{what} {level:?}: the shift is one of the row's values, so the sum is at least 1");
            let worst = ours.iter().zip(&softmax).map(|(&e, &p)| (f64::from(e) / sum - p).abs()).fold(0.0, f64::max);
            let top = softmax.iter().copied().fold(0.0, f64::max);
            assert!(worst < 2e-6 * top, "{what} {level:?}: softmax off by {worst:e} (largest {top})");
        }
    }

    fn logits(len: usize, seed: usize, spread: f32) -> Vec<f32> {
        (0..len).map(|i| (((i * 7919 + seed * 104_729) % 4001) as f32 / 4000.0 - 0.5) * spread).collect()
    }

    #[test]
    fn numerators_give_the_softmax_and_log_sum_exp_of_rows_of_any_length() {
        for len in [1, 7, 16, 17, FIRST - 1, FIRST, FIRST + 5, 3 * FIRST + 9, 50_257] {
            assert_matches_exact(&logits(len, len, 30.0), &format!("length {len}"));
        }
    }

    #[test]
    fn a_maximum_far_above_the_first_chunk_raises_the_shift_and_rescales_what_is_written() {
        // the first chunk's maximum is about 5; later chunks hold 30 (above the slack) and
        // then 400 (where exp of the distance would overflow f32)
        let mut row = logits(5 * FIRST + 3, 1, 10.0);
        row[2 * FIRST + 11] = 30.0;
        assert_matches_exact(&row, "one raise");
        row[4 * FIRST + 100] = 400.0;
        row[5 * FIRST + 1] = 399.0;
        assert_matches_exact(&row, "two raises, one past f32's exp range");
    }

    #[test]
    fn kernels_track_exp_to_three_tenths_of_a_micro_across_its_range() {
        let xs: Vec<f32> = (0..=200_000).map(|i| -87.0 + 175.3 * i as f32 / 200_000.0).collect();
        for level in supported_levels() {
            let mut out = xs.clone();
            let (_, stop) = exp_until_at(level, &mut out, 0.0, f32::INFINITY);
            assert_eq!(stop, xs.len(), "{level:?}");
            let mut worst = 0f64;
            for (&x, &e) in xs.iter().zip(&out) {
                let exact = f64::from(x).exp();
                worst = worst.max(((f64::from(e) - exact) / exact).abs());
            }
            assert!(worst < 3e-7, "{level:?}: worst relative error {worst:e}");
            // the lane sums, over values that cannot overflow them
            let mut below_zero = xs[..100_000].to_vec();
            let (sum, _) = exp_until_at(level, &mut below_zero, 0.0, f32::INFINITY);
            let exact_sum: f64 = below_zero.iter().map(|&e| f64::from(e)).sum();
            assert!(((sum - exact_sum) / exact_sum).abs() < 1e-5, "{level:?}: lane sums {sum} vs {exact_sum}");
        }
    }

    #[test]
    fn kernels_stop_at_the_vector_holding_a_value_above_the_limit_and_leave_the_rest() {
        for level in supported_levels() {
            for at in [0, 5, 16, 37, 99] {
                let mut xs = vec![-1.0f32; 100];
                xs[at] = 3.0;
                let (sum, stop) = exp_until_at(level, &mut xs, 0.0, 2.0);
                assert!(stop <= at && at - stop < 16, "{level:?}: stopped at {stop} for a value at {at}");
                assert!(xs[..stop].iter().all(|&e| (e - (-1f32).exp()).abs() < 1e-7), "{level:?}");
                assert!(xs[stop..].iter().enumerate().all(|(j, &v)| v == if stop + j == at { 3.0 } else { -1.0 }));
                assert!((sum - stop as f64 * (-1f64).exp()).abs() < 1e-5, "{level:?}");
            }
            let mut with_inf = vec![0f32; 40];
            with_inf[33] = f32::INFINITY;
            assert!(exp_until_at(level, &mut with_inf, 0.0, 16.0).1 <= 33, "{level:?}: +inf is above any limit");
        }
    }

    #[test]
    fn kernels_give_zero_below_the_range_inf_above_it_and_keep_nan() {
        let xs = [-88.0, f32::NEG_INFINITY, -1e30, 0.0, 89.0, 1e30, f32::INFINITY, f32::NAN];
        for level in supported_levels() {
            let mut low = xs[..4].to_vec();
            let (sum, _) = exp_until_at(level, &mut low, 0.0, f32::INFINITY);
            assert_eq!((&low[..], sum), (&[0.0, 0.0, 0.0, 1.0][..], 1.0), "{level:?}");
            // whole vectors as well as the scalar tail
            let wide: Vec<f32> = xs.iter().cycle().take(40).copied().collect();
            let mut out = wide.clone();
            let (sum, stop) = exp_until_at(level, &mut out, 0.0, f32::MAX);
            assert!(stop <= 6 && 6 - stop < 16, "{level:?}: +inf is above f32::MAX, stopped at {stop}");
            let mut out = wide.iter().map(|&x| if x == f32::INFINITY { 0.0 } else { x }).collect::<Vec<_>>();
            let (sum_all, stop_all) = exp_until_at(level, &mut out, 0.0, f32::INFINITY);
            assert_eq!(stop_all, 40, "{level:?}");
            assert!(sum_all.is_nan() && sum.is_finite(), "{level:?}: NaN reaches the sum, and only it");
            for (&x, &e) in wide.iter().zip(&out) {
                match x {
                    x if x.is_nan() => assert!(e.is_nan(), "{level:?}"),
                    x if x < -87.5 => assert_eq!(e, 0.0, "{level:?} at {x}"),
                    f32::INFINITY => assert_eq!(e, 1.0, "{level:?}"),
                    x if x > 88.8 => assert!(!e.is_finite() || e.is_nan(), "{level:?} at {x}: {e}"),
                    _ => assert_eq!(e, 1.0, "{level:?}"),
                }
            }
        }
    }

    #[test]
    fn non_finite_rows_match_the_plain_formulas_wherever_the_value_sits() {
        for level in supported_levels() {
            for (at, value) in
                [(3, f32::NAN), (FIRST + 3, f32::NAN), (3, f32::INFINITY), (2 * FIRST + 1, f32::INFINITY)]
            {
                let mut row = logits(3 * FIRST, 2, 10.0);
                row[at] = value;
                row[FIRST / 2] = f32::NEG_INFINITY;
                let mut expected = row.clone();
                let expected_result = non_finite_exps(&mut expected);
                let result = exps_in_place_f32_at(level, &mut row);
                let same = |a: f64, b: f64| a == b || (a.is_nan() && b.is_nan());
                assert!(
                    same(result.0, expected_result.0) && result.1 == expected_result.1,
                    "{level:?} {value} at {at}"
                );
                for (j, (a, b)) in row.iter().zip(&expected).enumerate() {
                    assert!(same(f64::from(*a), f64::from(*b)), "{level:?} {value} at {at}: entry {j} is {a}, not {b}");
                }
            }
        }
    }

    #[test]
    fn leading_minus_infinities_and_all_minus_infinity_rows() {
        let mut row = logits(2 * FIRST + 50, 3, 8.0);
        row[..FIRST + 7].fill(f32::NEG_INFINITY);
        assert_matches_exact(&row, "a masked first chunk");
        for level in supported_levels() {
            let mut masked = vec![f32::NEG_INFINITY; FIRST + 1];
            let (lse, sum) = exps_in_place_f32_at(level, &mut masked);
            assert_eq!((lse, sum), (f64::NEG_INFINITY, 1.0), "{level:?}");
            assert!(masked.iter().all(|v| v.is_nan()), "{level:?}: softmax of nothing has no meaning");
            let (lse, _) = exps_in_place_f32_at(level, &mut []);
            assert_eq!(lse, f64::NEG_INFINITY, "{level:?}: an empty row");
        }
    }
}
