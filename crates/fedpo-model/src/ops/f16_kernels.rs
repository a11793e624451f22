//! The aarch64 inner kernel of the f16 matmul: an 8 x 16 block of f32 output from packed
//! f16 operands on the FP16 vector arithmetic of Cortex-A76, A78 and later (`fmla .8h`:
//! eight products per instruction where f32 has four).
//!
//! Those cores lack FEAT_FHM's widening `fmlal`, so products accumulate in f16 registers
//! over runs of [`RUN`] inner indices, and each run's sums are widened and added into f32.
//! The packs scale every operand below 32 in magnitude (see [`super::f16_gemm`]), so a
//! run's sum stays under 16 x 32 x 32 = 16,384, a quarter of f16's largest finite value;
//! an f16 sum of 16 terms keeps about 9 of its 11 significant bits in the worst case, and
//! the f32 accumulation across runs loses nothing more.
//!
//! Both packs run along the inner dimension: for each inner index, the block's 8 rows of
//! the left operand (one vector, multiplied by element) and the strip's 16 columns of the
//! right (two vectors). Rust's f16 vector types and intrinsics are unstable, so the kernel
//! is inline assembly; the conversions in and out (`fcvtn`, `fcvtl`) are base ASIMD.

use std::arch::asm;

/// Rows of output per block: one f16 vector of the left operand.
pub(super) const MR: usize = 8;
/// Columns of output per block: two f16 vectors of the right operand.
pub(super) const NR: usize = 16;
/// Inner indices summed in f16 before widening into f32.
pub(super) const RUN: usize = 16;

/// Whether the CPU has FP16 vector arithmetic (FEAT_FP16: `asimdhp` in `/proc/cpuinfo`).
pub(super) fn fp16_usable() -> bool {
    std::arch::is_aarch64_feature_detected!("fp16")
}

/// `acc[8 x 16] += a @ b` over `kp` inner indices, f16 within each run of [`RUN`].
///
/// # Safety
/// `a` holds `kp * 8` f16 (inner index `p`'s 8 rows at `a[8 p..]`), `b` holds `kp * 16`
/// (its 16 columns at `b[16 p..]`), `kp` is a positive multiple of [`RUN`], and
/// [`fp16_usable`] returned true.
#[target_feature(enable = "fp16")]
pub(super) unsafe fn block(a: *const u16, b: *const u16, kp: usize, acc: &mut [f32; MR * NR]) {
    debug_assert!(kp > 0 && kp.is_multiple_of(RUN));
    // SAFETY: the caller's contract: the loads stay inside a's kp * 8 and b's kp * 16
    // halves, the stores inside acc; v0-v7 and v16-v31 are declared clobbered.
    unsafe {
        asm!(
            "2:",
            // a run: zero the f16 accumulators
            "movi v16.16b, #0",
            "movi v17.16b, #0",
            "movi v18.16b, #0",
            "movi v19.16b, #0",
            "movi v20.16b, #0",
            "movi v21.16b, #0",
            "movi v22.16b, #0",
            "movi v23.16b, #0",
            "movi v24.16b, #0",
            "movi v25.16b, #0",
            "movi v26.16b, #0",
            "movi v27.16b, #0",
            "movi v28.16b, #0",
            "movi v29.16b, #0",
            "movi v30.16b, #0",
            "movi v31.16b, #0",
            // 16 inner indices: one column of the 8 packed rows and one row of the 16 columns each
            "mov {n}, #16",
            "3:",
            "ld1 {{v0.8h}}, [{a}], #16",
            "ld1 {{v1.8h, v2.8h}}, [{b}], #32",
            "fmla v16.8h, v1.8h, v0.h[0]",
            "fmla v17.8h, v2.8h, v0.h[0]",
            "fmla v18.8h, v1.8h, v0.h[1]",
            "fmla v19.8h, v2.8h, v0.h[1]",
            "fmla v20.8h, v1.8h, v0.h[2]",
            "fmla v21.8h, v2.8h, v0.h[2]",
            "fmla v22.8h, v1.8h, v0.h[3]",
            "fmla v23.8h, v2.8h, v0.h[3]",
            "fmla v24.8h, v1.8h, v0.h[4]",
            "fmla v25.8h, v2.8h, v0.h[4]",
            "fmla v26.8h, v1.8h, v0.h[5]",
            "fmla v27.8h, v2.8h, v0.h[5]",
            "fmla v28.8h, v1.8h, v0.h[6]",
            "fmla v29.8h, v2.8h, v0.h[6]",
            "fmla v30.8h, v1.8h, v0.h[7]",
            "fmla v31.8h, v2.8h, v0.h[7]",
            "subs {n}, {n}, #1",
            "b.ne 3b",
            // widen each row's two f16 accumulators and add them into its 16 f32
            // row 0
            "ld1 {{v3.4s, v4.4s, v5.4s, v6.4s}}, [{c}]",
            "fcvtl v7.4s, v16.4h",
            "fcvtl2 v16.4s, v16.8h",
            "fadd v3.4s, v3.4s, v7.4s",
            "fadd v4.4s, v4.4s, v16.4s",
            "fcvtl v7.4s, v17.4h",
            "fcvtl2 v17.4s, v17.8h",
            "fadd v5.4s, v5.4s, v7.4s",
            "fadd v6.4s, v6.4s, v17.4s",
            "st1 {{v3.4s, v4.4s, v5.4s, v6.4s}}, [{c}], #64",
            // row 1
            "ld1 {{v3.4s, v4.4s, v5.4s, v6.4s}}, [{c}]",
            "fcvtl v7.4s, v18.4h",
            "fcvtl2 v18.4s, v18.8h",
            "fadd v3.4s, v3.4s, v7.4s",
            "fadd v4.4s, v4.4s, v18.4s",
            "fcvtl v7.4s, v19.4h",
            "fcvtl2 v19.4s, v19.8h",
            "fadd v5.4s, v5.4s, v7.4s",
            "fadd v6.4s, v6.4s, v19.4s",
            "st1 {{v3.4s, v4.4s, v5.4s, v6.4s}}, [{c}], #64",
            // row 2
            "ld1 {{v3.4s, v4.4s, v5.4s, v6.4s}}, [{c}]",
            "fcvtl v7.4s, v20.4h",
            "fcvtl2 v20.4s, v20.8h",
            "fadd v3.4s, v3.4s, v7.4s",
            "fadd v4.4s, v4.4s, v20.4s",
            "fcvtl v7.4s, v21.4h",
            "fcvtl2 v21.4s, v21.8h",
            "fadd v5.4s, v5.4s, v7.4s",
            "fadd v6.4s, v6.4s, v21.4s",
            "st1 {{v3.4s, v4.4s, v5.4s, v6.4s}}, [{c}], #64",
            // row 3
            "ld1 {{v3.4s, v4.4s, v5.4s, v6.4s}}, [{c}]",
            "fcvtl v7.4s, v22.4h",
            "fcvtl2 v22.4s, v22.8h",
            "fadd v3.4s, v3.4s, v7.4s",
            "fadd v4.4s, v4.4s, v22.4s",
            "fcvtl v7.4s, v23.4h",
            "fcvtl2 v23.4s, v23.8h",
            "fadd v5.4s, v5.4s, v7.4s",
            "fadd v6.4s, v6.4s, v23.4s",
            "st1 {{v3.4s, v4.4s, v5.4s, v6.4s}}, [{c}], #64",
            // row 4
            "ld1 {{v3.4s, v4.4s, v5.4s, v6.4s}}, [{c}]",
            "fcvtl v7.4s, v24.4h",
            "fcvtl2 v24.4s, v24.8h",
            "fadd v3.4s, v3.4s, v7.4s",
            "fadd v4.4s, v4.4s, v24.4s",
            "fcvtl v7.4s, v25.4h",
            "fcvtl2 v25.4s, v25.8h",
            "fadd v5.4s, v5.4s, v7.4s",
            "fadd v6.4s, v6.4s, v25.4s",
            "st1 {{v3.4s, v4.4s, v5.4s, v6.4s}}, [{c}], #64",
            // row 5
            "ld1 {{v3.4s, v4.4s, v5.4s, v6.4s}}, [{c}]",
            "fcvtl v7.4s, v26.4h",
            "fcvtl2 v26.4s, v26.8h",
            "fadd v3.4s, v3.4s, v7.4s",
            "fadd v4.4s, v4.4s, v26.4s",
            "fcvtl v7.4s, v27.4h",
            "fcvtl2 v27.4s, v27.8h",
            "fadd v5.4s, v5.4s, v7.4s",
            "fadd v6.4s, v6.4s, v27.4s",
            "st1 {{v3.4s, v4.4s, v5.4s, v6.4s}}, [{c}], #64",
            // row 6
            "ld1 {{v3.4s, v4.4s, v5.4s, v6.4s}}, [{c}]",
            "fcvtl v7.4s, v28.4h",
            "fcvtl2 v28.4s, v28.8h",
            "fadd v3.4s, v3.4s, v7.4s",
            "fadd v4.4s, v4.4s, v28.4s",
            "fcvtl v7.4s, v29.4h",
            "fcvtl2 v29.4s, v29.8h",
            "fadd v5.4s, v5.4s, v7.4s",
            "fadd v6.4s, v6.4s, v29.4s",
            "st1 {{v3.4s, v4.4s, v5.4s, v6.4s}}, [{c}], #64",
            // row 7
            "ld1 {{v3.4s, v4.4s, v5.4s, v6.4s}}, [{c}]",
            "fcvtl v7.4s, v30.4h",
            "fcvtl2 v30.4s, v30.8h",
            "fadd v3.4s, v3.4s, v7.4s",
            "fadd v4.4s, v4.4s, v30.4s",
            "fcvtl v7.4s, v31.4h",
            "fcvtl2 v31.4s, v31.8h",
            "fadd v5.4s, v5.4s, v7.4s",
            "fadd v6.4s, v6.4s, v31.4s",
            "st1 {{v3.4s, v4.4s, v5.4s, v6.4s}}, [{c}], #64",
            "sub {c}, {c}, #512",
            "subs {runs}, {runs}, #1",
            "b.ne 2b",
            a = inout(reg) a => _,
            b = inout(reg) b => _,
            c = inout(reg) acc.as_mut_ptr() => _,
            runs = inout(reg) kp / RUN => _,
            n = out(reg) _,
            out("v0") _, out("v1") _, out("v2") _, out("v3") _, out("v4") _, out("v5") _, out("v6") _, out("v7") _,
            out("v16") _, out("v17") _, out("v18") _, out("v19") _, out("v20") _, out("v21") _, out("v22") _, out("v23") _, out("v24") _, out("v25") _, out("v26") _, out("v27") _, out("v28") _, out("v29") _, out("v30") _, out("v31") _,
            options(nostack),
        );
    }
}

/// Rounds `x[i] * scales[i]` for `i < 8` to f16 (nearest, ties to even: the FPCR's default
/// mode).
///
/// # Safety
/// `x` and `scales` hold 8 readable f32 and `out` 8 writable u16.
#[inline]
pub(super) unsafe fn round_8(x: *const f32, scales: *const f32, out: *mut u16) {
    // SAFETY: the caller's contract; fcvtn is base ASIMD, present on every aarch64 CPU.
    unsafe {
        asm!(
            "ld1 {{v0.4s, v1.4s}}, [{x}]",
            "ld1 {{v2.4s, v3.4s}}, [{s}]",
            "fmul v0.4s, v0.4s, v2.4s",
            "fmul v1.4s, v1.4s, v3.4s",
            "fcvtn v3.4h, v0.4s",
            "fcvtn2 v3.8h, v1.4s",
            "st1 {{v3.8h}}, [{out}]",
            x = in(reg) x,
            s = in(reg) scales,
            out = in(reg) out,
            out("v0") _, out("v1") _, out("v2") _, out("v3") _,
            options(nostack, preserves_flags),
        );
    }
}

#[cfg(test)]
mod tests;
