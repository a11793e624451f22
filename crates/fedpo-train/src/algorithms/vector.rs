//! Gradients and parameter sets as named tensors, with the few vector operations the
//! local terms need (dot products and norms accumulate in f64).

use std::collections::HashMap;

use candle_core::{DType, Tensor};

use crate::error::Result;

/// Tensors by parameter name: a gradient, a control variate, a direction.
pub type Grads = HashMap<String, Tensor>;

/// `Σ a·b` over the named tensors both sets hold.
pub(crate) fn dot<'a>(a: &Grads, b: &Grads, names: impl IntoIterator<Item = &'a str>) -> Result<f64> {
    let mut sum = 0.0;
    for name in names {
        if let (Some(x), Some(y)) = (a.get(name), b.get(name)) {
            sum += (x.to_dtype(DType::F64)? * y.to_dtype(DType::F64)?)?.sum_all()?.to_scalar::<f64>()?;
        }
    }
    Ok(sum)
}

/// `a[name] += scale · b[name]` for every name of `b` (inserting where `a` has none).
pub(crate) fn add_scaled(a: &mut Grads, b: &Grads, scale: f64) -> Result<()> {
    for (name, y) in b {
        let y = y.to_dtype(a.get(name).map_or(y.dtype(), Tensor::dtype))?;
        let sum = match a.remove(name) {
            Some(x) => (x + (y * scale)?)?,
            None => (y * scale)?,
        };
        a.insert(name.clone(), sum);
    }
    Ok(())
}
