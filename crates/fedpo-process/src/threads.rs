//! Thread-pool tuning for processes that train.
//!
//! candle runs its large element-wise ops on a pool of its own, beside rayon's (which runs
//! gemm and fedpo's kernels). After each op, candle's workers spin on the CPU for 25,000
//! pause instructions before they park. Between the step's element-wise ops come matmuls,
//! so on a two-core board that spin takes a core from the gemm that follows: the tiny
//! shape's step ran faster with a short spin, and the bigger DistilGPT-2 step was
//! unchanged.

/// The spin, in pause instructions, after which candle's idle workers park.
pub const CANDLE_SPIN_LIMIT: u32 = 1_000;

/// Sets candle's `CANDLE_BARRIER_POOL_SPIN_LIMIT` to [`CANDLE_SPIN_LIMIT`] unless the
/// user set it. Call first thing in `main`, before any thread exists: the environment is
/// not safe to change while another thread may read it, and candle reads it once, when
/// its pool starts.
pub fn park_idle_candle_workers_quickly() {
    const VAR: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";
    if std::env::var_os(VAR).is_none() {
        std::env::set_var(VAR, CANDLE_SPIN_LIMIT.to_string());
    }
}
