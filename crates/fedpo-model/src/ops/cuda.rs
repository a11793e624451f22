//! The fused ops' CUDA kernels (`kernels/*.cu`, compiled to PTX by `build.rs`), launched
//! from the ops' `cuda_fwd`. Inputs are contiguous f32 (the ops make them so); anything
//! else goes to candle's composed ops before reaching here.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{CudaStorage, Layout, Shape};

use super::CResult;

mod ptx {
    // cudaforge writes `pub const NAME: &str` for each kernel file
    #![allow(unreachable_pub)]
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

/// candle keeps loaded modules by name, per device.
const TOKEN_LOGPROBS_MODULE: &str = "fedpo-token-logprobs";
/// Threads per block of the row kernels (a multiple of 32, at most 1024).
const ROW_THREADS: u32 = 512;
/// Threads per block of the elementwise kernels.
const THREADS: u32 = 256;

fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout, what: &str) -> CResult<CudaView<'a, T>> {
    let Some((start, end)) = l.contiguous_offsets() else {
        candle_core::bail!("{what}: the CUDA kernel takes contiguous inputs");
    };
    Ok(s.as_cuda_slice::<T>()?.slice(start..end))
}

fn vocab_u32(vocab: usize, what: &str) -> CResult<u32> {
    u32::try_from(vocab).map_err(|_| candle_core::Error::Msg(format!("{what}: {vocab} columns exceed u32")))
}

/// `log softmax(logits)[i, targets[i]]` for `[rows, vocab]` f32 logits and u32 targets.
pub(super) fn token_logprobs(
    logits: &CudaStorage,
    logits_layout: &Layout,
    targets: &CudaStorage,
    targets_layout: &Layout,
) -> CResult<(CudaStorage, Shape)> {
    const WHAT: &str = "token-logprobs";
    let (rows, vocab) = logits_layout.shape().dims2()?;
    if targets_layout.shape().elem_count() != rows {
        candle_core::bail!("{WHAT}: {rows} logit rows but {} targets", targets_layout.shape().elem_count());
    }
    let device = logits.device().clone();
    // SAFETY: every one of the `rows` values is written by the kernel below.
    let mut out = unsafe { device.alloc::<f32>(rows)? };
    if rows > 0 && vocab > 0 {
        let (x, t) = (view::<f32>(logits, logits_layout, WHAT)?, view::<u32>(targets, targets_layout, WHAT)?);
        let vocab = vocab_u32(vocab, WHAT)?;
        let func = device.get_or_load_custom_func("token_logprobs_f32", TOKEN_LOGPROBS_MODULE, ptx::TOKEN_LOGPROBS)?;
        let config =
            LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (ROW_THREADS, 1, 1), shared_mem_bytes: 0 };
        let mut launch = func.builder();
        launch.arg(&x).arg(&t).arg(&mut out).arg(&vocab);
        // SAFETY: the kernel reads `rows * vocab` logits and `rows` targets, the sizes of
        // the views, and writes `rows` outputs.
        unsafe { launch.launch(config) }.w()?;
    }
    Ok((CudaStorage::wrap_cuda_slice(out, device), Shape::from(rows)))
}

/// `d/dlogits` of [`token_logprobs`]: `g * (onehot(t) - softmax(row))`, from the logits, the
/// targets and `[logp; g]` (`2 * rows` values).
pub(super) fn token_logprobs_grad(
    logits: &CudaStorage,
    logits_layout: &Layout,
    targets: &CudaStorage,
    targets_layout: &Layout,
    res_grad: &CudaStorage,
    res_grad_layout: &Layout,
) -> CResult<(CudaStorage, Shape)> {
    const WHAT: &str = "token-logprobs-grad";
    let (rows, vocab) = logits_layout.shape().dims2()?;
    if targets_layout.shape().elem_count() != rows || res_grad_layout.shape().elem_count() != 2 * rows {
        candle_core::bail!("{WHAT}: inputs disagree on the number of rows ({rows})");
    }
    let device = logits.device().clone();
    // SAFETY: every element is written by the kernel below.
    let mut grad = unsafe { device.alloc::<f32>(rows * vocab)? };
    if rows > 0 && vocab > 0 {
        let x = view::<f32>(logits, logits_layout, WHAT)?;
        let t = view::<u32>(targets, targets_layout, WHAT)?;
        let rg = view::<f32>(res_grad, res_grad_layout, WHAT)?;
        let (rows_u32, vocab_u32) = (vocab_u32(rows, WHAT)?, vocab_u32(vocab, WHAT)?);
        let chunks = vocab_u32.div_ceil(THREADS).min(65_535);
        let func =
            device.get_or_load_custom_func("token_logprobs_grad_f32", TOKEN_LOGPROBS_MODULE, ptx::TOKEN_LOGPROBS)?;
        let config = LaunchConfig { grid_dim: (rows_u32, chunks, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        let mut launch = func.builder();
        launch.arg(&x).arg(&t).arg(&rg).arg(&mut grad).arg(&rows_u32).arg(&vocab_u32);
        // SAFETY: reads `rows * vocab` logits, `rows` targets and `2 * rows` values of
        // `res_grad`; writes `rows * vocab` gradients, each once.
        unsafe { launch.launch(config) }.w()?;
    }
    Ok((CudaStorage::wrap_cuda_slice(grad, device), logits_layout.shape().clone()))
}
