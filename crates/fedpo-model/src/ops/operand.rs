//! An f32 matrix operand addressed by strides: what the packed half-precision products
//! read their inputs as, whatever the layout (row-major, transposed, or a view).

/// The inner dimension of a packed half-precision product is cut into slices of this many,
/// so a pack of the left operand never grows with it (the head's `e @ wte` runs 50,257
/// deep).
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
pub(super) const KC: usize = 4096;

/// Where element `(0, 0)` is, the (row, column) strides and the extent.
#[derive(Clone, Copy)]
pub(super) struct Operand {
    pub ptr: *const f32,
    pub row_stride: usize,
    pub col_stride: usize,
    pub rows: usize,
    pub cols: usize,
}

impl Operand {
    /// Element `(i, j)` (the bf16 packs' scalar path).
    ///
    /// # Safety
    /// `(i, j)` is inside the operand and its strides address its buffer.
    #[inline(always)]
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) unsafe fn at(&self, i: usize, j: usize) -> f32 {
        // SAFETY: the caller's contract.
        unsafe { *self.ptr.add(i * self.row_stride + j * self.col_stride) }
    }
}
