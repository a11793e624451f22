//! Client-level differential privacy: Gaussian noise on the clipped sum of updates, and a
//! Rényi-DP accountant that turns the rounds so far into (ε, δ).
//!
//! Each round is the DP-FedAvg mechanism (McMahan et al. 2018): every device's shared
//! update is clipped to L2 norm C, the clipped updates are summed with equal weight (a
//! device's claimed pair count would otherwise set its sensitivity), Gaussian noise of
//! standard deviation σ·C is added to the sum, and the result is divided by the number of
//! participants, which is treated as public. Selecting S of N devices amplifies privacy;
//! the accountant charges each round as a Poisson-subsampled Gaussian with q = S/N
//! (Mironov, Talwar and Zhang 2019), the usual approximation for fixed-size selection.
//! The guarantee covers the sequence of global models, against anyone who sees them
//! (devices included); the aggregator itself sees the individual updates.

use rand::rngs::StdRng;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use serde::{Deserialize, Serialize};

/// Rényi orders the accountant tracks: the integers 2..=256. Fractional orders would
/// tighten ε a little in the large-ε regime (about 10 % at ε ≈ 90) and cost a series
/// evaluation each; integer orders have a closed form.
const ORDERS: std::ops::RangeInclusive<u32> = 2..=256;

/// The accumulated Rényi divergence of the rounds so far, per order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct RdpAccountant {
    pub(crate) noise_multiplier: f64,
    /// RDP at each of [`ORDERS`].
    rdp: Vec<f64>,
    pub(crate) rounds: u64,
}

impl RdpAccountant {
    pub(crate) fn new(noise_multiplier: f64) -> Self {
        Self { noise_multiplier, rdp: vec![0.0; ORDERS.count()], rounds: 0 }
    }

    /// Charges one round in which each device took part with probability `q`.
    pub(crate) fn add_round(&mut self, q: f64) {
        for (r, alpha) in self.rdp.iter_mut().zip(ORDERS) {
            *r += sampled_gaussian_rdp(q, self.noise_multiplier, alpha);
        }
        self.rounds += 1;
    }

    /// The smallest ε over the tracked orders for which the rounds so far are (ε, δ)-DP,
    /// by the conversion of Canonne, Kamath and Steinke 2020 (Prop. 12 of arXiv
    /// 2004.00010), with the order that attains it.
    pub(crate) fn epsilon(&self, delta: f64) -> (f64, u32) {
        let mut best = (f64::INFINITY, *ORDERS.start());
        for (&r, alpha) in self.rdp.iter().zip(ORDERS) {
            let a = f64::from(alpha);
            let eps = if delta * delta + (-r).exp_m1() > 0.0 {
                0.0 // δ already covers the whole divergence (Pinsker)
            } else {
                r + (-1.0 / a).ln_1p() - (delta * a).ln() / (a - 1.0)
            };
            if eps < best.0 {
                best = (eps, alpha);
            }
        }
        (best.0.max(0.0), best.1)
    }
}

/// RDP of order α of the Gaussian mechanism with noise multiplier σ, each record sampled
/// with probability q: log(A_α)/(α − 1) with A_α = Σ_k C(α,k) (1−q)^(α−k) q^k
/// exp((k² − k)/(2σ²)), summed in log space.
fn sampled_gaussian_rdp(q: f64, sigma: f64, alpha: u32) -> f64 {
    if q <= 0.0 {
        return 0.0;
    }
    let a = f64::from(alpha);
    if q >= 1.0 {
        return a / (2.0 * sigma * sigma);
    }
    let (log_q, log_1mq) = (q.ln(), (-q).ln_1p());
    let mut log_binomial = 0.0;
    let mut log_a = f64::NEG_INFINITY;
    for k in 0..=alpha {
        if k > 0 {
            log_binomial += f64::from(alpha - k + 1).ln() - f64::from(k).ln();
        }
        let kf = f64::from(k);
        let term = log_binomial + kf * log_q + (a - kf) * log_1mq + (kf * kf - kf) / (2.0 * sigma * sigma);
        log_a = log_add(log_a, term);
    }
    log_a / (a - 1.0)
}

/// log(eˣ + eʸ) without overflow.
fn log_add(x: f64, y: f64) -> f64 {
    let (hi, lo) = if x > y { (x, y) } else { (y, x) };
    if lo == f64::NEG_INFINITY {
        return hi;
    }
    hi + (lo - hi).exp().ln_1p()
}

/// Draws the round's Gaussian noise, N(0, std²) per coordinate, from the operating
/// system's entropy: noise derived from a seed anyone can read could be subtracted again.
pub(crate) struct GaussianNoise {
    rng: StdRng,
    normal: Normal<f64>,
}

impl GaussianNoise {
    pub(crate) fn new(std: f64) -> anyhow::Result<Self> {
        let normal = Normal::new(0.0, std).map_err(|e| anyhow::anyhow!("noise standard deviation {std}: {e}"))?;
        Ok(Self { rng: StdRng::from_os_rng(), normal })
    }

    pub(crate) fn sample(&mut self) -> f64 {
        self.normal.sample(&mut self.rng)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct Golden {
        cases: Vec<Case>,
    }

    #[derive(Deserialize)]
    struct Case {
        q: f64,
        sigma: f64,
        rounds: u64,
        delta: f64,
        epsilon: f64,
        order: f64,
        epsilon_default_orders: f64,
    }

    /// `fixtures/golden/gen_rdp.py` wrote these with Google's dp_accounting.
    #[test]
    fn epsilon_matches_dp_accounting_for_sampled_gaussian_rounds() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/golden/rdp.json");
        let golden: Golden = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        assert!(golden.cases.len() >= 8);
        for c in golden.cases {
            let mut acc = RdpAccountant::new(c.sigma);
            (0..c.rounds).for_each(|_| acc.add_round(c.q));
            let (eps, order) = acc.epsilon(c.delta);
            let rel = (eps - c.epsilon).abs() / c.epsilon;
            assert!(rel < 1e-9, "q {} σ {} T {}: ε {eps} vs {} (rel {rel:e})", c.q, c.sigma, c.rounds, c.epsilon);
            assert_eq!(f64::from(order), c.order, "q {} σ {} T {}", c.q, c.sigma, c.rounds);
            // Integer orders only ever overstate ε.
            assert!(eps >= c.epsilon_default_orders - 1e-12);
        }
    }

    #[test]
    fn more_noise_fewer_rounds_and_sparser_sampling_all_cost_less_privacy() {
        let eps = |sigma, rounds, q| {
            let mut acc = RdpAccountant::new(sigma);
            (0..rounds).for_each(|_| acc.add_round(q));
            acc.epsilon(1e-5).0
        };
        assert!(eps(2.0, 50, 1.0) < eps(1.0, 50, 1.0));
        assert!(eps(1.0, 10, 1.0) < eps(1.0, 50, 1.0));
        assert!(eps(1.0, 50, 0.2) < eps(1.0, 50, 1.0));
        assert_eq!(RdpAccountant::new(1.0).epsilon(1e-5).0, 0.0, "no round, no privacy spent");
    }

    #[test]
    fn full_participation_rdp_is_the_gaussian_closed_form() {
        for alpha in [2, 7, 64] {
            assert_eq!(sampled_gaussian_rdp(1.0, 1.5, alpha), f64::from(alpha) / 4.5);
            // The sampled formula approaches it as q → 1.
            let near = sampled_gaussian_rdp(1.0 - 1e-12, 1.5, alpha);
            assert!((near - f64::from(alpha) / 4.5).abs() < 1e-6, "{alpha}: {near}");
        }
    }

    #[test]
    fn noise_has_the_requested_spread_and_differs_between_draws() {
        let mut a = GaussianNoise::new(0.5).unwrap();
        let draws: Vec<f64> = (0..200_000).map(|_| a.sample()).collect();
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        let std = (draws.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / draws.len() as f64).sqrt();
        assert!(mean.abs() < 0.01 && (std - 0.5).abs() < 0.01, "mean {mean} std {std}");
        let mut b = GaussianNoise::new(0.5).unwrap();
        assert_ne!(draws[..4], [b.sample(), b.sample(), b.sample(), b.sample()], "noise must not repeat across runs");
    }
}
