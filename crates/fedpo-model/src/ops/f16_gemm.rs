//! Matmuls on f16 operands, for f32 tensors: the mixed-precision step's products on
//! aarch64 boards with FP16 vector arithmetic (Raspberry Pi 5's Cortex-A76, Jetson Orin's
//! A78AE).
//!
//! As with bf16, parameters, activations, layer norms, softmax, log-probabilities and the
//! loss stay f32, and only the two operands of each large matmul are rounded, while being
//! packed. f16 needs one step more: each lane of an operand is scaled by a power of two
//! before rounding and the product unscaled after (see [`super::f16_pack`]), because f16's
//! range is too narrow for a step's gradients.
//!
//! Which kernel runs is decided once per process ([`F16Engine::detect`]):
//! - FP16 vector arithmetic (`fmla .8h`, [`super::f16_kernels`]), where an aarch64 CPU has
//!   it: products summed in f16 over runs of 16 inner indices, the runs added in f32;
//! - elsewhere, the same scaled, rounded operands through the f32 gemm: f32 accumulation
//!   throughout (slightly more accurate than the kernel), no faster than f32.
//!
//! The kernel's speed on a board has not been measured, so `--compute-dtype auto` does not
//! pick f16; `--compute-dtype f16` asks for it.

/// The kernel that multiplies f16 operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum F16Engine {
    /// aarch64 FP16 vector arithmetic.
    NeonFp16,
    /// Rounded operands through the f32 gemm.
    Emulated,
}

impl F16Engine {
    /// The fastest engine this CPU allows (asked once).
    pub fn detect() -> Self {
        static ENGINE: std::sync::OnceLock<F16Engine> = std::sync::OnceLock::new();
        *ENGINE.get_or_init(|| {
            let engine = Self::probe();
            tracing::debug!(?engine, "f16 matmul engine");
            engine
        })
    }

    #[cfg(target_arch = "aarch64")]
    fn probe() -> Self {
        if super::f16_kernels::fp16_usable() {
            Self::NeonFp16
        } else {
            Self::Emulated
        }
    }

    #[cfg(not(target_arch = "aarch64"))]
    fn probe() -> Self {
        Self::Emulated
    }

    /// Whether f16 products run on f16 arithmetic here.
    pub fn is_native(self) -> bool {
        self != Self::Emulated
    }

    /// The engines this machine can run, the detected one first (tests compare them).
    pub fn available() -> Vec<Self> {
        let mut engines = vec![Self::detect()];
        if engines[0] != Self::Emulated {
            engines.push(Self::Emulated);
        }
        engines
    }
}

#[cfg(target_arch = "aarch64")]
pub(super) use native::gemm as native_gemm;

#[cfg(target_arch = "aarch64")]
mod native {
    use rayon::prelude::*;

    use super::super::f16_kernels::{block, MR, NR, RUN};
    use super::super::f16_pack::{lane_scales, pack, Lanes};
    use super::super::operand::{Operand, KC};
    use super::super::send_ptr::SendPtr;

    /// `dst[m x n] (+)= scale * a @ b` with both operands scaled and rounded to f16, on
    /// FP16 arithmetic; `gemm_into` hands products here.
    ///
    /// The blocked product: lane scales for both operands first (one pass each); then for
    /// each slice of the inner dimension, the left operand is packed once (in parallel, 8
    /// rows per task), and each task packs a band of the right operand's columns and runs
    /// every row block against it, so a band stays in cache while the rows stream past.
    ///
    /// # Safety
    /// As `gemm_into`'s, for f32, with the operands' strides addressing their buffers;
    /// [`super::F16Engine::detect`] chose FP16 arithmetic.
    pub(in crate::ops) unsafe fn gemm(
        a: Operand,
        b: Operand,
        (dst, dst_rs): (*mut f32, usize),
        accumulate: bool,
        scale: f32,
        threads: usize,
    ) {
        let (m, n, k) = (a.rows, b.cols, a.cols);
        let (rows, columns) = (Lanes::rows_of(&a), Lanes::columns_of(&b));
        // SAFETY: the operands' strides address their buffers (the caller's contract).
        let ((a_scales, a_inverse), (b_scales, b_inverse)) = unsafe { (lane_scales(&rows), lane_scales(&columns)) };
        let row_blocks = m.div_ceil(MR);
        // Bands of 16 to 128 columns, at least two per thread where the width allows.
        let band = (n.div_ceil(2 * threads.max(1)).div_ceil(NR) * NR).clamp(NR, 8 * NR);
        let bands = n.div_ceil(band);
        let (rows_ptr, columns_ptr) = (SendPtr(rows.ptr.cast_mut()), SendPtr(columns.ptr.cast_mut()));
        let dst = SendPtr(dst);
        for p0 in (0..k).step_by(KC) {
            let kc = KC.min(k - p0);
            let kp = kc.div_ceil(RUN) * RUN;
            let add = accumulate || p0 > 0;
            let mut a_pack = vec![0u16; row_blocks * MR * kp];
            a_pack.par_chunks_mut(MR * kp).enumerate().for_each(|(i, out)| {
                let rows = Lanes { ptr: rows_ptr.get().cast_const(), ..rows };
                // SAFETY: rows i * 8.., inner p0..p0 + kc of a (the caller's contract).
                unsafe { pack(&rows, i * MR, MR, (p0, kc), &a_scales, out) };
            });
            let a_pack = &a_pack;
            let (a_inverse, b_inverse, b_scales) = (&a_inverse, &b_inverse, &b_scales);
            (0..bands).into_par_iter().for_each(|band_index| {
                let columns = Lanes { ptr: columns_ptr.get().cast_const(), ..columns };
                let j0 = band_index * band;
                let width = band.min(n - j0);
                let strips = width.div_ceil(NR);
                let mut b_pack = vec![0u16; strips * kp * NR];
                for (s, out) in b_pack.chunks_exact_mut(kp * NR).enumerate() {
                    // SAFETY: inner p0..p0 + kc, columns j0 + 16 s.. of b.
                    unsafe { pack(&columns, j0 + s * NR, NR, (p0, kc), b_scales, out) };
                }
                let mut acc = [0f32; MR * NR];
                for i in 0..row_blocks {
                    let a_block = a_pack[i * MR * kp..].as_ptr();
                    let (i0, live_rows) = (i * MR, MR.min(m - i * MR));
                    for s in 0..strips {
                        let (jb, live_cols) = (j0 + s * NR, NR.min(n - j0 - s * NR));
                        acc.fill(0.0);
                        // SAFETY: 8 packed rows and one packed strip of kp each, kp a
                        // positive multiple of RUN; the engine was detected.
                        unsafe { block(a_block, b_pack[s * kp * NR..].as_ptr(), kp, &mut acc) };
                        for (r, acc_row) in acc.chunks_exact(NR).take(live_rows).enumerate() {
                            let unscale = scale * a_inverse[i0 + r];
                            // SAFETY: row i0 + r, columns jb..jb + live_cols of dst, a
                            // region only this band's task writes.
                            let out = unsafe {
                                std::slice::from_raw_parts_mut(dst.get().add((i0 + r) * dst_rs + jb), live_cols)
                            };
                            let terms = acc_row.iter().zip(&b_inverse[jb..jb + live_cols]);
                            if add {
                                out.iter_mut().zip(terms).for_each(|(o, (&v, &t))| *o += unscale * v * t);
                            } else {
                                out.iter_mut().zip(terms).for_each(|(o, (&v, &t))| *o = unscale * v * t);
                            }
                        }
                    }
                }
            });
        }
    }
}
