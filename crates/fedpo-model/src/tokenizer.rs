//! Text to token ids: the GPT-2 byte-level BPE, built offline, or any `tokenizer.json`.
//!
//! The default tokenizer is compiled from GPT-2's own vocabulary files (`encoder.json`,
//! `vocab.bpe`, see `assets/gpt2/README.md`) into a `tokenizers` BPE with GPT-2's byte-level
//! pre-tokenizer and decoder, the same pipeline as the hub's DistilGPT-2 `tokenizer.json`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use crate::error::{ModelError, Result};
use crate::trimmed_vocab::TrimmedVocab;

const ENCODER_JSON: &str = include_str!("../assets/gpt2/encoder.json");
const VOCAB_BPE: &str = include_str!("../assets/gpt2/vocab.bpe");

/// GPT-2's end-of-text token, also used as padding and as the start of an empty prompt.
pub const ENDOFTEXT: &str = "<|endoftext|>";

/// A tokenizer plus the id of its end-of-text token, optionally renumbered into a
/// [`TrimmedVocab`].
#[derive(Clone)]
pub struct Gpt2Tokenizer {
    inner: Tokenizer,
    eos_id: u32,
    trimmed: Option<Arc<TrimmedVocab>>,
}

impl std::fmt::Debug for Gpt2Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpt2Tokenizer").field("vocab", &self.vocab_size()).field("eos_id", &self.eos_id).finish()
    }
}

fn tok_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

impl Gpt2Tokenizer {
    /// The GPT-2 BPE from the bundled vocabulary files (50,257 tokens).
    pub fn gpt2() -> Result<Self> {
        let vocab: HashMap<String, u32> = serde_json::from_str(ENCODER_JSON).map_err(tok_err)?;
        let merges: Vec<(String, String)> = VOCAB_BPE
            .lines()
            .filter(|l| !l.starts_with("#version") && !l.trim().is_empty())
            .map(|l| {
                let (a, b) = l.split_once(' ').ok_or_else(|| tok_err(format!("bad merge line `{l}`")))?;
                Ok((a.to_string(), b.to_string()))
            })
            .collect::<Result<_>>()?;
        let vocab: ahash::AHashMap<String, u32> = vocab.into_iter().collect();
        let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(tok_err)?;
        let mut inner = Tokenizer::new(bpe);
        inner
            .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false).trim_offsets(true).use_regex(true)))
            .with_decoder(Some(ByteLevelDecoder::default()))
            .with_post_processor(Some(ByteLevel::default().trim_offsets(false)));
        inner.add_special_tokens([AddedToken::from(ENDOFTEXT, true)]).map_err(tok_err)?;
        Self::wrap(inner)
    }

    /// Loads any HF `tokenizer.json`. It must know `<|endoftext|>`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let inner = Tokenizer::from_file(path).map_err(|e| tok_err(format!("{}: {e}", path.display())))?;
        Self::wrap(inner)
    }

    fn wrap(inner: Tokenizer) -> Result<Self> {
        let eos_id =
            inner.token_to_id(ENDOFTEXT).ok_or_else(|| tok_err(format!("the tokenizer has no `{ENDOFTEXT}` token")))?;
        Ok(Self { inner, eos_id, trimmed: None })
    }

    /// This tokenizer renumbered into `vocab`: the same segmentation, compact ids.
    pub fn with_trimmed_vocab(mut self, vocab: Arc<TrimmedVocab>) -> Result<Self> {
        if self.trimmed.is_some() {
            return Err(tok_err("the tokenizer is already trimmed"));
        }
        if vocab.original(vocab.len() as u32 - 1).is_some_and(|id| id as usize >= self.inner.get_vocab_size(true)) {
            return Err(tok_err(format!(
                "the trimmed vocabulary names ids beyond the tokenizer's {}",
                self.vocab_size()
            )));
        }
        if vocab.compact(self.eos_id).is_none() {
            return Err(tok_err(format!("the trimmed vocabulary lacks `{ENDOFTEXT}` (id {})", self.eos_id)));
        }
        self.trimmed = Some(vocab);
        Ok(self)
    }

    /// The trimmed vocabulary of every token in `texts`, plus `<|endoftext|>`.
    pub fn vocabulary_of<'a>(&self, texts: impl IntoIterator<Item = &'a str>) -> Result<TrimmedVocab> {
        if self.trimmed.is_some() {
            return Err(tok_err("the tokenizer is already trimmed"));
        }
        let mut ids = Vec::new();
        for text in texts {
            ids.extend(self.encode(text)?);
        }
        Ok(TrimmedVocab::new(ids, self.eos_id))
    }

    /// Token ids of `text`, without special tokens added. With a trimmed vocabulary, a
    /// token outside it is an error that names the token.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let ids = self.inner.encode(text, false).map_err(tok_err)?.get_ids().to_vec();
        let Some(vocab) = &self.trimmed else { return Ok(ids) };
        ids.into_iter()
            .map(|id| {
                vocab.compact(id).ok_or_else(|| {
                    let token = self.inner.id_to_token(id).unwrap_or_default();
                    tok_err(format!(
                        "token `{token}` (GPT-2 id {id}) is not in the trimmed vocabulary of {} tokens",
                        vocab.len()
                    ))
                })
            })
            .collect()
    }

    /// Text of `ids` (special tokens kept).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let Some(vocab) = &self.trimmed else { return self.inner.decode(ids, false).map_err(tok_err) };
        let full = ids
            .iter()
            .map(|&id| {
                vocab.original(id).ok_or_else(|| tok_err(format!("id {id} is beyond the trimmed {}", vocab.len())))
            })
            .collect::<Result<Vec<_>>>()?;
        self.inner.decode(&full, false).map_err(tok_err)
    }

    /// Id of `<|endoftext|>`.
    pub fn eos_id(&self) -> u32 {
        match &self.trimmed {
            Some(vocab) => vocab.compact(self.eos_id).expect("checked when trimmed"),
            None => self.eos_id,
        }
    }

    /// Vocabulary size including added tokens (the kept tokens once trimmed).
    pub fn vocab_size(&self) -> usize {
        match &self.trimmed {
            Some(vocab) => vocab.len(),
            None => self.inner.get_vocab_size(true),
        }
    }

    /// Writes an HF `tokenizer.json`, atomically. A trimmed tokenizer has no such form.
    pub fn save(&self, path: &Path) -> Result<()> {
        if self.trimmed.is_some() {
            return Err(tok_err(format!(
                "{}: a tokenizer with a trimmed vocabulary cannot be written as tokenizer.json",
                path.display()
            )));
        }
        let json = self.inner.to_string(false).map_err(tok_err)?;
        Ok(fedpo_process::files::write_atomic(path, json.as_bytes())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Strings where byte-level BPE implementations usually part ways.
    const TRICKY: &[&str] = &[
        "Hello, world!",
        "I'm sure you'll see it's what they've done, and we'd... OK?",
        "  leading spaces and\ttabs\n\nnew lines   \n",
        "Ünïcödé: naïve café, 日本語のテキスト, emoji 🤖🚀 and Ω≈ç√",
        "numbers 1234567890 3.14159 -42 1e-5",
        "\n\nHuman: What is DPO?\n\nAssistant: Direct preference optimisation.",
        "trailing whitespace   ",
        "<|endoftext|> is special",
        "",
        "don't DON'T Don't",
        "    def f(x):\n        return x**2  # comment",
    ];

    #[test]
    fn gpt2_ids_match_tiktoken_r50k_base_on_tricky_strings() {
        let ours = Gpt2Tokenizer::gpt2().unwrap();
        let reference = tiktoken_rs::r50k_base().unwrap();
        for text in TRICKY {
            let expected: Vec<u32> = reference.encode_with_special_tokens(text).into_iter().collect();
            assert_eq!(ours.encode(text).unwrap(), expected, "ids differ for {text:?}");
        }
    }

    #[test]
    fn decoding_round_trips_the_text() {
        let tok = Gpt2Tokenizer::gpt2().unwrap();
        for text in TRICKY {
            assert_eq!(&tok.decode(&tok.encode(text).unwrap()).unwrap(), text);
        }
    }

    #[test]
    fn default_tokenizer_has_gpt2_vocabulary_and_eos() {
        let tok = Gpt2Tokenizer::gpt2().unwrap();
        assert_eq!(tok.vocab_size(), 50257);
        assert_eq!(tok.eos_id(), 50256);
    }

    #[test]
    fn tokenizer_json_written_and_loaded_back_tokenizes_identically() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        let tok = Gpt2Tokenizer::gpt2().unwrap();
        tok.save(&path).unwrap();
        let loaded = Gpt2Tokenizer::from_file(&path).unwrap();
        for text in TRICKY {
            assert_eq!(loaded.encode(text).unwrap(), tok.encode(text).unwrap());
        }
    }

    #[test]
    fn a_trimmed_tokenizer_segments_like_gpt2_and_refuses_unseen_tokens() {
        let full = Gpt2Tokenizer::gpt2().unwrap();
        let text = "Hello, world! Hello again.";
        let vocab = full.vocabulary_of([text]).unwrap();
        let trimmed = full.clone().with_trimmed_vocab(Arc::new(vocab.clone())).unwrap();
        let ids = trimmed.encode(text).unwrap();
        let back: Vec<u32> = ids.iter().map(|&i| vocab.original(i).unwrap()).collect();
        assert_eq!(back, full.encode(text).unwrap());
        assert!(ids.iter().all(|&i| (i as usize) < trimmed.vocab_size()));
        assert_eq!(trimmed.vocab_size(), vocab.len());
        assert_eq!(trimmed.decode(&ids).unwrap(), text);
        assert_eq!(vocab.original(trimmed.eos_id()), Some(50256));
        let err = trimmed.encode("zebra").unwrap_err().to_string();
        assert!(err.contains("`z` (GPT-2 id 89)") && err.contains("not in the trimmed vocabulary"), "{err}");
        assert!(trimmed.save(Path::new("/tmp/never.json")).is_err());
    }

    #[test]
    fn unreadable_tokenizer_file_names_the_path() {
        let err = Gpt2Tokenizer::from_file(Path::new("/nonexistent/tokenizer.json")).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/tokenizer.json"), "{err}");
    }
}
