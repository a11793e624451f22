//! Byzantine-robust combination rules: coordinate-wise median, trimmed mean and Krum.
//!
//! The mean lets one device move the global model anywhere: a sign-flipped or scaled
//! update, or a huge claimed pair count, dominates it. These rules bound what `f` bad
//! updates among `n` can do, at the price of holding every update of the round (n copies
//! of the shared set instead of one running sum) and of ignoring the devices' pair counts,
//! which a Byzantine device could inflate at will.

use anyhow::{bail, Result};
use clap::ValueEnum;

/// How a round's accepted updates become one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub(crate) enum AggregationRule {
    /// Pair-weighted mean (FedAvg); tolerates no Byzantine device.
    #[default]
    Mean,
    /// Coordinate-wise median (Yin et al. 2018): needs f < n/2.
    Median,
    /// Coordinate-wise mean after dropping the f largest and f smallest values (Yin et al.
    /// 2018): needs n > 2f.
    TrimmedMean,
    /// The one update closest to its n − f − 2 nearest neighbours (Blanchard et al. 2017):
    /// needs n > 2f + 2.
    Krum,
}

impl AggregationRule {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Mean => "mean",
            Self::Median => "median",
            Self::TrimmedMean => "trimmed-mean",
            Self::Krum => "krum",
        }
    }

    /// Whether the rule needs every update of the round held at once.
    pub(crate) fn holds_updates(self) -> bool {
        self != Self::Mean
    }

    /// Checks that `n` updates can tolerate `f` Byzantine ones under this rule.
    pub(crate) fn check(self, n: usize, f: usize) -> Result<()> {
        let ok = match self {
            Self::Mean => f == 0,
            Self::Median | Self::TrimmedMean => n > 2 * f,
            Self::Krum => n > 2 * f + 2,
        };
        if ok {
            return Ok(());
        }
        match self {
            Self::Mean => bail!("--byzantine {f}: the mean tolerates no Byzantine device; choose --aggregation median, trimmed-mean or krum"),
            Self::Median | Self::TrimmedMean => bail!(
                "--aggregation {} with --byzantine {f} needs more than {} updates per round (a Byzantine fraction below 1/2), got {n}",
                self.name(),
                2 * f
            ),
            Self::Krum => bail!(
                "--aggregation krum with --byzantine {f} needs n > 2f + 2 = {} updates per round, got {n}",
                2 * f + 2
            ),
        }
    }

    /// Combines flattened updates (same length each) under the rule, tolerating `f`
    /// Byzantine ones. `weights` count only for the mean.
    pub(crate) fn combine(self, updates: &[Vec<f32>], weights: &[f64], f: usize) -> Result<Vec<f64>> {
        self.check(updates.len(), f)?;
        Ok(match self {
            Self::Mean => weighted_mean(updates, weights),
            Self::Median => coordinate_wise(updates, median),
            Self::TrimmedMean => coordinate_wise(updates, |v| trimmed_mean(v, f)),
            Self::Krum => {
                let chosen = krum(updates, f);
                updates[chosen].iter().map(|&v| f64::from(v)).collect()
            }
        })
    }
}

fn weighted_mean(updates: &[Vec<f32>], weights: &[f64]) -> Vec<f64> {
    let total: f64 = weights.iter().sum();
    let mut out = vec![0.0; updates.first().map_or(0, Vec::len)];
    for (u, w) in updates.iter().zip(weights) {
        for (o, &v) in out.iter_mut().zip(u) {
            *o += w * f64::from(v);
        }
    }
    out.iter_mut().for_each(|o| *o /= total);
    out
}

/// Applies `reduce` to each coordinate's n values.
fn coordinate_wise(updates: &[Vec<f32>], reduce: impl Fn(&mut [f32]) -> f64) -> Vec<f64> {
    let len = updates.first().map_or(0, Vec::len);
    let mut column = vec![0.0f32; updates.len()];
    (0..len)
        .map(|j| {
            for (c, u) in column.iter_mut().zip(updates) {
                *c = u[j];
            }
            reduce(&mut column)
        })
        .collect()
}

/// The median of `v` (the mean of the two middle values when `v.len()` is even).
fn median(v: &mut [f32]) -> f64 {
    let n = v.len();
    let (_, &mut upper, _) = v.select_nth_unstable_by(n / 2, f32::total_cmp);
    if n % 2 == 1 {
        return f64::from(upper);
    }
    let lower = v[..n / 2].iter().copied().fold(f32::NEG_INFINITY, f32::max);
    (f64::from(lower) + f64::from(upper)) / 2.0
}

/// The mean of `v` without its `f` smallest and `f` largest values.
fn trimmed_mean(v: &mut [f32], f: usize) -> f64 {
    v.sort_unstable_by(f32::total_cmp);
    let kept = &v[f..v.len() - f];
    kept.iter().map(|&x| f64::from(x)).sum::<f64>() / kept.len() as f64
}

/// Krum's choice: the update whose summed squared distance to its n − f − 2 nearest
/// neighbours is smallest (ties go to the lower index).
fn krum(updates: &[Vec<f32>], f: usize) -> usize {
    let n = updates.len();
    let mut distance = vec![vec![0.0f64; n]; n];
    for i in 0..n {
        for j in i + 1..n {
            let d: f64 = updates[i].iter().zip(&updates[j]).map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2)).sum();
            distance[i][j] = d;
            distance[j][i] = d;
        }
    }
    let neighbours = n - f - 2;
    let score = |i: usize| {
        let mut others: Vec<f64> = (0..n).filter(|&j| j != i).map(|j| distance[i][j]).collect();
        others.sort_unstable_by(f64::total_cmp);
        others[..neighbours].iter().sum::<f64>()
    };
    (0..n).map(|i| (i, score(i))).min_by(|a, b| a.1.total_cmp(&b.1)).map_or(0, |(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Four honest updates near (1, 2, 3) and `attackers` copies of `attack`.
    fn fleet(attack: [f32; 3], attackers: usize) -> Vec<Vec<f32>> {
        let mut u = vec![vec![1.0, 2.0, 3.0], vec![1.1, 1.9, 3.0], vec![0.9, 2.1, 2.9], vec![1.0, 2.0, 3.1]];
        u.extend(std::iter::repeat_n(attack.to_vec(), attackers));
        u
    }

    fn distance_to_honest(v: &[f64]) -> f64 {
        v.iter().zip([1.0, 2.0, 3.0]).map(|(a, b)| (a - b).powi(2)).sum::<f64>().sqrt()
    }

    #[test]
    fn median_trimmed_mean_and_krum_stay_with_the_honest_devices_under_a_scaled_sign_flip() {
        let updates = fleet([-100.0, -200.0, -300.0], 1);
        let weights = vec![1.0; updates.len()];
        let mean = AggregationRule::Mean.combine(&updates, &weights, 0).unwrap();
        assert!(distance_to_honest(&mean) > 50.0, "the attack must break the mean: {mean:?}");
        for rule in [AggregationRule::Median, AggregationRule::TrimmedMean, AggregationRule::Krum] {
            let got = rule.combine(&updates, &weights, 1).unwrap();
            assert!(distance_to_honest(&got) < 0.2, "{}: {got:?}", rule.name());
        }
    }

    #[test]
    fn a_claimed_pair_count_moves_the_mean_but_not_the_robust_rules() {
        let updates = fleet([50.0, 50.0, 50.0], 1);
        let mut weights = vec![10.0; updates.len()];
        weights[4] = 1e6;
        let mean = AggregationRule::Mean.combine(&updates, &weights, 0).unwrap();
        assert!(distance_to_honest(&mean) > 50.0);
        let median = AggregationRule::Median.combine(&updates, &weights, 1).unwrap();
        assert!(distance_to_honest(&median) < 0.2);
    }

    #[test]
    fn median_and_trimmed_mean_match_hand_computed_values() {
        let updates = vec![vec![1.0, 5.0], vec![3.0, -1.0], vec![2.0, 0.0], vec![10.0, 4.0]];
        let w = vec![1.0; 4];
        // Column 0 sorted: 1 2 3 10; column 1: -1 0 4 5.
        assert_eq!(AggregationRule::Median.combine(&updates, &w, 1).unwrap(), vec![2.5, 2.0]);
        assert_eq!(AggregationRule::TrimmedMean.combine(&updates, &w, 1).unwrap(), vec![2.5, 2.0]);
        let odd = &updates[..3];
        assert_eq!(AggregationRule::Median.combine(odd, &w[..3], 1).unwrap(), vec![2.0, 0.0]);
        assert_eq!(AggregationRule::TrimmedMean.combine(odd, &w[..3], 0).unwrap(), vec![2.0, 4.0 / 3.0]);
    }

    #[test]
    fn krum_picks_the_update_in_the_densest_cluster() {
        // n = 5, f = 1: each score sums the 2 nearest squared distances.
        let updates = vec![vec![0.0], vec![0.1], vec![0.3], vec![5.0], vec![-7.0]];
        let got = AggregationRule::Krum.combine(&updates, &[1.0; 5], 1).unwrap();
        assert_eq!(got, vec![f64::from(0.1f32)]);
    }

    #[test]
    fn preconditions_name_the_rule_the_counts_and_the_bound() {
        assert!(AggregationRule::Krum.check(5, 1).is_ok());
        let err = AggregationRule::Krum.check(4, 1).unwrap_err().to_string();
        assert!(err.contains("n > 2f + 2 = 4") && err.contains("got 4"), "{err}");
        assert!(AggregationRule::Median.check(3, 1).is_ok());
        let err = AggregationRule::Median.check(2, 1).unwrap_err().to_string();
        assert!(err.contains("below 1/2") && err.contains("got 2"), "{err}");
        assert!(AggregationRule::TrimmedMean.check(4, 2).is_err());
        let err = AggregationRule::Mean.check(10, 1).unwrap_err().to_string();
        assert!(err.contains("tolerates no Byzantine"), "{err}");
        assert!(AggregationRule::Mean.check(10, 0).is_ok());
    }
}
