//! The FP16 kernel and rounding against scalar definitions: bit for bit, under qemu in CI.

use half::f16;

use super::*;

fn values(len: usize, seed: u64, magnitude: f32) -> Vec<f32> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..len).map(|_| magnitude * (rng.random::<f32>() * 2.0 - 1.0)).collect()
}

fn bits(values: &[f32]) -> Vec<u16> {
    values.iter().map(|&x| f16::from_f32(x).to_bits()).collect()
}

/// The kernel's arithmetic written out: each run of 16 products summed in f16 with one
/// rounding per fused multiply-add, then added into the f32 accumulator.
fn simulated(a: &[u16], b: &[u16], kp: usize, acc: &mut [f32; MR * NR]) {
    for r in 0..MR {
        for c in 0..NR {
            for run in (0..kp).step_by(RUN) {
                let mut h = f16::ZERO;
                for p in run..run + RUN {
                    let product = f64::from(f16::from_bits(a[p * MR + r])) * f64::from(f16::from_bits(b[p * NR + c]));
                    h = f16::from_f64(f64::from(h) + product);
                }
                acc[r * NR + c] += h.to_f32();
            }
        }
    }
}

fn require_fp16() -> bool {
    let usable = fp16_usable();
    if !usable {
        // CI runs these under qemu-aarch64, whose default CPU has FP16; a board without it
        // never runs the kernel.
        assert!(std::env::var_os("FEDPO_EXPECT_FP16").is_none(), "FEDPO_EXPECT_FP16 is set but the CPU lacks FP16");
        eprintln!("no FP16 arithmetic here: kernel tests skipped");
    }
    usable
}

#[test]
fn the_block_kernel_sums_runs_in_f16_and_adds_them_into_f32_bit_for_bit() {
    if !require_fp16() {
        return;
    }
    // Operands in the packs' range (below 32), over several runs, into a nonzero start.
    for (kp, seed) in [(16, 1), (48, 2), (256, 3)] {
        let (a, b) = (bits(&values(kp * MR, seed, 31.0)), bits(&values(kp * NR, seed + 10, 31.0)));
        let start: [f32; MR * NR] = values(MR * NR, seed + 20, 100.0).try_into().unwrap();
        let (mut ours, mut expected) = (start, start);
        // SAFETY: a holds kp * 8 halves, b kp * 16, kp a multiple of 16; FP16 is usable.
        unsafe { block(a.as_ptr(), b.as_ptr(), kp, &mut ours) };
        simulated(&a, &b, kp, &mut expected);
        for (e, (o, x)) in ours.iter().zip(&expected).enumerate() {
            assert_eq!(o.to_bits(), x.to_bits(), "kp {kp}: element {e}: {o} against {x}");
        }
    }
}

#[test]
fn the_block_kernel_accumulates_in_f16_not_f32() {
    if !require_fp16() {
        return;
    }
    // 1 + 16 x 2^-12: each 2^-12 is under half an f16 ulp of 1, so an f16 run rounds every
    // one away; f32 would keep them.
    let kp = RUN;
    let mut a = vec![0u16; kp * MR];
    let mut b = vec![0u16; kp * NR];
    a[0] = f16::ONE.to_bits();
    b[0] = f16::ONE.to_bits();
    for p in 1..kp {
        a[p * MR] = f16::from_f32(1.0 / 64.0).to_bits();
        b[p * NR] = f16::from_f32(1.0 / 64.0).to_bits();
    }
    let mut acc = [0f32; MR * NR];
    // SAFETY: as above.
    unsafe { block(a.as_ptr(), b.as_ptr(), kp, &mut acc) };
    assert_eq!(acc[0], 1.0, "the products under half an ulp of the run's sum were kept: f32, not f16");
    assert!(acc[1..].iter().all(|&x| x == 0.0));
}

#[test]
fn rounding_eight_at_a_time_matches_the_scalar_conversion_on_ties_subnormals_and_overflow() {
    let cases: [f32; 16] = [
        1.0 + 1.0 / 2048.0, // a tie: to even (1.0)
        1.0 + 3.0 / 2048.0, // a tie: to even (1 + 2^-9)
        -2.5e-7,            // subnormal in f16
        1e-9,               // below f16's least subnormal: zero
        65504.0,            // the largest finite f16
        65520.0,            // rounds to infinity
        f32::INFINITY,
        f32::NAN,
        -0.0,
        0.1,
        31.99,
        -17.3,
        3.0e-5,
        1234.567,
        -65519.0,     // rounds down to the largest finite
        6.1035156e-5, // the least normal f16
    ];
    let scales = [1.0f32; 16];
    let mut out = [0u16; 16];
    // SAFETY: 16 f32 and 16 u16, in two calls of 8.
    unsafe {
        round_8(cases.as_ptr(), scales.as_ptr(), out.as_mut_ptr());
        round_8(cases.as_ptr().add(8), scales.as_ptr().add(8), out.as_mut_ptr().add(8));
    }
    for (x, h) in cases.iter().zip(out) {
        let expected = f16::from_f32(*x);
        if x.is_nan() {
            assert!(f16::from_bits(h).is_nan());
        } else {
            assert_eq!(h, expected.to_bits(), "{x}: {} against {expected}", f16::from_bits(h));
        }
    }
    // The scale multiplies first: 3 x 2^-20 scaled by 2^20 is exactly 3.
    let (x, s) = ([3.0 * 2f32.powi(-20); 8], [2f32.powi(20); 8]);
    // SAFETY: 8 each.
    unsafe { round_8(x.as_ptr(), s.as_ptr(), out.as_mut_ptr()) };
    assert!(out[..8].iter().all(|&h| f16::from_bits(h).to_f32() == 3.0));
}
