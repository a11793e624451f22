//! Matmuls on bf16 operands with f32 accumulation, for f32 tensors: the mixed-precision
//! step's products.
//!
//! The step keeps parameters, activations, layer norms, softmax, log-probabilities and the
//! loss in f32 and rounds only the two operands of each large matmul to bf16 while packing
//! them; products accumulate in f32. This is what PyTorch's CPU autocast does for a matmul.
//! Autocast also stores the activations in bf16; this step does not, so the fused kernels
//! run unchanged and only the products' inputs lose precision.
//!
//! Which kernel runs is decided once per process ([`Bf16Engine::detect`]):
//! - AMX tiles (`tdpbf16ps`), where the CPU has AMX-BF16 and Linux grants the tile state;
//! - AVX512-BF16 (`vdpbf16ps`);
//! - elsewhere, rounding the operands to bf16 and multiplying them with the f32 gemm:
//!   the same numbers as the hardware (a product of two bf16 is exact in f32), no faster
//!   than f32. `--compute-dtype auto` does not pick bf16 on such a CPU.
//!
//! Whether a model's matmuls take this path is [`super::MatmulPrecision`].

/// The kernel that multiplies bf16 operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Engine {
    /// AMX tiles.
    Amx,
    /// AVX512-BF16 `vdpbf16ps`.
    Avx512Bf16,
    /// Rounded operands through the f32 gemm.
    Emulated,
}

impl Bf16Engine {
    /// The fastest engine this CPU and OS allow (asked once).
    pub fn detect() -> Self {
        static ENGINE: std::sync::OnceLock<Bf16Engine> = std::sync::OnceLock::new();
        *ENGINE.get_or_init(|| {
            let engine = Self::probe();
            tracing::debug!(?engine, "bf16 matmul engine");
            engine
        })
    }

    #[cfg(target_arch = "x86_64")]
    fn probe() -> Self {
        use super::bf16_kernels::{amx_usable, avx512_bf16_usable};
        match (avx512_bf16_usable(), amx_usable()) {
            // The packs round with AVX512-BF16 on every AMX CPU made so far; an AMX CPU
            // without it would take the emulation rather than scalar packing.
            (true, true) => Self::Amx,
            (true, false) => Self::Avx512Bf16,
            _ => Self::Emulated,
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn probe() -> Self {
        Self::Emulated
    }

    /// Whether bf16 products run faster than f32 ones here.
    pub fn is_native(self) -> bool {
        self != Self::Emulated
    }

    /// The engines this machine can run, the detected one first (tests compare them).
    pub fn available() -> Vec<Self> {
        let mut engines = vec![Self::detect()];
        if engines[0] == Self::Amx {
            engines.push(Self::Avx512Bf16);
        }
        if engines[0] != Self::Emulated {
            engines.push(Self::Emulated);
        }
        engines
    }
}

/// `[rows, cols]` of an f32 operand given by strides, each element rounded to bf16
/// (nearest, ties to even) and widened back: the emulated engine's operands, row-major.
///
/// # Safety
/// Every `(i, j)` the strides address is inside the operand's buffer.
pub(super) unsafe fn rounded_copy(ptr: *const f32, (rs, cs): (usize, usize), rows: usize, cols: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let mut out = vec![0f32; rows * cols];
    if cols == 0 {
        return out;
    }
    let ptr = super::send_ptr::SendPtr(ptr.cast_mut());
    out.par_chunks_mut(cols).enumerate().for_each(|(i, row)| {
        for (j, v) in row.iter_mut().enumerate() {
            // SAFETY: (i, j) is inside the operand (the caller's contract).
            *v = half::bf16::from_f32(unsafe { *ptr.get().add(i * rs + j * cs) }).to_f32();
        }
    });
    out
}

#[cfg(target_arch = "x86_64")]
pub(super) use native::gemm as native_gemm;

#[cfg(target_arch = "x86_64")]
mod native {
    use rayon::prelude::*;

    use super::super::bf16_kernels::{amx_block, avx512_block, Tiles, BLOCK};
    use super::super::bf16_pack::{pack_rows, pack_strips};
    use super::super::operand::Operand;
    use super::super::operand::KC;
    use super::super::send_ptr::SendPtr;

    /// One 32 x 32 block on the chosen kernel.
    ///
    /// # Safety
    /// As `amx_block`'s; without tiles, AVX512-BF16 was detected.
    #[allow(clippy::too_many_arguments)]
    unsafe fn block_product(
        tiles: Option<&Tiles>,
        a: *const u16,
        kp: usize,
        b0: *const u16,
        b1: *const u16,
        c: *mut f32,
        c_stride: usize,
        add: bool,
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            if let Some(tiles) = tiles {
                amx_block(tiles, a, kp, b0, b1, kp, c, c_stride, add);
            } else {
                avx512_block(a, kp, b0, b1, kp, c, c_stride, add);
            }
        }
    }

    /// The blocked product: for each slice of the inner dimension, the left operand is
    /// packed once (in parallel, 32 rows per task), then each task packs a band of the
    /// right operand's columns and runs every row block against it, so a band stays in
    /// cache while the rows stream past.
    ///
    /// `dst[m x n] (+)= scale * a @ b` with both operands rounded to bf16, on AMX (`amx`)
    /// or AVX512-BF16; `gemm_into` hands products here.
    ///
    /// # Safety
    /// As `gemm_into`'s, for f32, with the operands' strides addressing their buffers;
    /// `amx` only where [`super::Bf16Engine::detect`] chose AMX, AVX512-BF16 otherwise.
    pub(in crate::ops) unsafe fn gemm(
        amx: bool,
        a: Operand,
        b: Operand,
        (dst, dst_rs): (*mut f32, usize),
        accumulate: bool,
        scale: f32,
        threads: usize,
    ) {
        let (m, n, k) = (a.rows, b.cols, a.cols);
        let row_blocks = m.div_ceil(BLOCK);
        // Bands of 32 to 128 columns, at least two per thread where the width allows.
        let band = (n.div_ceil(2 * threads.max(1)).div_ceil(BLOCK) * BLOCK).clamp(BLOCK, 4 * BLOCK);
        let bands = n.div_ceil(band);
        let (a_shared, b_shared) = (SendPtr(a.ptr.cast_mut()), SendPtr(b.ptr.cast_mut()));
        let dst = SendPtr(dst);
        for p0 in (0..k).step_by(KC) {
            let kc = KC.min(k - p0);
            let kp = kc.div_ceil(32) * 32;
            let add = accumulate || p0 > 0;
            let mut a_pack = vec![0u16; row_blocks * BLOCK * kp];
            a_pack.par_chunks_mut(BLOCK * kp).enumerate().for_each(|(block, out)| {
                let a = Operand { ptr: a_shared.get().cast_const(), ..a };
                // SAFETY: rows block * 32.., inner p0..p0 + kc of a (the caller's contract).
                unsafe { pack_rows(&a, block * BLOCK, p0, kc, kp, out) };
            });
            let a_pack = &a_pack;
            (0..bands).into_par_iter().for_each(|band_index| {
                let b = Operand { ptr: b_shared.get().cast_const(), ..b };
                let j0 = band_index * band;
                let width = band.min(n - j0);
                let strips = width.div_ceil(BLOCK) * 2;
                let mut b_pack = vec![0u16; strips * kp * 16];
                // SAFETY: inner p0..p0 + kc, columns j0.. of b.
                unsafe { pack_strips(&b, p0, kc, j0, kp, &mut b_pack) };
                let mut c = [0f32; BLOCK * BLOCK];
                // SAFETY: AMX was detected (the caller's contract); nothing else in this
                // task uses the tiles.
                let tiles = amx.then(|| unsafe { Tiles::configure() });
                for block in 0..row_blocks {
                    let a_rows = a_pack[block * BLOCK * kp..].as_ptr();
                    for pair in 0..strips / 2 {
                        let (b0, b1) =
                            (b_pack[2 * pair * kp * 16..].as_ptr(), b_pack[(2 * pair + 1) * kp * 16..].as_ptr());
                        let (i0, jb) = (block * BLOCK, j0 + pair * BLOCK);
                        let (rows, cols) = (BLOCK.min(m - i0), BLOCK.min(n - jb));
                        // A whole unscaled block goes straight into dst (the kernel adds to
                        // what is there); an edge or scaled one through c.
                        let direct = rows == BLOCK && cols == BLOCK && scale == 1.0;
                        // SAFETY: rows i0..i0 + 32, columns jb..jb + 32 of dst when direct
                        // (a region only this band's task writes).
                        let (out, out_stride) = if direct {
                            (unsafe { dst.get().add(i0 * dst_rs + jb) }, dst_rs)
                        } else {
                            (c.as_mut_ptr(), BLOCK)
                        };
                        // SAFETY: 32 packed rows of kp and two packed strips, kp a multiple
                        // of 32; out holds 32 x 32; the engine was detected.
                        unsafe { block_product(tiles.as_ref(), a_rows, kp, b0, b1, out, out_stride, direct && add) };
                        if direct {
                            continue;
                        }
                        for (r, c_row) in c.chunks_exact(BLOCK).take(rows).enumerate() {
                            // SAFETY: row i0 + r, columns jb..jb + cols of dst, a region
                            // only this band's task writes.
                            let out =
                                unsafe { std::slice::from_raw_parts_mut(dst.get().add((i0 + r) * dst_rs + jb), cols) };
                            if add {
                                out.iter_mut().zip(c_row).for_each(|(o, &v)| *o += scale * v);
                            } else {
                                out.iter_mut().zip(c_row).for_each(|(o, &v)| *o = scale * v);
                            }
                        }
                    }
                }
            });
        }
    }
}
