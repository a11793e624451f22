//! The x86-64 inner kernels of the bf16 matmul: one 32 x 32 block of f32 output from
//! packed bf16 operands, on AMX tiles or on AVX512-BF16's `vdpbf16ps`, and the vector
//! conversions that fill the packs.
//!
//! Both kernels read the same packs (see [`super::bf16_pack`]):
//! - the left operand as rows of `kp` bf16 (`kp` a multiple of 32), 32 rows per block;
//! - the right operand as strips of 16 columns, each strip `kp / 2` rows of 16 column
//!   pairs `(b[2q][j], b[2q + 1][j])`: the "VNNI" layout both `tdpbf16ps` and `vdpbf16ps`
//!   multiply, two products of the inner dimension per f32 lane.
//!
//! AMX needs the process to ask Linux for the tile registers' state
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`), once; a refused request
//! leaves the AVX512-BF16 kernel. Rust's AMX intrinsics are unstable, so the tile kernel is
//! inline assembly; the compiler never touches the tile registers, which a [`Tiles`]
//! value configures for one task on one thread and releases when dropped.

use std::arch::asm;
use std::arch::x86_64::*;

/// The rows and columns of output one kernel call writes.
pub(super) const BLOCK: usize = 32;

/// Whether the CPU reports AMX-TILE and AMX-BF16 and Linux granted this process the tile
/// data state. Asked once; the grant holds for every thread of the process.
pub(super) fn amx_usable() -> bool {
    static USABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *USABLE.get_or_init(|| {
        let leaf7 = __cpuid_count(7, 0);
        let (amx_bf16, amx_tile) = ((leaf7.edx >> 22) & 1 == 1, (leaf7.edx >> 24) & 1 == 1);
        amx_bf16 && amx_tile && request_tile_data()
    })
}

#[cfg(target_os = "linux")]
fn request_tile_data() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with this request only changes which xsave features the kernel
    // lets the process use; a kernel without AMX support returns an error.
    let ret = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
    if ret != 0 {
        tracing::debug!(errno = std::io::Error::last_os_error().raw_os_error(), "AMX tile data refused by the kernel");
    }
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn request_tile_data() -> bool {
    false
}

/// Whether `vdpbf16ps` and the conversions the packs use may run.
pub(super) fn avx512_bf16_usable() -> bool {
    is_x86_feature_detected!("avx512bf16") && is_x86_feature_detected!("avx512bw")
}

/// The 64-byte tile configuration `ldtilecfg` reads (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    _reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

/// tmm0-3: the 2 x 2 output tiles (16 x 16 f32); tmm4-5: two 16-row slices of the left
/// operand (16 x 32 bf16); tmm6-7: two strips of the right (16 pair-rows x 16 columns).
const TILES: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    _reserved: [0; 14],
    bytes_per_row: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// The tile registers configured for [`amx_block`] on this thread, released on drop.
/// Configuring once per task rather than per block: `ldtilecfg` and `tilerelease` cost
/// as much as a short block's products. Not `Send`: the configuration is the thread's.
pub(super) struct Tiles(std::marker::PhantomData<*const ()>);

impl Tiles {
    /// # Safety
    /// [`amx_usable`] returned true, and nothing else on this thread uses the tile
    /// registers while the value lives.
    pub(super) unsafe fn configure() -> Self {
        // SAFETY: AMX is usable (the caller's contract); TILES is a valid palette-1
        // configuration.
        unsafe { asm!("ldtilecfg [{cfg}]", cfg = in(reg) &TILES as *const TileConfig, options(nostack, readonly)) };
        Self(std::marker::PhantomData)
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: the tiles were configured by `configure`; releasing them returns the
        // thread to the init state, which costs nothing on a context switch.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// `c[32 x 32] (+)= a[32 x kp] @ b` on AMX: with `add`, the tiles start from `c`'s
/// values, so an accumulating product needs no pass of its own.
///
/// # Safety
/// `a` holds 32 rows of `a_stride` bf16 with `kp` readable in
/// each; `b0` and `b1` each hold one packed strip of `kp / 2` pair-rows; `kp` is a
/// positive multiple of 32; `c` holds 32 rows of 32 f32, `c_stride` f32 apart.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn amx_block(
    _tiles: &Tiles,
    a: *const u16,
    a_stride: usize,
    b0: *const u16,
    b1: *const u16,
    kp: usize,
    c: *mut f32,
    c_stride: usize,
    add: bool,
) {
    debug_assert!(kp >= 32 && kp.is_multiple_of(32));
    let a1 = a.wrapping_add(16 * a_stride);
    let (c1, c2, c3) = (c.wrapping_add(16), c.wrapping_add(16 * c_stride), c.wrapping_add(16 * c_stride + 16));
    // SAFETY: the caller's contract: every tile load stays inside a's rows (64 bytes of
    // each of 16 rows, a_stride * 2 bytes apart), b's strips (16 pair-rows of 64 bytes)
    // and c's 32 x 32; `_tiles` proves the registers are configured as TILES.
    unsafe {
        asm!(
            "test {add}, {add}",
            "jz 3f",
            "tileloadd tmm0, [{c0} + {sc}*1]",
            "tileloadd tmm1, [{c1} + {sc}*1]",
            "tileloadd tmm2, [{c2} + {sc}*1]",
            "tileloadd tmm3, [{c3} + {sc}*1]",
            "jmp 2f",
            "3:",
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "2:",
            "tileloadd tmm4, [{a0} + {sa}*1]",
            "tileloadd tmm5, [{a1} + {sa}*1]",
            "tileloadd tmm6, [{b0} + {sb}*1]",
            "tileloadd tmm7, [{b1} + {sb}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a0}, 64",
            "add {a1}, 64",
            "add {b0}, 1024",
            "add {b1}, 1024",
            "dec {steps}",
            "jnz 2b",
            "tilestored [{c0} + {sc}*1], tmm0",
            "tilestored [{c1} + {sc}*1], tmm1",
            "tilestored [{c2} + {sc}*1], tmm2",
            "tilestored [{c3} + {sc}*1], tmm3",
            add = in(reg) usize::from(add),
            a0 = inout(reg) a => _,
            a1 = inout(reg) a1 => _,
            b0 = inout(reg) b0 => _,
            b1 = inout(reg) b1 => _,
            steps = inout(reg) kp / 32 => _,
            sa = in(reg) a_stride * 2,
            sb = in(reg) 64usize,
            c0 = in(reg) c,
            c1 = in(reg) c1,
            c2 = in(reg) c2,
            c3 = in(reg) c3,
            sc = in(reg) c_stride * 4,
            options(nostack),
        );
    }
}

/// [`amx_block`] on AVX512-BF16: eight rows at a time, each row's pair of inner products
/// broadcast against a strip's pair-row, 16 accumulators in registers.
///
/// # Safety
/// [`avx512_bf16_usable`] returned true; the operands are as [`amx_block`]'s.
#[target_feature(enable = "avx512f,avx512bf16,avx512bw")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn avx512_block(
    a: *const u16,
    a_stride: usize,
    b0: *const u16,
    b1: *const u16,
    kp: usize,
    c: *mut f32,
    c_stride: usize,
    add: bool,
) {
    const ROWS: usize = 8;
    // SAFETY: pair-row q of each strip, pair q of each of the 32 rows and row r of c lie
    // inside the packs and the output (the caller's contract); the transmutes reinterpret
    // 512 bits as 32 bf16, the type `vdpbf16ps` takes.
    unsafe {
        for group in 0..BLOCK / ROWS {
            let a = a.add(group * ROWS * a_stride);
            let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
            if add {
                for (r, acc) in acc.iter_mut().enumerate() {
                    let row = c.add((group * ROWS + r) * c_stride);
                    *acc = [_mm512_loadu_ps(row), _mm512_loadu_ps(row.add(16))];
                }
            }
            for q in 0..kp / 2 {
                let s0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b0.add(q * 32).cast()));
                let s1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b1.add(q * 32).cast()));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let pair = a.add(r * a_stride + 2 * q).cast::<i32>().read_unaligned();
                    let pair: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                    acc[0] = _mm512_dpbf16_ps(acc[0], pair, s0);
                    acc[1] = _mm512_dpbf16_ps(acc[1], pair, s1);
                }
            }
            for (r, acc) in acc.iter().enumerate() {
                let row = c.add((group * ROWS + r) * c_stride);
                _mm512_storeu_ps(row, acc[0]);
                _mm512_storeu_ps(row.add(16), acc[1]);
            }
        }
    }
}

/// Rounds 16 f32 at `src` to bf16 (nearest, ties to even) at `dst`.
///
/// # Safety
/// [`avx512_bf16_usable`] returned true; `src` has 16 f32 to read, `dst` room for 16 u16.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16,avx512bw")]
pub(super) unsafe fn round_16(src: *const f32, dst: *mut u16) {
    // SAFETY: the caller's contract.
    unsafe {
        let v: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(_mm512_loadu_ps(src)));
        _mm256_storeu_si256(dst.cast(), v);
    }
}

/// Rounds 16 f32 from each of two rows and interleaves them, `(lo[j], hi[j])` for each
/// `j`: one pair-row of a packed strip.
///
/// # Safety
/// As [`round_16`], with 16 f32 at both `lo` and `hi` and room for 32 u16 at `dst`.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16,avx512bw")]
pub(super) unsafe fn round_interleaved_16(lo: *const f32, hi: *const f32, dst: *mut u16) {
    // Lane 2j takes lo's j (element j of the conversion), lane 2j + 1 hi's (element 16 + j).
    const INTERLEAVE: [i16; 32] = [
        0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30,
        15, 31,
    ];
    // SAFETY: the caller's contract.
    unsafe {
        let both: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(hi), _mm512_loadu_ps(lo)));
        let order = _mm512_loadu_si512(INTERLEAVE.as_ptr().cast());
        _mm512_storeu_si512(dst.cast(), _mm512_permutexvar_epi16(order, both));
    }
}
