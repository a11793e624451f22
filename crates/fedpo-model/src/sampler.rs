//! Choosing the next token from logits: greedy, or sampled at a temperature from the top-k
//! and/or the nucleus (top-p), from a seeded generator so that a seed repeats a completion.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::{ModelError, Result};

/// How tokens are chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Logits are divided by it before sampling; 0 picks the most likely token (greedy).
    pub temperature: f64,
    /// Sample among the `k` most likely tokens only.
    pub top_k: Option<usize>,
    /// Sample among the fewest most likely tokens whose probabilities sum to at least `p`.
    pub top_p: Option<f64>,
    /// Seed of the sampling generator.
    pub seed: u64,
}

impl Sampling {
    /// The most likely token at every step.
    pub const GREEDY: Self = Self { temperature: 0.0, top_k: None, top_p: None, seed: 0 };

    /// Whether every step takes the most likely token.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == Some(1)
    }

    /// Checks the settings, naming the one out of range.
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(ModelError::InvalidConfig(format!(
                "temperature {} must be a finite number ≥ 0 (0 is greedy)",
                self.temperature
            )));
        }
        if self.top_k == Some(0) {
            return Err(ModelError::InvalidConfig("top-k 0 keeps no token; use 1 or more".into()));
        }
        if let Some(p) = self.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return Err(ModelError::InvalidConfig(format!("top-p {p} must be in (0, 1]")));
        }
        Ok(())
    }
}

/// Picks tokens under a [`Sampling`].
#[derive(Debug)]
pub struct Sampler {
    sampling: Sampling,
    rng: StdRng,
    /// Scratch: candidate (token, weight) pairs, reused across steps.
    candidates: Vec<(u32, f64)>,
}

impl Sampler {
    /// A sampler; refuses settings out of range.
    pub fn new(sampling: Sampling) -> Result<Self> {
        sampling.validate()?;
        Ok(Self { sampling, rng: StdRng::seed_from_u64(sampling.seed), candidates: Vec::new() })
    }

    /// The next token for `logits` over the vocabulary. Non-finite logits are never
    /// chosen; if none is finite, the error says so.
    pub fn pick(&mut self, logits: &[f32]) -> Result<u32> {
        let finite = |&(_, l): &(usize, &f32)| l.is_finite();
        if self.sampling.is_greedy() {
            // The first of equal maxima, as PyTorch's argmax picks.
            let best =
                logits.iter().enumerate().filter(finite).fold(None, |best: Option<(usize, f32)>, (i, &l)| match best {
                    Some((_, b)) if b >= l => best,
                    _ => Some((i, l)),
                });
            return best.map(|(i, _)| i as u32).ok_or_else(no_finite_logit);
        }
        let t = self.sampling.temperature;
        self.candidates.clear();
        self.candidates.extend(logits.iter().enumerate().filter(finite).map(|(i, &l)| (i as u32, f64::from(l) / t)));
        if self.candidates.is_empty() {
            return Err(no_finite_logit());
        }
        // Most likely first; equal logits by token id, so a seed repeats exactly.
        self.candidates.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if let Some(k) = self.sampling.top_k {
            self.candidates.truncate(k);
        }
        let max = self.candidates[0].1;
        let mut total = 0.0;
        for c in &mut self.candidates {
            c.1 = (c.1 - max).exp();
            total += c.1;
        }
        if let Some(p) = self.sampling.top_p {
            let mut mass = 0.0;
            let keep = self
                .candidates
                .iter()
                .position(|c| {
                    mass += c.1 / total;
                    mass >= p
                })
                .map_or(self.candidates.len(), |i| i + 1);
            self.candidates.truncate(keep);
            total = self.candidates.iter().map(|c| c.1).sum();
        }
        let mut draw = self.rng.random::<f64>() * total;
        for &(id, weight) in &self.candidates {
            if draw < weight {
                return Ok(id);
            }
            draw -= weight;
        }
        Ok(self.candidates.last().expect("at least one candidate").0)
    }
}

fn no_finite_logit() -> ModelError {
    ModelError::InvalidConfig("every logit is NaN or infinite: the model's output cannot be sampled".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampled(sampling: Sampling, logits: &[f32], draws: usize) -> Vec<usize> {
        let mut sampler = Sampler::new(sampling).unwrap();
        let mut counts = vec![0; logits.len()];
        for _ in 0..draws {
            counts[sampler.pick(logits).unwrap() as usize] += 1;
        }
        counts
    }

    #[test]
    fn greedy_takes_the_first_largest_finite_logit() {
        let mut s = Sampler::new(Sampling::GREEDY).unwrap();
        assert_eq!(s.pick(&[0.5, 2.0, f32::NAN, 2.0, -1.0]).unwrap(), 1);
        assert_eq!(s.pick(&[f32::NAN, -3.0]).unwrap(), 1);
        assert!(s.pick(&[f32::NAN, f32::INFINITY]).unwrap_err().to_string().contains("NaN"));
    }

    #[test]
    fn sampling_follows_the_softmax_and_top_k_and_top_p_cut_the_tail() {
        let logits = [2.0f32.ln(), 1.0f32.ln(), 1.0f32.ln(), f32::NEG_INFINITY];
        let plain = Sampling { temperature: 1.0, top_k: None, top_p: None, seed: 7 };
        let counts = sampled(plain, &logits, 40_000);
        // probabilities 0.5, 0.25, 0.25, 0
        assert!((counts[0] as f64 / 40_000.0 - 0.5).abs() < 0.01, "{counts:?}");
        assert!((counts[1] as f64 / 40_000.0 - 0.25).abs() < 0.01, "{counts:?}");
        assert_eq!(counts[3], 0);
        let top2 = sampled(Sampling { top_k: Some(2), ..plain }, &logits, 20_000);
        assert_eq!(top2[2], 0, "the third token is outside the top 2: {top2:?}");
        assert!((top2[0] as f64 / 20_000.0 - 2.0 / 3.0).abs() < 0.015, "{top2:?}");
        let nucleus = sampled(Sampling { top_p: Some(0.5), ..plain }, &logits, 1_000);
        assert_eq!(nucleus[0], 1_000, "0.5 of the mass is the first token alone: {nucleus:?}");
        // A low temperature sharpens towards the most likely token.
        let cold = sampled(Sampling { temperature: 0.1, ..plain }, &logits, 2_000);
        assert!(cold[0] > 1_990, "{cold:?}");
    }

    #[test]
    fn a_seed_repeats_its_draws_and_another_differs() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = |seed| {
            let mut s = Sampler::new(Sampling { temperature: 1.0, top_k: None, top_p: Some(0.9), seed }).unwrap();
            (0..40).map(|_| s.pick(&logits).unwrap()).collect::<Vec<_>>()
        };
        assert_eq!(run(3), run(3));
        assert_ne!(run(3), run(4));
    }

    #[test]
    fn settings_out_of_range_are_refused_by_name() {
        let bad = |s: Sampling| Sampler::new(s).unwrap_err().to_string();
        assert!(bad(Sampling { temperature: -1.0, ..Sampling::GREEDY }).contains("temperature"));
        assert!(bad(Sampling { top_k: Some(0), ..Sampling::GREEDY }).contains("top-k"));
        assert!(bad(Sampling { top_p: Some(1.5), ..Sampling::GREEDY }).contains("top-p"));
        assert!(bad(Sampling { top_p: Some(0.0), ..Sampling::GREEDY }).contains("top-p"));
    }
}
