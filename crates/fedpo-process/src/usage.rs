//! What this process has used: its peak resident memory and CPU time, and the memory the
//! kernel has available for new work.

/// This process's resource usage so far (all its threads).
#[cfg(unix)]
fn own_usage() -> Option<libc::rusage> {
    // SAFETY: getrusage only writes into the zeroed struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    (unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } == 0).then_some(usage)
}

/// Peak resident set size of this process so far, in MiB (0 where unknown).
///
/// In a fleet simulated in one process every device shares this number.
pub fn peak_rss_mib() -> f64 {
    #[cfg(unix)]
    {
        if let Some(usage) = own_usage() {
            // Linux reports KiB (macOS bytes).
            let kib = if cfg!(target_os = "macos") { usage.ru_maxrss as f64 / 1024.0 } else { usage.ru_maxrss as f64 };
            return kib / 1024.0;
        }
    }
    0.0
}

/// User and system CPU time of this process so far, all threads together (the
/// benchmark's measure of how busy its threads were).
pub fn process_cpu_seconds() -> Option<f64> {
    #[cfg(unix)]
    {
        let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
        if let Some(usage) = own_usage() {
            return Some(seconds(usage.ru_utime) + seconds(usage.ru_stime));
        }
    }
    None
}

/// Memory the kernel says is available for new work, in MiB (`MemAvailable`), if known.
pub fn available_mib() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This thread's own CPU time: an independent clock for the process-wide one.
    fn thread_cpu_seconds() -> f64 {
        // SAFETY: clock_gettime only writes into the zeroed struct it is given.
        let mut t: libc::timespec = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) }, 0);
        t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
    }

    #[test]
    fn process_cpu_time_adds_up_the_time_every_thread_computed() {
        // Each thread computes until its own clock says 0.1 s, however long a shared
        // host makes that take; other tests running in this process only add to the sum.
        let spin = || {
            let start = thread_cpu_seconds();
            let mut x = 0u64;
            while thread_cpu_seconds() - start < 0.1 {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        };
        let before = process_cpu_seconds().unwrap();
        std::thread::scope(|s| {
            s.spawn(spin);
            spin();
        });
        let spent = process_cpu_seconds().unwrap() - before;
        // getrusage counts in microseconds (or the scheduler's ticks): allow 10 ms short
        assert!(spent >= 0.19, "{spent} s of process CPU for two threads computing 0.1 s each");
    }
}
