//! Helpers shared by the model's integration tests.

use candle_core::{DType, Device, Shape, Tensor};
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};

/// Normal noise with standard deviation `std` from a fixed seed, so that a failing
/// tolerance check fails on every run, not on an unlucky draw.
pub(crate) fn seeded_normal(shape: &Shape, std: f64, seed: u64, dtype: DType) -> Tensor {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let normal = Normal::new(0.0, std).expect("a finite, positive standard deviation");
    let values: Vec<f64> = (0..shape.elem_count()).map(|_| normal.sample(&mut rng)).collect();
    Tensor::from_vec(values, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}
