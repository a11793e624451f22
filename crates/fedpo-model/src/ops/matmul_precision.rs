//! The precision of a model's large matmuls' operands, chosen per thread for the duration
//! of a pass.
//!
//! Mixed precision on the CPU keeps parameters, activations, layer norms, softmax,
//! log-probabilities and the loss in f32 and rounds only the two operands of each large
//! matmul while packing them (bf16 in [`super::bf16_gemm`], f16 in [`super::f16_gemm`]).
//! The fused kernels read the precision on the thread that calls them, before they fan out
//! over rayon, so two models in one process do not interfere.

use std::cell::Cell;

/// The precision of the operands of a model's large f32 matmuls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MatmulPrecision {
    /// f32 operands (the default).
    #[default]
    F32,
    /// Operands rounded to bf16, products accumulated in f32.
    Bf16,
    /// Operands scaled by powers of two and rounded to f16; products accumulated in f32
    /// (in f16 over 16-deep runs on aarch64's FP16 arithmetic, see [`super::F16Engine`]).
    F16,
}

thread_local! {
    static PRECISION: Cell<MatmulPrecision> = const { Cell::new(MatmulPrecision::F32) };
}

/// Restores the thread's previous precision when dropped.
#[must_use = "the precision holds only while the guard lives"]
pub struct PrecisionScope(MatmulPrecision);

impl Drop for PrecisionScope {
    fn drop(&mut self) {
        PRECISION.with(|p| p.set(self.0));
    }
}

impl MatmulPrecision {
    /// Runs this thread's matmuls at `self` until the guard drops. The fused ops read it
    /// on the thread that calls them, before they fan out over rayon.
    pub fn scope(self) -> PrecisionScope {
        PrecisionScope(PRECISION.with(|p| p.replace(self)))
    }

    /// The precision in force on this thread.
    pub fn current() -> Self {
        PRECISION.with(Cell::get)
    }
}

/// Whether `gemm_into` should hand an `(m, n, k)` f32 product to the half-precision
/// engines: at bf16 or f16 precision, every product with at least a tile's 16 rows and
/// columns and 32-deep inner dimension. Thinner ones (a LoRA factor's rank-8 side, a
/// decoded token's single row) would be mostly padding and stay f32; so do attention's
/// per-head products, whose caller asks for f32.
pub(super) fn takes(precision: MatmulPrecision, (m, n, k): (usize, usize, usize)) -> bool {
    precision != MatmulPrecision::F32 && m >= 16 && n >= 16 && k >= 32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thin_products_and_f32_precision_stay_on_the_f32_gemm() {
        assert!(!takes(MatmulPrecision::F32, (1024, 1024, 1024)));
        for half in [MatmulPrecision::Bf16, MatmulPrecision::F16] {
            assert!(takes(half, (1024, 768, 768)));
            assert!(takes(half, (16, 16, 32)));
            // a rank-8 adapter factor, and a decoded token's row
            assert!(!takes(half, (1024, 8, 768)));
            assert!(!takes(half, (1024, 768, 8)));
            assert!(!takes(half, (1, 50257, 768)));
        }
    }

    #[test]
    fn a_precision_scope_holds_on_its_thread_until_dropped_and_nests() {
        assert_eq!(MatmulPrecision::current(), MatmulPrecision::F32);
        {
            let _outer = MatmulPrecision::Bf16.scope();
            assert_eq!(MatmulPrecision::current(), MatmulPrecision::Bf16);
            std::thread::spawn(|| assert_eq!(MatmulPrecision::current(), MatmulPrecision::F32)).join().unwrap();
            {
                let _inner = MatmulPrecision::F16.scope();
                assert_eq!(MatmulPrecision::current(), MatmulPrecision::F16);
            }
            assert_eq!(MatmulPrecision::current(), MatmulPrecision::Bf16);
        }
        assert_eq!(MatmulPrecision::current(), MatmulPrecision::F32);
    }
}
