//! A vocabulary trimmed to the tokens a fleet's data uses.
//!
//! The `tiny` model is 128 wide but keeps GPT-2's 50,257-token tied head and embedding,
//! so nearly all of a step's arithmetic and of the model's bytes on the wire go to tokens
//! that a simulation's pairs never contain. Trimming keeps the GPT-2 segmentation exactly
//! (text is tokenized by the full BPE, then each id is renumbered) and shrinks the head
//! and embedding to the kept tokens.
//!
//! What it gives up: the softmax normalises over the kept tokens only, so log-probabilities
//! lack the mass a full-vocabulary model puts on tokens the data never shows. It is an
//! option of simulations on randomly initialised presets, never applied silently.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// The kept GPT-2 ids, in order: compact id `i` is GPT-2 id `kept[i]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrimmedVocab {
    kept: Vec<u32>,
    compact: HashMap<u32, u32>,
}

/// The file form: `{"gpt2_ids": [..]}`.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct VocabFile {
    gpt2_ids: Vec<u32>,
}

impl TrimmedVocab {
    /// The vocabulary of exactly `ids` (deduplicated, sorted). `eos_id` is always kept:
    /// it pads and ends every sequence.
    pub fn new(ids: impl IntoIterator<Item = u32>, eos_id: u32) -> Self {
        let kept: BTreeSet<u32> = ids.into_iter().chain(std::iter::once(eos_id)).collect();
        Self::from_sorted(kept.into_iter().collect())
    }

    fn from_sorted(kept: Vec<u32>) -> Self {
        let compact = kept.iter().enumerate().map(|(i, &id)| (id, i as u32)).collect();
        Self { kept, compact }
    }

    /// How many tokens are kept: the trimmed model's `vocab_size`.
    pub fn len(&self) -> usize {
        self.kept.len()
    }

    /// Whether no token is kept (never true for a vocabulary built with [`Self::new`]).
    pub fn is_empty(&self) -> bool {
        self.kept.is_empty()
    }

    /// The compact id of GPT-2 id `id`, if kept.
    pub fn compact(&self, id: u32) -> Option<u32> {
        self.compact.get(&id).copied()
    }

    /// The GPT-2 id of compact id `id`, if in range.
    pub fn original(&self, id: u32) -> Option<u32> {
        self.kept.get(id as usize).copied()
    }

    /// Reads a vocabulary file written by [`Self::save`]. Every id must be below
    /// `full_vocab` (the untrimmed tokenizer's size), and the list strictly increasing.
    pub fn load(path: &Path, full_vocab: usize) -> Result<Self> {
        let bad = |why: String| ModelError::Tokenizer(format!("{}: {why}", path.display()));
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        let file: VocabFile = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        if file.gpt2_ids.is_empty() {
            return Err(bad("the trimmed vocabulary lists no token".into()));
        }
        if let Some(w) = file.gpt2_ids.windows(2).find(|w| w[0] >= w[1]) {
            return Err(bad(format!("token ids must be strictly increasing; {} is followed by {}", w[0], w[1])));
        }
        if let Some(&last) = file.gpt2_ids.last().filter(|&&id| id as usize >= full_vocab) {
            return Err(bad(format!("token id {last} is outside the tokenizer's {full_vocab} tokens")));
        }
        Ok(Self::from_sorted(file.gpt2_ids))
    }

    /// Writes the vocabulary atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        let json = serde_json::to_vec(&VocabFile { gpt2_ids: self.kept.clone() })
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(fedpo_process::files::write_atomic(path, &json)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_renumbered_in_order_and_back() {
        let v = TrimmedVocab::new([464, 11, 464, 3290], 50256);
        assert_eq!(v.len(), 4);
        assert_eq!(v.compact(11), Some(0));
        assert_eq!(v.compact(50256), Some(3));
        assert_eq!(v.compact(12), None);
        assert_eq!(v.original(2), Some(3290));
        assert_eq!(v.original(4), None);
    }

    #[test]
    fn a_saved_vocabulary_loads_back_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vocab.json");
        let v = TrimmedVocab::new([7, 3, 9], 50256);
        v.save(&path).unwrap();
        assert_eq!(TrimmedVocab::load(&path, 50257).unwrap(), v);
    }

    #[test]
    fn a_vocabulary_file_that_lies_is_refused_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vocab.json");
        for (body, why) in [
            (r#"{"gpt2_ids": []}"#, "no token"),
            (r#"{"gpt2_ids": [5, 5]}"#, "strictly increasing"),
            (r#"{"gpt2_ids": [1, 60000]}"#, "outside the tokenizer's 50257"),
            (r#"{"gpt2_ids": "x"}"#, "invalid type"),
        ] {
            std::fs::write(&path, body).unwrap();
            let err = TrimmedVocab::load(&path, 50257).unwrap_err().to_string();
            assert!(err.contains(why) && err.contains("vocab.json"), "{body}: {err}");
        }
    }
}
