//! The bf16 products `gemm_into` hands to [`half_product`]: every engine this machine runs
//! against the definition on rounded operands, and against f32.

use super::*;
use crate::ops::operand::KC;
use crate::ops::tests::randn;

fn values(len: usize, seed: u64) -> Vec<f32> {
    randn(&[len], seed).to_dtype(candle_core::DType::F32).unwrap().to_vec1::<f32>().unwrap()
}

fn rounded(x: f32) -> f64 {
    f64::from(half::bf16::from_f32(x).to_f32())
}

/// For each output element: the product of the bf16-rounded operands in f64, and the sum
/// of the magnitudes of its terms (the scale of an f32 accumulation's error).
fn reference(
    (m, n, k): (usize, usize, usize),
    lhs: &[f32],
    (lrs, lcs): (usize, usize),
    rhs: &[f32],
    (rrs, rcs): (usize, usize),
) -> (Vec<f64>, Vec<f64>) {
    let (mut exact, mut magnitude) = (vec![0.0; m * n], vec![0.0; m * n]);
    for i in 0..m {
        for j in 0..n {
            for p in 0..k {
                let t = rounded(lhs[i * lrs + p * lcs]) * rounded(rhs[p * rrs + j * rcs]);
                exact[i * n + j] += t;
                magnitude[i * n + j] += t.abs();
            }
        }
    }
    (exact, magnitude)
}

#[test]
fn every_engine_multiplies_the_rounded_operands_in_every_layout_and_at_ragged_shapes() {
    // ragged edges on every side; whole blocks, which the kernels write straight into
    // the output unless scaled, over several inner runs; k over one inner slice (KC), so
    // slices accumulate
    for ((m, n, k), scale) in [
        ((33, 47, 70), 0.5),
        ((64, 160, 96), 1.0),
        ((64, 160, 96), 0.5),
        ((64, 64, 600), 1.0),
        ((17, 200, KC + 40), 1.0),
    ] {
        let (lhs, rhs, start) = (values(m * k, 1), values(k * n, 2), values(m * n, 3));
        for engine in Bf16Engine::available() {
            for (lhs_t, rhs_t, accumulate) in
                [(false, false, false), (true, false, true), (false, true, true), (true, true, false)]
            {
                let ls = if lhs_t { (1, m) } else { (k, 1) };
                let rs = if rhs_t { (1, k) } else { (n, 1) };
                let (exact, magnitude) = reference((m, n, k), &lhs, ls, &rhs, rs);
                let mut ours = if accumulate { start.clone() } else { vec![f32::NAN; m * n] };
                // SAFETY: the strides address [m, k] and [k, n] inside lhs and rhs; ours is [m, n].
                unsafe {
                    half_product(
                        HalfEngine::Bf16(engine),
                        (m, n, k),
                        ours.as_mut_ptr(),
                        n,
                        accumulate,
                        lhs.as_ptr(),
                        ls,
                        rhs.as_ptr(),
                        rs,
                        scale,
                        2,
                    )
                };
                for e in 0..m * n {
                    let expected = f64::from(scale) * exact[e] + if accumulate { f64::from(start[e]) } else { 0.0 };
                    let bound = 1e-5 * (magnitude[e] + f64::from(start[e].abs())) + 1e-6;
                    let err = (f64::from(ours[e]) - expected).abs();
                    assert!(
                        err <= bound,
                        "{engine:?} [{m}, {n}, {k}] {lhs_t} {rhs_t} {accumulate}: element {e} off by {err}"
                    );
                }
            }
        }
    }
}

#[test]
fn bf16_products_are_within_bf16_rounding_of_the_f32_ones_and_not_equal_to_them() {
    let (m, n, k) = (64, 96, 256);
    let (lhs, rhs) = (values(m * k, 4), values(k * n, 5));
    let mut full = vec![0f32; m * n];
    let mut half = vec![0f32; m * n];
    // SAFETY: row-major [m, k], [k, n] and [m, n].
    unsafe {
        let args = |dst: *mut f32| (dst, lhs.as_ptr(), rhs.as_ptr());
        let (d, l, r) = args(full.as_mut_ptr());
        gemm_into((m, n, k), d, n, false, l, (k, 1), r, (n, 1), 1.0, 2, MatmulPrecision::F32);
        let (d, l, r) = args(half.as_mut_ptr());
        gemm_into((m, n, k), d, n, false, l, (k, 1), r, (n, 1), 1.0, 2, MatmulPrecision::Bf16);
    }
    let (_, magnitude) = reference((m, n, k), &lhs, (k, 1), &rhs, (n, 1));
    let mut worst = 0f64;
    for e in 0..m * n {
        let err = f64::from((full[e] - half[e]).abs());
        // each operand rounds by at most 2^-9 of itself, so a term by about 2^-8 of itself
        assert!(err <= magnitude[e] / 256.0, "element {e}: {err} against {}", magnitude[e]);
        worst = worst.max(err / magnitude[e]);
    }
    assert!(worst > 1e-5, "the bf16 precision left every product as f32 computes it ({worst})");
}
