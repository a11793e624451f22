//! GPT-2's tanh GELU with its exact derivative, each in one pass.
//!
//! f32 runs on the vectorised [`exp_f32`], at the CPU's widest vectors: with libm's scalar `tanh` this op took a tenth
//! of a DistilGPT-2 training step. f64 keeps libm, as the reference the tests compare with.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::fast_math::exp_f32;
use super::multiversion::multiversion;
use super::parallel_fill::par_filled;
use super::{contiguous_slice, full_precision, CResult};

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const GELU_COEF: f64 = 0.044_715;
/// Elements per parallel task: large enough that rayon's overhead vanishes.
const CHUNK: usize = 16 * 1024;

pub(super) fn gelu_new_f64(x: f64) -> f64 {
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + GELU_COEF * x * x * x)).tanh())
}

fn gelu_new_derivative_f64(x: f64) -> f64 {
    let inner = SQRT_2_OVER_PI * (x + GELU_COEF * x * x * x);
    let t = inner.tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_COEF * x * x)
}

/// `sigmoid(2u)` and `1 - sigmoid(2u)` for GELU's inner `u`, each without cancellation.
/// GELU is `x * sigmoid(2u)` since `(1 + tanh u) / 2 = sigmoid(2u)`; through `tanh`, the
/// derivative's `1 + t` and `1 - t^2` lose every digit in the tails.
#[inline(always)]
fn gelu_sigmoids(x: f32) -> (f32, f32) {
    let (k, c) = (SQRT_2_OVER_PI as f32, GELU_COEF as f32);
    // Beyond |u| = 40 both sigmoids are 0 or 1 in f32; clamping keeps e^{-2u} finite.
    let u = (k * (x + c * x * x * x)).clamp(-40.0, 40.0);
    let e = exp_f32(-2.0 * u);
    (1.0 / (1.0 + e), e / (1.0 + e))
}

#[inline(always)]
fn gelu_new_f32(x: f32) -> f32 {
    x * gelu_sigmoids(x).0
}

/// `d/dx [x s(2u)] = s + 2 x s (1 - s) u'` with `u' = k (1 + 3 c x^2)`.
#[inline(always)]
fn gelu_new_derivative_f32(x: f32) -> f32 {
    let (k, c) = (SQRT_2_OVER_PI as f32, GELU_COEF as f32);
    let (s, one_minus_s) = gelu_sigmoids(x);
    s + 2.0 * x * s * one_minus_s * k * (1.0 + 3.0 * c * x * x)
}

multiversion! {
    /// GELU of a chunk, dispatched to the CPU's widest vectors.
    fn forward_chunk / forward_chunk_at(out: &mut [f32], xs: &[f32]) {
        for (o, &x) in out.iter_mut().zip(xs) {
            *o = gelu_new_f32(x);
        }
    }
}

multiversion! {
    /// `grad * GELU'(x)` of a chunk, dispatched to the CPU's widest vectors.
    fn backward_chunk / backward_chunk_at(out: &mut [f32], xs: &[f32], grads: &[f32]) {
        for ((o, &x), &g) in out.iter_mut().zip(xs).zip(grads) {
            *o = g * gelu_new_derivative_f32(x);
        }
    }
}

pub(super) fn forward_f32(xs: &[f32]) -> Vec<f32> {
    par_filled(xs.len(), CHUNK, |at, out| forward_chunk(out, &xs[at..at + out.len()]))
}

/// `grads * GELU'(xs)`; `grads` must be as long as `xs`.
pub(super) fn backward_f32(xs: &[f32], grads: &[f32]) -> Vec<f32> {
    let n = xs.len().min(grads.len());
    par_filled(n, CHUNK, |at, out| backward_chunk(out, &xs[at..at + out.len()], &grads[at..at + out.len()]))
}

pub(super) fn forward_f64(xs: &[f64]) -> Vec<f64> {
    xs.par_iter().with_min_len(4096).map(|&x| gelu_new_f64(x)).collect()
}

pub(super) fn backward_f64(xs: &[f64], grads: &[f64]) -> Vec<f64> {
    xs.par_iter().with_min_len(4096).zip(grads.par_iter()).map(|(&x, &g)| g * gelu_new_derivative_f64(x)).collect()
}

struct GeluNew;

impl CustomOp1 for GeluNew {
    fn name(&self) -> &'static str {
        "gelu-new"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let out = match s {
            CpuStorage::F32(_) => CpuStorage::F32(forward_f32(contiguous_slice(s, l, self.name())?)),
            CpuStorage::F64(_) => CpuStorage::F64(forward_f64(contiguous_slice(s, l, self.name())?)),
            other => candle_core::bail!("gelu-new: unsupported dtype {:?}", other.dtype()),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(&grad.contiguous()?, &GeluNewBackward)?))
    }
}

/// `grad * gelu_new'(x)`, one pass.
struct GeluNewBackward;

impl CustomOp2 for GeluNewBackward {
    fn name(&self) -> &'static str {
        "gelu-new-backward"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> CResult<(CpuStorage, Shape)> {
        let out = match s1 {
            CpuStorage::F32(_) => CpuStorage::F32(backward_f32(
                contiguous_slice(s1, l1, self.name())?,
                contiguous_slice(s2, l2, self.name())?,
            )),
            CpuStorage::F64(_) => CpuStorage::F64(backward_f64(
                contiguous_slice(s1, l1, self.name())?,
                contiguous_slice(s2, l2, self.name())?,
            )),
            other => candle_core::bail!("gelu-new-backward: unsupported dtype {:?}", other.dtype()),
        };
        Ok((out, l1.shape().clone()))
    }
}

/// GPT-2's `gelu_new`: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub fn gelu_new(x: &Tensor) -> CResult<Tensor> {
    if x.device().is_cpu() && full_precision(x) {
        x.contiguous()?.apply_op1(GeluNew)
    } else {
        // candle's `gelu` is the same tanh approximation.
        x.gelu()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn every_vector_width_gives_the_baseline_gelu_bits() {
        use crate::ops::multiversion::{supported_levels, Level};
        let xs: Vec<f32> = (0..10_007).map(|i| -30.0 + 60.0 * i as f32 / 10_007.0).collect();
        let grads: Vec<f32> = xs.iter().map(|x| 1.0 - x / 7.0).collect();
        let run = |level| {
            let (mut fwd, mut bwd) = (vec![0f32; xs.len()], vec![0f32; xs.len()]);
            forward_chunk_at(level, &mut fwd, &xs);
            backward_chunk_at(level, &mut bwd, &xs, &grads);
            (fwd.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), bwd.iter().map(|v| v.to_bits()).collect::<Vec<_>>())
        };
        let baseline = run(Level::Baseline);
        for level in supported_levels() {
            assert!(run(level) == baseline, "{level:?} differs from the baseline");
        }
    }

    #[test]
    fn f32_gelu_and_its_derivative_match_the_f64_reference() {
        let xs: Vec<f32> = (0..=200_000).map(|i| -12.0 + 24.0 * i as f32 / 200_000.0).collect();
        let ones = vec![1f32; xs.len()];
        let (fwd, bwd) = (forward_f32(&xs), backward_f32(&xs, &ones));
        for ((&x, &y), &d) in xs.iter().zip(&fwd).zip(&bwd) {
            let (y64, d64) = (gelu_new_f64(x as f64), gelu_new_derivative_f64(x as f64));
            assert!((y as f64 - y64).abs() <= 4e-7 * (1.0 + y64.abs()), "gelu({x}) = {y}, f64 {y64}");
            assert!((d as f64 - d64).abs() <= 4e-7 * (1.0 + d64.abs()), "gelu'({x}) = {d}, f64 {d64}");
        }
    }

    #[test]
    fn f32_gelu_through_the_op_matches_candles_gelu_and_gradient_is_grad_times_derivative() {
        let xs: Vec<f32> = (0..40_000).map(|i| ((i * 7919 % 20_000) as f32 - 10_000.0) / 1500.0).collect();
        let x = Var::from_vec(xs.clone(), xs.len(), &Device::Cpu).unwrap();
        let ours = gelu_new(x.as_tensor()).unwrap();
        let candle = x.as_tensor().gelu().unwrap();
        let diff: f32 = (&ours - &candle).unwrap().abs().unwrap().max(0).unwrap().to_scalar().unwrap();
        assert!(diff < 2e-6, "f32 gelu differs from candle's by {diff}");
        let weights =
            Tensor::from_vec((0..xs.len()).map(|i| (i % 5) as f32 - 2.0).collect::<Vec<_>>(), xs.len(), &Device::Cpu)
                .unwrap();
        let grads = (ours * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        let g: Vec<f32> = grads.get(x.as_tensor()).unwrap().to_vec1().unwrap();
        for (i, (&x, &g)) in xs.iter().zip(&g).enumerate() {
            let want = ((i % 5) as f64 - 2.0) * gelu_new_derivative_f64(x as f64);
            assert!((g as f64 - want).abs() < 1e-5, "x={x}: {g} vs {want}");
        }
    }
}
