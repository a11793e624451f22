//! Optimizer updates that write parameters and moments in place.
//!
//! Expressed as tensor ops, an SGD step on DistilGPT-2 allocates two parameter-sized
//! temporaries (328 MB each) and copies a third, and AdamW several more; on a small device
//! that is both time and peak memory. These kernels read the gradient once and update the
//! destination where it lives. On an NVIDIA GPU the device-resident step's updates run
//! as CUDA kernels ([`crate::cuda`]); elsewhere [`crate::optim`] falls back to tensor ops.
//!
//! The two passes every SGD step makes over all parameters, the gradient's sum of squares
//! and the update, run on f32 kernels compiled for the CPU's widest vectors
//! ([`fedpo_model::multiversion!`]): built for baseline x86-64 they spent a visible share
//! of a DistilGPT-2 step widening f32 to f64 two lanes at a time.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, InplaceOp2, InplaceOp3, Layout, Storage, Tensor};

type CResult<T> = candle_core::Result<T>;

fn range(l: &Layout, what: &str) -> CResult<(usize, usize)> {
    match l.contiguous_offsets() {
        Some(r) => Ok(r),
        None => bail!("{what}: tensors must be contiguous"),
    }
}

/// Elements per parallel task of the in-place kernels: large enough that rayon's overhead
/// vanishes, small enough that both cores get work on the smallest trained tensors.
const CHUNK: usize = 64 * 1024;

fn same_length(what: &str, src: usize, dst: usize) -> CResult<()> {
    if src != dst {
        bail!("{what}: {src} source values for {dst} destination values");
    }
    Ok(())
}

/// Applies `f(dst, src...)` element-wise over f32 or f64 storages, in parallel chunks.
/// Sources must have the destination's length.
macro_rules! zip_storages {
    ($name:expr, $dst:expr, $dl:expr, [$(($src:expr, $sl:expr)),+], |$d:ident, $($s:ident),+| $body:expr) => {{
        use rayon::prelude::*;
        let (d0, d1) = range($dl, $name)?;
        match $dst {
            CpuStorage::F32(dv) => {
                let dv = &mut dv[d0..d1];
                $(let $s = { let (a, b) = range($sl, $name)?; &$src.as_slice::<f32>()?[a..b] };
                  same_length($name, $s.len(), dv.len())?;)+
                dv.par_chunks_mut(CHUNK).enumerate().for_each(|(c, dv)| {
                    $(let $s = &$s[c * CHUNK..c * CHUNK + dv.len()];)+
                    for (i, $d) in dv.iter_mut().enumerate() {
                        $(let $s = f64::from($s[i]);)+
                        let v: f64 = { let $d = f64::from(*$d); $body };
                        *$d = v as f32;
                    }
                });
            }
            CpuStorage::F64(dv) => {
                let dv = &mut dv[d0..d1];
                $(let $s = { let (a, b) = range($sl, $name)?; &$src.as_slice::<f64>()?[a..b] };
                  same_length($name, $s.len(), dv.len())?;)+
                dv.par_chunks_mut(CHUNK).enumerate().for_each(|(c, dv)| {
                    $(let $s = &$s[c * CHUNK..c * CHUNK + dv.len()];)+
                    for (i, $d) in dv.iter_mut().enumerate() {
                        $(let $s = $s[i];)+
                        *$d = { let $d = *$d; $body };
                    }
                });
            }
            other => bail!("{}: unsupported dtype {:?}", $name, other.dtype()),
        }
        Ok(())
    }};
}

/// `theta -= step * g`.
pub(crate) struct SgdStep {
    pub(crate) step: f64,
}

fedpo_model::multiversion! {
    /// `theta -= step * g` over a chunk, in f64 and rounded once, as [`zip_storages!`] does.
    fn sgd_step_f32 / sgd_step_f32_at(theta: &mut [f32], g: &[f32], step: f64) {
        for (t, &g) in theta.iter_mut().zip(g) {
            *t = (f64::from(*t) - step * f64::from(g)) as f32;
        }
    }
}

impl InplaceOp2 for SgdStep {
    fn name(&self) -> &'static str {
        "sgd-step"
    }
    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> CResult<()> {
        use rayon::prelude::*;
        let step = self.step;
        if let (CpuStorage::F32(theta), CpuStorage::F32(g)) = (&mut *s1, s2) {
            let ((t0, t1), (g0, g1)) = (range(l1, "sgd-step")?, range(l2, "sgd-step")?);
            let (theta, g) = (&mut theta[t0..t1], &g[g0..g1]);
            same_length("sgd-step", g.len(), theta.len())?;
            theta.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).for_each(|(t, g)| sgd_step_f32(t, g, step));
            return Ok(());
        }
        zip_storages!("sgd-step", s1, l1, [(s2, l2)], |theta, g| theta - step * g)
    }
}

/// `theta -= step * g`, summing `g^2` on the way: an unclipped SGD step's update and its
/// gradient norm in one read of the gradient instead of two (on DistilGPT-2 the separate
/// norm pass re-read all 328 MB of it). Each chunk is updated, then its squares
/// summed while it is still in cache, with the same chunks and lanes as
/// [`cpu_sum_of_squares`], so the sum has that function's bits.
pub(crate) struct SgdStepSummingSquares {
    pub(crate) step: f64,
    /// The gradient's `sum(g^2)`, set by the op.
    pub(crate) sum_of_squares: std::sync::Mutex<f64>,
}

impl SgdStepSummingSquares {
    pub(crate) fn new(step: f64) -> Self {
        Self { step, sum_of_squares: std::sync::Mutex::new(0.0) }
    }

    /// The sum the op left.
    pub(crate) fn take_sum(self) -> f64 {
        self.sum_of_squares.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn sgd_step_f64(theta: &mut [f64], g: &[f64], step: f64) {
    for (t, &g) in theta.iter_mut().zip(g) {
        *t -= step * g;
    }
}

/// [`SgdStepSummingSquares`] over one storage pair: the chunks in parallel, their sums
/// added in order.
fn sgd_step_summing<T: Copy + Send + Sync>(
    theta: &mut [T],
    g: &[T],
    step: f64,
    update: impl Fn(&mut [T], &[T], f64) + Sync + Send,
    chunk_sum: impl Fn(&[T]) -> f64 + Sync + Send,
) -> CResult<f64> {
    use rayon::prelude::*;
    same_length("sgd-step", g.len(), theta.len())?;
    let partial: Vec<f64> = theta
        .par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .map(|(t, g)| {
            update(t, g, step);
            chunk_sum(g)
        })
        .collect();
    Ok(partial.iter().sum())
}

impl InplaceOp2 for SgdStepSummingSquares {
    fn name(&self) -> &'static str {
        "sgd-step-summing-squares"
    }
    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> CResult<()> {
        let ((t0, t1), (g0, g1)) = (range(l1, self.name())?, range(l2, self.name())?);
        let sum = match (&mut *s1, s2) {
            (CpuStorage::F32(theta), CpuStorage::F32(g)) => {
                sgd_step_summing(&mut theta[t0..t1], &g[g0..g1], self.step, sgd_step_f32, sum_of_squares_f32)?
            }
            (CpuStorage::F64(theta), CpuStorage::F64(g)) => {
                sgd_step_summing(&mut theta[t0..t1], &g[g0..g1], self.step, sgd_step_f64, sum_of_squares_f64)?
            }
            (theta, g) => bail!("{}: unsupported dtypes {:?} and {:?}", self.name(), theta.dtype(), g.dtype()),
        };
        *self.sum_of_squares.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = sum;
        Ok(())
    }
}

/// `acc += g`: gradient accumulation over micro-batches without a new buffer each time.
pub(crate) struct AddAssign;

impl InplaceOp2 for AddAssign {
    fn name(&self) -> &'static str {
        "add-assign"
    }
    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> CResult<()> {
        zip_storages!("add-assign", s1, l1, [(s2, l2)], |acc, g| acc + g)
    }
}

/// Adds `g` into `acc` where it lives when both are contiguous f32/f64 CPU tensors of one
/// shape; otherwise returns the sum as a new tensor.
pub(crate) fn accumulate(acc: Tensor, g: &Tensor) -> CResult<Tensor> {
    let in_place = acc.device().is_cpu()
        && acc.is_contiguous()
        && g.is_contiguous()
        && acc.dtype() == g.dtype()
        && acc.shape() == g.shape()
        && matches!(acc.dtype(), candle_core::DType::F32 | candle_core::DType::F64);
    if in_place {
        acc.inplace_op2(g, &AddAssign)?;
        Ok(acc)
    } else {
        acc + g
    }
}

/// `m = beta m + (1 - beta) (scale g)`, or with `square`, `(scale g)^2`.
pub(crate) struct MomentUpdate {
    pub(crate) beta: f64,
    pub(crate) scale: f64,
    pub(crate) square: bool,
}

impl InplaceOp2 for MomentUpdate {
    fn name(&self) -> &'static str {
        "moment-update"
    }
    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> CResult<()> {
        let (beta, scale, square) = (self.beta, self.scale, self.square);
        zip_storages!("moment-update", s1, l1, [(s2, l2)], |m, g| {
            let g = g * scale;
            beta * m + (1.0 - beta) * if square { g * g } else { g }
        })
    }
}

/// `theta = theta (1 - lr wd) - lr (m / bc1) / (sqrt(v / bc2) + eps)`.
pub(crate) struct AdamApply {
    pub(crate) lr: f64,
    pub(crate) weight_decay: f64,
    pub(crate) bias_correction1: f64,
    pub(crate) bias_correction2: f64,
    pub(crate) eps: f64,
}

impl InplaceOp3 for AdamApply {
    fn name(&self) -> &'static str {
        "adam-apply"
    }
    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<()> {
        let a = self;
        zip_storages!("adam-apply", s1, l1, [(s2, l2), (s3, l3)], |theta, m, v| {
            let m_hat = m / a.bias_correction1;
            let v_hat = v / a.bias_correction2;
            theta * (1.0 - a.lr * a.weight_decay) - a.lr * m_hat / (v_hat.sqrt() + a.eps)
        })
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> CResult<()> {
        let a = self;
        let scalars = [a.lr, a.weight_decay, a.bias_correction1, a.bias_correction2, a.eps];
        crate::cuda::adam_apply(crate::cuda::AdamScalars(scalars), (s1, l1), (s2, l2), (s3, l3))
    }
}

/// The one value of a `[1]` (or scalar) tensor's CPU storage, widened to f64.
fn scalar_of(s: &CpuStorage, l: &Layout, what: &str) -> CResult<f64> {
    let (a, b) = range(l, what)?;
    if b != a + 1 {
        bail!("{what}: the clipping factor must be one value, got {}", b - a);
    }
    Ok(match s {
        CpuStorage::F32(v) => f64::from(v[a]),
        CpuStorage::F64(v) => v[a],
        other => bail!("{what}: unsupported dtype {:?} for the clipping factor", other.dtype()),
    })
}

/// `theta -= lr * clip * g`, with the clipping factor a one-value tensor on the device:
/// `(theta, g, clip)`. The device-resident step's SGD update ([`crate::Optimizer::step_on_device`]).
pub(crate) struct ClippedSgdStep {
    pub(crate) lr: f64,
}

impl InplaceOp3 for ClippedSgdStep {
    fn name(&self) -> &'static str {
        "clipped-sgd-step"
    }
    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<()> {
        let step = self.lr * scalar_of(s3, l3, self.name())?;
        zip_storages!("clipped-sgd-step", s1, l1, [(s2, l2)], |theta, g| theta - step * g)
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> CResult<()> {
        crate::cuda::clipped_sgd_step(self.lr, (s1, l1), (s2, l2), (s3, l3))
    }
}

/// [`MomentUpdate`] with the clipping factor a one-value tensor: `(m, g, clip)`.
pub(crate) struct ClippedMomentUpdate {
    pub(crate) beta: f64,
    pub(crate) square: bool,
}

impl InplaceOp3 for ClippedMomentUpdate {
    fn name(&self) -> &'static str {
        "clipped-moment-update"
    }
    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<()> {
        let (beta, scale, square) = (self.beta, scalar_of(s3, l3, self.name())?, self.square);
        zip_storages!("clipped-moment-update", s1, l1, [(s2, l2)], |m, g| {
            let g = g * scale;
            beta * m + (1.0 - beta) * if square { g * g } else { g }
        })
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> CResult<()> {
        crate::cuda::clipped_moment_update(self.beta, self.square, (s1, l1), (s2, l2), (s3, l3))
    }
}

/// `sum(t^2)` in f64 without allocating, on the CPU; `None` elsewhere.
pub(crate) fn cpu_sum_of_squares(t: &Tensor) -> Option<f64> {
    let (storage, layout) = t.storage_and_layout();
    let (a, b) = layout.contiguous_offsets()?;
    match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => Some(sum_of_squares(&v[a..b], sum_of_squares_f32)),
        Storage::Cpu(CpuStorage::F64(v)) => Some(sum_of_squares(&v[a..b], sum_of_squares_f64)),
        _ => None,
    }
}

/// Independent accumulators of a chunk's sum of squares: a single chained sum would wait
/// on every add, sixteen fill two AVX-512 registers of f64.
const LANES: usize = 16;

/// `sum(x^2)` of one chunk in f64 over [`LANES`] accumulators, with `widen` applied first.
#[inline(always)]
fn lane_sum_of_squares<T: Copy>(chunk: &[T], widen: impl Fn(T) -> f64) -> f64 {
    let mut lanes = [0f64; LANES];
    let mut exact = chunk.chunks_exact(LANES);
    for group in &mut exact {
        for (lane, &x) in lanes.iter_mut().zip(group) {
            let x = widen(x);
            *lane += x * x;
        }
    }
    let tail: f64 = exact.remainder().iter().map(|&x| widen(x) * widen(x)).sum();
    lanes.iter().sum::<f64>() + tail
}

fedpo_model::multiversion! {
    /// One chunk's `sum(x^2)` in f64, dispatched to the CPU's widest vectors.
    fn sum_of_squares_f32 / sum_of_squares_f32_at(chunk: &[f32]) -> f64 {
        lane_sum_of_squares(chunk, f64::from)
    }
}

fn sum_of_squares_f64(chunk: &[f64]) -> f64 {
    lane_sum_of_squares(chunk, |x| x)
}

/// `sum(x^2)` in f64: chunks in parallel, each summed by `chunk_sum`, the chunks' sums added
/// in order. The result depends only on the values, not on the thread count.
fn sum_of_squares<T: Copy + Send + Sync>(xs: &[T], chunk_sum: impl Fn(&[T]) -> f64 + Sync + Send) -> f64 {
    use rayon::prelude::*;
    let partial: Vec<f64> = xs.par_chunks(CHUNK).map(chunk_sum).collect();
    partial.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn values(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 7919 % 1009) as f32 - 504.0) / 97.0).collect()
    }

    #[test]
    fn sum_of_squares_over_many_chunks_matches_a_sequential_f64_sum() {
        let xs = values(3 * CHUNK + 1234);
        let exact: f64 = xs.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        let t = Tensor::from_slice(&xs, xs.len(), &Device::Cpu).unwrap();
        let ours = cpu_sum_of_squares(&t).unwrap();
        assert!(((ours - exact) / exact).abs() < 1e-10, "{ours} vs {exact}");
        // a view into the middle of a storage sums only its own elements
        let mid = t.narrow(0, 100, 2 * CHUNK).unwrap();
        let exact_mid: f64 = xs[100..100 + 2 * CHUNK].iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        assert!((cpu_sum_of_squares(&mid).unwrap() - exact_mid).abs() / exact_mid < 1e-10);
    }

    #[test]
    fn sgd_step_in_parallel_chunks_updates_every_element_and_only_the_view() {
        let n = 2 * CHUNK + 77;
        let (theta0, g) = (values(n), values(n).iter().map(|v| v * 0.5 + 1.0).collect::<Vec<_>>());
        let theta = Var::from_slice(&theta0, n, &Device::Cpu).unwrap();
        let grad = Tensor::from_slice(&g, n, &Device::Cpu).unwrap();
        theta.as_tensor().inplace_op2(&grad, &SgdStep { step: 0.1 }).unwrap();
        let got = theta.as_tensor().to_vec1::<f32>().unwrap();
        for i in [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, n - 1] {
            let want = (f64::from(theta0[i]) - 0.1 * f64::from(g[i])) as f32;
            assert_eq!(got[i], want, "element {i}");
        }
    }

    #[test]
    fn every_vector_width_gives_the_baseline_kernels_bits() {
        use fedpo_model::ops::multiversion::{supported_levels, Level};
        // 1000 + 7: whole lane groups and a tail
        let (theta0, g) = (values(1007), values(1007).iter().map(|v| v * 0.25 - 2.0).collect::<Vec<_>>());
        let base_sum = sum_of_squares_f32_at(Level::Baseline, &g);
        let mut base_theta = theta0.clone();
        sgd_step_f32_at(Level::Baseline, &mut base_theta, &g, 0.003);
        for level in supported_levels() {
            assert_eq!(sum_of_squares_f32_at(level, &g).to_bits(), base_sum.to_bits(), "{level:?}");
            let mut theta = theta0.clone();
            sgd_step_f32_at(level, &mut theta, &g, 0.003);
            assert_eq!(theta, base_theta, "{level:?}");
        }
        let exact: f64 = g.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        assert!(((base_sum - exact) / exact).abs() < 1e-12, "{base_sum} vs {exact}");
    }

    #[test]
    fn in_place_update_refuses_a_gradient_of_another_length() {
        let theta = Var::from_slice(&values(10), 10, &Device::Cpu).unwrap();
        let short = Tensor::from_slice(&values(9), 9, &Device::Cpu).unwrap();
        let err = theta.as_tensor().inplace_op2(&short, &SgdStep { step: 0.1 }).unwrap_err();
        assert!(err.to_string().contains("9 source values for 10"), "{err}");
    }
}
