//! Tensor operations with gradients that are correct and cheap.
//!
//! candle 0.11's fused `softmax_last_dim`, `layer_norm` and `sdpa` return no gradient at all,
//! silently, so the model composes those from primitives here. Three CPU kernels replace
//! graphs that would otherwise allocate many activation-sized temporaries:
//! - [`matmul_frozen_rhs`]: a matmul whose backward skips the weight gradient, for frozen
//!   weights (candle's matmul always computes it, e.g. the full 50257x768 tied head);
//! - [`token_logprobs`]: a fused log-softmax + gather, so the `[tokens x vocab]` grid is read
//!   twice and written once in backward instead of materialised five times;
//! - [`gelu_new`]: GPT-2's tanh GELU with its exact derivative in one pass.
//!
//! Each kernel falls back to composed candle ops off the CPU.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Shape, Tensor, WithDType, D};
use rayon::prelude::*;

type CResult<T> = candle_core::Result<T>;

/// Layer norm over the last dimension, from primitive ops so that it has gradients.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> CResult<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let centered = x.broadcast_sub(&mean)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = centered.broadcast_div(&(var + eps)?.sqrt()?)?;
    normed.broadcast_mul(weight)?.broadcast_add(bias)
}

/// Softmax over the last dimension. The max is detached: shifting by a constant does not
/// change the result, so its gradient is exactly zero and computing it would be waste.
pub fn softmax_last_dim(x: &Tensor) -> CResult<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let exp = x.broadcast_sub(&max)?.exp()?;
    let sum = exp.sum_keepdim(D::Minus1)?;
    exp.broadcast_div(&sum)
}

/// Log-softmax over the last dimension, composed (the reference for [`token_logprobs`]).
pub fn log_softmax_last_dim(x: &Tensor) -> CResult<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let shifted = x.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    shifted.broadcast_sub(&lse)
}

fn contiguous_slice<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout, what: &str) -> CResult<&'a [T]> {
    let data = s.as_slice::<T>()?;
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => candle_core::bail!("{what}: input must be contiguous"),
    }
}

// ---------------------------------------------------------------------------------------------
// matmul with a frozen right-hand side
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// fused log-softmax + gather
// ---------------------------------------------------------------------------------------------

struct TokenLogProbs;

fn row_logsumexp<T: WithDType>(row: &[T]) -> f64 {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, v| m.max(v.to_f64()));
    let sum: f64 = row.iter().map(|v| (v.to_f64() - max).exp()).sum();
    max + sum.ln()
}

fn check_targets(targets: &[u32], vocab: usize) -> CResult<()> {
    if let Some(&bad) = targets.iter().find(|&&t| t as usize >= vocab) {
        candle_core::bail!("token id {bad} is outside the vocabulary of {vocab}");
    }
    Ok(())
}

fn token_logprobs_cpu<T: WithDType>(logits: &[T], targets: &[u32], vocab: usize) -> CResult<Vec<T>> {
    check_targets(targets, vocab)?;
    Ok(logits
        .par_chunks(vocab)
        .zip(targets.par_iter())
        .map(|(row, &t)| T::from_f64(row[t as usize].to_f64() - row_logsumexp(row)))
        .collect())
}

impl CustomOp2 for TokenLogProbs {
    fn name(&self) -> &'static str {
        "token-logprobs"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> CResult<(CpuStorage, Shape)> {
        let (rows, vocab) = l1.shape().dims2()?;
        let targets = contiguous_slice::<u32>(s2, l2, self.name())?;
        if targets.len() != rows {
            candle_core::bail!("token-logprobs: {rows} logit rows but {} targets", targets.len());
        }
        let out = match s1 {
            CpuStorage::F32(_) => {
                CpuStorage::F32(token_logprobs_cpu(contiguous_slice::<f32>(s1, l1, self.name())?, targets, vocab)?)
            }
            CpuStorage::F64(_) => {
                CpuStorage::F64(token_logprobs_cpu(contiguous_slice::<f64>(s1, l1, self.name())?, targets, vocab)?)
            }
            other => candle_core::bail!("token-logprobs: unsupported dtype {:?}", other.dtype()),
        };
        Ok((out, Shape::from(rows)))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let grad_logits = logits.apply_op3_no_bwd(targets, &Tensor::stack(&[res, grad], 0)?, &TokenLogProbsGrad)?;
        Ok((Some(grad_logits), None))
    }
}

/// Backward of [`TokenLogProbs`]: `d/dlogits = g * (onehot(t) - softmax(logits))`, with the
/// row's log-sum-exp recovered from the forward result (`lse = logit[t] - res`).
struct TokenLogProbsGrad;

fn token_logprobs_grad_cpu<T: WithDType>(logits: &[T], targets: &[u32], res_and_grad: &[T], vocab: usize) -> Vec<T> {
    let rows = targets.len();
    let (res, grad) = res_and_grad.split_at(rows);
    let mut out = vec![T::zero(); logits.len()];
    out.par_chunks_mut(vocab).enumerate().for_each(|(i, out_row)| {
        let row = &logits[i * vocab..(i + 1) * vocab];
        let t = targets[i] as usize;
        let lse = row[t].to_f64() - res[i].to_f64();
        let g = grad[i].to_f64();
        for (o, v) in out_row.iter_mut().zip(row) {
            *o = T::from_f64(-g * (v.to_f64() - lse).exp());
        }
        out_row[t] = T::from_f64(out_row[t].to_f64() + g);
    });
    out
}

impl CustomOp3 for TokenLogProbsGrad {
    fn name(&self) -> &'static str {
        "token-logprobs-grad"
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
        let (_, vocab) = l1.shape().dims2()?;
        let targets = contiguous_slice::<u32>(s2, l2, self.name())?;
        let out = match s1 {
            CpuStorage::F32(_) => CpuStorage::F32(token_logprobs_grad_cpu(
                contiguous_slice::<f32>(s1, l1, self.name())?,
                targets,
                contiguous_slice::<f32>(s3, l3, self.name())?,
                vocab,
            )),
            CpuStorage::F64(_) => CpuStorage::F64(token_logprobs_grad_cpu(
                contiguous_slice::<f64>(s1, l1, self.name())?,
                targets,
                contiguous_slice::<f64>(s3, l3, self.name())?,
                vocab,
            )),
            other => candle_core::bail!("token-logprobs-grad: unsupported dtype {:?}", other.dtype()),
        };
        Ok((out, l1.shape().clone()))
    }
}

/// `log softmax(logits)[i, targets[i]]` for `logits: [N, V]` and `targets: [N]` (u32).
pub fn token_logprobs(logits: &Tensor, targets: &Tensor) -> CResult<Tensor> {
    if logits.device().is_cpu() && full_precision(logits) {
        logits.contiguous()?.apply_op2(&targets.contiguous()?, TokenLogProbs)
    } else {
        log_softmax_last_dim(logits)?.gather(&targets.unsqueeze(1)?, 1)?.squeeze(1)
    }
}

// ---------------------------------------------------------------------------------------------
// gelu_new
// ---------------------------------------------------------------------------------------------

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const GELU_COEF: f64 = 0.044_715;

fn gelu_new_f64(x: f64) -> f64 {
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + GELU_COEF * x * x * x)).tanh())
}

fn gelu_new_derivative(x: f64) -> f64 {
    let inner = SQRT_2_OVER_PI * (x + GELU_COEF * x * x * x);
    let t = inner.tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_COEF * x * x)
}

fn map_cpu<T: WithDType>(xs: &[T], f: fn(f64) -> f64) -> Vec<T> {
    xs.par_iter().with_min_len(4096).map(|v| T::from_f64(f(v.to_f64()))).collect()
}

struct GeluNew;

impl CustomOp1 for GeluNew {
    fn name(&self) -> &'static str {
        "gelu-new"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let out = match s {
            CpuStorage::F32(_) => CpuStorage::F32(map_cpu(contiguous_slice::<f32>(s, l, self.name())?, gelu_new_f64)),
            CpuStorage::F64(_) => CpuStorage::F64(map_cpu(contiguous_slice::<f64>(s, l, self.name())?, gelu_new_f64)),
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

fn gelu_backward_cpu<T: WithDType>(xs: &[T], grads: &[T]) -> Vec<T> {
    xs.par_iter()
        .with_min_len(4096)
        .zip(grads.par_iter())
        .map(|(x, g)| T::from_f64(g.to_f64() * gelu_new_derivative(x.to_f64())))
        .collect()
}

impl CustomOp2 for GeluNewBackward {
    fn name(&self) -> &'static str {
        "gelu-new-backward"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> CResult<(CpuStorage, Shape)> {
        let out = match s1 {
            CpuStorage::F32(_) => CpuStorage::F32(gelu_backward_cpu(
                contiguous_slice::<f32>(s1, l1, self.name())?,
                contiguous_slice::<f32>(s2, l2, self.name())?,
            )),
            CpuStorage::F64(_) => CpuStorage::F64(gelu_backward_cpu(
                contiguous_slice::<f64>(s1, l1, self.name())?,
                contiguous_slice::<f64>(s2, l2, self.name())?,
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

/// The fused CPU kernels cover f32 and f64; half precision takes candle's own ops.
fn full_precision(x: &Tensor) -> bool {
    matches!(x.dtype(), candle_core::DType::F32 | candle_core::DType::F64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| rng.random_range(-3.0..3.0)).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap()
    }

    #[test]
    fn fused_token_logprobs_match_composed_log_softmax_and_gradient() {
        let logits = Var::from_tensor(&randn(&[5, 11], 1)).unwrap();
        let targets = Tensor::new(&[0u32, 3, 10, 7, 7], &Device::Cpu).unwrap();
        let weights = Tensor::new(&[1.0f64, -2.0, 0.5, 3.0, 1.5], &Device::Cpu).unwrap();

        let fused = token_logprobs(logits.as_tensor(), &targets).unwrap();
        let composed = log_softmax_last_dim(logits.as_tensor())
            .unwrap()
            .gather(&targets.unsqueeze(1).unwrap(), 1)
            .unwrap()
            .squeeze(1)
            .unwrap();
        assert!(max_abs_diff(&fused, &composed) < 1e-12);

        let g_fused = (fused * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        let g_comp = (composed * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        let a = g_fused.get(logits.as_tensor()).unwrap();
        let b = g_comp.get(logits.as_tensor()).unwrap();
        assert!(max_abs_diff(a, b) < 1e-12, "gradients differ by {}", max_abs_diff(a, b));
    }

    #[test]
    fn token_logprobs_reject_an_out_of_vocabulary_target() {
        let logits = Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap();
        let targets = Tensor::new(&[1u32, 4], &Device::Cpu).unwrap();
        let err = token_logprobs(&logits, &targets).unwrap_err().to_string();
        assert!(err.contains("token id 4") && err.contains("vocabulary of 4"), "{err}");
    }

    #[test]
    fn gelu_new_gradient_matches_central_differences() {
        let x = Var::from_tensor(&randn(&[64], 2)).unwrap();
        let grads = gelu_new(x.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
        let analytic: Vec<f64> = grads.get(x.as_tensor()).unwrap().to_vec1().unwrap();
        let xs: Vec<f64> = x.as_tensor().to_vec1().unwrap();
        for (xi, gi) in xs.iter().zip(&analytic) {
            let h = 1e-6;
            let numeric = (gelu_new_f64(xi + h) - gelu_new_f64(xi - h)) / (2.0 * h);
            assert!((numeric - gi).abs() < 1e-8, "x={xi}: {numeric} vs {gi}");
        }
        // and the forward agrees with candle's tanh-approximate gelu
        let ours = gelu_new(x.as_tensor()).unwrap();
        let candle = x.as_tensor().gelu().unwrap();
        assert!(max_abs_diff(&ours, &candle) < 1e-12);
    }

    #[test]
    fn frozen_rhs_matmul_gives_input_gradient_and_no_weight_gradient() {
        let x = Var::from_tensor(&randn(&[3, 4], 3)).unwrap();
        let w = Var::from_tensor(&randn(&[4, 5], 4)).unwrap();
        let ours = matmul_frozen_rhs(x.as_tensor(), w.as_tensor()).unwrap();
        let plain = x.as_tensor().matmul(w.as_tensor()).unwrap();
        assert!(max_abs_diff(&ours, &plain) < 1e-12);
        let g_ours = ours.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        let g_plain = plain.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        let gx = g_ours.get(x.as_tensor()).unwrap();
        assert!(max_abs_diff(gx, g_plain.get(x.as_tensor()).unwrap()) < 1e-12);
        assert!(g_ours.get(w.as_tensor()).is_none(), "a frozen weight must get no gradient");
        // transposed (tied-head) layout works too
        let wt = Var::from_tensor(&randn(&[5, 4], 5)).unwrap();
        let a = matmul_frozen_rhs(x.as_tensor(), &wt.as_tensor().t().unwrap()).unwrap();
        let b = x.as_tensor().matmul(&wt.as_tensor().t().unwrap()).unwrap();
        assert!(max_abs_diff(&a, &b) < 1e-12);
    }

    #[test]
    fn composed_layer_norm_and_softmax_have_gradients() {
        let x = Var::from_tensor(&randn(&[2, 6], 6)).unwrap();
        let w = Var::from_tensor(&randn(&[6], 7)).unwrap();
        let b = Var::from_tensor(&randn(&[6], 8)).unwrap();
        let y = layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5).unwrap();
        let s = softmax_last_dim(&y).unwrap();
        let loss = (s * randn(&[2, 6], 9)).unwrap().sum_all().unwrap();
        let grads = loss.backward().unwrap();
        for v in [&x, &w, &b] {
            let g = grads.get(v.as_tensor()).expect("gradient present");
            let norm = g.sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
            assert!(norm > 0.0);
        }
    }
}
