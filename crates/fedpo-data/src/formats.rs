//! Preference-pair files in JSONL: TRL, HH-RLHF and SHP layouts, detected by their keys.
//!
//! - **TRL**: `{"prompt", "chosen", "rejected"}`, responses without the prompt.
//! - **HH-RLHF**: `{"chosen", "rejected"}`, two whole dialogues. The prompt is their shared
//!   prefix through the last `\n\nAssistant:`; the responses are what follows.
//! - **SHP**: `{"history", "human_ref_A", "human_ref_B", "labels"}` with `labels == 1` when A
//!   is preferred, and an optional `domain`. The prompt is the history plus a blank line.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use serde_json::{Map, Value};

use crate::error::{DataError, Result};
use crate::pair::PreferencePair;

/// A JSONL layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataFormat {
    /// `prompt` / `chosen` / `rejected`.
    Trl,
    /// Anthropic HH-RLHF dialogues.
    HhRlhf,
    /// Stanford Human Preferences.
    Shp,
}

impl FromStr for DataFormat {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "trl" => Ok(Self::Trl),
            "hh-rlhf" | "hh" => Ok(Self::HhRlhf),
            "shp" => Ok(Self::Shp),
            _ => Err(format!("unknown data format `{s}`; expected trl, hh-rlhf or shp")),
        }
    }
}

impl fmt::Display for DataFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Trl => "trl",
            Self::HhRlhf => "hh-rlhf",
            Self::Shp => "shp",
        })
    }
}

/// Pairs read from a file, and how many lines were skipped.
#[derive(Debug, Clone)]
pub struct LoadedPairs {
    /// The usable pairs, in file order.
    pub pairs: Vec<PreferencePair>,
    /// With [`load_jsonl_keyed`], each pair's value of the field asked for; else empty.
    pub keys: Vec<Option<String>>,
    /// Lines skipped as bad (only with `skip_bad`).
    pub skipped: usize,
}

const HH_ASSISTANT: &str = "\n\nAssistant:";

/// Guesses the layout of one record from its keys.
pub fn detect_format(obj: &Map<String, Value>) -> std::result::Result<DataFormat, String> {
    let has = |k: &str| obj.contains_key(k);
    if has("history") && has("human_ref_A") && has("human_ref_B") && has("labels") {
        Ok(DataFormat::Shp)
    } else if has("prompt") && has("chosen") && has("rejected") {
        Ok(DataFormat::Trl)
    } else if has("chosen") && has("rejected") {
        Ok(DataFormat::HhRlhf)
    } else {
        let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        Err(format!(
            "cannot tell the format from keys {keys:?}; expected prompt/chosen/rejected (trl), \
             chosen/rejected (hh-rlhf) or history/human_ref_A/human_ref_B/labels (shp)"
        ))
    }
}

fn string_field(obj: &Map<String, Value>, key: &str) -> std::result::Result<String, String> {
    match obj.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(_)) => Err(format!("`{key}` is a message list; only plain-text pairs are supported")),
        Some(other) => Err(format!("`{key}` must be a string, found {}", type_name(other))),
        None => Err(format!("missing `{key}`")),
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Splits two HH-RLHF dialogues into (prompt, chosen response, rejected response).
pub fn split_hh_dialogues(chosen: &str, rejected: &str) -> std::result::Result<(String, String, String), String> {
    let common_bytes = chosen
        .char_indices()
        .zip(rejected.chars())
        .find(|((_, a), b)| a != b)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| chosen.len().min(rejected.len()));
    let shared = &chosen[..common_bytes];
    let cut = shared
        .rfind(HH_ASSISTANT)
        .ok_or_else(|| "chosen and rejected share no prefix ending in \"\\n\\nAssistant:\"".to_string())?
        + HH_ASSISTANT.len();
    Ok((chosen[..cut].to_string(), chosen[cut..].to_string(), rejected[cut..].to_string()))
}

/// Parses one record in a known layout.
pub fn parse_record(obj: &Map<String, Value>, format: DataFormat) -> std::result::Result<PreferencePair, String> {
    let domain = obj.get("domain").and_then(Value::as_str).map(String::from);
    match format {
        DataFormat::Trl => Ok(PreferencePair {
            prompt: string_field(obj, "prompt")?,
            chosen: string_field(obj, "chosen")?,
            rejected: string_field(obj, "rejected")?,
            domain,
        }),
        DataFormat::HhRlhf => {
            let (prompt, chosen, rejected) =
                split_hh_dialogues(&string_field(obj, "chosen")?, &string_field(obj, "rejected")?)?;
            Ok(PreferencePair { prompt, chosen, rejected, domain })
        }
        DataFormat::Shp => {
            let history = string_field(obj, "history")?;
            let a = string_field(obj, "human_ref_A")?;
            let b = string_field(obj, "human_ref_B")?;
            let label = match obj.get("labels") {
                Some(Value::Number(n)) if n.as_i64() == Some(1) => true,
                Some(Value::Number(n)) if n.as_i64() == Some(0) => false,
                Some(Value::Bool(b)) => *b,
                other => return Err(format!("`labels` must be 0 or 1, found {other:?}")),
            };
            let (chosen, rejected) = if label { (a, b) } else { (b, a) };
            Ok(PreferencePair { prompt: format!("{history}\n\n"), chosen, rejected, domain })
        }
    }
}

/// Reads a JSONL file of preference pairs.
///
/// Each line is detected on its own unless `format` forces one. A bad line is an error
/// naming `file:line` and the reason, unless `skip_bad` is set: then it is counted in
/// [`LoadedPairs::skipped`] and logged by the caller. Blank lines are ignored.
pub fn load_jsonl(path: &Path, format: Option<DataFormat>, skip_bad: bool) -> Result<LoadedPairs> {
    load_jsonl_keyed(path, format, skip_bad, None)
}

/// [`load_jsonl`], also reading each usable record's field `key` (a string, number or
/// boolean, as text; `None` where absent or of another type) into
/// [`LoadedPairs::keys`], for partitioning by it.
pub fn load_jsonl_keyed(
    path: &Path,
    format: Option<DataFormat>,
    skip_bad: bool,
    key: Option<&str>,
) -> Result<LoadedPairs> {
    let text = std::fs::read_to_string(path).map_err(|source| DataError::Io { path: path.to_path_buf(), source })?;
    let mut pairs = Vec::new();
    let mut keys = Vec::new();
    let mut skipped = 0;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let parsed = serde_json::from_str::<Value>(line)
            .map_err(|e| format!("invalid JSON: {e}"))
            .and_then(|v| match v {
                Value::Object(obj) => Ok(obj),
                other => Err(format!("expected a JSON object, found {}", type_name(&other))),
            })
            .and_then(|obj| {
                let f = match format {
                    Some(f) => f,
                    None => detect_format(&obj)?,
                };
                let field = key.and_then(|k| match obj.get(k)? {
                    Value::String(v) => Some(v.clone()),
                    v @ (Value::Number(_) | Value::Bool(_)) => Some(v.to_string()),
                    _ => None,
                });
                Ok((parse_record(&obj, f)?, field))
            });
        match parsed {
            Ok((pair, field)) => {
                pairs.push(pair);
                if key.is_some() {
                    keys.push(field);
                }
            }
            Err(_) if skip_bad => skipped += 1,
            Err(reason) => return Err(DataError::BadLine { file: path.to_path_buf(), line: i + 1, reason }),
        }
    }
    if pairs.is_empty() {
        return Err(DataError::Empty { path: path.to_path_buf(), skipped });
    }
    Ok(LoadedPairs { pairs, keys, skipped })
}

/// Writes pairs as TRL-layout JSONL (the format `score` and `--data` read back).
pub fn to_jsonl(pairs: &[PreferencePair]) -> String {
    let mut out = String::new();
    for p in pairs {
        out.push_str(&serde_json::to_string(p).unwrap_or_default());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(lines: &[&str]) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), lines.join("\n")).unwrap();
        f
    }

    #[test]
    fn hh_rlhf_prompt_is_shared_prefix_through_last_assistant_turn() {
        let chosen = "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Tea?\n\nAssistant: Boil water first.";
        let rejected = "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Tea?\n\nAssistant: No idea.";
        let (p, c, r) = split_hh_dialogues(chosen, rejected).unwrap();
        assert_eq!(p, "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Tea?\n\nAssistant:");
        assert_eq!(c, " Boil water first.");
        assert_eq!(r, " No idea.");
    }

    #[test]
    fn a_keyed_load_reads_the_named_field_of_each_usable_record_as_text() {
        let f = write(&[
            r#"{"prompt": "Q", "chosen": " a", "rejected": " b", "user": "ann"}"#,
            r#"{"prompt": "Q", "chosen": " a", "rejected": " b", "user": 7}"#,
            r#"{"broken": true}"#,
            r#"{"prompt": "Q", "chosen": " a", "rejected": " b"}"#,
        ]);
        let loaded = load_jsonl_keyed(f.path(), None, true, Some("user")).unwrap();
        assert_eq!(loaded.keys, [Some("ann".to_string()), Some("7".to_string()), None]);
        assert_eq!((loaded.pairs.len(), loaded.skipped), (3, 1));
        assert!(load_jsonl(f.path(), None, true).unwrap().keys.is_empty());
    }

    #[test]
    fn hh_rlhf_dialogues_diverging_before_any_assistant_turn_are_rejected() {
        assert!(split_hh_dialogues("\n\nHuman: A\n\nAssistant: x", "\n\nHuman: B\n\nAssistant: y").is_err());
    }

    #[test]
    fn all_three_formats_are_detected_from_their_keys() {
        let f = write(&[
            r#"{"prompt": "Q", "chosen": " good", "rejected": " bad"}"#,
            r#"{"chosen": "\n\nHuman: Q\n\nAssistant: good", "rejected": "\n\nHuman: Q\n\nAssistant: bad"}"#,
            r#"{"history": "Q", "human_ref_A": "a", "human_ref_B": "b", "labels": 0, "domain": "askscience"}"#,
            "",
        ]);
        let loaded = load_jsonl(f.path(), None, false).unwrap();
        assert_eq!(loaded.pairs.len(), 3);
        assert_eq!(loaded.pairs[0].chosen, " good");
        assert_eq!(loaded.pairs[1].prompt, "\n\nHuman: Q\n\nAssistant:");
        let shp = &loaded.pairs[2];
        assert_eq!((shp.chosen.as_str(), shp.rejected.as_str()), ("b", "a"), "labels 0 prefers B");
        assert_eq!(shp.domain.as_deref(), Some("askscience"));
    }

    #[test]
    fn bad_line_error_names_file_and_line() {
        let f = write(&[r#"{"prompt": "Q", "chosen": "a", "rejected": "b"}"#, r#"{"prompt": "Q", "chosen": 3}"#]);
        let err = load_jsonl(f.path(), None, false).unwrap_err().to_string();
        assert!(err.contains(&format!("{}:2:", f.path().display())), "{err}");
    }

    #[test]
    fn skip_bad_counts_skipped_lines() {
        let f = write(&[r#"{"prompt": "Q", "chosen": "a", "rejected": "b"}"#, "not json", r#"{"x": 1}"#]);
        let loaded = load_jsonl(f.path(), None, true).unwrap();
        assert_eq!((loaded.pairs.len(), loaded.skipped), (1, 2));
    }

    #[test]
    fn forced_format_overrides_detection() {
        let f = write(&[
            r#"{"prompt": "ignored", "chosen": "\n\nHuman: Q\n\nAssistant: a", "rejected": "\n\nHuman: Q\n\nAssistant: b"}"#,
        ]);
        let loaded = load_jsonl(f.path(), Some(DataFormat::HhRlhf), false).unwrap();
        assert_eq!(loaded.pairs[0].chosen, " a");
    }

    #[test]
    fn file_without_pairs_is_an_error() {
        let f = write(&["", "  "]);
        assert!(matches!(load_jsonl(f.path(), None, false), Err(DataError::Empty { .. })));
    }
}
