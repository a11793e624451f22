//! Generating a completion: a prefill of the prompt into a [`KvCache`], then one position
//! per token, each token handed to the caller as soon as it is chosen (to stream it).

use std::time::{Duration, Instant};

use crate::error::{ModelError, Result};
use crate::gpt2::{Gpt2, KvCache};
use crate::sampler::{Sampler, Sampling};

/// What to generate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GenerateSettings {
    /// The most tokens to generate.
    pub max_new_tokens: usize,
    /// How each token is chosen.
    pub sampling: Sampling,
    /// The token that ends a completion (GPT-2's `<|endoftext|>`); it is not returned.
    pub end_of_text: Option<u32>,
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// `max_new_tokens` were generated.
    MaxNewTokens,
    /// The model chose the end-of-text token.
    EndOfText,
    /// The caller asked to stop (e.g. a stop string appeared).
    Caller,
}

/// A completion and what it cost.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    /// The generated token ids, the prompt's excluded.
    pub ids: Vec<u32>,
    /// Why it ended.
    pub stop: StopReason,
    /// Time of the prompt's forward pass (up to the first token's logits).
    pub prefill: Duration,
    /// Time of every later position's forward pass and every choice.
    pub decode: Duration,
}

/// The part of `prompt` that fits before `max_new_tokens` in `n_positions`: its last
/// tokens, and how many were dropped from its start. An error when no prompt token fits.
pub fn fit_prompt(prompt: &[u32], max_new_tokens: usize, n_positions: usize) -> Result<(&[u32], usize)> {
    if prompt.is_empty() {
        return Err(ModelError::InvalidConfig("the prompt is empty: give at least one token".into()));
    }
    if max_new_tokens >= n_positions {
        return Err(ModelError::InvalidConfig(format!(
            "{max_new_tokens} new tokens leave no room for the prompt in the model's {n_positions} positions; ask for \
             at most {}",
            n_positions - 1
        )));
    }
    let room = n_positions - max_new_tokens;
    let dropped = prompt.len().saturating_sub(room);
    Ok((&prompt[dropped..], dropped))
}

/// Generates after `prompt` (which must fit with `max_new_tokens` in the model's
/// positions: see [`fit_prompt`]). `on_token` receives each token as it is chosen and
/// returns whether to go on.
pub fn generate(
    model: &Gpt2,
    prompt: &[u32],
    settings: &GenerateSettings,
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<Generated> {
    let (fitted, dropped) = fit_prompt(prompt, settings.max_new_tokens, model.n_positions())?;
    if dropped > 0 {
        return Err(ModelError::SequenceTooLong {
            len: prompt.len() + settings.max_new_tokens,
            max: model.n_positions(),
        });
    }
    let mut sampler = Sampler::new(settings.sampling)?;
    let mut cache = KvCache::new(model, fitted.len() + settings.max_new_tokens)?;
    let started = Instant::now();
    let mut logits = model.next_logits(fitted, &mut cache)?;
    let prefill = started.elapsed();
    let mut ids = Vec::with_capacity(settings.max_new_tokens);
    let mut stop = StopReason::MaxNewTokens;
    while ids.len() < settings.max_new_tokens {
        let id = sampler.pick(&logits)?;
        if settings.end_of_text == Some(id) {
            stop = StopReason::EndOfText;
            break;
        }
        ids.push(id);
        if !on_token(id) {
            stop = StopReason::Caller;
            break;
        }
        if ids.len() < settings.max_new_tokens {
            logits = model.next_logits(&[id], &mut cache)?;
        }
    }
    Ok(Generated { ids, stop, prefill, decode: started.elapsed() - prefill })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_prompt_keeps_its_last_tokens_and_an_impossible_request_is_refused_with_the_limit() {
        let prompt: Vec<u32> = (0..10).collect();
        assert_eq!(fit_prompt(&prompt, 4, 20).unwrap(), (&prompt[..], 0));
        assert_eq!(fit_prompt(&prompt, 14, 20).unwrap(), (&prompt[4..], 4));
        let err = fit_prompt(&prompt, 20, 20).unwrap_err().to_string();
        assert!(err.contains("20 new tokens") && err.contains("at most 19"), "{err}");
        assert!(fit_prompt(&[], 4, 20).unwrap_err().to_string().contains("empty"));
    }
}
