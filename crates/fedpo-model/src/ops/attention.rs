//! Causal self-attention from the fused `q | k | v` projection, as one op.
//!
//! Composed, attention is a dozen graph nodes per layer: three narrows of the projection,
//! a squeeze, transpose and copy per head tensor, two batched matmuls, the softmax and the
//! merge of the heads. candle's backward gives each node's input a fresh zero gradient and
//! adds into it, and turns each narrow back into a full-size padded copy, so the split
//! alone costs several projection-sized passes. Here the matmuls read the heads where they
//! lie in the projection (gemm takes strides) and write the merged output directly, and
//! backward writes the three head gradients straight into one projection-sized gradient.
//!
//! Each head runs in blocks of queries over only the keys they see ([`query_blocks`]), so
//! the masked half of the scores (and, for a forked sequence, branch two's scores against
//! branch one) is never computed, which shortened a layer's attention both ways at the
//! tiny and the DistilGPT-2 head shapes.
//!
//! Nothing attention-sized is kept: backward recomputes each block's probabilities, one
//! small matmul per block and key segment.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor, WithDType};
use rayon::prelude::*;

use super::fast_math::FastExp;
use super::fork::Forks;
use super::matmul_precision::MatmulPrecision;
use super::query_blocks::{query_blocks, QueryBlock, MAX_ROWS};
use super::send_ptr::SendPtr;
use super::strided_gemm::gemm_into;
use super::{contiguous_slice, full_precision, CResult};

/// The shape of one call: `batch` sequences of `t` tokens, `n_head` heads of `head_dim`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Dims {
    batch: usize,
    t: usize,
    n_head: usize,
    head_dim: usize,
}

impl Dims {
    /// From a `[batch * t, 3d]` projection of sequences of `t` tokens.
    fn of(l: &Layout, t: usize, n_head: usize, what: &str) -> CResult<Self> {
        let (rows, three_d) = l.shape().dims2()?;
        Self::of_rows(rows, three_d, t, n_head, what)
    }

    /// From `rows` rows of a `three_d`-wide projection.
    pub(super) fn of_rows(rows: usize, three_d: usize, t: usize, n_head: usize, what: &str) -> CResult<Self> {
        if n_head == 0 || !three_d.is_multiple_of(3 * n_head) {
            candle_core::bail!("{what}: last dimension {three_d} is not 3 x n_head ({n_head}) x head_dim");
        }
        if t == 0 || !rows.is_multiple_of(t) {
            candle_core::bail!("{what}: {rows} rows are not whole sequences of {t} tokens");
        }
        Ok(Self { batch: rows / t, t, n_head, head_dim: three_d / (3 * n_head) })
    }

    fn d(&self) -> usize {
        self.n_head * self.head_dim
    }
}

/// `dst[m x n] = alpha * lhs @ rhs` (with `accumulate`, `dst += ..`) on the calling thread
/// (the tasks are the parallelism).
///
/// # Safety
/// As [`gemm_into`]'s.
#[allow(clippy::too_many_arguments)]
unsafe fn matmul_into<T: WithDType>(
    mnk: (usize, usize, usize),
    dst: *mut T,
    dst_rs: usize,
    accumulate: bool,
    lhs: *const T,
    lhs_strides: (usize, usize),
    rhs: *const T,
    rhs_strides: (usize, usize),
    alpha: T,
) {
    // SAFETY: the caller's contract.
    // Per-head products are below the bf16 path's size and stay f32 at any precision.
    unsafe {
        gemm_into(mnk, dst, dst_rs, accumulate, lhs, lhs_strides, rhs, rhs_strides, alpha, 1, MatmulPrecision::F32)
    }
}

/// One head of one sequence: where its queries, keys and values start in the projection
/// (row stride `3d`).
#[derive(Clone, Copy)]
struct Head<T> {
    q: *const T,
    k: *const T,
    v: *const T,
}

impl<T> Head<T> {
    /// # Safety
    /// `qkv` holds the whole `[batch, t, 3d]` projection, `b < batch` and `h < n_head`.
    unsafe fn of(qkv: *const T, dims: Dims, b: usize, h: usize) -> Self {
        let (t, d, hd) = (dims.t, dims.d(), dims.head_dim);
        // SAFETY: the caller's contract: these are offsets inside the projection.
        unsafe {
            let seq = qkv.add(b * t * 3 * d);
            Self { q: seq.add(h * hd), k: seq.add(d + h * hd), v: seq.add(2 * d + h * hd) }
        }
    }
}

/// The probabilities of `block`'s queries over the keys they see, packed (`rows x width`,
/// row stride `width`, see [`QueryBlock`]): `scale Q K^T` segment by segment, then each
/// row's softmax over its visible columns, and exact zeros after them.
///
/// # Safety
/// `head` is as [`Head::of`] gives, and `probs` holds at least `rows x width` values.
unsafe fn block_probs<T: FastExp>(dims: Dims, head: Head<T>, block: &QueryBlock, probs: &mut [T]) {
    let (three_d, hd) = (3 * dims.d(), dims.head_dim);
    let scale = T::from_f64(1.0 / (hd as f64).sqrt());
    let (rows, width) = (block.rows.len(), block.width());
    for (column, keys) in block.segments() {
        // SAFETY: the block's queries and the segment's keys lie inside the head, and the
        // segment's columns inside `probs`. K^T's (row, col) is K's (col, row).
        unsafe {
            let q = head.q.add(block.rows.start * three_d);
            let k = head.k.add(keys.start * three_d);
            let dst = probs.as_mut_ptr().add(column);
            matmul_into((rows, keys.len(), hd), dst, width, false, q, (three_d, 1), k, (1, three_d), scale);
        }
    }
    for (r, row) in block.rows.clone().zip(probs[..rows * width].chunks_mut(width)) {
        let (seen, masked) = row.split_at_mut(block.visible(r));
        T::softmax_in_place(seen);
        masked.fill(T::zero());
    }
}

/// The query blocks of each sequence of the batch.
fn plans(dims: Dims, forks: &Forks) -> Vec<Vec<QueryBlock>> {
    (0..dims.batch).map(|b| query_blocks(dims.t, forks.of(b))).collect()
}

pub(super) fn forward_cpu<T: FastExp>(qkv: &[T], dims: Dims, forks: &Forks) -> Vec<T> {
    let (t, d, hd) = (dims.t, dims.d(), dims.head_dim);
    let plans = plans(dims, forks);
    // Every head's task writes all of its columns (its first segment's matmul reads none of
    // them), so the output needs no zero fill first.
    let n = dims.batch * t * d;
    let mut out: Vec<T> = Vec::with_capacity(n);
    let dst = SendPtr(out.as_mut_ptr());
    (0..dims.batch * dims.n_head).into_par_iter().for_each_init(
        || vec![T::zero(); MAX_ROWS.min(t) * t],
        |probs, task| {
            let (b, h) = (task / dims.n_head, task % dims.n_head);
            // SAFETY: `qkv` is [batch, t, 3d] (checked by the caller), `out` is [batch, t, d],
            // and this task writes only head h's columns of sequence b, each block's rows
            // once (first segment) and then added into.
            unsafe {
                let head = Head::of(qkv.as_ptr(), dims, b, h);
                for block in &plans[b] {
                    block_probs(dims, head, block, probs);
                    let y = dst.get().add((b * t + block.rows.start) * d + h * hd);
                    let (rows, width) = (block.rows.len(), block.width());
                    for (column, keys) in block.segments() {
                        let p = probs.as_ptr().add(column);
                        let v = head.v.add(keys.start * 3 * d);
                        matmul_into((rows, hd, keys.len()), y, d, column > 0, p, (width, 1), v, (3 * d, 1), T::one());
                    }
                }
            }
        },
    );
    // SAFETY: the heads' tasks wrote columns `h * hd..(h + 1) * hd` of every row of every
    // sequence, for every h: all `n` elements.
    unsafe { out.set_len(n) };
    out
}

/// `d qkv` from `dy`: per head and query block, with `P` recomputed and `S` the scaled
/// scores, `dV += P^T dY`, `dP = dY V^T`, `dS = P * (dP - rowsum(dP * P))`, and through the
/// scale `dQ = scale dS K`, `dK += scale dS^T Q`, each over the keys the block sees.
pub(super) fn backward_cpu<T: FastExp>(qkv: &[T], dy: &[T], dims: Dims, forks: &Forks) -> Vec<T> {
    let (t, d, hd) = (dims.t, dims.d(), dims.head_dim);
    let three_d = 3 * d;
    let plans = plans(dims, forks);
    // The tasks zero their k and v columns before adding into them and write every q
    // column, so the buffer needs no zero fill first.
    let n = dims.batch * t * three_d;
    let mut out: Vec<T> = Vec::with_capacity(n);
    let dst = SendPtr(out.as_mut_ptr());
    let scale = T::from_f64(1.0 / (hd as f64).sqrt());
    let block_len = MAX_ROWS.min(t) * t;
    (0..dims.batch * dims.n_head).into_par_iter().for_each_init(
        || (vec![T::zero(); block_len], vec![T::zero(); block_len]),
        |(probs, dprobs), task| {
            let (b, h) = (task / dims.n_head, task % dims.n_head);
            // SAFETY: `qkv` and `out` are [batch, t, 3d], `dy` is [batch, t, d] (checked by
            // the caller); this task writes only head h's q, k and v columns of sequence b.
            unsafe {
                let head = Head::of(qkv.as_ptr(), dims, b, h);
                let grad = Head::of(dst.get().cast_const(), dims, b, h);
                let (dq, dk, dv) = (grad.q.cast_mut(), grad.k.cast_mut(), grad.v.cast_mut());
                for r in 0..t {
                    std::slice::from_raw_parts_mut(dk.add(r * three_d), hd).fill(T::zero());
                    std::slice::from_raw_parts_mut(dv.add(r * three_d), hd).fill(T::zero());
                }
                for block in &plans[b] {
                    block_probs(dims, head, block, probs);
                    let (rows, width) = (block.rows.len(), block.width());
                    let dy_b = dy.as_ptr().add((b * t + block.rows.start) * d + h * hd);
                    let (q_b, dq_b) = (head.q.add(block.rows.start * three_d), dq.add(block.rows.start * three_d));
                    for (column, keys) in block.segments() {
                        let (p, dp) = (probs.as_ptr().add(column), dprobs.as_mut_ptr().add(column));
                        let (v, dv) = (head.v.add(keys.start * three_d), dv.add(keys.start * three_d));
                        let m = keys.len();
                        matmul_into((m, hd, rows), dv, three_d, true, p, (1, width), dy_b, (d, 1), T::one());
                        matmul_into((rows, m, hd), dp, width, false, dy_b, (d, 1), v, (1, three_d), T::one());
                    }
                    let used = rows * width;
                    let rows_of = probs[..used].chunks(width).zip(dprobs[..used].chunks_mut(width));
                    for (r, (p, dp)) in block.rows.clone().zip(rows_of) {
                        let (seen, masked) = dp.split_at_mut(block.visible(r));
                        T::softmax_backward(&p[..seen.len()], seen);
                        masked.fill(T::zero());
                    }
                    for (column, keys) in block.segments() {
                        let ds = dprobs.as_ptr().add(column);
                        let (k, dk) = (head.k.add(keys.start * three_d), dk.add(keys.start * three_d));
                        let m = keys.len();
                        matmul_into((rows, hd, m), dq_b, three_d, column > 0, ds, (width, 1), k, (three_d, 1), scale);
                        matmul_into((m, hd, rows), dk, three_d, true, ds, (1, width), q_b, (three_d, 1), scale);
                    }
                }
            }
        },
    );
    // SAFETY: every head's task wrote its q, k and v columns of every row of its sequence:
    // all `n` elements.
    unsafe { out.set_len(n) };
    out
}

struct CausalAttention {
    seq_len: usize,
    n_head: usize,
    forks: Forks,
}

impl CustomOp1 for CausalAttention {
    fn name(&self) -> &'static str {
        "causal-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let dims = Dims::of(l, self.seq_len, self.n_head, self.name())?;
        self.forks.check(dims.batch, dims.t, self.name())?;
        let out = map_float_storage!(s, self.name(), T =>
            forward_cpu::<T>(contiguous_slice(s, l, self.name())?, dims, &self.forks));
        Ok((out, Shape::from((dims.batch * dims.t, dims.d()))))
    }

    fn bwd(&self, qkv: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let backward =
            CausalAttentionBackward { seq_len: self.seq_len, n_head: self.n_head, forks: self.forks.clone() };
        Ok(Some(qkv.apply_op2_no_bwd(&grad.contiguous()?, &backward)?))
    }
}

struct CausalAttentionBackward {
    seq_len: usize,
    n_head: usize,
    forks: Forks,
}

impl CustomOp2 for CausalAttentionBackward {
    fn name(&self) -> &'static str {
        "causal-attention-backward"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> CResult<(CpuStorage, Shape)> {
        let (name, dims) = (self.name(), Dims::of(l1, self.seq_len, self.n_head, self.name())?);
        self.forks.check(dims.batch, dims.t, name)?;
        if l2.shape().dims() != [dims.batch * dims.t, dims.d()] {
            candle_core::bail!("{name}: gradient of shape {:?} for attention output {:?}", l2.shape(), dims);
        }
        let out = map_float_storage!(s1, name, T =>
            backward_cpu::<T>(contiguous_slice(s1, l1, name)?, contiguous_slice(s2, l2, name)?, dims, &self.forks));
        Ok((out, l1.shape().clone()))
    }
}

/// Causal multi-head self-attention over sequences of `seq_len` tokens: `[b * t, d]` from
/// the fused projection `qkv: [b * t, 3d]` (queries, keys, values, each `n_head` heads of
/// `d / n_head`), with the heads merged back in order. Rows, not `[b, t, ..]`: the model
/// keeps its residual stream 2-D, because every reshape is a node whose backward sums its
/// gradient into a fresh zero tensor. One fused op on the CPU in f32 and f64; elsewhere,
/// and in half precision, the composed ops with the softmax in `softmax_dtype`.
pub fn causal_self_attention(
    qkv: &Tensor,
    seq_len: usize,
    n_head: usize,
    softmax_dtype: candle_core::DType,
) -> CResult<Tensor> {
    forked_self_attention(qkv, seq_len, n_head, softmax_dtype, &Forks::none())
}

/// [`causal_self_attention`] where each sequence may fork after a shared prefix
/// ([`Fork`](super::Fork)): a token of a fork's second branch does not see its first.
pub fn forked_self_attention(
    qkv: &Tensor,
    seq_len: usize,
    n_head: usize,
    softmax_dtype: candle_core::DType,
    forks: &Forks,
) -> CResult<Tensor> {
    if qkv.device().is_cpu() && full_precision(qkv) && qkv.dtype() == softmax_dtype {
        return qkv.contiguous()?.apply_op1(CausalAttention { seq_len, n_head, forks: forks.clone() });
    }
    forked_self_attention_composed(qkv, seq_len, n_head, softmax_dtype, forks)
}

/// The composed version: the fallback, and the fused op's reference.
pub fn causal_self_attention_composed(
    qkv: &Tensor,
    seq_len: usize,
    n_head: usize,
    softmax_dtype: candle_core::DType,
) -> CResult<Tensor> {
    forked_self_attention_composed(qkv, seq_len, n_head, softmax_dtype, &Forks::none())
}

/// The composed [`forked_self_attention`]: an additive mask per sequence where there are
/// forks, the causal softmax where there are none.
pub fn forked_self_attention_composed(
    qkv: &Tensor,
    seq_len: usize,
    n_head: usize,
    softmax_dtype: candle_core::DType,
    forks: &Forks,
) -> CResult<Tensor> {
    let (rows, three_d) = qkv.dims2()?;
    let (t, d) = (seq_len, three_d / 3);
    if t == 0 || rows % t != 0 {
        candle_core::bail!("causal-attention: {rows} rows are not whole sequences of {t} tokens");
    }
    let (b, head_dim) = (rows / t, d / n_head);
    forks.check(b, t, "causal-attention")?;
    // One copy per head tensor: the reshape is a view of the contiguous projection, and
    // only the transpose to [b, head, t, head_dim] copies.
    let qkv = qkv.reshape((b, t, 3, n_head, head_dim))?;
    let split = |i: usize| -> CResult<Tensor> { qkv.narrow(2, i, 1)?.squeeze(2)?.transpose(1, 2)?.contiguous() };
    let (q, k, v) = (split(0)?, split(1)?, split(2)?);
    let scores = q.matmul(&k.t()?)?.to_dtype(softmax_dtype)?;
    let scale = 1.0 / (head_dim as f64).sqrt();
    let probs = if forks.is_none() {
        super::causal_softmax(&scores, scale)?
    } else {
        let mask = super::masks::forked(forks, b, t, scores.dtype(), scores.device())?;
        super::softmax_composed(&(scores * scale)?.broadcast_add(&mask)?)?
    };
    probs.to_dtype(v.dtype())?.matmul(&v)?.transpose(1, 2)?.reshape((rows, d))
}

#[cfg(test)]
mod tests {
    use super::super::fork::Fork;
    use super::super::tests::{max_abs_diff, randn};
    use super::*;
    use candle_core::{DType, Var};

    #[test]
    fn fused_attention_matches_the_composed_ops_in_value_and_gradient() {
        for (batch, t, n_head, head_dim) in [(2, 5, 2, 4), (1, 9, 3, 2), (3, 1, 1, 6)] {
            let d = n_head * head_dim;
            let qkv = Var::from_tensor(&randn(&[batch * t, 3 * d], 51)).unwrap();
            let upstream = randn(&[batch * t, d], 52);
            let fused = causal_self_attention(qkv.as_tensor(), t, n_head, DType::F64).unwrap();
            let composed = causal_self_attention_composed(qkv.as_tensor(), t, n_head, DType::F64).unwrap();
            assert!(max_abs_diff(&fused, &composed) < 1e-12, "{batch} x {t}, {n_head} heads");
            let g_fused = (fused * &upstream).unwrap().sum_all().unwrap().backward().unwrap();
            let g_comp = (composed * &upstream).unwrap().sum_all().unwrap().backward().unwrap();
            let (a, b) = (g_fused.get(qkv.as_tensor()).unwrap(), g_comp.get(qkv.as_tensor()).unwrap());
            assert!(max_abs_diff(a, b) < 1e-12, "gradients differ by {}", max_abs_diff(a, b));
        }
    }

    #[test]
    fn a_forked_sequence_attends_as_its_prefix_followed_by_either_branch_alone() {
        // prefix of 3, branch one of 2, branch two of 3: [p; a; b] against [p; a] and [p; b]
        let (n_head, w) = (2, 3 * 4);
        let (p, a, b) = (randn(&[3, w], 61), randn(&[2, w], 62), randn(&[3, w], 63));
        let packed = Tensor::cat(&[&p, &a, &b], 0).unwrap();
        let forks = Forks::new(vec![Fork { prefix: 3, first: 2 }]);
        let one = causal_self_attention(&Tensor::cat(&[&p, &a], 0).unwrap(), 5, n_head, DType::F64).unwrap();
        let two = causal_self_attention(&Tensor::cat(&[&p, &b], 0).unwrap(), 6, n_head, DType::F64).unwrap();
        let expected = Tensor::cat(&[&one, &two.narrow(0, 3, 3).unwrap()], 0).unwrap();
        let fused = forked_self_attention(&packed, 8, n_head, DType::F64, &forks).unwrap();
        let composed = forked_self_attention_composed(&packed, 8, n_head, DType::F64, &forks).unwrap();
        assert!(max_abs_diff(&fused, &expected) < 1e-12, "{}", max_abs_diff(&fused, &expected));
        assert!(max_abs_diff(&composed, &expected) < 1e-12);
        // and the two paths' gradients agree
        let var = Var::from_tensor(&packed).unwrap();
        let upstream = randn(&[8, 4], 64);
        let grad = |y: Tensor| (y * &upstream).unwrap().sum_all().unwrap().backward().unwrap();
        let g_fused = grad(forked_self_attention(var.as_tensor(), 8, n_head, DType::F64, &forks).unwrap());
        let g_comp = grad(forked_self_attention_composed(var.as_tensor(), 8, n_head, DType::F64, &forks).unwrap());
        let (x, y) = (g_fused.get(var.as_tensor()).unwrap(), g_comp.get(var.as_tensor()).unwrap());
        assert!(max_abs_diff(x, y) < 1e-12, "gradients differ by {}", max_abs_diff(x, y));
    }

    #[test]
    fn attention_over_several_query_blocks_matches_the_composed_ops_with_and_without_forks() {
        // longer than a block, so queries run in several blocks and branch two's skip the
        // keys of branch one; the sequences fork at different places (or not at all)
        let (batch, t, n_head, head_dim) = (3, 150, 2, 4);
        let d = n_head * head_dim;
        let forks = [
            Forks::none(),
            Forks::new(vec![
                Fork { prefix: 70, first: 40 },
                Fork { prefix: 0, first: 90 },
                Fork { prefix: 149, first: 1 },
            ]),
        ];
        for forks in forks {
            let qkv = Var::from_tensor(&randn(&[batch * t, 3 * d], 57)).unwrap();
            let upstream = randn(&[batch * t, d], 58);
            let fused = forked_self_attention(qkv.as_tensor(), t, n_head, DType::F64, &forks).unwrap();
            let composed = forked_self_attention_composed(qkv.as_tensor(), t, n_head, DType::F64, &forks).unwrap();
            assert!(max_abs_diff(&fused, &composed) < 1e-12, "{forks:?}: {}", max_abs_diff(&fused, &composed));
            let g_fused = (fused * &upstream).unwrap().sum_all().unwrap().backward().unwrap();
            let g_comp = (composed * &upstream).unwrap().sum_all().unwrap().backward().unwrap();
            let (a, b) = (g_fused.get(qkv.as_tensor()).unwrap(), g_comp.get(qkv.as_tensor()).unwrap());
            assert!(max_abs_diff(a, b) < 1e-12, "{forks:?}: gradients differ by {}", max_abs_diff(a, b));
        }
    }

    #[test]
    fn a_token_attends_only_to_itself_and_earlier_tokens() {
        // changing the last token's q, k and v leaves every earlier output unchanged
        // two sequences of 6: changing token 5 of the first leaves its earlier outputs and
        // all of the second sequence unchanged
        let qkv = randn(&[12, 3 * 4], 53);
        let changed = qkv.slice_assign(&[5..6, 0..12], &randn(&[1, 12], 54)).unwrap();
        let a = causal_self_attention(&qkv, 6, 2, DType::F64).unwrap();
        let b = causal_self_attention(&changed, 6, 2, DType::F64).unwrap();
        assert!(max_abs_diff(&a.narrow(0, 0, 5).unwrap(), &b.narrow(0, 0, 5).unwrap()) == 0.0);
        assert!(max_abs_diff(&a.narrow(0, 6, 6).unwrap(), &b.narrow(0, 6, 6).unwrap()) == 0.0);
        assert!(max_abs_diff(&a.narrow(0, 5, 1).unwrap(), &b.narrow(0, 5, 1).unwrap()) > 1e-3);
    }

    #[test]
    fn f32_attention_and_its_gradient_track_f64() {
        // two query blocks per sequence
        let qkv64 = randn(&[2 * 100, 3 * 32], 55);
        let upstream = randn(&[2 * 100, 32], 56);
        let exact = Var::from_tensor(&qkv64).unwrap();
        let ours = Var::from_tensor(&qkv64.to_dtype(DType::F32).unwrap()).unwrap();
        let y64 = causal_self_attention(exact.as_tensor(), 100, 4, DType::F64).unwrap();
        let y32 = causal_self_attention(ours.as_tensor(), 100, 4, DType::F32).unwrap();
        assert!(max_abs_diff(&y32.to_dtype(DType::F64).unwrap(), &y64) < 1e-5);
        let g64 = (y64 * &upstream).unwrap().sum_all().unwrap().backward().unwrap();
        let up32 = upstream.to_dtype(DType::F32).unwrap();
        let g32 = (y32 * up32).unwrap().sum_all().unwrap().backward().unwrap();
        let a = g32.get(ours.as_tensor()).unwrap().to_dtype(DType::F64).unwrap();
        let err = max_abs_diff(&a, g64.get(exact.as_tensor()).unwrap());
        assert!(err < 1e-4, "gradient differs from f64 by {err}");
    }

    #[test]
    fn attention_refuses_a_projection_that_is_not_three_heads_wide() {
        let qkv = Tensor::zeros((4, 10), DType::F32, &candle_core::Device::Cpu).unwrap();
        let err = causal_self_attention(&qkv, 4, 2, DType::F32).unwrap_err().to_string();
        assert!(err.contains("not 3 x n_head"), "{err}");
        let qkv = Tensor::zeros((5, 12), DType::F32, &candle_core::Device::Cpu).unwrap();
        let err = causal_self_attention(&qkv, 4, 2, DType::F32).unwrap_err().to_string();
        assert!(err.contains("5 rows are not whole sequences of 4"), "{err}");
    }
}
