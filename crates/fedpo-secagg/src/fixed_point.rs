//! Fixed-point encoding mod 2³²: masks are uniform in Z/2³², so inputs must live there too.

use serde::{Deserialize, Serialize};

use crate::error::SecAggError;

/// `x ↦ round(x · scale) mod 2³²`, for values within ±`range`. The sum of up to
/// `parties` encoded values decodes exactly as long as it stays within ±2³¹ / scale;
/// [`FixedPoint::for_sum`] picks the finest scale for which it always does.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FixedPoint {
    pub scale: f64,
    pub range: f32,
}

impl FixedPoint {
    /// The finest scale at which `parties` values of at most `range` each sum without
    /// wrapping. The decoding error of the sum is then at most `parties / (2 · scale)`.
    pub fn for_sum(range: f32, parties: usize) -> Self {
        let bound = f64::from(range) * parties.max(1) as f64;
        Self { scale: (f64::from(i32::MAX) / bound).floor().max(1.0), range }
    }

    pub fn encode(&self, values: &[f32]) -> Result<Vec<u32>, SecAggError> {
        values
            .iter()
            .map(|&v| {
                // NaN fails this test too.
                if v.is_nan() || v.abs() > self.range {
                    return Err(SecAggError::OutOfRange { value: v, range: self.range });
                }
                Ok((f64::from(v) * self.scale).round() as i64 as u32)
            })
            .collect()
    }

    /// Decodes a sum (two's complement in 32 bits).
    pub fn decode(&self, values: &[u32]) -> Vec<f64> {
        values.iter().map(|&v| f64::from(v as i32) / self.scale).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_of_encoded_values_decode_to_the_sum_within_the_rounding_bound() {
        let fp = FixedPoint::for_sum(2.0, 3);
        let inputs = [[1.99f32, -2.0, 0.3], [1.5, -1.75, -0.1], [2.0, -2.0, 1e-7]];
        let mut sum = [0u32; 3];
        for x in &inputs {
            for (s, e) in sum.iter_mut().zip(fp.encode(x).unwrap()) {
                *s = s.wrapping_add(e);
            }
        }
        let decoded = fp.decode(&sum);
        for (j, d) in decoded.iter().enumerate() {
            let exact: f64 = inputs.iter().map(|x| f64::from(x[j])).sum();
            assert!((d - exact).abs() <= 3.0 / (2.0 * fp.scale), "{j}: {d} vs {exact}");
        }
        assert!(fp.encode(&[2.5]).unwrap_err().to_string().contains("±2"));
        assert!(fp.encode(&[f32::NAN]).is_err());
    }
}
