//! The optimizer's CUDA kernels (`kernels/optimizer.cu`, compiled to PTX by `build.rs`),
//! launched from the in-place ops' `cuda_fwd` (`crate::optimizer_ops`). f32 and contiguous
//! only: [`crate::optim`] sends everything else to tensor ops.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, CudaDevice, CudaStorage, Layout};

type CResult<T> = candle_core::Result<T>;

mod ptx {
    // cudaforge writes `pub const NAME: &str` for each kernel file
    #![allow(unreachable_pub)]
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

const MODULE: &str = "fedpo-optimizer";
const THREADS: u32 = 256;
/// Blocks of a launch at most; the kernels stride over the rest.
const MAX_BLOCKS: u32 = 4096;

fn offsets(l: &Layout, what: &str) -> CResult<(usize, usize)> {
    match l.contiguous_offsets() {
        Some(r) => Ok(r),
        None => bail!("{what}: the CUDA kernel takes contiguous tensors"),
    }
}

fn source<'a>((s, l): (&'a CudaStorage, &Layout), what: &str) -> CResult<CudaView<'a, f32>> {
    let (a, b) = offsets(l, what)?;
    Ok(s.as_cuda_slice::<f32>()?.slice(a..b))
}

fn destination<'a>((s, l): (&'a mut CudaStorage, &Layout), what: &str) -> CResult<(CudaViewMut<'a, f32>, CudaDevice)> {
    let (a, b) = offsets(l, what)?;
    let device = s.device().clone();
    Ok((s.as_cuda_slice_mut::<f32>()?.slice_mut(a..b), device))
}

/// The launch shape for `n` elements, and `n` as the kernels take it.
fn shape(n: usize, what: &str) -> CResult<(LaunchConfig, u32)> {
    let n = u32::try_from(n).map_err(|_| candle_core::Error::Msg(format!("{what}: {n} elements exceed u32")))?;
    let blocks = n.div_ceil(THREADS).clamp(1, MAX_BLOCKS);
    Ok((LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }, n))
}

fn same_length(what: &str, dst: usize, src: usize) -> CResult<()> {
    if dst != src {
        bail!("{what}: {src} source values for {dst} destination values");
    }
    Ok(())
}

type Dst<'a> = (&'a mut CudaStorage, &'a Layout);
type Src<'a> = (&'a CudaStorage, &'a Layout);

pub(crate) fn clipped_sgd_step(lr: f64, theta: Dst<'_>, g: Src<'_>, clip: Src<'_>) -> CResult<()> {
    const WHAT: &str = "clipped-sgd-step";
    let (mut theta, device) = destination(theta, WHAT)?;
    let (g, clip) = (source(g, WHAT)?, source(clip, WHAT)?);
    same_length(WHAT, theta.len(), g.len())?;
    let (config, n) = shape(theta.len(), WHAT)?;
    let func = device.get_or_load_custom_func("clipped_sgd_step_f32", MODULE, ptx::OPTIMIZER)?;
    let lr = lr as f32;
    let mut launch = func.builder();
    launch.arg(&mut theta).arg(&g).arg(&clip).arg(&lr).arg(&n);
    // SAFETY: reads and writes `n` values of each view, whose lengths were checked.
    unsafe { launch.launch(config) }.w()?;
    Ok(())
}

pub(crate) fn clipped_moment_update(beta: f64, square: bool, m: Dst<'_>, g: Src<'_>, clip: Src<'_>) -> CResult<()> {
    const WHAT: &str = "clipped-moment-update";
    let (mut m, device) = destination(m, WHAT)?;
    let (g, clip) = (source(g, WHAT)?, source(clip, WHAT)?);
    same_length(WHAT, m.len(), g.len())?;
    let (config, n) = shape(m.len(), WHAT)?;
    let func = device.get_or_load_custom_func("clipped_moment_update_f32", MODULE, ptx::OPTIMIZER)?;
    let (beta, square) = (beta as f32, u32::from(square));
    let mut launch = func.builder();
    launch.arg(&mut m).arg(&g).arg(&clip).arg(&beta).arg(&square).arg(&n);
    // SAFETY: as in `clipped_sgd_step`.
    unsafe { launch.launch(config) }.w()?;
    Ok(())
}

/// AdamW's update scalars: learning rate, weight decay, the two bias corrections, epsilon.
pub(crate) struct AdamScalars(pub(crate) [f64; 5]);

pub(crate) fn adam_apply(scalars: AdamScalars, theta: Dst<'_>, m: Src<'_>, v: Src<'_>) -> CResult<()> {
    const WHAT: &str = "adam-apply";
    let (mut theta, device) = destination(theta, WHAT)?;
    let (m, v) = (source(m, WHAT)?, source(v, WHAT)?);
    same_length(WHAT, theta.len(), m.len())?;
    same_length(WHAT, theta.len(), v.len())?;
    let (config, n) = shape(theta.len(), WHAT)?;
    let func = device.get_or_load_custom_func("adam_apply_f32", MODULE, ptx::OPTIMIZER)?;
    let values = scalars.0.map(|x| x as f32);
    let mut launch = func.builder();
    launch.arg(&mut theta).arg(&m).arg(&v);
    for value in &values {
        launch.arg(value);
    }
    launch.arg(&n);
    // SAFETY: as in `clipped_sgd_step`.
    unsafe { launch.launch(config) }.w()?;
    Ok(())
}
