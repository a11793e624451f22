//! Optimizer updates that write parameters and moments in place.
//!
//! Expressed as tensor ops, an SGD step on DistilGPT-2 allocates two parameter-sized
//! temporaries (328 MB each) and copies a third, and AdamW several more; on a small device
//! that is both time and peak memory. These kernels read the gradient once and update the
//! destination where it lives. Off the CPU, [`crate::optim`] falls back to tensor ops.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, InplaceOp2, InplaceOp3, Layout, Storage, Tensor};

type CResult<T> = candle_core::Result<T>;

fn range(l: &Layout, what: &str) -> CResult<(usize, usize)> {
    match l.contiguous_offsets() {
        Some(r) => Ok(r),
        None => bail!("{what}: tensors must be contiguous"),
    }
}

/// Applies `f(dst, src...)` element-wise over f32 or f64 storages.
macro_rules! zip_storages {
    ($name:expr, $dst:expr, $dl:expr, [$(($src:expr, $sl:expr)),+], |$d:ident, $($s:ident),+| $body:expr) => {{
        let (d0, d1) = range($dl, $name)?;
        match $dst {
            CpuStorage::F32(dv) => {
                let dv = &mut dv[d0..d1];
                $(let $s = { let (a, b) = range($sl, $name)?; &$src.as_slice::<f32>()?[a..b] };)+
                for (i, $d) in dv.iter_mut().enumerate() {
                    $(let $s = f64::from($s[i]);)+
                    let v: f64 = { let $d = f64::from(*$d); $body };
                    *$d = v as f32;
                }
            }
            CpuStorage::F64(dv) => {
                let dv = &mut dv[d0..d1];
                $(let $s = { let (a, b) = range($sl, $name)?; &$src.as_slice::<f64>()?[a..b] };)+
                for (i, $d) in dv.iter_mut().enumerate() {
                    $(let $s = $s[i];)+
                    *$d = { let $d = *$d; $body };
                }
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

impl InplaceOp2 for SgdStep {
    fn name(&self) -> &'static str {
        "sgd-step"
    }
    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> CResult<()> {
        let step = self.step;
        zip_storages!("sgd-step", s1, l1, [(s2, l2)], |theta, g| theta - step * g)
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
}

/// `sum(t^2)` in f64 without allocating, on the CPU; `None` elsewhere.
pub(crate) fn cpu_sum_of_squares(t: &Tensor) -> Option<f64> {
    let (storage, layout) = t.storage_and_layout();
    let (a, b) = layout.contiguous_offsets()?;
    match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => Some(v[a..b].iter().map(|x| f64::from(*x) * f64::from(*x)).sum()),
        Storage::Cpu(CpuStorage::F64(v)) => Some(v[a..b].iter().map(|x| x * x).sum()),
        _ => None,
    }
}
