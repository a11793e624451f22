//! The round's one update, as a strategy applies it.
//!
//! It comes in two kinds. The mean rule streams: it keeps `Σ w_i Δ_i` and `Σ w_i` (with DP
//! noise in the sum, if asked) and the strategy divides. A robust rule (median, trimmed
//! mean, Krum) and secure aggregation's unmasking yield the combined values themselves,
//! which are no weighted sum of anything; they are kept as what they are, with the number
//! of updates behind them.

use std::collections::HashMap;

use crate::global_model::GlobalModel;
use crate::weighted_sum::{sum_of_squares, WeightedSum};

/// The round's combined update.
#[derive(Debug)]
pub(crate) enum CombinedUpdate {
    /// The mean rule's weighted sum, divided when applied.
    Sum(WeightedSum),
    /// The combined values of each shared tensor, from `count` updates.
    Values { values: HashMap<String, Vec<f64>>, count: usize },
}

impl From<WeightedSum> for CombinedUpdate {
    fn from(sum: WeightedSum) -> Self {
        Self::Sum(sum)
    }
}

impl CombinedUpdate {
    /// `flat`, the shared set's values in the model's order, combined from `count` updates.
    pub(crate) fn values(model: &GlobalModel, flat: &[f64], count: usize) -> Self {
        let mut offset = 0;
        let mut values = HashMap::new();
        for t in model.shared() {
            let n = t.values.len();
            values.insert(t.name.clone(), flat[offset..offset + n].to_vec());
            offset += n;
        }
        Self::Values { values, count }
    }

    /// Updates behind it.
    pub(crate) fn count(&self) -> usize {
        match self {
            Self::Sum(sum) => sum.count(),
            Self::Values { count, .. } => *count,
        }
    }

    /// One tensor's values and the divisor that makes them the update (`Σ w_i Δ_i` and
    /// `Σ w_i`, or the combined values and 1): the strategy folds the division into its
    /// own scale. `None` without any update.
    pub(crate) fn scaled(&self, name: &str) -> Option<(&[f64], f64)> {
        match self {
            Self::Sum(sum) => sum.sum_of(name),
            Self::Values { count: 0, .. } => None,
            Self::Values { values, .. } => values.get(name).map(|v| (v.as_slice(), 1.0)),
        }
    }

    /// One tensor's update, if any update was combined.
    pub(crate) fn mean(&self, name: &str) -> Option<impl Iterator<Item = f64> + '_> {
        self.scaled(name).map(|(values, divisor)| values.iter().map(move |v| v / divisor))
    }

    /// The update's L2 norm over every tensor (0 with no update).
    pub(crate) fn norm(&self) -> f64 {
        match self {
            Self::Sum(sum) => sum.mean_norm(),
            Self::Values { count: 0, .. } => 0.0,
            Self::Values { values, .. } => values.values().map(|v| sum_of_squares(v)).sum::<f64>().sqrt(),
        }
    }

    /// The sum's buffers, for the next round to sum into.
    pub(crate) fn into_buffers(self) -> Option<WeightedSum> {
        match self {
            Self::Sum(sum) => Some(sum),
            Self::Values { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use fedpo_model::{Gpt2Config, Partition, PartitionPreset, PolicySpec};
    use fedpo_wire::{TensorPayload, WireDType};

    use super::*;
    use crate::global_model::GlobalTensor;

    fn model() -> GlobalModel {
        let spec =
            PolicySpec { config: Gpt2Config::tiny(), lora: None, partition: Partition::new(PartitionPreset::Feddpo) };
        let t = |name: &str, n| GlobalTensor { name: name.into(), shape: vec![n], values: vec![0.0; n], shared: true };
        GlobalModel::new(spec, vec![t("a", 2), t("b", 1)])
    }

    #[test]
    fn combined_values_are_the_update_itself_and_a_sum_is_divided_by_its_weight() {
        let combined = CombinedUpdate::values(&model(), &[3.0, 0.0, 4.0], 7);
        assert_eq!(combined.count(), 7);
        assert_eq!(combined.mean("a").unwrap().collect::<Vec<_>>(), [3.0, 0.0]);
        assert_eq!(combined.scaled("b"), Some((&[4.0][..], 1.0)));
        assert_eq!(combined.norm(), 5.0);

        let mut sum = WeightedSum::new(&model());
        let t = |name: &str, values: Vec<f32>| GlobalTensor {
            name: name.into(),
            shape: vec![values.len()],
            values,
            shared: true,
        };
        sum.add(&TensorPayload::encode(&[t("a", vec![3.0, 0.0]), t("b", vec![4.0])], WireDType::F32), 2.0);
        let sum = CombinedUpdate::from(sum);
        assert_eq!(sum.scaled("b"), Some((&[8.0][..], 2.0)));
        assert_eq!(sum.mean("a").unwrap().collect::<Vec<_>>(), [3.0, 0.0]);
        assert_eq!(sum.norm(), 5.0);

        let nothing = CombinedUpdate::values(&model(), &[0.0; 3], 0);
        assert!(nothing.scaled("a").is_none() && nothing.norm() == 0.0);
    }
}
