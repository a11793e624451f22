//! Splitting a pool of pairs over N devices, and each device's pairs into train / held-out.

use std::collections::BTreeMap;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_distr::{Distribution, Gamma};

use crate::error::{DataError, Result};
use crate::pair::PreferencePair;

fn check_devices(n: usize, pool: usize) -> Result<()> {
    if n == 0 {
        return Err(DataError::Invalid("the number of devices must be at least 1".into()));
    }
    if pool < n {
        return Err(DataError::Invalid(format!("{pool} pairs cannot give each of {n} devices at least one")));
    }
    Ok(())
}

/// Shuffles and deals the pairs into `n` shares whose sizes differ by at most one.
pub fn split_equal(mut pairs: Vec<PreferencePair>, n: usize, seed: u64) -> Result<Vec<Vec<PreferencePair>>> {
    check_devices(n, pairs.len())?;
    pairs.shuffle(&mut StdRng::seed_from_u64(seed));
    let mut shares = vec![Vec::new(); n];
    for (i, p) in pairs.into_iter().enumerate() {
        shares[i % n].push(p);
    }
    Ok(shares)
}

/// One share per distinct key (e.g. SHP's `domain`), in key order. Pairs without a key
/// go to the share named `""`.
pub fn split_by_key(pairs: Vec<PreferencePair>) -> Vec<(String, Vec<PreferencePair>)> {
    let mut groups: BTreeMap<String, Vec<PreferencePair>> = BTreeMap::new();
    for p in pairs {
        groups.entry(p.domain.clone().unwrap_or_default()).or_default().push(p);
    }
    groups.into_iter().collect()
}

/// Label-skewed split: for each key (domain), device proportions are drawn from
/// Dirichlet(alpha). Small alpha gives each device few domains; large alpha approaches
/// an equal split. Without keys this is a quantity skew. Every device gets at least one pair.
pub fn split_dirichlet(
    pairs: Vec<PreferencePair>,
    n: usize,
    alpha: f64,
    seed: u64,
) -> Result<Vec<Vec<PreferencePair>>> {
    check_devices(n, pairs.len())?;
    if !(alpha.is_finite() && alpha > 0.0) {
        return Err(DataError::Invalid(format!("Dirichlet alpha must be positive, got {alpha}")));
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut shares = vec![Vec::new(); n];
    if n == 1 {
        shares[0] = pairs;
        return Ok(shares);
    }
    // Dirichlet(alpha, ..., alpha) as normalised Gamma(alpha, 1) draws.
    let gamma = Gamma::new(alpha, 1.0).map_err(|e| DataError::Invalid(e.to_string()))?;
    for (_, mut group) in split_by_key(pairs) {
        group.shuffle(&mut rng);
        let draws: Vec<f64> = (0..n).map(|_| gamma.sample(&mut rng)).collect();
        let sum: f64 = draws.iter().sum::<f64>().max(f64::MIN_POSITIVE);
        let props: Vec<f64> = draws.iter().map(|d| d / sum).collect();
        let total = group.len();
        let mut bounds = Vec::with_capacity(n);
        let mut acc = 0.0;
        for p in &props {
            acc += p;
            bounds.push(((acc * total as f64).round() as usize).min(total));
        }
        let mut start = 0;
        for (device, &end) in bounds.iter().enumerate() {
            let end = if device == n - 1 { total } else { end.max(start) };
            shares[device].extend(group[start..end].iter().cloned());
            start = end;
        }
    }
    // Hand empty devices one pair from the largest share so every device can train.
    while let Some(empty) = shares.iter().position(Vec::is_empty) {
        let largest = (0..n).max_by_key(|&i| shares[i].len()).unwrap_or(0);
        if let Some(p) = shares[largest].pop() {
            shares[empty].push(p);
        }
    }
    Ok(shares)
}

/// How a simulation deals one pool of pairs to its devices: `iid`,
/// `dirichlet:ALPHA[:FIELD]` or `by-key:FIELD`.
#[derive(Debug, Clone, PartialEq)]
pub enum Partition {
    /// Shuffled and dealt in equal shares: every device sees the same distribution.
    Iid,
    /// Per value of `key` (SHP's `domain` unless named), device proportions drawn from
    /// Dirichlet(alpha): small alpha gives each device few values. Pairs without the
    /// field form one group of their own.
    Dirichlet { alpha: f64, key: String },
    /// One device per value of the field, or several values per device when there are
    /// more values than devices; every pair must have the field.
    ByKey(String),
}

impl Partition {
    /// The record field this partition reads, if any.
    pub fn key(&self) -> Option<&str> {
        match self {
            Self::Iid => None,
            Self::Dirichlet { key, .. } | Self::ByKey(key) => Some(key),
        }
    }

    /// Deals `pairs` to `n` devices. `keys[i]` is pair `i`'s value of [`Partition::key`]
    /// (as [`crate::load_jsonl_keyed`] reads it); ignored by `iid`. A keyed partition
    /// leaves each pair's key in its `domain`, the label fedpo reports pairs by.
    pub fn split(
        &self,
        pairs: Vec<PreferencePair>,
        keys: Vec<Option<String>>,
        n: usize,
        seed: u64,
    ) -> Result<Vec<Vec<PreferencePair>>> {
        match self {
            Self::Iid => split_equal(pairs, n, seed),
            Self::Dirichlet { alpha, .. } => split_dirichlet(with_keys(pairs, keys)?, n, *alpha, seed),
            Self::ByKey(field) => {
                check_devices(n, pairs.len())?;
                let missing = keys.iter().filter(|k| k.is_none()).count();
                if missing > 0 {
                    return Err(DataError::Invalid(format!(
                        "by-key:{field}: {missing} of {} pairs have no `{field}`",
                        pairs.len()
                    )));
                }
                let groups = split_by_key(with_keys(pairs, keys)?);
                if groups.len() < n {
                    return Err(DataError::Invalid(format!(
                        "by-key:{field}: {} distinct values cannot give each of {n} devices its own; use fewer \
                         devices, or dirichlet:ALPHA:{field}",
                        groups.len()
                    )));
                }
                let mut shares = vec![Vec::new(); n];
                for (i, (_, group)) in groups.into_iter().enumerate() {
                    shares[i % n].extend(group);
                }
                Ok(shares)
            }
        }
    }
}

/// The pairs with their partition keys where the splitters look for one.
fn with_keys(pairs: Vec<PreferencePair>, keys: Vec<Option<String>>) -> Result<Vec<PreferencePair>> {
    if keys.len() != pairs.len() {
        return Err(DataError::Invalid(format!("{} keys for {} pairs", keys.len(), pairs.len())));
    }
    Ok(pairs.into_iter().zip(keys).map(|(p, k)| PreferencePair { domain: k, ..p }).collect())
}

impl std::str::FromStr for Partition {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let usage = "expected iid, dirichlet:ALPHA[:FIELD] or by-key:FIELD";
        let mut parts = s.splitn(3, ':');
        match (parts.next(), parts.next(), parts.next()) {
            (Some("iid"), None, None) => Ok(Self::Iid),
            (Some("dirichlet"), Some(alpha), field) => {
                let alpha: f64 = alpha.parse().map_err(|_| format!("`{s}`: ALPHA `{alpha}` is not a number"))?;
                if !(alpha.is_finite() && alpha > 0.0) {
                    return Err(format!("`{s}`: ALPHA must be positive"));
                }
                let key = field.unwrap_or("domain");
                if key.is_empty() {
                    return Err(format!("`{s}`: an empty FIELD"));
                }
                Ok(Self::Dirichlet { alpha, key: key.to_string() })
            }
            (Some("by-key"), Some(field), None) if !field.is_empty() => Ok(Self::ByKey(field.to_string())),
            _ => Err(format!("`{s}`: {usage}")),
        }
    }
}

impl std::fmt::Display for Partition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Iid => f.write_str("iid"),
            Self::Dirichlet { alpha, key } => write!(f, "dirichlet:{alpha}:{key}"),
            Self::ByKey(key) => write!(f, "by-key:{key}"),
        }
    }
}

/// Shuffles one device's pairs and keeps `heldout_fraction` of them (at least one, when
/// there are two or more) for held-out evaluation. Returns `(train, heldout)`.
pub fn train_heldout_split(
    mut pairs: Vec<PreferencePair>,
    heldout_fraction: f64,
    seed: u64,
) -> Result<(Vec<PreferencePair>, Vec<PreferencePair>)> {
    if !(0.0..1.0).contains(&heldout_fraction) {
        return Err(DataError::Invalid(format!("held-out fraction must be in [0, 1), got {heldout_fraction}")));
    }
    pairs.shuffle(&mut StdRng::seed_from_u64(seed));
    let mut k = (pairs.len() as f64 * heldout_fraction).round() as usize;
    if heldout_fraction > 0.0 && pairs.len() >= 2 {
        k = k.clamp(1, pairs.len() - 1);
    }
    let heldout = pairs.split_off(pairs.len() - k);
    Ok((pairs, heldout))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: usize, domains: usize) -> Vec<PreferencePair> {
        (0..n)
            .map(|i| PreferencePair {
                prompt: format!("p{i}"),
                chosen: "a".into(),
                rejected: "b".into(),
                domain: Some(format!("d{}", i % domains)),
            })
            .collect()
    }

    #[test]
    fn equal_split_gives_sizes_within_one_and_loses_nothing() {
        let shares = split_equal(pool(603, 1), 5, 0).unwrap();
        let sizes: Vec<usize> = shares.iter().map(Vec::len).collect();
        assert_eq!(sizes.iter().sum::<usize>(), 603);
        assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
    }

    #[test]
    fn key_split_puts_each_domain_on_its_own_device() {
        let groups = split_by_key(pool(30, 3));
        assert_eq!(groups.len(), 3);
        for (key, pairs) in groups {
            assert!(pairs.iter().all(|p| p.domain.as_deref() == Some(key.as_str())));
        }
    }

    #[test]
    fn small_dirichlet_alpha_skews_domains_more_than_large_alpha() {
        let distinct = |alpha: f64| -> f64 {
            let shares = split_dirichlet(pool(2000, 10), 5, alpha, 1).unwrap();
            assert_eq!(shares.iter().map(Vec::len).sum::<usize>(), 2000);
            assert!(shares.iter().all(|s| !s.is_empty()));
            let per_device: Vec<usize> = shares
                .iter()
                .map(|s| {
                    let mut d: Vec<_> = s.iter().map(|p| p.domain.clone()).collect();
                    d.sort();
                    d.dedup();
                    d.len()
                })
                .collect();
            per_device.iter().sum::<usize>() as f64 / 5.0
        };
        assert!(distinct(0.05) < distinct(100.0), "{} vs {}", distinct(0.05), distinct(100.0));
    }

    #[test]
    fn heldout_split_is_disjoint_and_complete() {
        let (train, heldout) = train_heldout_split(pool(120, 1), 0.25, 3).unwrap();
        assert_eq!((train.len(), heldout.len()), (90, 30));
        assert!(heldout.iter().all(|h| !train.contains(h)));
    }

    #[test]
    fn partition_specs_parse_and_bad_ones_name_the_syntax() {
        assert_eq!("iid".parse::<Partition>(), Ok(Partition::Iid));
        assert_eq!("dirichlet:0.5".parse(), Ok(Partition::Dirichlet { alpha: 0.5, key: "domain".into() }));
        assert_eq!("dirichlet:2:user".parse(), Ok(Partition::Dirichlet { alpha: 2.0, key: "user".into() }));
        assert_eq!("by-key:domain".parse(), Ok(Partition::ByKey("domain".into())));
        for bad in
            ["", "iid:1", "dirichlet", "dirichlet:x", "dirichlet:-1", "dirichlet:0", "by-key", "by-key:", "random"]
        {
            let e = bad.parse::<Partition>().unwrap_err();
            assert!(e.contains(&format!("`{bad}`")), "{bad}: {e}");
        }
        for p in ["iid", "dirichlet:0.5:domain", "by-key:user"] {
            assert_eq!(p.parse::<Partition>().unwrap().to_string(), p);
        }
    }

    fn keys(n: usize, values: usize) -> Vec<Option<String>> {
        (0..n).map(|i| Some(format!("k{}", i % values))).collect()
    }

    #[test]
    fn by_key_gives_each_device_whole_groups_of_the_named_field() {
        let shares = Partition::ByKey("user".into()).split(pool(30, 1), keys(30, 5), 2, 0).unwrap();
        assert_eq!(shares.iter().map(Vec::len).sum::<usize>(), 30);
        let values = |s: &Vec<PreferencePair>| {
            let mut v: Vec<_> = s.iter().map(|p| p.domain.clone().unwrap()).collect();
            v.dedup();
            v.sort();
            v.dedup();
            v
        };
        assert_eq!(values(&shares[0]), ["k0", "k2", "k4"]);
        assert_eq!(values(&shares[1]), ["k1", "k3"]);
    }

    #[test]
    fn by_key_refuses_too_few_values_and_pairs_without_the_field() {
        let e = Partition::ByKey("user".into()).split(pool(30, 1), keys(30, 2), 3, 0).unwrap_err().to_string();
        assert!(e.contains("2 distinct values") && e.contains("3 devices"), "{e}");
        let mut k = keys(30, 5);
        k[7] = None;
        let e = Partition::ByKey("user".into()).split(pool(30, 1), k, 3, 0).unwrap_err().to_string();
        assert!(e.contains("1 of 30 pairs have no `user`"), "{e}");
    }

    #[test]
    fn dirichlet_over_a_named_field_skews_by_that_field() {
        let p = |alpha| Partition::Dirichlet { alpha, key: "user".into() };
        let distinct = |alpha: f64| {
            let shares = p(alpha).split(pool(2000, 1), keys(2000, 10), 5, 1).unwrap();
            shares
                .iter()
                .map(|s| {
                    let mut v: Vec<_> = s.iter().map(|p| p.domain.clone()).collect();
                    v.sort();
                    v.dedup();
                    v.len()
                })
                .sum::<usize>()
        };
        assert!(distinct(0.05) < distinct(100.0));
        assert_eq!(distinct(100.0), 50, "a large alpha gives every device every value");
    }

    #[test]
    fn more_devices_than_pairs_is_an_error_naming_both() {
        let err = split_equal(pool(3, 1), 5, 0).unwrap_err().to_string();
        assert!(err.contains('3') && err.contains('5'), "{err}");
    }
}
