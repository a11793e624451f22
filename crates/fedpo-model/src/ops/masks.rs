//! Additive attention masks for the composed path, built once per shape and device.
//!
//! The fused CPU kernels skip masked keys without a mask. Candle's composed ops (GPUs, half
//! precision) add a `0 / -inf` mask to the scores instead, and building it on the host and
//! uploading it in every layer of every forward pass puts a host round trip in each layer.
//! Here a mask is made once per (shape, forks, device, dtype) and shared: every layer of a
//! forward uses the same tensor, and so does every later batch of the same shape, which in
//! training is most of them.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, DeviceLocation, Result as CResult, Tensor};

use super::fork::{Fork, Forks};

/// Masks kept at once. A causal mask is one per sequence length; forked masks change with
/// the batch's prompt and response lengths, so older ones are dropped first.
const KEPT: usize = 16;

#[derive(Clone, PartialEq, Eq)]
struct Key {
    location: DeviceLocation,
    dtype: DType,
    /// Sequences and their length; the causal mask has one sequence.
    shape: (usize, usize),
    forks: Option<Arc<[Fork]>>,
}

/// Most recently used first.
static CACHE: Mutex<Vec<(Key, Tensor)>> = Mutex::new(Vec::new());

#[cfg(test)]
static BUILT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn cached(key: Key, device: &Device, build: impl FnOnce() -> CResult<Tensor>) -> CResult<Tensor> {
    let mut cache = CACHE.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    // Two candle CUDA devices on one GPU have the same location but distinct streams, and
    // a tensor of one cannot meet a tensor of the other.
    if let Some(at) = cache.iter().position(|(k, mask)| *k == key && mask.device().same_device(device)) {
        let hit = cache.remove(at);
        let mask = hit.1.clone();
        cache.insert(0, hit);
        return Ok(mask);
    }
    let mask = build()?;
    #[cfg(test)]
    BUILT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    cache.insert(0, (key, mask.clone()));
    cache.truncate(KEPT);
    Ok(mask)
}

/// The `[t, t]` causal mask: 0 where the key is at or before the query, `-inf` after.
pub(crate) fn causal(t: usize, dtype: DType, device: &Device) -> CResult<Tensor> {
    let key = Key { location: device.location(), dtype, shape: (1, t), forks: None };
    cached(key, device, || {
        let mask: Vec<f32> =
            (0..t).flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY })).collect();
        Tensor::from_vec(mask, (t, t), device)?.to_dtype(dtype)
    })
}

/// The `[batch, 1, t, t]` mask of forked sequences ([`Forks::mask`]).
pub(crate) fn forked(forks: &Forks, batch: usize, t: usize, dtype: DType, device: &Device) -> CResult<Tensor> {
    let key = Key { location: device.location(), dtype, shape: (batch, t), forks: forks.shared() };
    cached(key, device, || Tensor::from_vec(forks.mask(batch, t), (batch, 1, t, t), device)?.to_dtype(dtype))
}

#[cfg(test)]
pub(crate) fn built() -> usize {
    BUILT.load(std::sync::atomic::Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mask_is_built_once_per_shape_and_forks_and_reused_after() {
        // Lengths no other test uses, so the count is this test's alone.
        let device = Device::Cpu;
        let before = built();
        let a = causal(97, DType::F32, &device).unwrap();
        let b = causal(97, DType::F32, &device).unwrap();
        assert_eq!(built() - before, 1, "the second causal(97) is a hit");
        assert_eq!(a.to_vec2::<f32>().unwrap(), b.to_vec2::<f32>().unwrap());
        let row: Vec<f32> = a.get(3).unwrap().to_vec1().unwrap();
        assert!(row[..4].iter().all(|v| *v == 0.0) && row[4..].iter().all(|v| *v == f32::NEG_INFINITY));
        causal(97, DType::F64, &device).unwrap();
        assert_eq!(built() - before, 2, "another dtype is another mask");

        let forks = Forks::new(vec![Fork { prefix: 40, first: 30 }, Fork { prefix: 41, first: 30 }]);
        let m = forked(&forks, 2, 93, DType::F32, &device).unwrap();
        assert_eq!(m.dims(), [2, 1, 93, 93]);
        let same = Forks::new(vec![Fork { prefix: 40, first: 30 }, Fork { prefix: 41, first: 30 }]);
        forked(&same, 2, 93, DType::F32, &device).unwrap();
        assert_eq!(built() - before, 3, "equal forks share a mask");
        let other = Forks::new(vec![Fork { prefix: 40, first: 31 }, Fork { prefix: 41, first: 30 }]);
        forked(&other, 2, 93, DType::F32, &device).unwrap();
        assert_eq!(built() - before, 4, "other forks are another mask");
        // a query of branch two does not see branch one
        let row: Vec<f32> = m.get(0).unwrap().get(0).unwrap().get(75).unwrap().to_vec1().unwrap();
        assert_eq!(row[39], 0.0);
        assert_eq!(row[40], f32::NEG_INFINITY);
        assert_eq!(row[70], 0.0);
    }
}
