//! A whole GPT-2 block as one op: layer norms, projections (with their adapters),
//! attention, GELU and both residual adds, with the backward written out.
//!
//! Through candle's autograd every node of a block sums each of its input gradients into a
//! fresh zero tensor, so a DistilGPT-2 block zero-fills and re-adds about 110 MB of
//! gradients per step, and the LoRA merge, the bias adds and the residual adds are passes
//! of their own. As one node, the block's backward writes each gradient once, straight
//! from gemm: a residual add is the matmul accumulating into a copy of its input, a bias is
//! the matmul accumulating into rows of the bias, and a weight gradient is the product
//! itself. The parameters' gradients leave through [`BlockGradients`], which the model
//! moves into the gradient store after backward (as [`super::TiedGradient`] does for the
//! embedding); the graph sees one input and one output per block.
//!
//! CPU, f32 or f64, every tensor in one dtype. Activations kept for backward: the two
//! normalized inputs, the projection, attention output, mid-block residual, the MLP's
//! pre-activation and its GELU, and per adapter the merged weight (base trains) or the
//! rank-`r` intermediate (base frozen).

use std::sync::{Arc, Mutex, PoisonError};

use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Storage, Tensor, WithDType};

use super::attention::{self, Dims};
use super::fast_math::FastExp;
use super::fork::Forks;
use super::projection::{
    add_into, projection_backward, projection_forward, AdapterActs, ParamGrads, ProjectionView, Wants,
};
use super::{gelu, layer_norm, parallel_fill, CResult};

/// A low-rank adapter `scale * x A^T B^T`, `a: [r, in]`, `b: [out, r]`.
#[derive(Debug, Clone)]
pub struct Adapter {
    /// `A: [r, in]`.
    pub a: Tensor,
    /// `B: [out, r]`.
    pub b: Tensor,
    /// `alpha / r`.
    pub scale: f64,
}

/// A Conv1D projection `x @ weight + bias`, `weight: [in, out]`.
#[derive(Debug, Clone)]
pub struct Projection {
    /// `[in, out]`.
    pub weight: Tensor,
    /// `[out]`.
    pub bias: Tensor,
    /// Whether weight and bias get gradients.
    pub trains: bool,
    /// The adapter, whose factors get gradients when they are variables.
    pub adapter: Option<Adapter>,
}

impl Projection {
    /// Whether the adapter is folded into the weight: when the base trains, backward forms
    /// the weight-sized gradient anyway.
    fn merges(&self) -> bool {
        self.trains && self.adapter.is_some()
    }
}

/// Everything one block computes with.
#[derive(Debug, Clone)]
pub struct BlockWeights {
    /// `ln_1` weight and bias.
    pub ln_1: (Tensor, Tensor),
    /// `attn.c_attn`: `[d, 3d]`.
    pub c_attn: Projection,
    /// `attn.c_proj`: `[d, d]`.
    pub attn_proj: Projection,
    /// `ln_2` weight and bias.
    pub ln_2: (Tensor, Tensor),
    /// `mlp.c_fc`: `[d, 4d]`.
    pub c_fc: Projection,
    /// `mlp.c_proj`: `[4d, d]`.
    pub mlp_proj: Projection,
    /// Layer norm epsilon.
    pub eps: f64,
    /// Attention heads.
    pub n_head: usize,
}

impl BlockWeights {
    fn projections(&self) -> [&Projection; 4] {
        [&self.c_attn, &self.attn_proj, &self.c_fc, &self.mlp_proj]
    }

    /// Every tensor the op reads, in a fixed order: the four layer-norm tensors, then per
    /// projection its weight, bias and, with an adapter, `a` and `b`.
    fn tensors(&self) -> Vec<&Tensor> {
        let mut all = vec![&self.ln_1.0, &self.ln_1.1, &self.ln_2.0, &self.ln_2.1];
        for p in self.projections() {
            all.extend([&p.weight, &p.bias]);
            if let Some(adapter) = &p.adapter {
                all.extend([&adapter.a, &adapter.b]);
            }
        }
        all
    }

    /// Whether the fused op applies to `x`: CPU, f32 or f64, and every tensor contiguous
    /// in `x`'s dtype with the shapes of a block.
    pub fn fits(&self, x: &Tensor) -> bool {
        let Ok((_, d)) = x.dims2() else { return false };
        let shapes_fit = self.c_attn.weight.dims() == [d, 3 * d]
            && self.attn_proj.weight.dims() == [d, d]
            && self.c_fc.weight.dims().first() == Some(&d)
            && self.ln_1.0.dims() == [d]
            && self.n_head > 0
            && d % self.n_head == 0;
        x.device().is_cpu()
            && super::full_precision(x)
            && shapes_fit
            && self.tensors().iter().all(|t| t.dtype() == x.dtype() && t.device().is_cpu() && t.is_contiguous())
    }
}

/// Where the blocks' parameter gradients collect during backward: each parameter with
/// its values. A step whose batch runs in several passes keeps them here between passes,
/// and each block's backward adds into them ([`ParamGrads`]).
///
/// A copy of the model gets a collector of its own, as with [`super::TiedGradient`].
#[derive(Debug, Default)]
pub struct BlockGradients(Arc<Mutex<Vec<(Tensor, CpuStorage)>>>);

impl Clone for BlockGradients {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl BlockGradients {
    /// Drops what earlier passes (or a failed one) left; call before a step's first
    /// backward pass.
    pub fn clear(&self) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).clear();
    }

    /// Moves the collected gradients into `grads`, adding to any the parameter already has.
    pub fn collect(&self, grads: &mut GradStore) -> CResult<()> {
        let collected = std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner));
        for (param, values) in collected {
            let grad = match values {
                CpuStorage::F32(v) => Tensor::from_vec(v, param.shape(), param.device())?,
                CpuStorage::F64(v) => Tensor::from_vec(v, param.shape(), param.device())?,
                other => candle_core::bail!("fused-block: a gradient in {:?}", other.dtype()),
            };
            let total = match grads.remove(&param) {
                Some(other) => (other + grad)?,
                None => grad,
            };
            grads.insert(&param, total);
        }
        Ok(())
    }
}

/// The element types the fused block runs in.
trait BlockFloat: FastExp + layer_norm::LayerNormFloat {
    fn gelu(xs: &[Self]) -> Vec<Self>;
    fn gelu_backward(xs: &[Self], grads: &[Self]) -> Vec<Self>;
    fn wrap(acts: Activations<Self>) -> Saved;
    fn unwrap(saved: &Saved) -> Option<&Activations<Self>>;
    fn storage(values: Vec<Self>) -> CpuStorage;
    fn values(storage: CpuStorage) -> Option<Vec<Self>>;
}

impl BlockFloat for f32 {
    fn gelu(xs: &[Self]) -> Vec<Self> {
        gelu::forward_f32(xs)
    }
    fn gelu_backward(xs: &[Self], grads: &[Self]) -> Vec<Self> {
        gelu::backward_f32(xs, grads)
    }
    fn wrap(acts: Activations<Self>) -> Saved {
        Saved::F32(acts)
    }
    fn unwrap(saved: &Saved) -> Option<&Activations<Self>> {
        match saved {
            Saved::F32(a) => Some(a),
            Saved::F64(_) => None,
        }
    }
    fn storage(values: Vec<Self>) -> CpuStorage {
        CpuStorage::F32(values)
    }
    fn values(storage: CpuStorage) -> Option<Vec<Self>> {
        match storage {
            CpuStorage::F32(v) => Some(v),
            _ => None,
        }
    }
}

impl BlockFloat for f64 {
    fn gelu(xs: &[Self]) -> Vec<Self> {
        gelu::forward_f64(xs)
    }
    fn gelu_backward(xs: &[Self], grads: &[Self]) -> Vec<Self> {
        gelu::backward_f64(xs, grads)
    }
    fn wrap(acts: Activations<Self>) -> Saved {
        Saved::F64(acts)
    }
    fn unwrap(saved: &Saved) -> Option<&Activations<Self>> {
        match saved {
            Saved::F64(a) => Some(a),
            Saved::F32(_) => None,
        }
    }
    fn storage(values: Vec<Self>) -> CpuStorage {
        CpuStorage::F64(values)
    }
    fn values(storage: CpuStorage) -> Option<Vec<Self>> {
        match storage {
            CpuStorage::F64(v) => Some(v),
            _ => None,
        }
    }
}

struct Activations<T> {
    h1: Vec<T>,
    qkv: Vec<T>,
    att: Vec<T>,
    x1: Vec<T>,
    h2: Vec<T>,
    pre_gelu: Vec<T>,
    gelu: Vec<T>,
    adapters: [AdapterActs<T>; 4],
}

enum Saved {
    F32(Activations<f32>),
    F64(Activations<f64>),
}

/// The block's tensors as slices (read guards held by the caller).
struct View<'a, T> {
    ln_1: (&'a [T], &'a [T]),
    ln_2: (&'a [T], &'a [T]),
    projections: [ProjectionView<'a, T>; 4],
}

fn slice_of<'a, T: WithDType>(storage: &'a Storage, layout: &Layout) -> CResult<&'a [T]> {
    match storage {
        Storage::Cpu(cpu) => super::contiguous_slice(cpu, layout, "fused-block"),
        _ => candle_core::bail!("fused-block: every tensor must be on the CPU"),
    }
}

impl<'a, T: WithDType> View<'a, T> {
    fn new(weights: &BlockWeights, slices: &[&'a [T]]) -> CResult<Self> {
        let mut next = slices[4..].iter().copied();
        let mut take = |p: &Projection| -> CResult<ProjectionView<'a, T>> {
            let (fan_in, fan_out) = p.weight.dims2()?;
            let (weight, bias) = (next.next().unwrap_or_default(), next.next().unwrap_or_default());
            if bias.len() != fan_out {
                candle_core::bail!("fused-block: a bias of {} for a projection of width {fan_out}", bias.len());
            }
            let (adapter, rank) = match &p.adapter {
                Some(adapter) => {
                    let rank = adapter.a.dim(0)?;
                    if adapter.a.dims() != [rank, fan_in] || adapter.b.dims() != [fan_out, rank] {
                        candle_core::bail!(
                            "fused-block: adapter {:?} x {:?} for a {fan_in} x {fan_out} projection",
                            adapter.a.dims(),
                            adapter.b.dims()
                        );
                    }
                    let (a, b) = (next.next().unwrap_or_default(), next.next().unwrap_or_default());
                    (Some((a, b, T::from_f64(adapter.scale))), rank)
                }
                None => (None, 0),
            };
            Ok(ProjectionView { weight, bias, adapter, fan_in, fan_out, rank })
        };
        let projections =
            [take(&weights.c_attn)?, take(&weights.attn_proj)?, take(&weights.c_fc)?, take(&weights.mlp_proj)?];
        Ok(Self { ln_1: (slices[0], slices[1]), ln_2: (slices[2], slices[3]), projections })
    }
}

/// The layer norm's input gradient added into `acc`, and its weight and bias gradients.
fn layer_norm_backward<T: layer_norm::LayerNormFloat>(
    acc: &mut [T],
    x: &[T],
    (weight, _): (&[T], &[T]),
    dy: &[T],
    eps: f64,
) -> (Vec<T>, Vec<T>) {
    let d = weight.len();
    let all = layer_norm::backward_cpu(x, weight, dy, eps);
    let (dx, params) = all.split_at(x.len());
    add_into(acc, dx);
    (params[..d].to_vec(), params[d..].to_vec())
}

struct FusedBlock {
    weights: BlockWeights,
    seq_len: usize,
    forks: Forks,
    saved: Mutex<Option<Saved>>,
    grads: Arc<Mutex<Vec<(Tensor, CpuStorage)>>>,
}

impl FusedBlock {
    fn forward<T: BlockFloat>(&self, x: &[T], slices: &[&[T]], rows: usize) -> CResult<Vec<T>> {
        let w = &self.weights;
        let view = View::new(w, slices)?;
        let [c_attn, attn_proj, c_fc, mlp_proj] = &view.projections;
        let d = c_attn.fan_in;
        let dims = Dims::of_rows(rows, 3 * d, self.seq_len, w.n_head, "fused-block")?;
        let h1 = layer_norm::forward_cpu(x, view.ln_1.0, view.ln_1.1, w.eps);
        let (qkv, a0) = projection_forward(c_attn, &h1, rows, None, w.c_attn.merges())?;
        let att = attention::forward_cpu(&qkv, dims, &self.forks);
        let (x1, a1) = projection_forward(attn_proj, &att, rows, Some(x), w.attn_proj.merges())?;
        let h2 = layer_norm::forward_cpu(&x1, view.ln_2.0, view.ln_2.1, w.eps);
        let (pre_gelu, a2) = projection_forward(c_fc, &h2, rows, None, w.c_fc.merges())?;
        let gelu = T::gelu(&pre_gelu);
        let (y, a3) = projection_forward(mlp_proj, &gelu, rows, Some(&x1), w.mlp_proj.merges())?;
        let acts = Activations { h1, qkv, att, x1, h2, pre_gelu, gelu, adapters: [a0, a1, a2, a3] };
        *self.saved.lock().unwrap_or_else(PoisonError::into_inner) = Some(T::wrap(acts));
        Ok(y)
    }

    /// `dx` of the block (if `want_dx`), with the parameter gradients as (tensor index,
    /// values).
    #[allow(clippy::too_many_arguments)]
    fn backward<T: BlockFloat>(
        &self,
        x: &[T],
        dy: &[T],
        slices: &[&[T]],
        wants: &[Wants; 4],
        ln_wants: [bool; 2],
        want_dx: bool,
        grads: &mut ParamGrads<T>,
    ) -> CResult<Option<Vec<T>>> {
        let w = &self.weights;
        let view = View::new(w, slices)?;
        let saved = self.saved.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(acts) = saved.as_ref().and_then(T::unwrap) else {
            candle_core::bail!("fused-block: backward without its forward's activations");
        };
        let [c_attn, attn_proj, c_fc, mlp_proj] = &view.projections;
        let rows = acts.x1.len() / c_attn.fan_in;
        let dims = Dims::of_rows(rows, 3 * c_attn.fan_in, self.seq_len, w.n_head, "fused-block")?;
        // y = x1 + gelu(h2 W_fc) W_proj: the residual passes dy through unchanged.
        let dgelu = projection_backward(mlp_proj, &acts.adapters[3], &acts.gelu, dy, rows, wants[3], grads)?;
        let dpre = T::gelu_backward(&acts.pre_gelu, &dgelu);
        drop(dgelu);
        let dh2 = projection_backward(c_fc, &acts.adapters[2], &acts.h2, &dpre, rows, wants[2], grads)?;
        drop(dpre);
        let mut dx1 = parallel_fill::par_copy(dy);
        let (dw2, db2) = layer_norm_backward(&mut dx1, &acts.x1, view.ln_2, &dh2, w.eps);
        if ln_wants[1] {
            grads.add(2, dw2)?;
            grads.add(3, db2)?;
        }
        drop(dh2);
        // x1 = x + attention(h1 W_attn) W_proj
        let datt = projection_backward(attn_proj, &acts.adapters[1], &acts.att, &dx1, rows, wants[1], grads)?;
        let dqkv = attention::backward_cpu(&acts.qkv, &datt, dims, &self.forks);
        drop(datt);
        // below c_attn only ln_1 and the block's input can want a gradient
        let c_attn_wants = Wants { input: want_dx || ln_wants[0], ..wants[0] };
        let dh1 = projection_backward(c_attn, &acts.adapters[0], &acts.h1, &dqkv, rows, c_attn_wants, grads)?;
        drop(dqkv);
        if !c_attn_wants.input {
            return Ok(None);
        }
        let mut dx = dx1;
        let (dw1, db1) = layer_norm_backward(&mut dx, x, view.ln_1, &dh1, w.eps);
        if ln_wants[0] {
            grads.add(0, dw1)?;
            grads.add(1, db1)?;
        }
        Ok(want_dx.then_some(dx))
    }

    /// Gradient indices per projection, and whether each layer norm trains.
    fn wants(&self) -> ([Wants; 4], [bool; 2]) {
        let tensors = self.weights.tensors();
        let trains = |i: usize| tensors[i].is_variable();
        let mut index = 4;
        let mut out = [Wants { weight: None, bias: None, a: None, b: None, input: true }; 4];
        for (slot, p) in out.iter_mut().zip(self.weights.projections()) {
            let (wi, bi) = (index, index + 1);
            index += 2;
            slot.weight = (p.trains && trains(wi)).then_some(wi);
            slot.bias = (p.trains && trains(bi)).then_some(bi);
            if p.adapter.is_some() {
                let (ai, bj) = (index, index + 1);
                index += 2;
                slot.a = trains(ai).then_some(ai);
                slot.b = trains(bj).then_some(bj);
            }
        }
        (out, [trains(0) || trains(1), trains(2) || trains(3)])
    }

    /// The input's gradient, `None` when the input tracks none (the first block over
    /// frozen embeddings): candle propagates nothing from it.
    fn run_backward<T: BlockFloat>(&self, x: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let tensors = self.weights.tensors();
        let guards: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
        let slices = guards.iter().map(|(s, l)| slice_of::<T>(s, l)).collect::<CResult<Vec<_>>>()?;
        let grad = grad.contiguous()?;
        let (xs, xl) = x.storage_and_layout();
        let (gs, gl) = grad.storage_and_layout();
        let (wants, ln_wants) = self.wants();
        // What earlier passes of the step left for these tensors, taken out while this
        // pass adds into it.
        let carried: Vec<Option<Vec<T>>> = {
            let mut pending = self.grads.lock().unwrap_or_else(PoisonError::into_inner);
            tensors
                .iter()
                .map(|t| {
                    let at = pending.iter().position(|(param, _)| param.id() == t.id())?;
                    T::values(pending.swap_remove(at).1)
                })
                .collect()
        };
        let mut grads = ParamGrads::new(carried);
        let dx = self.backward::<T>(
            slice_of(&xs, xl)?,
            slice_of(&gs, gl)?,
            &slices,
            &wants,
            ln_wants,
            x.track_op(),
            &mut grads,
        )?;
        drop(guards);
        let collected = grads.into_gradients().into_iter().map(|(i, values)| (tensors[i].clone(), T::storage(values)));
        self.grads.lock().unwrap_or_else(PoisonError::into_inner).extend(collected);
        dx.map(|dx| Tensor::from_vec(dx, x.shape().clone(), x.device())).transpose()
    }
}

/// The op's second input is one of the block's trainable tensors (the anchor), only so that
/// candle records the op when the block's input tracks no gradient (frozen embeddings):
/// candle records an op only if one of its inputs tracks. Its gradient, like every other
/// parameter's, leaves through [`BlockGradients`].
impl CustomOp2 for FusedBlock {
    fn name(&self) -> &'static str {
        "fused-block"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout, _: &CpuStorage, _: &Layout) -> CResult<(CpuStorage, Shape)> {
        let (rows, _) = l.shape().dims2()?;
        let tensors = self.weights.tensors();
        let guards: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
        let out = match s {
            CpuStorage::F32(_) => {
                let slices = guards.iter().map(|(s, l)| slice_of::<f32>(s, l)).collect::<CResult<Vec<_>>>()?;
                f32::storage(self.forward(super::contiguous_slice(s, l, self.name())?, &slices, rows)?)
            }
            CpuStorage::F64(_) => {
                let slices = guards.iter().map(|(s, l)| slice_of::<f64>(s, l)).collect::<CResult<Vec<_>>>()?;
                f64::storage(self.forward(super::contiguous_slice(s, l, self.name())?, &slices, rows)?)
            }
            other => candle_core::bail!("fused-block: unsupported dtype {:?}", other.dtype()),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        _anchor: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let dx = match x.dtype() {
            candle_core::DType::F32 => self.run_backward::<f32>(x, grad)?,
            candle_core::DType::F64 => self.run_backward::<f64>(x, grad)?,
            other => candle_core::bail!("fused-block: unsupported dtype {other:?}"),
        };
        Ok((dx, None))
    }
}

/// One GPT-2 block over `x: [batch * seq_len, d]` as a single op (see the module docs); the
/// caller checks [`BlockWeights::fits`] first. Attention follows the sequences' `forks`.
/// Parameter gradients go to `grads`.
pub fn fused_block(
    x: &Tensor,
    weights: BlockWeights,
    seq_len: usize,
    forks: &Forks,
    grads: &BlockGradients,
) -> CResult<Tensor> {
    let rows = x.dim(0)?;
    if seq_len == 0 || rows % seq_len != 0 {
        candle_core::bail!("fused-block: {rows} rows are not whole sequences of {seq_len} tokens");
    }
    forks.check(rows / seq_len, seq_len, "fused-block")?;
    let tensors = weights.tensors();
    let anchor = (*tensors.iter().find(|t| t.is_variable()).unwrap_or(&tensors[0])).clone();
    let op = FusedBlock { weights, seq_len, forks: forks.clone(), saved: Mutex::new(None), grads: grads.0.clone() };
    x.contiguous()?.apply_op2(&anchor, op)
}
