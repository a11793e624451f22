//! Sequences that fork after a shared prefix: one row holds a prompt and both responses.
//!
//! A DPO pair's chosen and rejected sequences share their prompt, and under a causal mask
//! the prompt's hidden states do not depend on what follows it. Laid out as
//! `prompt ++ chosen ++ rejected` with the rejected branch seeing the prompt and itself but
//! not the chosen response, and taking the positions the chosen tokens have, one row gives
//! exactly the hidden states of the two ordinary rows while running the prompt through the
//! blocks once: with prompts as long as responses, a quarter of the layers' work.

use std::sync::Arc;

/// A sequence of a shared prefix and two branches: tokens `[0, prefix)` are the prefix,
/// the next `first` tokens branch one, and the rest branch two (padding included, which
/// no real token attends to). Branch two attends to the prefix and to itself, and its
/// `k`-th token sits at position `prefix + k`, as branch one's does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fork {
    /// Tokens both branches see.
    pub prefix: usize,
    /// Tokens in branch one.
    pub first: usize,
}

impl Fork {
    /// Where branch two starts in the row.
    pub fn second_start(&self) -> usize {
        self.prefix + self.first
    }

    /// The position (for the position embedding) of row index `j`.
    pub fn position(&self, j: usize) -> usize {
        if j < self.second_start() {
            j
        } else {
            j - self.first
        }
    }

    /// The keys query `r` must not see beyond the causal mask: branch one, from branch
    /// two's tokens; empty otherwise.
    pub fn hidden_from(&self, r: usize) -> std::ops::Range<usize> {
        if r >= self.second_start() {
            self.prefix..self.second_start()
        } else {
            0..0
        }
    }
}

/// The forks of a batch's sequences, one per sequence, or none: every sequence is then one
/// ordinary causal sequence. Shared, because each layer's attention op holds it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Forks(Option<Arc<[Fork]>>);

impl Forks {
    /// No forks: plain causal sequences.
    pub fn none() -> Self {
        Self(None)
    }

    /// One fork per sequence of the batch.
    pub fn new(forks: Vec<Fork>) -> Self {
        Self(Some(forks.into()))
    }

    /// Whether every sequence is a plain causal one.
    pub fn is_none(&self) -> bool {
        self.0.is_none()
    }

    /// The fork of sequence `b`, if the batch has forks.
    pub fn of(&self, b: usize) -> Option<Fork> {
        self.0.as_ref().and_then(|f| f.get(b).copied())
    }

    /// The forks, shared, to key a cache with.
    pub(crate) fn shared(&self) -> Option<Arc<[Fork]>> {
        self.0.clone()
    }

    /// How many sequences the forks describe (0 for none).
    pub fn len(&self) -> usize {
        self.0.as_ref().map_or(0, |f| f.len())
    }

    /// Whether the forks describe no sequence.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Fails unless the forks describe `batch` sequences of `t` tokens.
    pub(crate) fn check(&self, batch: usize, t: usize, what: &str) -> candle_core::Result<()> {
        let Some(forks) = &self.0 else { return Ok(()) };
        if forks.len() != batch {
            candle_core::bail!("{what}: {} forks for {batch} sequences", forks.len());
        }
        if let Some(f) = forks.iter().find(|f| f.second_start() > t) {
            candle_core::bail!("{what}: fork {f:?} is longer than the sequence of {t} tokens");
        }
        Ok(())
    }

    /// The additive attention mask `[batch, 1, t, t]` (0 or -inf), for the composed path.
    pub(crate) fn mask(&self, batch: usize, t: usize) -> Vec<f32> {
        let mut mask = vec![f32::NEG_INFINITY; batch * t * t];
        for (b, seq) in mask.chunks_mut(t * t).enumerate() {
            let fork = self.of(b);
            for (r, row) in seq.chunks_mut(t).enumerate() {
                let hidden = fork.map_or(0..0, |f| f.hidden_from(r));
                for (c, v) in row.iter_mut().enumerate().take(r + 1) {
                    if !hidden.contains(&c) {
                        *v = 0.0;
                    }
                }
            }
        }
        mask
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn branch_two_takes_branch_ones_positions_and_does_not_see_it() {
        let fork = Fork { prefix: 3, first: 2 };
        let positions: Vec<usize> = (0..8).map(|j| fork.position(j)).collect();
        assert_eq!(positions, [0, 1, 2, 3, 4, 3, 4, 5]);
        assert_eq!(fork.hidden_from(4), 0..0);
        assert_eq!(fork.hidden_from(5), 3..5);
        let mask = Forks::new(vec![fork]).mask(1, 8);
        let row6: Vec<bool> = mask[6 * 8..7 * 8].iter().map(|v| *v == 0.0).collect();
        assert_eq!(row6, [true, true, true, false, false, true, true, false]);
    }

    #[test]
    fn forks_refuse_a_batch_they_do_not_describe() {
        let forks = Forks::new(vec![Fork { prefix: 2, first: 2 }]);
        assert!(forks.check(1, 4, "t").is_ok());
        assert!(forks.check(2, 4, "t").unwrap_err().to_string().contains("1 forks for 2 sequences"));
        assert!(forks.check(1, 3, "t").unwrap_err().to_string().contains("longer than the sequence of 3"));
        assert!(Forks::none().check(5, 1, "t").is_ok());
    }
}
