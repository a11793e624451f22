//! The f16 products `gemm_into` hands to [`half_product`]: every engine this machine runs
//! against the definition on scaled, rounded operands, against f32, and on the tiny
//! magnitudes of a step's gradients.

use super::*;
use crate::ops::f16_pack::scale_for;
use crate::ops::operand::KC;
use crate::ops::tests::randn;

fn values(len: usize, seed: u64) -> Vec<f32> {
    randn(&[len], seed).to_dtype(candle_core::DType::F32).unwrap().to_vec1::<f32>().unwrap()
}

/// Each lane of `x` (`lanes` of `inner`, at `at(lane, p)`) scaled by its power of two,
/// rounded to f16 and unscaled, in f64: the operands the engines multiply.
fn rounded_lanes(lanes: usize, inner: usize, at: impl Fn(usize, usize) -> f32) -> Vec<Vec<f64>> {
    (0..lanes)
        .map(|l| {
            let s = scale_for((0..inner).fold(0f32, |m, p| m.max(at(l, p).abs())));
            (0..inner).map(|p| f64::from(half::f16::from_f32(at(l, p) * s).to_f32() / s)).collect()
        })
        .collect()
}

/// For each output element: the product of the rounded operands in f64, and the sum of the
/// magnitudes of its terms.
fn reference(
    (m, n, k): (usize, usize, usize),
    lhs: &[f32],
    (lrs, lcs): (usize, usize),
    rhs: &[f32],
    (rrs, rcs): (usize, usize),
) -> (Vec<f64>, Vec<f64>) {
    let rows = rounded_lanes(m, k, |i, p| lhs[i * lrs + p * lcs]);
    let columns = rounded_lanes(n, k, |j, p| rhs[p * rrs + j * rcs]);
    let (mut exact, mut magnitude) = (vec![0.0; m * n], vec![0.0; m * n]);
    for i in 0..m {
        for j in 0..n {
            for p in 0..k {
                let t = rows[i][p] * columns[j][p];
                exact[i * n + j] += t;
                magnitude[i * n + j] += t.abs();
            }
        }
    }
    (exact, magnitude)
}

/// An f16 run of 16 terms keeps about 9 of its 11 bits in the worst case; the emulation
/// accumulates in f32.
fn tolerance(engine: F16Engine) -> f64 {
    match engine {
        F16Engine::NeonFp16 => 2f64.powi(-8),
        F16Engine::Emulated => 1e-5,
    }
}

#[allow(clippy::too_many_arguments)]
fn product(
    engine: F16Engine,
    shape: (usize, usize, usize),
    dst: &mut [f32],
    accumulate: bool,
    lhs: &[f32],
    ls: (usize, usize),
    rhs: &[f32],
    rs: (usize, usize),
    scale: f32,
) {
    let n = shape.1;
    // SAFETY: the callers' strides address [m, k] and [k, n] inside lhs and rhs; dst is [m, n].
    unsafe {
        half_product(
            HalfEngine::F16(engine),
            shape,
            dst.as_mut_ptr(),
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
}

#[test]
fn the_detected_f16_engine_is_the_one_ci_expects() {
    // cross/build.sh sets FEDPO_EXPECT_FP16 for the aarch64 tests under qemu, whose CPU has
    // FP16: a probe that failed there would leave the kernel untested.
    if std::env::var_os("FEDPO_EXPECT_FP16").is_some() {
        assert_eq!(F16Engine::detect(), F16Engine::NeonFp16);
    }
    if !cfg!(target_arch = "aarch64") {
        assert_eq!(F16Engine::detect(), F16Engine::Emulated);
    }
}

#[test]
fn every_f16_engine_multiplies_the_scaled_rounded_operands_in_every_layout_and_at_ragged_shapes() {
    for ((m, n, k), scale) in [((33, 47, 70), 0.5), ((64, 160, 96), 1.0), ((8, 16, 32), 1.0), ((17, 200, KC + 40), 1.0)]
    {
        let (lhs, rhs, start) = (values(m * k, 1), values(k * n, 2), values(m * n, 3));
        for engine in F16Engine::available() {
            for (lhs_t, rhs_t, accumulate) in
                [(false, false, false), (true, false, true), (false, true, true), (true, true, false)]
            {
                let ls = if lhs_t { (1, m) } else { (k, 1) };
                let rs = if rhs_t { (1, k) } else { (n, 1) };
                let (exact, magnitude) = reference((m, n, k), &lhs, ls, &rhs, rs);
                let mut ours = if accumulate { start.clone() } else { vec![f32::NAN; m * n] };
                product(engine, (m, n, k), &mut ours, accumulate, &lhs, ls, &rhs, rs, scale);
                for e in 0..m * n {
                    let expected = f64::from(scale) * exact[e] + if accumulate { f64::from(start[e]) } else { 0.0 };
                    let bound =
                        tolerance(engine) * f64::from(scale) * magnitude[e] + 1e-5 * f64::from(start[e].abs()) + 1e-6;
                    let err = (f64::from(ours[e]) - expected).abs();
                    assert!(
                        err <= bound,
                        "{engine:?} [{m}, {n}, {k}] {lhs_t} {rhs_t} {accumulate}: element {e} off by {err} (bound {bound})"
                    );
                }
            }
        }
    }
}

#[test]
fn f16_products_land_between_f32_and_bf16_in_error() {
    let (m, n, k) = (64, 96, 256);
    let (lhs, rhs) = (values(m * k, 4), values(k * n, 5));
    let run = |precision: MatmulPrecision| {
        let mut out = vec![0f32; m * n];
        // SAFETY: row-major [m, k], [k, n] and [m, n].
        unsafe {
            gemm_into(
                (m, n, k),
                out.as_mut_ptr(),
                n,
                false,
                lhs.as_ptr(),
                (k, 1),
                rhs.as_ptr(),
                (n, 1),
                1.0,
                2,
                precision,
            )
        };
        out
    };
    let (full, bf16, f16) = (run(MatmulPrecision::F32), run(MatmulPrecision::Bf16), run(MatmulPrecision::F16));
    let worst = |half: &[f32]| {
        let (mut num, mut den) = (0f64, 0f64);
        for (a, b) in full.iter().zip(half) {
            num += f64::from(a - b).powi(2);
            den += f64::from(*a).powi(2);
        }
        (num / den).sqrt()
    };
    let (e_bf16, e_f16) = (worst(&bf16), worst(&f16));
    eprintln!("relative error against f32: bf16 {e_bf16:.2e}, f16 {e_f16:.2e}");
    // f16 keeps 3 bits more than bf16 per operand; the FP16 kernel's f16 runs give back
    // some of them (bf16 against f32 here: 2.4e-3; f16 emulated 3.0e-4, on the kernel
    // under qemu 6.7e-4).
    assert!(e_f16 < e_bf16 / 2.0, "f16 {e_f16} against bf16 {e_bf16}");
    assert!(e_f16 > 1e-6, "the f16 precision left every product as f32 computes it ({e_f16})");
}

#[test]
fn gradient_sized_operands_keep_f16_precision_instead_of_flushing_to_zero() {
    // A DPO gradient's rows for unlikely tokens: 1e-7 and below, under f16's least
    // normal (6.1e-5) and mostly under its least subnormal (6e-8).
    let (m, n, k) = (32, 48, 64);
    let lhs: Vec<f32> = values(m * k, 6).iter().map(|x| x * 1e-8).collect();
    let rhs: Vec<f32> = values(k * n, 7).iter().map(|x| x * 1e3).collect();
    let (exact, magnitude) = reference((m, n, k), &lhs, (k, 1), &rhs, (n, 1));
    for engine in F16Engine::available() {
        let mut ours = vec![0f32; m * n];
        product(engine, (m, n, k), &mut ours, false, &lhs, (k, 1), &rhs, (n, 1), 1.0);
        let mut nonzero = 0;
        for e in 0..m * n {
            let err = (f64::from(ours[e]) - exact[e]).abs();
            assert!(
                err <= tolerance(engine) * magnitude[e] + 1e-12 * magnitude[e],
                "{engine:?}: element {e} off by {err}"
            );
            nonzero += usize::from(ours[e] != 0.0);
        }
        assert_eq!(nonzero, m * n, "{engine:?}: products flushed to zero");
    }
}
