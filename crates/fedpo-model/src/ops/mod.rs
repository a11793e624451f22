//! Tensor operations with gradients that are correct and cheap.
//!
//! candle 0.11's fused `softmax_last_dim`, `layer_norm` and `sdpa` return no gradient at all,
//! silently, and composing them from primitives allocates many activation-sized temporaries.
//! The CPU kernels here, one per file, do each in a pass or two, with the backward written
//! out:
//! - [`linear_bias`]: `x @ w + bias` in one node, gradients only for what is trained;
//! - [`matmul_frozen_rhs`]: a matmul whose backward skips the weight gradient;
//! - [`token_logprobs`]: a fused log-softmax + gather over the vocabulary;
//! - [`gelu_new`]: GPT-2's tanh GELU with its exact derivative;
//! - [`fused_block`]: a whole block in one node, its parameter gradients written once;
//! - [`causal_self_attention`]: multi-head causal attention straight from the fused
//!   projection, with the heads read and written in place;
//! - [`layer_norm`] and [`softmax_last_dim`]: forward keeps only what backward needs;
//! - [`rows_times_weight`] and [`rows_times_table`]: one decoded token's products,
//!   streaming each weight once across every core;
//! - [`TiedGradient`]: the embedding lookup and the tied head (alone, or fused with the
//!   target tokens' log-probabilities), adding into one gradient buffer.
//!
//! f32 kernels run on [`fast_math`]'s vectorised `exp`, their inner loops compiled for
//! AVX-512, AVX2 or the baseline and picked at run time ([`multiversion`]); the head's
//! rows have kernels of their own for each ([`row_exps`]). f64 ones keep libm and are the
//! reference. Matmuls whose operands are views go to gemm with strides
//! ([`dense`]). Each kernel falls back to composed candle ops off the CPU and in half
//! precision.

/// One body for f32 and f64 CPU storages: `$T` names the element type inside `$body`, whose
/// result goes back into a storage of the same dtype. Any other dtype is an error naming `$op`.
macro_rules! map_float_storage {
    ($storage:expr, $op:expr, $T:ident => $body:expr) => {
        match $storage {
            candle_core::CpuStorage::F32(_) => {
                type $T = f32;
                candle_core::CpuStorage::F32($body)
            }
            candle_core::CpuStorage::F64(_) => {
                type $T = f64;
                candle_core::CpuStorage::F64($body)
            }
            other => candle_core::bail!("{}: unsupported dtype {:?}", $op, other.dtype()),
        }
    };
}

mod attention;
mod bf16_gemm;
#[cfg(target_arch = "x86_64")]
mod bf16_kernels;
#[cfg(target_arch = "x86_64")]
mod bf16_pack;
mod block;
#[cfg(feature = "cuda")]
mod cuda;
mod f16_gemm;
#[cfg(target_arch = "aarch64")]
mod f16_kernels;
mod f16_pack;
mod fast_math;
mod fork;
mod gelu;
mod head_logprobs;
mod layer_norm;
mod linear;
mod masks;
mod matmul_frozen;
mod matmul_precision;
mod matvec;
pub mod multiversion;
mod operand;
mod parallel_fill;
mod projection;
mod query_blocks;
mod row_exps;
mod send_ptr;
mod softmax;
mod strided_gemm;
mod tied_embedding;
mod tied_head;
mod token_logprobs;

use candle_core::{CpuStorage, Layout, Tensor, WithDType, D};

pub use attention::{
    causal_self_attention, causal_self_attention_composed, forked_self_attention, forked_self_attention_composed,
};
pub use bf16_gemm::Bf16Engine;
pub use block::{fused_block, Adapter, BlockGradients, BlockWeights, Projection};
pub use f16_gemm::F16Engine;
pub use fork::{Fork, Forks};
pub use gelu::gelu_new;
pub use layer_norm::layer_norm;
pub use linear::linear_bias;
pub use matmul_frozen::matmul_frozen_rhs;
pub use matmul_precision::{MatmulPrecision, PrecisionScope};
pub use matvec::{rows_times_table, rows_times_weight, MATVEC_MAX_ROWS};
pub use softmax::{causal_softmax, softmax_last_dim};
pub use strided_gemm::matmul;
pub use tied_embedding::TiedGradient;
pub use token_logprobs::token_logprobs;

type CResult<T> = candle_core::Result<T>;

/// Layer norm from primitive ops: the fallback off the CPU, and the fused kernel's reference.
pub fn layer_norm_composed(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> CResult<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let centered = x.broadcast_sub(&mean)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = centered.broadcast_div(&(var + eps)?.sqrt()?)?;
    normed.broadcast_mul(weight)?.broadcast_add(bias)
}

/// Softmax from primitive ops (the fallback and reference). The max is detached: shifting
/// by a constant does not change the result, so its gradient is exactly zero.
pub fn softmax_composed(x: &Tensor) -> CResult<Tensor> {
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

/// The fused CPU kernels cover f32 and f64; half precision takes candle's own ops.
fn full_precision(x: &Tensor) -> bool {
    matches!(x.dtype(), candle_core::DType::F32 | candle_core::DType::F64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    pub(super) fn randn(shape: &[usize], seed: u64) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| rng.random_range(-3.0..3.0)).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    pub(super) fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
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
            let numeric = (gelu::gelu_new_f64(xi + h) - gelu::gelu_new_f64(xi - h)) / (2.0 * h);
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
    fn composed_layer_norm_and_softmax_have_gradients_off_the_cpu_path() {
        let x = Var::from_tensor(&randn(&[2, 6], 6)).unwrap();
        let w = Var::from_tensor(&randn(&[6], 7)).unwrap();
        let b = Var::from_tensor(&randn(&[6], 8)).unwrap();
        let y = layer_norm_composed(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5).unwrap();
        let s = softmax_composed(&y).unwrap();
        let loss = (s * randn(&[2, 6], 9)).unwrap().sum_all().unwrap();
        let grads = loss.backward().unwrap();
        for v in [&x, &w, &b] {
            let g = grads.get(v.as_tensor()).expect("gradient present");
            let norm = g.sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
            assert!(norm > 0.0);
        }
    }

    #[test]
    fn f32_token_logprobs_and_their_gradient_track_the_f64_ones_over_a_real_vocabulary() {
        let logits64 = (randn(&[6, 50_257], 41) * 3.0).unwrap();
        let targets = Tensor::new(&[0u32, 17, 50_256, 300, 300, 9_999], &Device::Cpu).unwrap();
        let weights = Tensor::new(&[1.0f32, -2.0, 0.5, 3.0, 1.5, -1.0], &Device::Cpu).unwrap();
        let exact = token_logprobs(&logits64, &targets).unwrap();
        let logits32 = Var::from_tensor(&logits64.to_dtype(DType::F32).unwrap()).unwrap();
        let ours = token_logprobs(logits32.as_tensor(), &targets).unwrap();
        let err = max_abs_diff(&ours.to_dtype(DType::F64).unwrap(), &exact);
        assert!(err < 2e-5, "log-probs of magnitude ~13 differ from f64 by {err}");
        let grads = (ours * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        let g = grads.get(logits32.as_tensor()).unwrap().to_dtype(DType::F64).unwrap();
        let logits64v = Var::from_tensor(&logits64).unwrap();
        let w64 = weights.to_dtype(DType::F64).unwrap();
        let exact_g = (token_logprobs(logits64v.as_tensor(), &targets).unwrap() * w64)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let err = max_abs_diff(&g, exact_g.get(logits64v.as_tensor()).unwrap());
        assert!(err < 1e-6, "gradient differs from f64 by {err}");
    }
}
