//! A row's softmax numerators, `e_j = exp(l_j - shift)`, in one pass over memory.
//!
//! The head's logit rows (50,257 wide, 201 KB each, 103 MB for a 512-token step) leave the
//! matmul in DRAM. Taking each row's maximum first and exponentiating after reads every row
//! from memory twice.
//!
//! Here the shift is the maximum of the row's first chunk, a lower bound on the row's. Each
//! chunk (8 KB, in L1) is read once: its exponentials go to a scratch chunk while its
//! maximum is tracked, then over the logits. A chunk that holds a logit more than
//! [`SHIFT_SLACK`] above the shift raises it to that chunk's maximum, and what is already
//! written is rescaled (rare for real logits; exact for any). So the shift is always one
//! of the row's values: every numerator is at most `e^SHIFT_SLACK` and their sum at least 1.
//!
//! The per-chunk kernel is written for each x86 vector width with FMA (AVX-512's
//! `roundscale` and `scalef` do the exponent's range reduction and reassembly in one
//! instruction each); elsewhere it is [`exp_f32`]. On an AVX-512 host, the 512 rows of
//! the tiny step took 3.6 ms this way against 5.9 ms for maximum-then-exponentiate, and
//! 1.6 ms with every row already in cache: what is left is mostly memory.

use super::fast_math::{exp_f32, max_f32};
use super::multiversion::{self, Level};

/// Logits per chunk: 8 KB of f32, with its scratch copy well inside L1.
const CHUNK: usize = 2048;
/// How far above the shift a chunk's maximum may lie before the shift is raised: the
/// numerators stay below `e^16` (9e6), their f32 lane sums far from overflow.
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
    let mut shift = max_f32(&row[..row.len().min(CHUNK)]);
    if shift == f32::NEG_INFINITY {
        // a first chunk of -inf only (or an empty row): the whole row's maximum decides
        shift = max_f32(row);
    }
    if !shift.is_finite() {
        return non_finite_exps(row);
    }
    let mut scratch = [0f32; CHUNK];
    let mut sum = 0f64;
    let mut start = 0;
    while start < row.len() {
        let end = (start + CHUNK).min(row.len());
        let scratch = &mut scratch[..end - start];
        let (mut chunk_sum, chunk_max) = exp_chunk_at(level, &row[start..end], scratch, shift);
        // A NaN, an infinity or an overflowed exponential makes the sum non-finite.
        if !chunk_sum.is_finite() || chunk_max > shift + SHIFT_SLACK {
            let exact_max = max_f32(&row[start..end]);
            if !exact_max.is_finite() {
                // NaN or +inf here; everything before is finite or -inf, so the row's
                // log-sum-exp is the rest's, and each earlier e^(l - lse) is 0 (or NaN).
                let (lse, rest_sum) = non_finite_exps(&mut row[start..]);
                row[..start].fill(if lse.is_nan() { f32::NAN } else { 0.0 });
                return (lse, rest_sum);
            }
            // In f64: the shifts' difference exactly, the factor without underflow.
            let factor = (f64::from(shift) - f64::from(exact_max)).exp();
            row[..start].iter_mut().for_each(|v| *v = (f64::from(*v) * factor) as f32);
            sum *= factor;
            shift = exact_max;
            chunk_sum = exp_chunk_at(level, &row[start..end], scratch, shift).0;
        }
        row[start..end].copy_from_slice(scratch);
        sum += chunk_sum;
        start = end;
    }
    (f64::from(shift) + sum.ln(), sum)
}

/// The answer for a row whose maximum is not finite (NaN, `+inf`, or all `-inf`): the
/// plain formulas give the right non-finite log-sum-exp, and the row becomes
/// `exp(row - lse)` (NaN where it has no meaning) with a sum of one.
pub(super) fn non_finite_exps<T: candle_core::WithDType>(row: &mut [T]) -> (f64, f64) {
    let lse = row.iter().map(|v| v.to_f64().exp()).sum::<f64>().ln();
    row.iter_mut().for_each(|v| *v = T::from_f64((v.to_f64() - lse).exp()));
    (lse, 1.0)
}

/// `dst[j] = exp(src[j] - shift)`, returning their sum and the maximum of `src` (which may
/// miss a NaN; the sum does not).
fn exp_chunk_at(level: Level, src: &[f32], dst: &mut [f32], shift: f32) -> (f64, f32) {
    assert_eq!(src.len(), dst.len(), "exp_chunk: source and destination lengths differ");
    #[cfg(target_arch = "x86_64")]
    match level.min(multiversion::level()) {
        // SAFETY: `level()` saw AVX-512 F, and the lengths match.
        Level::Avx512 => return unsafe { x86::exp_chunk_avx512(src, dst, shift) },
        // SAFETY: `level()` saw AVX2 and FMA, and the lengths match.
        Level::Avx2 => return unsafe { x86::exp_chunk_avx2(src, dst, shift) },
        Level::Baseline => {}
    }
    let _ = level;
    exp_chunk_portable(src, dst, shift)
}

/// Independent accumulators of the portable kernel, so that the compiler vectorises it.
const LANES: usize = 16;

fn exp_chunk_portable(src: &[f32], dst: &mut [f32], shift: f32) -> (f64, f32) {
    let mut sums = [0f32; LANES];
    let mut maxes = [f32::NEG_INFINITY; LANES];
    let whole = src.len() / LANES * LANES;
    for (s, d) in src[..whole].chunks_exact(LANES).zip(dst[..whole].chunks_exact_mut(LANES)) {
        // indexed, not zipped: the zipped form stayed scalar
        for k in 0..LANES {
            maxes[k] = if s[k] > maxes[k] { s[k] } else { maxes[k] };
            d[k] = exp_f32(s[k] - shift);
            sums[k] += d[k];
        }
    }
    finish(&sums, &maxes, &src[whole..], &mut dst[whole..], shift)
}

/// Adds up the lanes (in f64) and runs the tail that fills no whole vector.
fn finish(sums: &[f32], maxes: &[f32], src: &[f32], dst: &mut [f32], shift: f32) -> (f64, f32) {
    let mut sum: f64 = sums.iter().map(|&v| f64::from(v)).sum();
    let mut max = maxes.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for (&s, d) in src.iter().zip(dst) {
        max = max.max(s);
        *d = exp_f32(s - shift);
        sum += f64::from(*d);
    }
    (sum, max)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! `e^d = 2^k e^r` with `k = round(d / ln 2)` and `r = d - k ln 2` (Cody-Waite, two FMAs),
    //! `e^r` by its Taylor series to degree 7 in Horner form, as [`super::exp_f32`] but with every
    //! multiply-add fused. Inputs below `EXP_MIN` give 0, NaN stays NaN, and the top of the
    //! range overflows to `inf` as [`super::exp_f32`] does.

    use std::arch::x86_64::*;

    use super::finish;

    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const EXP_MIN: f32 = -87.336_55;
    const EXP_MAX: f32 = 88.722_84;
    /// Taylor coefficients of `e^r`, highest degree first.
    const TAYLOR: [f32; 8] = [1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0];

    /// # Safety
    /// The CPU must have AVX-512 F, and `dst` must be as long as `src`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp_chunk_avx512(src: &[f32], dst: &mut [f32], shift: f32) -> (f64, f32) {
        const W: usize = 16;
        let whole = src.len() / W * W;
        let (shift_v, log2e, min) = (_mm512_set1_ps(shift), _mm512_set1_ps(LOG2_E), _mm512_set1_ps(EXP_MIN));
        let (ln2_hi, ln2_lo) = (_mm512_set1_ps(-LN2_HI), _mm512_set1_ps(-LN2_LO));
        let taylor = TAYLOR.map(|c| _mm512_set1_ps(c));
        let (mut sums, mut maxes) = (_mm512_setzero_ps(), _mm512_set1_ps(f32::NEG_INFINITY));
        for i in (0..whole).step_by(W) {
            // SAFETY: i + W <= whole <= src.len() == dst.len().
            let x = unsafe { _mm512_loadu_ps(src.as_ptr().add(i)) };
            maxes = _mm512_max_ps(maxes, x);
            let d = _mm512_sub_ps(x, shift_v);
            // "not less than", true for NaN: NaN flows through, below-range lanes are zeroed
            let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(d, min);
            let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(d, log2e));
            let r = _mm512_fmadd_ps(k, ln2_lo, _mm512_fmadd_ps(k, ln2_hi, d));
            let p = taylor[1..].iter().fold(taylor[0], |p, &c| _mm512_fmadd_ps(p, r, c));
            let e = _mm512_maskz_scalef_ps(keep, p, k);
            // SAFETY: as for the load.
            unsafe { _mm512_storeu_ps(dst.as_mut_ptr().add(i), e) };
            sums = _mm512_add_ps(sums, e);
        }
        let (mut s, mut m) = ([0f32; W], [0f32; W]);
        // SAFETY: both arrays hold W floats.
        unsafe {
            _mm512_storeu_ps(s.as_mut_ptr(), sums);
            _mm512_storeu_ps(m.as_mut_ptr(), maxes);
        }
        finish(&s, &m, &src[whole..], &mut dst[whole..], shift)
    }

    /// # Safety
    /// The CPU must have AVX2 and FMA, and `dst` must be as long as `src`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_chunk_avx2(src: &[f32], dst: &mut [f32], shift: f32) -> (f64, f32) {
        const W: usize = 8;
        let whole = src.len() / W * W;
        let (shift_v, log2e) = (_mm256_set1_ps(shift), _mm256_set1_ps(LOG2_E));
        let (min, max) = (_mm256_set1_ps(EXP_MIN), _mm256_set1_ps(EXP_MAX));
        let (ln2_hi, ln2_lo) = (_mm256_set1_ps(-LN2_HI), _mm256_set1_ps(-LN2_LO));
        let taylor = TAYLOR.map(|c| _mm256_set1_ps(c));
        let bias = _mm256_set1_epi32(127);
        let (mut sums, mut maxes) = (_mm256_setzero_ps(), _mm256_set1_ps(f32::NEG_INFINITY));
        for i in (0..whole).step_by(W) {
            // SAFETY: i + W <= whole <= src.len() == dst.len().
            let x = unsafe { _mm256_loadu_ps(src.as_ptr().add(i)) };
            maxes = _mm256_max_ps(maxes, x);
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
            unsafe { _mm256_storeu_ps(dst.as_mut_ptr().add(i), e) };
            sums = _mm256_add_ps(sums, e);
        }
        let (mut s, mut m) = ([0f32; W], [0f32; W]);
        // SAFETY: both arrays hold W floats.
        unsafe {
            _mm256_storeu_ps(s.as_mut_ptr(), sums);
            _mm256_storeu_ps(m.as_mut_ptr(), maxes);
        }
        finish(&s, &m, &src[whole..], &mut dst[whole..], shift)
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
        for len in [1, 7, 16, 17, CHUNK - 1, CHUNK, CHUNK + 5, 3 * CHUNK + 9, 50_257] {
            assert_matches_exact(&logits(len, len, 30.0), &format!("length {len}"));
        }
    }

    #[test]
    fn a_maximum_far_above_the_first_chunk_raises_the_shift_and_rescales_what_is_written() {
        // the first chunk's maximum is about 5; later chunks hold 30 (above the slack) and
        // then 400 (where exp of the distance would overflow f32)
        let mut row = logits(5 * CHUNK + 3, 1, 10.0);
        row[2 * CHUNK + 11] = 30.0;
        assert_matches_exact(&row, "one raise");
        row[4 * CHUNK + 100] = 400.0;
        row[5 * CHUNK + 1] = 399.0;
        assert_matches_exact(&row, "two raises, one past f32's exp range");
    }

    #[test]
    fn kernels_track_exp_to_three_tenths_of_a_micro_across_its_range() {
        let xs: Vec<f32> = (0..=200_000).map(|i| -87.0 + 175.3 * i as f32 / 200_000.0).collect();
        for level in supported_levels() {
            let mut out = vec![0f32; xs.len()];
            let (_, max) = exp_chunk_at(level, &xs, &mut out, 0.0);
            assert_eq!(max, *xs.last().unwrap(), "{level:?}");
            let mut worst = 0f64;
            for (&x, &e) in xs.iter().zip(&out) {
                let exact = f64::from(x).exp();
                worst = worst.max(((f64::from(e) - exact) / exact).abs());
            }
            assert!(worst < 3e-7, "{level:?}: worst relative error {worst:e}");
            // the lane sums, over values that cannot overflow them
            let below_zero = &xs[..100_000];
            let (sum, _) = exp_chunk_at(level, below_zero, &mut out[..100_000], 0.0);
            let exact_sum: f64 = out[..100_000].iter().map(|&e| f64::from(e)).sum();
            assert!(((sum - exact_sum) / exact_sum).abs() < 1e-5, "{level:?}: lane sums {sum} vs {exact_sum}");
        }
    }

    #[test]
    fn kernels_give_zero_below_the_range_inf_above_it_and_keep_nan() {
        let xs = [-88.0, f32::NEG_INFINITY, -1e30, 0.0, 89.0, 1e30, f32::INFINITY, f32::NAN];
        for level in supported_levels() {
            let mut out = [1f32; 8];
            let (sum, _) = exp_chunk_at(level, &xs[..4], &mut out[..4], 0.0);
            assert_eq!((&out[..4], sum), (&[0.0, 0.0, 0.0, 1.0][..], 1.0), "{level:?}");
            // whole vectors as well as the scalar tail
            let wide: Vec<f32> = xs.iter().cycle().take(40).copied().collect();
            let mut wide_out = vec![0f32; 40];
            let (sum, _) = exp_chunk_at(level, &wide, &mut wide_out, 0.0);
            assert!(sum.is_nan(), "{level:?}: a NaN input must make the sum NaN");
            for (&x, &e) in wide.iter().zip(&wide_out) {
                match x {
                    x if x.is_nan() => assert!(e.is_nan(), "{level:?}"),
                    x if x < -87.5 => assert_eq!(e, 0.0, "{level:?} at {x}"),
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
                [(3, f32::NAN), (CHUNK + 3, f32::NAN), (3, f32::INFINITY), (2 * CHUNK + 1, f32::INFINITY)]
            {
                let mut row = logits(3 * CHUNK, 2, 10.0);
                row[at] = value;
                row[CHUNK / 2] = f32::NEG_INFINITY;
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
        let mut row = logits(2 * CHUNK + 50, 3, 8.0);
        row[..CHUNK + 7].fill(f32::NEG_INFINITY);
        assert_matches_exact(&row, "a masked first chunk");
        for level in supported_levels() {
            let mut masked = vec![f32::NEG_INFINITY; CHUNK + 1];
            let (lse, sum) = exps_in_place_f32_at(level, &mut masked);
            assert_eq!((lse, sum), (f64::NEG_INFINITY, 1.0), "{level:?}");
            assert!(masked.iter().all(|v| v.is_nan()), "{level:?}: softmax of nothing has no meaning");
            let (lse, _) = exps_in_place_f32_at(level, &mut []);
            assert_eq!(lse, f64::NEG_INFINITY, "{level:?}: an empty row");
        }
    }
}
