//! GPT-2 (Radford et al. 2019) with optional LoRA adapters, for DPO training on devices.
//!
//! ```text
//! fedpo-device train-local --synthetic --model tiny --steps 200
//! ```
//!
//! Struct fields carry the checkpoint's tensor names (`wte`, `h.N.attn.c_attn`, `ln_f`) so
//! loading reads like the checkpoint. Projections are HF `Conv1D`s: weights are stored
//! `[in, out]` and applied as `x @ W`, with no transpose on import. The head is tied to `wte`.
//!
//! Layer norm, softmax and GELU are the gradient-safe versions of [`crate::ops`]; frozen
//! projections use a matmul that skips the weight gradient.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};

use crate::config::Gpt2Config;
use crate::error::{ModelError, Result};
use crate::lora::{LoraConfig, LoraLayer};
use crate::ops;
use crate::weights::{Init, ParamBuilder};

mod decode;

pub use decode::KvCache;

type CResult<T> = candle_core::Result<T>;

/// GPT-2's initialiser range: weights are N(0, 0.02).
const INIT_STD: f64 = 0.02;

#[derive(Debug, Clone)]
struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    fn load(b: &mut ParamBuilder<'_>, prefix: &str, cfg: &Gpt2Config) -> Result<Self> {
        let d = cfg.n_embd;
        Ok(Self {
            weight: b.base(&format!("{prefix}.weight"), &[d], Init::Ones)?,
            bias: b.base(&format!("{prefix}.bias"), &[d], Init::Zeros)?,
            eps: cfg.layer_norm_epsilon,
        })
    }

    /// Normalizes in the weights' (master) dtype whatever the activations' dtype: mean and
    /// variance over 768 values lose too much in bf16.
    fn forward(&self, x: &Tensor) -> CResult<Tensor> {
        let normed = ops::layer_norm(&x.to_dtype(self.weight.dtype())?, &self.weight, &self.bias, self.eps)?;
        normed.to_dtype(x.dtype())
    }
}

/// HF's `Conv1D`: `y = x @ weight + bias` with `weight: [in, out]`, plus an optional adapter.
#[derive(Debug, Clone)]
struct Conv1D {
    weight: Tensor,
    bias: Tensor,
    weight_frozen: bool,
    lora: Option<LoraLayer>,
}

impl Conv1D {
    fn load(
        b: &mut ParamBuilder<'_>,
        prefix: &str,
        (fan_in, fan_out): (usize, usize),
        std: f64,
        lora: Option<&LoraConfig>,
    ) -> Result<Self> {
        let weight_name = format!("{prefix}.weight");
        let weight_frozen = !b.partition().base_role(&weight_name).is_trainable();
        let weight = b.base(&weight_name, &[fan_in, fan_out], Init::Normal(std))?;
        let bias = b.base(&format!("{prefix}.bias"), &[fan_out], Init::Zeros)?;
        let lora = match lora {
            Some(cfg) => {
                let bound = 1.0 / (fan_in as f64).sqrt();
                let a = b.adapter(&format!("{prefix}.lora_A.weight"), &[cfg.rank, fan_in], Init::Uniform(bound))?;
                let b_ = b.adapter(&format!("{prefix}.lora_B.weight"), &[fan_out, cfg.rank], Init::Zeros)?;
                Some(LoraLayer { a, b: b_, scale: cfg.scale() })
            }
            None => None,
        };
        Ok(Self { weight, bias, weight_frozen, lora })
    }

    /// The projection as the fused block reads it.
    fn fused(&self) -> ops::Projection {
        ops::Projection {
            weight: self.weight.clone(),
            bias: self.bias.clone(),
            trains: !self.weight_frozen,
            adapter: self.lora.as_ref().map(|l| ops::Adapter { a: l.a.clone(), b: l.b.clone(), scale: l.scale }),
        }
    }

    /// `x: [rows, fan_in]`, 2-D: the model keeps its residual stream as rows, so no
    /// reshape (a graph node with a zero-filled gradient of its own) sits around each
    /// projection.
    fn forward(&self, x: &Tensor) -> CResult<Tensor> {
        // Weights are kept in the master dtype and cast to the compute dtype at use (a no-op
        // when they agree); the gradient flows back through the cast in the master dtype.
        // A frozen projection is detached, so backward skips its weight and bias gradients.
        let param = |p: &Tensor| -> CResult<Tensor> {
            let p = p.to_dtype(x.dtype())?;
            Ok(if self.weight_frozen { p.detach() } else { p })
        };
        match &self.lora {
            // The base trains, so backward forms the weight-sized gradient anyway: folding the
            // adapter into the weight (W + s A^T B^T) costs one small matmul and saves the two
            // output-sized tensors (adapter output and sum) that backward would keep. Only in
            // the master dtype: rounded to half precision, W would swallow a small update.
            Some(lora) if !self.weight_frozen && x.dtype() == self.weight.dtype() => {
                let merged = (&self.weight + lora.delta_weight()?)?;
                ops::linear_bias(x, &merged, &self.bias)
            }
            Some(lora) => ops::linear_bias(x, &param(&self.weight)?, &param(&self.bias)?)? + lora.forward(x)?,
            None => ops::linear_bias(x, &param(&self.weight)?, &param(&self.bias)?),
        }
    }
}

#[derive(Debug, Clone)]
struct Attention {
    c_attn: Conv1D,
    c_proj: Conv1D,
    n_head: usize,
    /// The parameters' dtype, in which the softmax runs whatever the compute dtype.
    master: DType,
}

impl Attention {
    fn load(b: &mut ParamBuilder<'_>, prefix: &str, cfg: &Gpt2Config, lora: Option<&LoraConfig>) -> Result<Self> {
        let d = cfg.n_embd;
        let adapted = |module: &str| lora.filter(|l| l.targets_module(module));
        // GPT-2 scales residual projections by 1/sqrt(2 n_layer) at init.
        let proj_std = INIT_STD / (2.0 * cfg.n_layer as f64).sqrt();
        Ok(Self {
            c_attn: Conv1D::load(b, &format!("{prefix}.c_attn"), (d, 3 * d), INIT_STD, adapted("attn.c_attn"))?,
            c_proj: Conv1D::load(b, &format!("{prefix}.c_proj"), (d, d), proj_std, adapted("attn.c_proj"))?,
            n_head: cfg.n_head,
            master: b.dtype(),
        })
    }

    /// Causal self-attention over `x: [batch * seq_len, d]`. Right padding needs no extra
    /// mask: a real token only ever attends to earlier positions, which are real too.
    fn forward(&self, x: &Tensor, seq_len: usize, forks: &ops::Forks) -> CResult<Tensor> {
        let y = ops::forked_self_attention(&self.c_attn.forward(x)?, seq_len, self.n_head, self.master, forks)?;
        self.c_proj.forward(&y)
    }
}

#[derive(Debug, Clone)]
struct Mlp {
    c_fc: Conv1D,
    c_proj: Conv1D,
}

impl Mlp {
    fn load(b: &mut ParamBuilder<'_>, prefix: &str, cfg: &Gpt2Config, lora: Option<&LoraConfig>) -> Result<Self> {
        let (d, inner) = (cfg.n_embd, cfg.inner_dim());
        let adapted = |module: &str| lora.filter(|l| l.targets_module(module));
        let proj_std = INIT_STD / (2.0 * cfg.n_layer as f64).sqrt();
        Ok(Self {
            c_fc: Conv1D::load(b, &format!("{prefix}.c_fc"), (d, inner), INIT_STD, adapted("mlp.c_fc"))?,
            c_proj: Conv1D::load(b, &format!("{prefix}.c_proj"), (inner, d), proj_std, adapted("mlp.c_proj"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> CResult<Tensor> {
        self.c_proj.forward(&ops::gelu_new(&self.c_fc.forward(x)?)?)
    }
}

#[derive(Debug, Clone)]
struct Block {
    ln_1: LayerNorm,
    attn: Attention,
    ln_2: LayerNorm,
    mlp: Mlp,
}

impl Block {
    fn load(b: &mut ParamBuilder<'_>, i: usize, cfg: &Gpt2Config, lora: Option<&LoraConfig>) -> Result<Self> {
        let p = format!("h.{i}");
        Ok(Self {
            ln_1: LayerNorm::load(b, &format!("{p}.ln_1"), cfg)?,
            attn: Attention::load(b, &format!("{p}.attn"), cfg, lora)?,
            ln_2: LayerNorm::load(b, &format!("{p}.ln_2"), cfg)?,
            mlp: Mlp::load(b, &format!("{p}.mlp"), cfg, lora)?,
        })
    }

    fn fused(&self) -> ops::BlockWeights {
        ops::BlockWeights {
            ln_1: (self.ln_1.weight.clone(), self.ln_1.bias.clone()),
            c_attn: self.attn.c_attn.fused(),
            attn_proj: self.attn.c_proj.fused(),
            ln_2: (self.ln_2.weight.clone(), self.ln_2.bias.clone()),
            c_fc: self.mlp.c_fc.fused(),
            mlp_proj: self.mlp.c_proj.fused(),
            eps: self.ln_1.eps,
            n_head: self.attn.n_head,
        }
    }

    /// `x: [batch * seq_len, d]`: one fused op where it applies ([`ops::fused_block`]),
    /// otherwise the block's ops one by one.
    fn forward(
        &self,
        x: &Tensor,
        seq_len: usize,
        forks: &ops::Forks,
        grads: Option<&ops::BlockGradients>,
    ) -> CResult<Tensor> {
        if let Some(grads) = grads {
            let weights = self.fused();
            if weights.fits(x) {
                return ops::fused_block(x, weights, seq_len, forks, grads);
            }
        }
        let x = (x + self.attn.forward(&self.ln_1.forward(x)?, seq_len, forks)?)?;
        &x + self.mlp.forward(&self.ln_2.forward(&x)?)?
    }
}

/// Which pass of a step's backward [`Gpt2::backward_pass`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackwardPass {
    /// The step's first pass: buffers left by an earlier step are dropped.
    pub first: bool,
    /// The step's last pass: the buffered gradients join the returned store.
    pub last: bool,
}

impl BackwardPass {
    /// A step in one pass.
    pub const WHOLE: Self = Self { first: true, last: true };

    /// Pass `index` of `passes`.
    pub fn of(index: usize, passes: usize) -> Self {
        Self { first: index == 0, last: index + 1 >= passes }
    }
}

/// The GPT-2 language model with a head tied to the token embedding.
#[derive(Debug, Clone)]
pub struct Gpt2 {
    wte: Tensor,
    wpe: Tensor,
    h: Vec<Block>,
    ln_f: LayerNorm,
    wte_frozen: bool,
    /// Where `wte`'s gradient from the lookup and the tied head collects in backward.
    tied: ops::TiedGradient,
    /// Where the fused blocks' parameter gradients collect in backward.
    block_grads: ops::BlockGradients,
    /// Whether blocks run as one fused op where they can (see [`Gpt2::set_fused_blocks`]).
    fused_blocks: bool,
    n_positions: usize,
    dtype: DType,
    /// The dtype of matmuls and activations; `dtype` (the parameters', the logits' and
    /// every reduction's) unless set lower for mixed precision.
    compute: DType,
    /// The operands' precision in the large matmuls (see [`ops::MatmulPrecision`]).
    matmuls: ops::MatmulPrecision,
    device: Device,
}

impl Gpt2 {
    pub(crate) fn load(b: &mut ParamBuilder<'_>, cfg: &Gpt2Config, lora: Option<&LoraConfig>) -> Result<Self> {
        cfg.validate()?;
        let d = cfg.n_embd;
        let wte_frozen = !b.partition().base_role("wte.weight").is_trainable();
        let wte = b.base("wte.weight", &[cfg.vocab_size, d], Init::Normal(INIT_STD))?;
        let wpe = b.base("wpe.weight", &[cfg.n_positions, d], Init::Normal(0.01))?;
        let h = (0..cfg.n_layer).map(|i| Block::load(b, i, cfg, lora)).collect::<Result<Vec<_>>>()?;
        let ln_f = LayerNorm::load(b, "ln_f", cfg)?;
        Ok(Self {
            wte,
            wpe,
            h,
            ln_f,
            wte_frozen,
            tied: ops::TiedGradient::default(),
            block_grads: ops::BlockGradients::default(),
            fused_blocks: true,
            n_positions: cfg.n_positions,
            dtype: b.dtype(),
            compute: b.dtype(),
            matmuls: ops::MatmulPrecision::F32,
            device: b.device().clone(),
        })
    }

    /// The dtype of the parameters and of the logits the model returns.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The precision the model computes in: its matmuls' operands, and its activations
    /// where those follow (see [`Gpt2::set_compute_dtype`]).
    pub fn compute_dtype(&self) -> DType {
        match self.matmuls {
            ops::MatmulPrecision::Bf16 => DType::BF16,
            ops::MatmulPrecision::F16 => DType::F16,
            ops::MatmulPrecision::F32 => self.compute,
        }
    }

    /// Mixed precision, with parameters, their gradients, layer norms, softmax and the
    /// logits in the master dtype.
    ///
    /// bf16 or f16 over f32 parameters on the CPU keeps the activations in f32 and the
    /// fused kernels, and rounds only the large matmuls' operands (f32 accumulation, see
    /// [`ops::MatmulPrecision`]). Elsewhere activations and matmuls run in `compute`
    /// through candle's ops.
    pub fn set_compute_dtype(&mut self, compute: DType) {
        let packed = self.dtype == DType::F32 && self.device.is_cpu();
        (self.compute, self.matmuls) = match compute {
            DType::BF16 if packed => (DType::F32, ops::MatmulPrecision::Bf16),
            DType::F16 if packed => (DType::F32, ops::MatmulPrecision::F16),
            _ => (compute, ops::MatmulPrecision::F32),
        };
    }

    /// The matmul precision this model's passes run at.
    pub fn matmul_precision(&self) -> ops::MatmulPrecision {
        self.matmuls
    }

    /// Whether blocks run as one fused op on the CPU in full precision (the default), or
    /// op by op, as everywhere else: the composed path is the fused one's reference.
    pub fn set_fused_blocks(&mut self, fused: bool) {
        self.fused_blocks = fused;
    }

    /// The device the model lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Final hidden states `[batch, seq, n_embd]` for token ids `[batch, seq]` (u32).
    pub fn hidden_states(&self, input_ids: &Tensor) -> Result<Tensor> {
        self.hidden_states_forked(input_ids, &ops::Forks::none())
    }

    /// [`Gpt2::hidden_states`] for sequences that may fork after a shared prefix
    /// ([`ops::Fork`]): a fork's second branch takes the first's positions and does not
    /// see it, so each branch's hidden states are those of `prefix ++ branch` alone.
    pub fn hidden_states_forked(&self, input_ids: &Tensor, forks: &ops::Forks) -> Result<Tensor> {
        let _precision = self.matmuls.scope();
        let (b, t) = input_ids.dims2()?;
        let longest = (0..b).map(|i| forks.of(i).map_or(t, |f| t.saturating_sub(f.first))).max().unwrap_or(t);
        if longest > self.n_positions {
            return Err(ModelError::SequenceTooLong { len: longest, max: self.n_positions });
        }
        let d = self.wte.dim(1)?;
        let ids = input_ids.flatten_all()?;
        let tokens = if ops::TiedGradient::routes(&self.wte) {
            self.tied.lookup(&self.wte, &ids)?
        } else {
            self.wte.index_select(&ids, 0)?
        };
        // The blocks run on rows [b * t, d]; see `Conv1D::forward`.
        let mut x = if forks.is_none() {
            let positions = self.wpe.narrow(0, 0, t)?.to_dtype(self.compute)?;
            tokens.reshape((b, t, d))?.to_dtype(self.compute)?.broadcast_add(&positions)?.reshape((b * t, d))?
        } else {
            let ids: Vec<u32> = (0..b)
                .flat_map(|i| {
                    let fork = forks.of(i);
                    (0..t).map(move |j| fork.map_or(j, |f| f.position(j)) as u32)
                })
                .collect();
            let ids = Tensor::from_vec(ids, b * t, &self.device)?;
            (tokens.to_dtype(self.compute)? + self.wpe.index_select(&ids, 0)?.to_dtype(self.compute)?)?
        };
        let fused = self.fused_blocks.then_some(&self.block_grads);
        for block in &self.h {
            x = block.forward(&x, t, forks, fused)?;
        }
        Ok(self.ln_f.forward(&x)?.reshape((b, t, d))?)
    }

    /// Logits `[n, vocab]` for hidden states `[n, n_embd]`, in the master dtype: the
    /// log-softmax over the vocabulary that follows needs its precision.
    pub fn lm_head(&self, hidden: &Tensor) -> Result<Tensor> {
        let _precision = self.matmuls.scope();
        if ops::TiedGradient::routes(&self.wte) && hidden.dtype() == self.wte.dtype() {
            return Ok(self.tied.head(hidden, &self.wte)?);
        }
        let head = self.wte.t()?.to_dtype(hidden.dtype())?;
        let logits = if self.wte_frozen { ops::matmul_frozen_rhs(hidden, &head)? } else { hidden.matmul(&head)? };
        Ok(logits.to_dtype(self.dtype)?)
    }

    /// `log softmax(logits)[i, targets[i]]` for hidden states `[n, n_embd]` and target ids
    /// `[n]`, in the master dtype. On the CPU in full precision the head and the log-softmax
    /// run as one op that keeps no logits tensor in the graph.
    pub fn token_logprobs(&self, hidden: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let _precision = self.matmuls.scope();
        let fused =
            self.device.is_cpu() && hidden.dtype() == self.wte.dtype() && matches!(self.dtype, DType::F32 | DType::F64);
        if fused {
            let wte = if self.wte_frozen { self.wte.detach() } else { self.wte.clone() };
            return Ok(self.tied.head_logprobs(hidden, &wte, targets)?);
        }
        Ok(ops::token_logprobs(&self.lm_head(hidden)?, targets)?)
    }

    /// Gradients of `loss` (a scalar computed from this model's outputs) for every tracked
    /// tensor. Use this rather than `loss.backward()`: the tied embedding's gradient is
    /// collected outside candle's store (see [`ops::TiedGradient`]) and added here.
    pub fn backward(&self, loss: &Tensor) -> Result<GradStore> {
        self.backward_pass(loss, BackwardPass::WHOLE)
    }

    /// One backward pass of a step whose batch is split into several. The gradients this
    /// model collects outside candle's store (the tied embedding's and the fused blocks')
    /// stay in their buffers from the first pass to the last, each pass adding into them, and
    /// come out in the last pass's store: summed over the passes, held once. What reaches
    /// candle's own store is returned by every pass, for the caller to sum.
    pub fn backward_pass(&self, loss: &Tensor, pass: BackwardPass) -> Result<GradStore> {
        if pass.first {
            // also drops what a pass that failed halfway left behind
            self.tied.clear();
            self.block_grads.clear();
        }
        let mut grads = {
            let _precision = self.matmuls.scope();
            loss.backward()?
        };
        // The embedding's buffer is carried only where the head adds into it as well (it
        // runs in the embedding's dtype). Under mixed precision the head's part reaches
        // candle's store, the caller sums it over the passes, and a carried buffer beside
        // that sum would be a second embedding-sized one.
        let head_adds_into_buffer = self.compute == self.wte.dtype();
        if pass.last || !head_adds_into_buffer {
            self.tied.collect(&self.wte, &mut grads)?;
        }
        if pass.last {
            self.block_grads.collect(&mut grads)?;
        }
        Ok(grads)
    }

    /// Logits `[batch, seq, vocab]` at every position (for tests and reference checks; the
    /// trainer only computes the head at response positions).
    pub fn forward(&self, input_ids: &Tensor) -> Result<Tensor> {
        let h = self.hidden_states(input_ids)?;
        let (b, t, d) = h.dims3()?;
        Ok(self.lm_head(&h.reshape((b * t, d))?)?.reshape((b, t, ()))?)
    }
}

#[cfg(test)]
mod tests;
