//! What the GPU's driver says about its memory: free and total, and the peak a run took.
//!
//! Host RSS says nothing about a model on a GPU, so the planner ([`super::planner`]) and
//! `bench` ask the driver. The peak comes from the device's default memory pool, which
//! candle's CUDA allocations are taken from (stream-ordered `cuMemAllocAsync`), so it is
//! the most the run's tensors held at once, not a sample between steps. Everything here
//! is `None` on the CPU, on Metal, and in a build without the `cuda` feature.

use candle_core::Device;

#[cfg(feature = "cuda")]
const MIB: f64 = 1024.0 * 1024.0;

/// A GPU's memory as the driver reports it, in MiB.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuMemory {
    /// Not allocated by anyone, this process or another.
    pub free_mib: f64,
    /// The card's memory.
    pub total_mib: f64,
}

/// MiB of a GPU left aside beyond the footprint estimate: cuBLAS's workspace, the memory
/// pool's rounding, and room for what other processes on the card allocate meanwhile.
pub const GPU_RESERVE_MIB: u64 = 256;

/// A memory budget, and what set it: an error that refuses a model names the limit the
/// user can change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// MiB training may take.
    pub mib: u64,
    /// Where the limit comes from.
    pub source: BudgetSource,
}

/// What sets a [`Budget`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BudgetSource {
    /// `--max-memory`.
    MaxMemory,
    /// The GPU's free memory, less [`GPU_RESERVE_MIB`].
    GpuFree {
        /// What the driver reported free, MiB.
        free_mib: u64,
    },
}

impl From<u64> for Budget {
    /// A `--max-memory` budget.
    fn from(mib: u64) -> Self {
        Self { mib, source: BudgetSource::MaxMemory }
    }
}

impl std::fmt::Display for Budget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.source {
            BudgetSource::MaxMemory => write!(f, "--max-memory {} MiB", self.mib),
            BudgetSource::GpuFree { free_mib } => write!(
                f,
                "the GPU's free memory ({free_mib} MiB, less {GPU_RESERVE_MIB} MiB kept in reserve: {} MiB)",
                self.mib
            ),
        }
    }
}

/// The budget training on `device` is planned against, in MiB: `--max-memory` on the CPU;
/// on a GPU also what its driver reports free, less [`GPU_RESERVE_MIB`], so that a step
/// that would run out of GPU memory (an abort, not a slowdown) is planned smaller or
/// refused before it starts. On a Jetson the GPU shares the board's memory, and the
/// smaller of the two is the one that binds. `None`: nothing to plan against.
pub fn training_budget(device: &Device, max_memory: Option<u64>) -> Option<Budget> {
    budget_from(max_memory, gpu_memory(device))
}

fn budget_from(max_memory: Option<u64>, gpu: Option<GpuMemory>) -> Option<Budget> {
    let gpu = gpu.map(|g| {
        let free_mib = g.free_mib.max(0.0) as u64;
        Budget { mib: free_mib.saturating_sub(GPU_RESERVE_MIB), source: BudgetSource::GpuFree { free_mib } }
    });
    let max_memory = max_memory.map(Budget::from);
    match (max_memory, gpu) {
        (Some(a), Some(b)) => Some(if b.mib < a.mib { b } else { a }),
        (a, b) => a.or(b),
    }
}

/// Free and total memory of the GPU `device` runs on.
pub fn gpu_memory(device: &Device) -> Option<GpuMemory> {
    #[cfg(feature = "cuda")]
    if let Ok(cuda) = device.as_cuda_device() {
        let (free, total) = cuda.cuda_stream().context().mem_get_info().ok()?;
        return Some(GpuMemory { free_mib: free as f64 / MIB, total_mib: total as f64 / MIB });
    }
    let _ = device;
    None
}

/// The most this process has held in the device's default memory pool since the start
/// or the last [`reset_gpu_peak`], in MiB.
pub fn gpu_peak_mib(device: &Device) -> Option<f64> {
    #[cfg(feature = "cuda")]
    if let Ok(cuda) = device.as_cuda_device() {
        return cuda_pool::used_high(cuda).map(|bytes| bytes as f64 / MIB);
    }
    let _ = device;
    None
}

/// Starts [`gpu_peak_mib`] again from what is held now (e.g. after warm-up steps).
pub fn reset_gpu_peak(device: &Device) {
    #[cfg(feature = "cuda")]
    if let Ok(cuda) = device.as_cuda_device() {
        cuda_pool::reset_used_high(cuda);
    }
    let _ = device;
}

#[cfg(feature = "cuda")]
mod cuda_pool {
    use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::CudaDevice;

    /// The default pool of the device's GPU, with its context current on this thread.
    fn default_pool(cuda: &CudaDevice) -> Option<sys::CUmemoryPool> {
        let stream = cuda.cuda_stream();
        let context = stream.context();
        context.bind_to_thread().ok()?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: the driver writes one pool handle into `pool`; the device handle comes
        // from a live context.
        let status = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, context.cu_device()) };
        (status == sys::CUresult::CUDA_SUCCESS && !pool.is_null()).then_some(pool)
    }

    pub(super) fn used_high(cuda: &CudaDevice) -> Option<u64> {
        let pool = default_pool(cuda)?;
        let mut bytes: u64 = 0;
        // SAFETY: USED_MEM_HIGH is a cuuint64_t, written into `bytes`.
        let status = unsafe {
            sys::cuMemPoolGetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut bytes as *mut u64).cast(),
            )
        };
        (status == sys::CUresult::CUDA_SUCCESS).then_some(bytes)
    }

    pub(super) fn reset_used_high(cuda: &CudaDevice) {
        let Some(pool) = default_pool(cuda) else { return };
        // The driver only accepts zero: the high-water mark restarts at the current use.
        let mut zero: u64 = 0;
        // SAFETY: as in `used_high`; the driver reads one cuuint64_t.
        let status = unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut zero as *mut u64).cast(),
            )
        };
        if status != sys::CUresult::CUDA_SUCCESS {
            tracing::debug!(?status, "could not reset the GPU memory pool's peak");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_has_no_gpu_memory_to_report() {
        assert_eq!(gpu_memory(&Device::Cpu), None);
        assert_eq!(gpu_peak_mib(&Device::Cpu), None);
        reset_gpu_peak(&Device::Cpu);
        assert_eq!(training_budget(&Device::Cpu, Some(900)), Some(Budget::from(900)));
        assert_eq!(training_budget(&Device::Cpu, None), None);
    }

    #[test]
    fn a_gpu_budget_is_its_free_memory_less_the_reserve_and_never_above_max_memory() {
        let card = |free_mib| Some(GpuMemory { free_mib, total_mib: 81_559.0 });
        let mib = |b: Option<Budget>| b.map(|b| b.mib);
        assert_eq!(mib(budget_from(None, card(80_000.5))), Some(80_000 - GPU_RESERVE_MIB));
        assert_eq!(budget_from(Some(4000), card(80_000.0)), Some(Budget::from(4000)));
        assert_eq!(mib(budget_from(Some(90_000), card(6000.0))), Some(6000 - GPU_RESERVE_MIB));
        assert_eq!(
            mib(budget_from(None, card(100.0))),
            Some(0),
            "a full card leaves nothing, which the planner refuses"
        );
    }

    #[test]
    fn a_budget_names_the_limit_that_binds() {
        let card = |free_mib| Some(GpuMemory { free_mib, total_mib: 81_559.0 });
        assert_eq!(budget_from(Some(1200), card(80_000.0)).unwrap().to_string(), "--max-memory 1200 MiB");
        let gpu = budget_from(Some(90_000), card(6000.0)).unwrap().to_string();
        assert!(gpu.starts_with("the GPU's free memory (6000 MiB") && gpu.ends_with(": 5744 MiB)"), "{gpu}");
    }
}
