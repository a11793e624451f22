//! glibc allocator tuning for training loops.
//!
//! By default glibc serves every allocation above 32 MiB with a fresh `mmap` and returns it
//! with `munmap` on free. A training step allocates and frees the same large activations
//! every step, so each step page-faults hundreds of MB back in and system time dominates.
//! Keeping freed memory in the heap removed that cost.
//! Peak RSS is unchanged: the same buffers are reused instead of re-mapped.

/// Disables mmap for large blocks and heap trimming. Call once, at start-up, in any
/// process that trains: the device binary, and the aggregator's in-process fleets.
pub fn keep_freed_memory_in_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters and is MT-safe (mallopt(3)).
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        // -1 disables trimming (mallopt(3)); a positive int caps the threshold at 2 GiB,
        // below a DistilGPT-2 step's heap, and the top of the heap would still be returned.
        libc::mallopt(libc::M_TRIM_THRESHOLD, -1);
    }
}

/// One glibc arena for every thread, for processes that train on several threads (the
/// aggregator's in-process devices). A thread's own arena grows in 64 MiB heaps that glibc
/// shrinks back on free whatever the trim threshold, so each device thread page-faulted its
/// activations in again every step; one arena made rounds of two DistilGPT-2 devices
/// faster. The device binary trains on its main thread and does not need it (its step
/// measured slower with it, from the rayon workers sharing the arena).
pub fn share_one_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: as above; effective for threads that have not allocated yet.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}
