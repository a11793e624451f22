//! A raw pointer that rayon's tasks share.
//!
//! The parallel kernels (the strided gemm, the packed bf16 product, attention's per-head
//! tasks) cut one output buffer into parts that each task writes alone, and read operands
//! that outlive the parallel loop. Raw pointers are neither `Send` nor `Sync`; this wrapper
//! is, and every use states why no two tasks touch the same element.

/// A pointer that crosses into parallel tasks. Creating one is safe; what makes its use
/// sound is that the tasks write disjoint elements and the buffer outlives them, which
/// each caller's `unsafe` block states.
#[derive(Clone, Copy)]
pub(super) struct SendPtr<T>(pub(super) *mut T);

// SAFETY: see the type's doc: dereferencing stays behind each caller's `unsafe`, whose
// tasks write disjoint elements of a buffer that outlives them.
unsafe impl<T> Send for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// By value, so that closures capture the whole wrapper rather than its raw field.
    pub(super) fn get(self) -> *mut T {
        self.0
    }
}
