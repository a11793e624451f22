//! Token-level pairs and padded batches.
//!
//! A batch of P pairs is 2P rows: the P chosen sequences, then the P rejected ones, so one
//! forward pass serves both. Each row is `prompt ++ response`, padded on the right to the
//! longest row. Past `max_len`, the prompt is cut from the left (the end of a dialogue
//! matters most) and the responses from the right.

use sha2::{Digest, Sha256};

use crate::error::{DataError, Result};
use crate::pair::PreferencePair;

/// A pair after tokenization and truncation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizedPair {
    /// Prompt ids; never empty (an empty prompt becomes the start token).
    pub prompt: Vec<u32>,
    /// Chosen response ids.
    pub chosen: Vec<u32>,
    /// Rejected response ids.
    pub rejected: Vec<u32>,
}

/// Tokenizes and truncates pairs. `start_id` stands in for an empty prompt (GPT-2 uses
/// `<|endoftext|>`), since the first response token is scored from the position before it.
pub fn tokenize_pairs<E: std::fmt::Display>(
    pairs: &[PreferencePair],
    encode: impl Fn(&str) -> std::result::Result<Vec<u32>, E>,
    max_len: usize,
    start_id: u32,
) -> Result<Vec<TokenizedPair>> {
    if max_len < 2 {
        return Err(DataError::Invalid(format!("max_len must be at least 2, got {max_len}")));
    }
    pairs
        .iter()
        .enumerate()
        .map(|(index, p)| {
            let enc = |s: &str| encode(s).map_err(|e| DataError::Tokenize { index, reason: e.to_string() });
            let mut prompt = enc(&p.prompt)?;
            if prompt.is_empty() {
                prompt.push(start_id);
            }
            Ok(truncate(prompt, enc(&p.chosen)?, enc(&p.rejected)?, max_len))
        })
        .collect()
}

fn truncate(mut prompt: Vec<u32>, mut chosen: Vec<u32>, mut rejected: Vec<u32>, max_len: usize) -> TokenizedPair {
    let longest = chosen.len().max(rejected.len());
    if prompt.len() + longest > max_len {
        // The prompt keeps at least half the budget, and at least one token.
        let keep_prompt = prompt.len().min(max_len.saturating_sub(longest).max(max_len / 2)).max(1);
        prompt.drain(..prompt.len() - keep_prompt);
        let keep_response = max_len - keep_prompt;
        chosen.truncate(keep_response);
        rejected.truncate(keep_response);
    }
    TokenizedPair { prompt, chosen, rejected }
}

/// 2P right-padded rows: chosen rows first, then rejected rows.
#[derive(Debug, Clone, PartialEq)]
pub struct PairBatch {
    /// Row-major ids, `rows x seq_len`.
    pub input_ids: Vec<u32>,
    /// Number of pairs P.
    pub pairs: usize,
    /// Padded length of every row.
    pub seq_len: usize,
    /// Prompt length of each of the 2P rows.
    pub prompt_lens: Vec<usize>,
    /// Response length of each of the 2P rows.
    pub response_lens: Vec<usize>,
    /// 1 where a row's token is part of its response, row-major like `input_ids`.
    pub response_mask: Vec<u8>,
}

impl PairBatch {
    /// Rows in the batch (2P).
    pub fn rows(&self) -> usize {
        2 * self.pairs
    }

    /// Total response tokens, i.e. the rows of the head's input.
    pub fn response_tokens(&self) -> usize {
        self.response_lens.iter().sum()
    }
}

/// Pads pairs into one batch with `pad_id`.
pub fn collate(pairs: &[&TokenizedPair], pad_id: u32) -> PairBatch {
    let rows: Vec<(&[u32], &[u32])> = pairs
        .iter()
        .map(|p| (p.prompt.as_slice(), p.chosen.as_slice()))
        .chain(pairs.iter().map(|p| (p.prompt.as_slice(), p.rejected.as_slice())))
        .collect();
    let seq_len = rows.iter().map(|(p, r)| p.len() + r.len()).max().unwrap_or(0);
    let mut input_ids = Vec::with_capacity(rows.len() * seq_len);
    let mut response_mask = Vec::with_capacity(rows.len() * seq_len);
    for (prompt, response) in &rows {
        input_ids.extend_from_slice(prompt);
        input_ids.extend_from_slice(response);
        response_mask.extend(std::iter::repeat_n(0u8, prompt.len()));
        response_mask.extend(std::iter::repeat_n(1u8, response.len()));
        let pad = seq_len - prompt.len() - response.len();
        input_ids.extend(std::iter::repeat_n(pad_id, pad));
        response_mask.extend(std::iter::repeat_n(0u8, pad));
    }
    PairBatch {
        input_ids,
        pairs: pairs.len(),
        seq_len,
        prompt_lens: rows.iter().map(|(p, _)| p.len()).collect(),
        response_lens: rows.iter().map(|(_, r)| r.len()).collect(),
        response_mask,
    }
}

/// SHA-256 over the token ids of all pairs, in order: the data half of a reference-cache key.
pub fn fingerprint(pairs: &[TokenizedPair]) -> String {
    let mut h = Sha256::new();
    for p in pairs {
        for part in [&p.prompt, &p.chosen, &p.rejected] {
            h.update((part.len() as u64).to_le_bytes());
            for id in part.iter() {
                h.update(id.to_le_bytes());
            }
        }
    }
    hex::encode(h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: usize, base: u32) -> Vec<u32> {
        (0..n as u32).map(|i| base + i).collect()
    }

    #[test]
    fn long_prompt_is_cut_from_the_left_and_long_response_from_the_right() {
        let t = truncate(ids(100, 0), ids(10, 1000), ids(50, 2000), 64);
        assert_eq!(t.prompt.len() + t.rejected.len(), 64);
        assert_eq!(*t.prompt.last().unwrap(), 99, "the prompt keeps its end");
        assert_eq!(t.rejected[0], 2000, "the response keeps its start");
        assert_eq!(t.chosen.len(), 10, "a short response is untouched");
    }

    #[test]
    fn sequences_within_max_len_are_untouched() {
        let t = truncate(ids(5, 0), ids(3, 10), ids(4, 20), 9);
        assert_eq!((t.prompt.len(), t.chosen.len(), t.rejected.len()), (5, 3, 4));
    }

    #[test]
    fn collate_pads_to_longest_row_and_masks_responses_only() {
        let a = TokenizedPair { prompt: vec![1, 2], chosen: vec![3], rejected: vec![4, 5, 6] };
        let b = TokenizedPair { prompt: vec![7], chosen: vec![8, 9], rejected: vec![10] };
        let batch = collate(&[&a, &b], 0);
        assert_eq!((batch.rows(), batch.seq_len), (4, 5));
        assert_eq!(&batch.input_ids[0..5], &[1, 2, 3, 0, 0]); // a chosen
        assert_eq!(&batch.input_ids[5..10], &[7, 8, 9, 0, 0]); // b chosen
        assert_eq!(&batch.input_ids[10..15], &[1, 2, 4, 5, 6]); // a rejected
        assert_eq!(&batch.response_mask[10..15], &[0, 0, 1, 1, 1]);
        assert_eq!(batch.response_tokens(), 1 + 2 + 3 + 1);
    }

    #[test]
    fn empty_prompt_gets_the_start_token() {
        let pair = PreferencePair { prompt: String::new(), chosen: "x".into(), rejected: "y".into(), domain: None };
        let enc = |s: &str| -> std::result::Result<Vec<u32>, String> { Ok(s.bytes().map(u32::from).collect()) };
        let t = tokenize_pairs(&[pair], enc, 16, 50256).unwrap();
        assert_eq!(t[0].prompt, vec![50256]);
    }

    #[test]
    fn fingerprint_changes_when_a_token_changes() {
        let a = TokenizedPair { prompt: vec![1], chosen: vec![2], rejected: vec![3] };
        let mut b = a.clone();
        b.rejected[0] = 4;
        assert_ne!(fingerprint(std::slice::from_ref(&a)), fingerprint(&[b]));
        assert_eq!(fingerprint(std::slice::from_ref(&a)), fingerprint(&[a]));
    }
}
