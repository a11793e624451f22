//! Layer norm over the last dimension with a one-pass backward.
//!
//! Composed from candle primitives, a layer norm keeps seven activation-sized tensors alive
//! for backward and runs about twenty elementwise passes; a DistilGPT-2 step has thirteen of
//! them. Here forward keeps only its input (mean and inverse deviation are recomputed per
//! row in backward, which is cheaper than storing them), and backward produces the input,
//! weight and bias gradients in one pass.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::multiversion::multiversion;
use super::parallel_fill::{par_filled, par_zeroed};
use super::{contiguous_slice, full_precision, CResult};

/// Rows per parallel task in backward; each task sums its own weight and bias gradients.
const ROWS_PER_TASK: usize = 32;

/// Mean and `1 / sqrt(var + eps)` of a row, in f64.
fn row_stats<T: WithDType>(row: &[T], eps: f64) -> (f64, f64) {
    let n = row.len() as f64;
    let mean = row.iter().map(|v| v.to_f64()).sum::<f64>() / n;
    let var = row.iter().map(|v| (v.to_f64() - mean).powi(2)).sum::<f64>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// The layer norm's CPU kernels: f64 as written (the reference), f32 on vectorised rows.
pub(super) trait LayerNormFloat: WithDType {
    fn forward(x: &[Self], weight: &[Self], bias: &[Self], eps: f64) -> Vec<Self>;
    fn backward(x: &[Self], weight: &[Self], grad: &[Self], eps: f64) -> Vec<Self>;
}

impl LayerNormFloat for f64 {
    fn forward(x: &[Self], weight: &[Self], bias: &[Self], eps: f64) -> Vec<Self> {
        forward_generic(x, weight, bias, eps)
    }
    fn backward(x: &[Self], weight: &[Self], grad: &[Self], eps: f64) -> Vec<Self> {
        backward_generic(x, weight, grad, eps)
    }
}

impl LayerNormFloat for f32 {
    fn forward(x: &[Self], weight: &[Self], bias: &[Self], eps: f64) -> Vec<Self> {
        let d = weight.len().max(1);
        par_filled(x.len(), ROWS_PER_TASK * d, |at, out| {
            normalize_rows(out, &x[at..at + out.len()], weight, bias, eps as f32);
        })
    }

    fn backward(x: &[Self], weight: &[Self], grad: &[Self], eps: f64) -> Vec<Self> {
        let d = weight.len().max(1);
        let rows = x.len() / d;
        let mut out = par_zeroed((rows + 2) * d);
        let (dx, dparams) = out.split_at_mut(rows * d);
        let block = ROWS_PER_TASK * d;
        let sums = dx
            .par_chunks_mut(block)
            .zip(x.par_chunks(block).zip(grad.par_chunks(block)))
            .map(|(dx, (x, grad))| {
                let mut sums = vec![0f32; 2 * d];
                backward_rows(dx, x, weight, grad, eps as f32, &mut sums);
                sums
            })
            .fold(
                || vec![0f64; 2 * d],
                |mut acc, task| {
                    acc.iter_mut().zip(&task).for_each(|(a, &t)| *a += f64::from(t));
                    acc
                },
            )
            .reduce(|| vec![0f64; 2 * d], add_sums);
        for (o, s) in dparams.iter_mut().zip(&sums) {
            *o = *s as f32;
        }
        out
    }
}

pub(super) fn forward_cpu<T: LayerNormFloat>(x: &[T], weight: &[T], bias: &[T], eps: f64) -> Vec<T> {
    T::forward(x, weight, bias, eps)
}

/// `[rows + 2, d]`: the input gradient's rows, then the weight's, then the bias's.
pub(super) fn backward_cpu<T: LayerNormFloat>(x: &[T], weight: &[T], grad: &[T], eps: f64) -> Vec<T> {
    T::backward(x, weight, grad, eps)
}

/// Two tasks' weight and bias gradient sums, added.
fn add_sums(mut a: Vec<f64>, b: Vec<f64>) -> Vec<f64> {
    a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
    a
}

const LANES: usize = 16;

/// `sum(f(x))` over independent lanes, so the loop vectorises.
#[inline(always)]
fn lane_sum(xs: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for chunk in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(chunk) {
            *a += f(v);
        }
    }
    let tail: f32 = chunks.remainder().iter().map(|&v| f(v)).sum();
    acc.iter().sum::<f32>() + tail
}

/// Mean and `1 / sqrt(var + eps)` of a row in f32, the variance from the centred values.
#[inline(always)]
fn row_stats_f32(row: &[f32], eps: f32) -> (f32, f32) {
    let d = row.len() as f32;
    let mean = lane_sum(row, |v| v) / d;
    let var = lane_sum(row, |v| (v - mean) * (v - mean)) / d;
    (mean, 1.0 / (var + eps).sqrt())
}

multiversion! {
    /// Normalized rows of `x` into `out`, dispatched to the CPU's widest vectors.
    fn normalize_rows / normalize_rows_at(out: &mut [f32], x: &[f32], weight: &[f32], bias: &[f32], eps: f32) {
        let d = weight.len();
        for (out, row) in out.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
            let (mean, rstd) = row_stats_f32(row, eps);
            for (((o, &v), &w), &b) in out.iter_mut().zip(row).zip(weight).zip(bias) {
                *o = (v - mean) * rstd * w + b;
            }
        }
    }
}

multiversion! {
    /// The input gradient of a chunk of rows into `dx`, its weight and bias gradients
    /// added into `sums` (`[dw | db]`).
    fn backward_rows / backward_rows_at(
        dx: &mut [f32],
        x: &[f32],
        weight: &[f32],
        grad: &[f32],
        eps: f32,
        sums: &mut [f32],
    ) {
        let d = weight.len();
        let (dw, db) = sums.split_at_mut(d);
        let (dw, db) = (&mut dw[..d], &mut db[..d]);
        let full = d / LANES * LANES;
        for ((dx, row), g) in dx.chunks_exact_mut(d).zip(x.chunks_exact(d)).zip(grad.chunks_exact(d)) {
            let (mean, rstd) = row_stats_f32(row, eps);
            let (dx, row, g) = (&mut dx[..d], &row[..d], &g[..d]);
            let (mut s_dn, mut s_dn_n) = ([0f32; LANES], [0f32; LANES]);
            for base in (0..full).step_by(LANES) {
                for l in 0..LANES {
                    let j = base + l;
                    let n = (row[j] - mean) * rstd;
                    let dn = g[j] * weight[j];
                    dw[j] += g[j] * n;
                    db[j] += g[j];
                    s_dn[l] += dn;
                    s_dn_n[l] += dn * n;
                }
            }
            for j in full..d {
                let n = (row[j] - mean) * rstd;
                let dn = g[j] * weight[j];
                dw[j] += g[j] * n;
                db[j] += g[j];
                s_dn[0] += dn;
                s_dn_n[0] += dn * n;
            }
            let mean_dn = s_dn.iter().sum::<f32>() / d as f32;
            let mean_dn_n = s_dn_n.iter().sum::<f32>() / d as f32;
            for j in 0..d {
                let n = (row[j] - mean) * rstd;
                dx[j] = rstd * (g[j] * weight[j] - mean_dn - n * mean_dn_n);
            }
        }
    }
}

fn forward_generic<T: WithDType>(x: &[T], weight: &[T], bias: &[T], eps: f64) -> Vec<T> {
    let d = weight.len();
    let mut out = vec![T::zero(); x.len()];
    out.par_chunks_mut(d).zip(x.par_chunks(d)).for_each(|(out, row)| {
        let (mean, rstd) = row_stats(row, eps);
        for (((o, v), w), b) in out.iter_mut().zip(row).zip(weight).zip(bias) {
            *o = T::from_f64((v.to_f64() - mean) * rstd * w.to_f64() + b.to_f64());
        }
    });
    out
}

fn backward_generic<T: WithDType>(x: &[T], weight: &[T], grad: &[T], eps: f64) -> Vec<T> {
    let d = weight.len();
    let rows = x.len() / d;
    let mut out = vec![T::zero(); (rows + 2) * d];
    let (dx, dparams) = out.split_at_mut(rows * d);
    let (dweight, dbias) = dparams.split_at_mut(d);
    let block = ROWS_PER_TASK * d;
    let sums = dx
        .par_chunks_mut(block)
        .zip(x.par_chunks(block).zip(grad.par_chunks(block)))
        .map(|(dx, (x, grad))| {
            let mut sums = vec![0f64; 2 * d];
            let (dw, db) = sums.split_at_mut(d);
            let mut normed = vec![0f64; d];
            for ((dx, row), g) in dx.chunks_mut(d).zip(x.chunks(d)).zip(grad.chunks(d)) {
                let (mean, rstd) = row_stats(row, eps);
                let (mut mean_dn, mut mean_dn_n) = (0f64, 0f64);
                for j in 0..d {
                    let (n, g) = ((row[j].to_f64() - mean) * rstd, g[j].to_f64());
                    normed[j] = n;
                    dw[j] += g * n;
                    db[j] += g;
                    let dn = g * weight[j].to_f64();
                    mean_dn += dn;
                    mean_dn_n += dn * n;
                }
                mean_dn /= d as f64;
                mean_dn_n /= d as f64;
                for j in 0..d {
                    let dn = g[j].to_f64() * weight[j].to_f64();
                    dx[j] = T::from_f64(rstd * (dn - mean_dn - normed[j] * mean_dn_n));
                }
            }
            sums
        })
        .reduce(|| vec![0f64; 2 * d], add_sums);
    for (o, s) in dweight.iter_mut().chain(dbias.iter_mut()).zip(&sums) {
        *o = T::from_f64(*s);
    }
    out
}

struct LayerNorm {
    eps: f64,
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let n = self.name();
        let out = map_float_storage!(s1, n, T => forward_cpu::<T>(
            contiguous_slice(s1, l1, n)?,
            contiguous_slice(s2, l2, n)?,
            contiguous_slice(s3, l3, n)?,
            self.eps,
        ));
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _bias: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = weight.dim(0)?;
        let rows = x.elem_count() / d;
        let all = x.apply_op3_no_bwd(weight, &grad.contiguous()?, &LayerNormBackward { eps: self.eps })?;
        let dx = all.narrow(0, 0, rows)?.reshape(x.shape())?;
        // The parameter gradients are copied out so that the grad store does not keep the whole
        // activation-sized buffer alive until the end of backward.
        let dweight = all.narrow(0, rows, 1)?.squeeze(0)?.copy()?;
        let dbias = all.narrow(0, rows + 1, 1)?.squeeze(0)?.copy()?;
        Ok((Some(dx), Some(dweight), Some(dbias)))
    }
}

struct LayerNormBackward {
    eps: f64,
}

impl CustomOp3 for LayerNormBackward {
    fn name(&self) -> &'static str {
        "layer-norm-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let n = self.name();
        let d = l2.shape().elem_count();
        let rows = l1.shape().elem_count() / d.max(1);
        let out = map_float_storage!(s1, n, T => backward_cpu::<T>(
            contiguous_slice(s1, l1, n)?,
            contiguous_slice(s2, l2, n)?,
            contiguous_slice(s3, l3, n)?,
            self.eps,
        ));
        Ok((out, Shape::from((rows + 2, d))))
    }
}

/// Layer norm over the last dimension: `(x - mean) / sqrt(var + eps) * weight + bias`.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> CResult<Tensor> {
    let d = x.dim(candle_core::D::Minus1)?;
    if x.device().is_cpu() && full_precision(x) && weight.dims() == [d] && bias.dims() == [d] && d > 0 {
        x.contiguous()?.apply_op3(&weight.contiguous()?, &bias.contiguous()?, LayerNorm { eps })
    } else {
        super::layer_norm_composed(x, weight, bias, eps)
    }
}

#[cfg(test)]
mod tests {
    use super::super::layer_norm_composed;
    use super::super::tests::{max_abs_diff, randn};
    use super::*;
    use candle_core::Var;

    #[test]
    fn fused_layer_norm_matches_the_composed_one_in_value_and_all_three_gradients() {
        let x = Var::from_tensor(&randn(&[3, 70, 48], 11)).unwrap();
        let w = Var::from_tensor(&randn(&[48], 12)).unwrap();
        let b = Var::from_tensor(&randn(&[48], 13)).unwrap();
        let upstream = randn(&[3, 70, 48], 14);
        let fused = layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5).unwrap();
        let composed = layer_norm_composed(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5).unwrap();
        assert!(max_abs_diff(&fused, &composed) < 1e-12);
        let g_fused = (fused * &upstream).unwrap().sum_all().unwrap().backward().unwrap();
        let g_comp = (composed * &upstream).unwrap().sum_all().unwrap().backward().unwrap();
        for (name, v) in [("x", &x), ("weight", &w), ("bias", &b)] {
            let (a, c) = (g_fused.get(v.as_tensor()).unwrap(), g_comp.get(v.as_tensor()).unwrap());
            assert_eq!(a.dims(), c.dims(), "{name}");
            assert!(max_abs_diff(a, c) < 1e-10, "{name} gradient differs by {}", max_abs_diff(a, c));
        }
    }

    #[test]
    fn f32_layer_norm_gradients_track_the_f64_ones_at_every_vector_width() {
        // 50 columns: three full lanes of 16 and a tail
        for d in [768, 50] {
            let x64 = (randn(&[40, d], 31) * 4.0).unwrap().affine(1.0, 2.5).unwrap();
            let (w64, g64) = (randn(&[d], 32), randn(&[40, d], 33));
            let exact = backward_generic(
                &x64.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
                &w64.to_vec1::<f64>().unwrap(),
                &g64.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
                1e-5,
            );
            let f32s = |t: &Tensor| {
                t.flatten_all().unwrap().to_dtype(candle_core::DType::F32).unwrap().to_vec1::<f32>().unwrap()
            };
            let ours = <f32 as LayerNormFloat>::backward(&f32s(&x64), &f32s(&w64), &f32s(&g64), 1e-5);
            let scale = exact.iter().fold(0f64, |m, v| m.max(v.abs()));
            let err = ours.iter().zip(&exact).map(|(a, e)| (f64::from(*a) - e).abs()).fold(0.0, f64::max);
            assert!(err < 1e-5 * scale, "d={d}: off by {err} of {scale}");
            let (x, w, g) = (f32s(&x64), f32s(&w64), f32s(&g64));
            let mut by_level = Vec::new();
            for level in crate::ops::multiversion::supported_levels() {
                let (mut dx, mut sums) = (vec![0f32; 40 * d], vec![0f32; 2 * d]);
                backward_rows_at(level, &mut dx, &x, &w, &g, 1e-5, &mut sums);
                let mut out = vec![0f32; 40 * d];
                normalize_rows_at(level, &mut out, &x, &w, &w, 1e-5);
                by_level.push((dx, sums, out));
            }
            assert!(by_level.windows(2).all(|p| p[0] == p[1]), "d={d}: results differ between vector widths");
        }
    }

    #[test]
    fn fused_layer_norm_in_f32_is_as_close_to_f64_as_f32_allows() {
        let x64 = randn(&[64, 768], 21);
        let (w64, b64) = (randn(&[768], 22), randn(&[768], 23));
        let f32 = |t: &Tensor| t.to_dtype(candle_core::DType::F32).unwrap();
        let ours = layer_norm(&f32(&x64), &f32(&w64), &f32(&b64), 1e-5).unwrap();
        let exact = layer_norm(&x64, &w64, &b64, 1e-5).unwrap();
        let err = max_abs_diff(&ours.to_dtype(candle_core::DType::F64).unwrap(), &exact);
        assert!(err < 1e-5, "{err}");
    }
}
