//! Incremental decoding: each layer's keys and values are kept across calls in a
//! [`KvCache`], so a generated token costs one position's forward pass, not the whole
//! sequence's.
//!
//! Weights may be bf16 with f32 activations (`generate --dtype bf16`): one token's
//! products read them as stored, half the bytes a token streams, while layer norms,
//! attention, the cache and the logits stay f32.
//!
//! Inference only: nothing here records a gradient, and the adapter is applied beside the
//! frozen base projection (two rank-r matmuls per token) rather than merged into it, which
//! would cost a weight-sized addition per token and a second copy of every adapted weight.

use candle_core::{DType, Device, Tensor};

use super::{Attention, Block, Conv1D, Gpt2, LayerNorm};
use crate::config::Gpt2Config;
use crate::error::{ModelError, Result};
use crate::ops;

type CResult<T> = candle_core::Result<T>;

/// The keys and values of every position decoded so far, for every layer.
///
/// Each layer's buffers are allocated once for `capacity` positions (`[n_head, capacity,
/// head_dim]`), and each call writes its new positions in place: appending never copies
/// what is already there.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<(Tensor, Tensor)>,
    len: usize,
    capacity: usize,
}

impl KvCache {
    /// An empty cache for `model`, holding up to `capacity` positions (at most the model's
    /// `n_positions`).
    pub fn new(model: &Gpt2, capacity: usize) -> Result<Self> {
        if capacity > model.n_positions {
            return Err(ModelError::SequenceTooLong { len: capacity, max: model.n_positions });
        }
        let d = model.wte.dim(1)?;
        let layers = model
            .h
            .iter()
            .map(|block| {
                let shape = (block.attn.n_head, capacity, d / block.attn.n_head);
                let buffer = || Tensor::zeros(shape, model.compute, &model.device);
                Ok((buffer()?, buffer()?))
            })
            .collect::<CResult<Vec<_>>>()?;
        Ok(Self { layers, len: 0, capacity })
    }

    /// Bytes a cache of `capacity` positions takes for `config` in `dtype`: the memory
    /// planner's figure.
    pub fn bytes(config: &Gpt2Config, capacity: usize, dtype: DType) -> u64 {
        2 * (config.n_layer * capacity * config.n_embd * dtype.size_in_bytes()) as u64
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The most positions it can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets every position; the buffers stay allocated.
    pub fn clear(&mut self) {
        self.len = 0;
    }
}

impl Conv1D {
    /// `x @ weight + bias`, plus the adapter's output, without gradients.
    fn infer(&self, x: &Tensor) -> CResult<Tensor> {
        let cast = |p: &Tensor| p.detach().to_dtype(x.dtype());
        // One token's rows read bf16 weights as stored; a prefill's casts them once.
        let base = match ops::rows_times_weight(x, &self.weight, &self.bias)? {
            Some(y) => y,
            None => ops::linear_bias(x, &cast(&self.weight)?, &cast(&self.bias)?)?,
        };
        match &self.lora {
            Some(lora) => {
                let (a, b) = (cast(&lora.a)?, cast(&lora.b)?);
                base + (x.matmul(&a.t()?)? * lora.scale)?.matmul(&b.t()?)?
            }
            None => Ok(base),
        }
    }
}

impl Attention {
    /// Attention of `x: [n, d]`, the positions after the `past` ones in `cache`, over
    /// those and themselves; writes their keys and values into `cache`.
    fn infer(&self, x: &Tensor, (k_cache, v_cache): &(Tensor, Tensor), past: usize) -> CResult<Tensor> {
        let (n, d) = x.dims2()?;
        let (h, head_dim) = (self.n_head, d / self.n_head);
        // [n, 3, h, head_dim] -> three [h, n, head_dim]
        let qkv = self.c_attn.infer(x)?.reshape((n, 3, h, head_dim))?;
        let heads = |i: usize| qkv.narrow(1, i, 1)?.squeeze(1)?.transpose(0, 1)?.contiguous();
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        k_cache.slice_set(&k, 1, past)?;
        v_cache.slice_set(&v, 1, past)?;
        let total = past + n;
        let (keys, values) = (k_cache.narrow(1, 0, total)?, v_cache.narrow(1, 0, total)?);
        // Scores and softmax in f32 when either the activations or the weights are.
        let softmax = if x.dtype() == DType::F32 { DType::F32 } else { self.master };
        let scale = 1.0 / (head_dim as f64).sqrt();
        let mut scores = (q.matmul(&keys.t()?)?.to_dtype(softmax)? * scale)?;
        if n > 1 {
            // Query i sits at position past + i and sees keys up to it.
            let mask: Vec<f32> = (0..n)
                .flat_map(|i| (0..total).map(move |j| if j <= past + i { 0.0 } else { f32::NEG_INFINITY }))
                .collect();
            let mask = Tensor::from_vec(mask, (n, total), x.device())?.to_dtype(softmax)?;
            scores = scores.broadcast_add(&mask)?;
        }
        let probs = ops::softmax_last_dim(&scores)?.to_dtype(x.dtype())?;
        let y = probs.matmul(&values)?; // [h, n, head_dim]
        self.c_proj.infer(&y.transpose(0, 1)?.reshape((n, d))?)
    }
}

impl LayerNorm {
    /// Normalizes in the activations' dtype when it is f32, whatever the weights'.
    fn infer(&self, x: &Tensor) -> CResult<Tensor> {
        if x.dtype() == DType::F32 {
            let f32 = |p: &Tensor| p.detach().to_dtype(DType::F32);
            return ops::layer_norm(x, &f32(&self.weight)?, &f32(&self.bias)?, self.eps);
        }
        self.forward(x)
    }
}

impl Block {
    fn infer(&self, x: &Tensor, cache: &(Tensor, Tensor), past: usize) -> CResult<Tensor> {
        let x = (x + self.attn.infer(&self.ln_1.infer(x)?, cache, past)?)?;
        let mlp = self.mlp.c_proj.infer(&ops::gelu_new(&self.mlp.c_fc.infer(&self.ln_2.infer(&x)?)?)?)?;
        &x + mlp
    }
}

impl Gpt2 {
    /// Final hidden states `[n, n_embd]` of `ids`, the tokens that follow the positions
    /// `cache` holds, whose keys and values join the cache. The first call with the whole
    /// prompt is the prefill; each later one passes the token just chosen.
    pub fn forward_cached(&self, ids: &[u32], cache: &mut KvCache) -> Result<Tensor> {
        let (past, n) = (cache.len, ids.len());
        if past + n > cache.capacity {
            return Err(ModelError::SequenceTooLong { len: past + n, max: cache.capacity });
        }
        if cache.layers.len() != self.h.len() {
            return Err(ModelError::InvalidConfig(format!(
                "a cache of {} layers for a model of {}",
                cache.layers.len(),
                self.h.len()
            )));
        }
        let vocab = self.wte.dim(0)?;
        if let Some(id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(ModelError::InvalidConfig(format!("token id {id} is outside the model's {vocab} tokens")));
        }
        let ids_t = Tensor::from_slice(ids, n, &self.device)?;
        let tokens = self.wte.detach().index_select(&ids_t, 0)?.to_dtype(self.compute)?;
        let positions = self.wpe.detach().narrow(0, past, n)?.to_dtype(self.compute)?;
        let mut x = (tokens + positions)?;
        for (block, layer) in self.h.iter().zip(&cache.layers) {
            x = block.infer(&x, layer, past)?;
        }
        cache.len += n;
        Ok(self.ln_f.infer(&x)?)
    }

    /// Logits `[n, vocab]` in the master dtype for hidden states `[n, n_embd]`, without
    /// gradients.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        // `wte @ hidden^T`: the embedding's rows are read in place, one dot product per
        // token, where `hidden @ wte^T` would read the table transposed.
        let logits = match ops::rows_times_table(hidden, &self.wte)? {
            Some(l) => l,
            None => self.wte.detach().to_dtype(hidden.dtype())?.matmul(&hidden.t()?)?.t()?,
        };
        Ok(logits.to_dtype(self.dtype)?)
    }

    /// Logits of the position after the last of `ids`, decoded after what `cache` holds.
    pub fn next_logits(&self, ids: &[u32], cache: &mut KvCache) -> Result<Vec<f32>> {
        let hidden = self.forward_cached(ids, cache)?;
        let last = hidden.narrow(0, hidden.dim(0)? - 1, 1)?;
        Ok(self.logits(&last)?.squeeze(0)?.to_dtype(DType::F32)?.to_vec1()?)
    }

    /// This model without its adapters: the shared base alone, sharing its tensors.
    pub fn base_only(&self) -> Self {
        let mut base = self.clone();
        for block in &mut base.h {
            for p in [&mut block.attn.c_attn, &mut block.attn.c_proj, &mut block.mlp.c_fc, &mut block.mlp.c_proj] {
                p.lora = None;
            }
        }
        base
    }

    /// The device the model's tensors live on (for callers building inputs).
    pub fn on_device(&self) -> &Device {
        &self.device
    }

    /// Positions the model can attend over.
    pub fn n_positions(&self) -> usize {
        self.n_positions
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LoraConfig, Partition, PartitionPreset, Policy, PolicySpec};

    fn policy_with_adapter() -> Policy {
        let spec = PolicySpec {
            config: Gpt2Config {
                vocab_size: 97,
                n_positions: 40,
                n_embd: 32,
                n_layer: 2,
                n_head: 4,
                ..Gpt2Config::tiny()
            },
            lora: Some(LoraConfig::new(4, 8.0, &["c_attn", "mlp.c_fc"]).unwrap()),
            partition: Partition::new(PartitionPreset::Pfeddpo),
        };
        let policy = Policy::random(spec, 3, &Device::Cpu).unwrap();
        // A fresh adapter's B is zero; give it a part in the output.
        for p in policy.params.iter().filter(|p| p.name.contains("lora_B")) {
            let b = Tensor::randn(0f32, 0.2, p.tensor().shape(), &Device::Cpu).unwrap();
            p.var().expect("pFedDPO trains the adapter").set(&b).unwrap();
        }
        policy
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    #[test]
    fn cached_decoding_gives_the_logits_of_a_full_recompute_at_every_position() {
        let policy = policy_with_adapter();
        let ids: Vec<u32> = (0..23u32).map(|i| (i * 37 + 5) % 97).collect();
        let full = policy.model.forward(&Tensor::new(ids.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap());
        let full = full.unwrap().squeeze(0).unwrap();
        // A prefill of 9, then one token at a time.
        let mut cache = KvCache::new(&policy.model, 30).unwrap();
        let mut rows = vec![policy.model.logits(&policy.model.forward_cached(&ids[..9], &mut cache).unwrap()).unwrap()];
        for id in &ids[9..] {
            rows.push(policy.model.logits(&policy.model.forward_cached(&[*id], &mut cache).unwrap()).unwrap());
        }
        assert_eq!(cache.len(), ids.len());
        let cached = Tensor::cat(&rows, 0).unwrap();
        assert!(max_diff(&cached, &full) < 1e-5, "cache vs recompute: {}", max_diff(&cached, &full));
        // The adapter matters, and the base alone differs from the adapted model.
        let base = policy.model.base_only();
        let mut cache = KvCache::new(&base, 30).unwrap();
        let base_logits = base.logits(&base.forward_cached(&ids, &mut cache).unwrap()).unwrap();
        assert!(max_diff(&base_logits, &full) > 1e-3);
    }

    #[test]
    fn a_cache_refuses_positions_beyond_its_capacity_and_the_model_naming_both() {
        let policy = policy_with_adapter();
        let err = KvCache::new(&policy.model, 41).unwrap_err().to_string();
        assert!(err.contains("41") && err.contains("40"), "{err}");
        let mut cache = KvCache::new(&policy.model, 8).unwrap();
        let err = policy.model.forward_cached(&[1; 9], &mut cache).unwrap_err().to_string();
        assert!(err.contains('9') && err.contains('8'), "{err}");
        assert!(cache.is_empty(), "a refused call leaves the cache as it was");
        let err = policy.model.forward_cached(&[97], &mut cache).unwrap_err().to_string();
        assert!(err.contains("97"), "{err}");
    }
}
