//! Runtime dispatch of the fused kernels' inner loops to the CPU's widest vectors.
//!
//! The crate is built for baseline x86-64 (SSE2) so one binary runs on every desktop and
//! server, which leaves the element-wise loops four lanes wide on machines with sixteen.
//! [`multiversion!`] compiles one body three times, for AVX-512, for AVX2 + FMA and for
//! the baseline, and picks the widest the CPU reports (std caches the check). This is what
//! gemm does for the matmuls. The arithmetic is the same in all three (Rust never fuses a
//! multiply and an add on its own), so results are bit-identical whichever runs.
//!
//! Dispatch sits at the level of one row or one chunk, inside the rayon closure: the
//! target features of a function do not reach closures it hands to other threads.
//! Elsewhere (aarch64's NEON is baseline) the body is compiled once.

/// `multiversion! { fn name / name_at(args) -> ret { body } }`: `name(args)` runs the body
/// compiled for AVX-512 (F, VL, BW, DQ), for AVX2 + FMA, or for the baseline, as the CPU
/// allows; `name_at(level, args)` runs a chosen version (the tests compare them). The body
/// must be free of generics, and helpers it calls should be `#[inline(always)]` so they
/// are compiled into each version. Exported for the optimizer's kernels in `fedpo-train`.
#[macro_export]
macro_rules! multiversion {
    ($(#[$attr:meta])* $vis:vis fn $name:ident / $at:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$attr])*
        #[inline]
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            $at($crate::ops::multiversion::level(), $($arg),*)
        }

        /// The version of the function without `_at` for `level`, which must not be
        /// wider than [`level()`](crate::ops::multiversion::level) reports.
        #[allow(dead_code)]
        $vis fn $at(level: $crate::ops::multiversion::Level, $($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn portable($($arg: $ty),*) $(-> $ret)? $body

            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,bmi1,bmi2,lzcnt,popcnt")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    portable($($arg),*)
                }
                #[target_feature(enable = "avx2,fma,bmi1,bmi2,lzcnt,popcnt")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    portable($($arg),*)
                }
                // A level wider than the CPU's would be undefined behaviour: clamp to it.
                match level.min($crate::ops::multiversion::level()) {
                    // SAFETY: `level()` saw every feature this version is compiled for.
                    $crate::ops::multiversion::Level::Avx512 => return unsafe { avx512($($arg),*) },
                    // SAFETY: as above.
                    $crate::ops::multiversion::Level::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::ops::multiversion::Level::Baseline => {}
                }
            }
            let _ = level;
            portable($($arg),*)
        }
    };
}

pub use crate::multiversion;

/// The widest instruction set the dispatched kernels may use on this CPU.
/// Ordered from narrowest to widest, so `min` of two levels is the one both allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[allow(dead_code)] // only x86-64 constructs the wide levels
pub enum Level {
    Baseline,
    Avx2,
    Avx512,
}

/// Every level this CPU runs, narrowest first.
#[allow(dead_code)] // the tests' list
pub fn supported_levels() -> Vec<Level> {
    [Level::Baseline, Level::Avx2, Level::Avx512].into_iter().filter(|&l| l <= level()).collect()
}

/// The level for this CPU. `FEDPO_SIMD=baseline` (or `avx2`) caps it, for comparing the
/// versions or working around a CPU that misreports its features.
pub fn level() -> Level {
    static LEVEL: std::sync::OnceLock<Level> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        let cap = std::env::var("FEDPO_SIMD").unwrap_or_default();
        detect(&cap)
    })
}

#[cfg(target_arch = "x86_64")]
fn detect(cap: &str) -> Level {
    use std::arch::is_x86_feature_detected as has;
    let avx2 = has!("avx2") && has!("fma") && has!("bmi1") && has!("bmi2") && has!("lzcnt") && has!("popcnt");
    let avx512 = avx2 && has!("avx512f") && has!("avx512vl") && has!("avx512bw") && has!("avx512dq");
    match cap {
        "baseline" => Level::Baseline,
        "avx2" if avx2 => Level::Avx2,
        _ if avx512 => Level::Avx512,
        _ if avx2 => Level::Avx2,
        _ => Level::Baseline,
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect(_cap: &str) -> Level {
    Level::Baseline
}
