//! Softmax over the last dimension with a one-pass backward.
//!
//! Composed, a softmax keeps the shifted scores, their exponentials and the row sums for
//! backward (three attention-sized tensors per layer) and runs five passes. Here forward
//! keeps only its result, which is all backward needs: `dx = p * (dy - sum(dy * p))`.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::fast_math::FastExp;
use super::{contiguous_slice, full_precision, CResult};

/// Softmax of `scale * row` over each row of `n`; with `causal`, row `r` of every `n x n`
/// block keeps only its first `r % n + 1` entries (a query sees itself and earlier keys)
/// and the rest are exactly zero.
fn forward_cpu<T: FastExp>(x: &[T], n: usize, scale: f64, causal: bool) -> Vec<T> {
    let mut out = vec![T::zero(); x.len()];
    let scale = T::from_f64(scale);
    out.par_chunks_mut(n).zip(x.par_chunks(n)).enumerate().for_each(|(r, (out, row))| {
        let seen = if causal { r % n + 1 } else { n };
        let (out, row) = (&mut out[..seen], &row[..seen]);
        let max = row.iter().map(|&v| v * scale).fold(T::from_f64(f64::NEG_INFINITY), |m, v| if v > m { v } else { m });
        for (o, &v) in out.iter_mut().zip(row) {
            *o = (v * scale - max).fast_exp();
        }
        let sum: f64 = out.iter().map(|o| o.to_f64()).sum();
        let inv = T::from_f64(1.0 / sum);
        out.iter_mut().for_each(|o| *o *= inv);
    });
    out
}

/// `scale * p * (dy - sum(dy * p))`, row by row.
fn backward_cpu<T: WithDType>(probs: &[T], grad: &[T], n: usize, scale: f64) -> Vec<T> {
    let mut out = vec![T::zero(); probs.len()];
    out.par_chunks_mut(n).zip(probs.par_chunks(n).zip(grad.par_chunks(n))).for_each(|(out, (p, g))| {
        let dot: f64 = p.iter().zip(g).map(|(p, g)| p.to_f64() * g.to_f64()).sum();
        let (dot, scale) = (T::from_f64(dot), T::from_f64(scale));
        for ((o, &p), &g) in out.iter_mut().zip(p).zip(g) {
            *o = scale * p * (g - dot);
        }
    });
    out
}

fn last_dim(l: &Layout) -> usize {
    l.shape().dims().last().copied().unwrap_or(1).max(1)
}

struct Softmax {
    scale: f64,
    causal: bool,
}

impl CustomOp1 for Softmax {
    fn name(&self) -> &'static str {
        "softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let n = last_dim(l);
        let dims = l.shape().dims();
        if self.causal && (dims.len() < 2 || dims[dims.len() - 2] != n) {
            candle_core::bail!("causal softmax: scores must end in a square [t, t], got {dims:?}");
        }
        let (scale, causal) = (self.scale, self.causal);
        let out = map_float_storage!(s, self.name(), T =>
            forward_cpu::<T>(contiguous_slice(s, l, self.name())?, n, scale, causal));
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        Ok(Some(res.apply_op2_no_bwd(&grad.contiguous()?, &SoftmaxBackward { scale: self.scale })?))
    }
}

struct SoftmaxBackward {
    scale: f64,
}

impl CustomOp2 for SoftmaxBackward {
    fn name(&self) -> &'static str {
        "softmax-backward"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> CResult<(CpuStorage, Shape)> {
        let (name, n) = (self.name(), last_dim(l1));
        let out = map_float_storage!(s1, name, T => backward_cpu::<T>(
            contiguous_slice(s1, l1, name)?,
            contiguous_slice(s2, l2, name)?,
            n,
            self.scale,
        ));
        Ok((out, l1.shape().clone()))
    }
}

/// Softmax over the last dimension.
pub fn softmax_last_dim(x: &Tensor) -> CResult<Tensor> {
    if x.device().is_cpu() && full_precision(x) && x.rank() > 0 {
        x.contiguous()?.apply_op1(Softmax { scale: 1.0, causal: false })
    } else {
        super::softmax_composed(x)
    }
}

/// Causal attention probabilities from raw scores `[.., t, t]`: `softmax(scale * scores)`
/// with every key after its query masked out. One op instead of a scale, a mask add and a
/// softmax, each an attention-sized tensor kept for backward.
pub fn causal_softmax(scores: &Tensor, scale: f64) -> CResult<Tensor> {
    if scores.device().is_cpu() && full_precision(scores) {
        return scores.contiguous()?.apply_op1(Softmax { scale, causal: true });
    }
    let t = scores.dim(candle_core::D::Minus1)?;
    let mask = super::masks::causal(t, scores.dtype(), scores.device())?;
    super::softmax_composed(&(scores * scale)?.broadcast_add(&mask)?)
}

#[cfg(test)]
mod tests {
    use super::super::softmax_composed;
    use super::super::tests::{max_abs_diff, randn};
    use super::*;
    use candle_core::Var;

    #[test]
    fn fused_softmax_matches_the_composed_one_with_masked_entries_and_its_gradient() {
        // an upper-triangular -inf mask, as in causal attention
        let mask: Vec<f64> =
            (0..9).flat_map(|i| (0..9).map(move |j| if j <= i { 0.0 } else { f64::NEG_INFINITY })).collect();
        let mask = Tensor::from_vec(mask, (9, 9), &candle_core::Device::Cpu).unwrap();
        let x = Var::from_tensor(&randn(&[2, 3, 9, 9], 31)).unwrap();
        let masked = x.as_tensor().broadcast_add(&mask).unwrap();
        let upstream = randn(&[2, 3, 9, 9], 32);
        let fused = softmax_last_dim(&masked).unwrap();
        let composed = softmax_composed(&masked).unwrap();
        assert!(max_abs_diff(&fused, &composed) < 1e-14);
        let g_fused = (fused * &upstream).unwrap().sum_all().unwrap().backward().unwrap();
        let g_comp = (composed * &upstream).unwrap().sum_all().unwrap().backward().unwrap();
        let (a, b) = (g_fused.get(x.as_tensor()).unwrap(), g_comp.get(x.as_tensor()).unwrap());
        assert!(max_abs_diff(a, b) < 1e-12, "gradients differ by {}", max_abs_diff(a, b));
    }

    #[test]
    fn fused_softmax_in_f32_rows_sum_to_one_and_track_f64() {
        let x64 = (randn(&[16, 128], 33) * 4.0).unwrap();
        let ours = softmax_last_dim(&x64.to_dtype(candle_core::DType::F32).unwrap()).unwrap();
        let exact = softmax_last_dim(&x64).unwrap();
        let err = max_abs_diff(&ours.to_dtype(candle_core::DType::F64).unwrap(), &exact);
        assert!(err < 1e-6, "{err}");
        let sums: Vec<f32> = ours.sum(1).unwrap().to_vec1().unwrap();
        assert!(sums.iter().all(|s| (s - 1.0).abs() < 1e-5), "{sums:?}");
    }

    #[test]
    fn causal_softmax_equals_scaled_masked_softmax_in_value_and_gradient() {
        let mask: Vec<f64> =
            (0..7).flat_map(|i| (0..7).map(move |j| if j <= i { 0.0 } else { f64::NEG_INFINITY })).collect();
        let mask = Tensor::from_vec(mask, (7, 7), &candle_core::Device::Cpu).unwrap();
        let x = Var::from_tensor(&randn(&[2, 3, 7, 7], 34)).unwrap();
        let upstream = randn(&[2, 3, 7, 7], 35);
        let fused = causal_softmax(x.as_tensor(), 0.125).unwrap();
        let composed = softmax_composed(&(x.as_tensor() * 0.125).unwrap().broadcast_add(&mask).unwrap()).unwrap();
        assert!(max_abs_diff(&fused, &composed) < 1e-14);
        // masked entries are exactly zero
        let row0: Vec<f64> = fused.get(1).unwrap().get(2).unwrap().get(0).unwrap().to_vec1().unwrap();
        assert_eq!(row0[1..], [0.0; 6]);
        let g_fused = (fused * &upstream).unwrap().sum_all().unwrap().backward().unwrap();
        let g_comp = (composed * &upstream).unwrap().sum_all().unwrap().backward().unwrap();
        let (a, b) = (g_fused.get(x.as_tensor()).unwrap(), g_comp.get(x.as_tensor()).unwrap());
        assert!(max_abs_diff(a, b) < 1e-12, "gradients differ by {}", max_abs_diff(a, b));
    }

    #[test]
    fn causal_softmax_refuses_scores_that_are_not_square() {
        let x = Tensor::zeros((2, 3, 5), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        let err = causal_softmax(&x, 1.0).unwrap_err().to_string();
        assert!(err.contains("square"), "{err}");
    }
}
