//! The DPO family of losses, on per-sequence log-probabilities.
//!
//! The loss depends on the network only through 2P numbers (policy log-probs of the chosen
//! and rejected responses), so it is evaluated here in f64 together with its exact
//! derivative with respect to each of them. The trainer then back-propagates the surrogate
//! `sum_k c_k * logp_k`, whose parameter gradient equals the loss's. This keeps every loss
//! variant a small pure function that tests can check against closed forms.

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// Which preference loss.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum LossKind {
    /// Sigmoid DPO (Rafailov et al. 2023) with optional label smoothing (cDPO):
    /// `-(1-e) log s(b h) - e log s(-b h)`.
    Sigmoid {
        /// Share of labels assumed flipped, in [0, 0.5).
        label_smoothing: f64,
    },
    /// IPO (Azar et al. 2023): `(h - 1/(2b))^2` on length-averaged log-ratios, as TRL does.
    Ipo,
}

impl Default for LossKind {
    fn default() -> Self {
        Self::Sigmoid { label_smoothing: 0.0 }
    }
}

/// Log-probs of one micro-batch: P chosen and P rejected, policy and reference.
#[derive(Debug, Clone, Copy)]
pub struct PairLogps<'a> {
    /// Policy log-prob of each chosen response.
    pub policy_chosen: &'a [f64],
    /// Policy log-prob of each rejected response.
    pub policy_rejected: &'a [f64],
    /// Reference log-prob of each chosen response.
    pub ref_chosen: &'a [f64],
    /// Reference log-prob of each rejected response.
    pub ref_rejected: &'a [f64],
    /// Token count of each chosen response (for IPO's averaging).
    pub chosen_lens: &'a [usize],
    /// Token count of each rejected response.
    pub rejected_lens: &'a [usize],
}

/// The loss of a micro-batch and what back-propagation needs.
#[derive(Debug, Clone, PartialEq)]
pub struct LossOutput {
    /// Sum over the micro-batch's pairs of the per-pair loss.
    pub loss_sum: f64,
    /// `d(loss_sum)/d(policy_chosen[i])`.
    pub grad_chosen: Vec<f64>,
    /// `d(loss_sum)/d(policy_rejected[i])`.
    pub grad_rejected: Vec<f64>,
    /// Pairs whose implicit chosen reward beats the rejected one.
    pub correct: usize,
    /// Sum of `reward_chosen - reward_rejected`.
    pub margin_sum: f64,
}

fn log_sigmoid(x: f64) -> f64 {
    // Stable for both signs: log s(x) = min(x, 0) - log(1 + e^{-|x|}).
    x.min(0.0) - (-x.abs()).exp().ln_1p()
}

fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// Validates `beta` and the loss settings.
pub fn check_loss_settings(kind: LossKind, beta: f64) -> Result<()> {
    if !(beta.is_finite() && beta > 0.0) {
        return Err(TrainError::Invalid(format!("beta must be positive, got {beta}")));
    }
    if let LossKind::Sigmoid { label_smoothing } = kind {
        if !(0.0..0.5).contains(&label_smoothing) {
            return Err(TrainError::Invalid(format!("label smoothing must be in [0, 0.5), got {label_smoothing}")));
        }
    }
    Ok(())
}

/// Evaluates the loss, its gradient and the reward metrics (TRL's `rewards/accuracies`
/// and `rewards/margins`, with rewards `beta * (policy - reference)`).
pub fn preference_loss(kind: LossKind, beta: f64, x: PairLogps<'_>) -> LossOutput {
    let n = x.policy_chosen.len();
    let mut out = LossOutput {
        loss_sum: 0.0,
        grad_chosen: vec![0.0; n],
        grad_rejected: vec![0.0; n],
        correct: 0,
        margin_sum: 0.0,
    };
    for i in 0..n {
        let reward_chosen = beta * (x.policy_chosen[i] - x.ref_chosen[i]);
        let reward_rejected = beta * (x.policy_rejected[i] - x.ref_rejected[i]);
        out.correct += usize::from(reward_chosen > reward_rejected);
        out.margin_sum += reward_chosen - reward_rejected;
        match kind {
            LossKind::Sigmoid { label_smoothing: eps } => {
                let h = (x.policy_chosen[i] - x.policy_rejected[i]) - (x.ref_chosen[i] - x.ref_rejected[i]);
                let z = beta * h;
                out.loss_sum += -(1.0 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z);
                let dz = -(1.0 - eps) * sigmoid(-z) + eps * sigmoid(z);
                out.grad_chosen[i] = dz * beta;
                out.grad_rejected[i] = -dz * beta;
            }
            LossKind::Ipo => {
                let lc = x.chosen_lens[i].max(1) as f64;
                let lr = x.rejected_lens[i].max(1) as f64;
                let h = (x.policy_chosen[i] - x.ref_chosen[i]) / lc - (x.policy_rejected[i] - x.ref_rejected[i]) / lr;
                let d = h - 1.0 / (2.0 * beta);
                out.loss_sum += d * d;
                out.grad_chosen[i] = 2.0 * d / lc;
                out.grad_rejected[i] = -2.0 * d / lr;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logps<'a>(pc: &'a [f64], pr: &'a [f64], rc: &'a [f64], rr: &'a [f64], lens: &'a [usize]) -> PairLogps<'a> {
        PairLogps {
            policy_chosen: pc,
            policy_rejected: pr,
            ref_chosen: rc,
            ref_rejected: rr,
            chosen_lens: lens,
            rejected_lens: lens,
        }
    }

    #[test]
    fn policy_equal_to_reference_gives_ln2_and_half_beta_gradients() {
        let v = [-10.0, -20.0];
        let out = preference_loss(LossKind::default(), 0.2, logps(&v, &v, &v, &v, &[3, 3]));
        assert!((out.loss_sum / 2.0 - std::f64::consts::LN_2).abs() < 1e-12);
        assert!((out.grad_chosen[0] + 0.1).abs() < 1e-12, "{:?}", out.grad_chosen);
        assert!((out.grad_rejected[0] - 0.1).abs() < 1e-12);
        assert_eq!(out.correct, 0, "ties are not counted as correct, as in TRL");
    }

    #[test]
    fn gradients_match_finite_differences_for_every_variant() {
        let (pc, pr, rc, rr) = ([-3.0, -7.5], [-4.0, -6.0], [-3.5, -7.0], [-3.8, -6.2]);
        let lens = [4, 9];
        for kind in
            [LossKind::Sigmoid { label_smoothing: 0.0 }, LossKind::Sigmoid { label_smoothing: 0.1 }, LossKind::Ipo]
        {
            let base = preference_loss(kind, 0.3, logps(&pc, &pr, &rc, &rr, &lens));
            for i in 0..2 {
                let h = 1e-6;
                let (mut up, mut down) = (pc, pc);
                up[i] += h;
                down[i] -= h;
                let f = |c: &[f64]| preference_loss(kind, 0.3, logps(c, &pr, &rc, &rr, &lens)).loss_sum;
                let numeric = (f(&up) - f(&down)) / (2.0 * h);
                assert!((numeric - base.grad_chosen[i]).abs() < 1e-7, "{kind:?} chosen {i}");
                let (mut up, mut down) = (pr, pr);
                up[i] += h;
                down[i] -= h;
                let f = |r: &[f64]| preference_loss(kind, 0.3, logps(&pc, r, &rc, &rr, &lens)).loss_sum;
                let numeric = (f(&up) - f(&down)) / (2.0 * h);
                assert!((numeric - base.grad_rejected[i]).abs() < 1e-7, "{kind:?} rejected {i}");
            }
        }
    }

    #[test]
    fn reward_accuracy_and_margin_follow_implicit_rewards() {
        // pair 0: chosen gained 2 nats, rejected lost 1 -> correct; pair 1: the opposite.
        let out = preference_loss(
            LossKind::default(),
            0.5,
            logps(&[-8.0, -12.0], &[-11.0, -8.0], &[-10.0, -10.0], &[-10.0, -10.0], &[1, 1]),
        );
        assert_eq!(out.correct, 1);
        assert!((out.margin_sum - (0.5 * 3.0 + 0.5 * -4.0)).abs() < 1e-12);
    }

    #[test]
    fn loss_is_stable_for_huge_margins() {
        let out = preference_loss(LossKind::default(), 1.0, logps(&[0.0], &[-1e4], &[0.0], &[0.0], &[1]));
        assert!(out.loss_sum.is_finite() && out.loss_sum < 1e-12);
        let out = preference_loss(LossKind::default(), 1.0, logps(&[-1e4], &[0.0], &[0.0], &[0.0], &[1]));
        assert!((out.loss_sum - 1e4).abs() < 1e-6);
    }

    #[test]
    fn out_of_range_settings_are_rejected() {
        assert!(check_loss_settings(LossKind::default(), 0.0).is_err());
        assert!(check_loss_settings(LossKind::Sigmoid { label_smoothing: 0.5 }, 0.1).is_err());
        assert!(check_loss_settings(LossKind::Ipo, 0.1).is_ok());
    }
}
