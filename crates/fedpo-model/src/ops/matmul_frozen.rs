//! A matmul whose backward skips the weight gradient, for frozen weights: candle's matmul
//! always computes it (e.g. the full 50257x768 tied head), a weight-sized matmul per frozen
//! layer per step thrown away.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};

use super::CResult;

struct MatmulFrozenRhs;

impl CustomOp2 for MatmulFrozenRhs {
    fn name(&self) -> &'static str {
        "matmul-frozen-rhs"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> CResult<(CpuStorage, Shape)> {
        let (m, k) = l1.shape().dims2()?;
        let (k2, n) = l2.shape().dims2()?;
        if k != k2 {
            candle_core::bail!("matmul-frozen-rhs: inner dimensions differ, {m}x{k} @ {k2}x{n}");
        }
        let out = s1.matmul(s2, (1, m, n, k), l1, l2)?;
        Ok((out, Shape::from((m, n))))
    }

    fn bwd(&self, _x: &Tensor, w: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.matmul(&w.t()?)?), None))
    }
}

/// `x @ w` for a 2-D `x` and a weight `w` that is never trained: backward returns only the
/// input gradient. Saves a full weight-sized matmul per frozen layer per step.
pub fn matmul_frozen_rhs(x: &Tensor, w: &Tensor) -> CResult<Tensor> {
    if x.device().is_cpu() {
        x.apply_op2(&w.detach(), MatmulFrozenRhs)
    } else {
        x.matmul(&w.detach())
    }
}
