//! Memory on small devices: what training will take ([`footprint`]), fitting it into a
//! budget ([`planner`]), and what the process actually used.

pub mod footprint;
pub mod planner;

pub use footprint::{Estimate, ParamCounts, StepKernels, Workload, SAFETY_MARGIN, TOKENIZER_MIB};
pub use planner::{longest, plan, MemoryPlan, PlanError, PlanRequest, StartOnDisk};

/// Peak resident set size of this process so far, in MiB (0 where unknown).
///
/// In a fleet simulated in one process every device shares this number.
pub fn peak_rss_mib() -> f64 {
    #[cfg(unix)]
    {
        // SAFETY: getrusage only writes into the zeroed struct we pass.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } == 0 {
            // Linux reports KiB (macOS bytes).
            let kib = if cfg!(target_os = "macos") { usage.ru_maxrss as f64 / 1024.0 } else { usage.ru_maxrss as f64 };
            return kib / 1024.0;
        }
    }
    0.0
}

/// Memory the kernel says is available for new work, in MiB (`MemAvailable`), if known.
pub fn available_mib() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}
