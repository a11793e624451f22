//! `fedpo-device score`: per-pair response log-probs under a policy.
//!
//! One JSON object per input pair, in input order: `index`, `chosen_logp`, `rejected_logp`
//! (summed over response tokens, truncated like training). Serves held-out evaluation and
//! cross-checks against other implementations.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use fedpo_data::{load_jsonl, DataFormat};
use fedpo_model::PartitionPreset;
use fedpo_process::files::write_atomic;
use fedpo_train::score_pairs;
use serde_json::json;

use crate::cli::assemble::{parse_device, tokenize, ModelArgs};

#[derive(Debug, Args)]
pub(crate) struct ScoreArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// JSONL preference pairs.
    #[arg(long)]
    pub(crate) data: PathBuf,
    /// Force the data layout: trl, hh-rlhf or shp.
    #[arg(long)]
    pub(crate) format: Option<DataFormat>,
    /// Skip unparsable lines instead of stopping.
    #[arg(long)]
    pub(crate) skip_bad: bool,
    /// Tokens per sequence after truncation.
    #[arg(long, default_value_t = 128)]
    pub(crate) max_len: usize,
    /// Pairs per forward pass.
    #[arg(long, default_value_t = 8)]
    pub(crate) batch_pairs: usize,
    /// Output file (JSONL); standard output when absent.
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
}

pub(crate) fn run(mut args: ScoreArgs) -> Result<()> {
    // Nothing trains here: freeze the base so no gradient bookkeeping is kept for it.
    args.model.partition = PartitionPreset::SharedLora;
    let device = parse_device(&args.model.device)?;
    let (policy, tokenizer) = args.model.build(&device)?;
    let loaded = load_jsonl(&args.data, args.format, args.skip_bad)?;
    if loaded.skipped > 0 {
        tracing::warn!(skipped = loaded.skipped, "skipped bad lines");
    }
    let pairs = tokenize(&loaded.pairs, &tokenizer, args.max_len, policy.spec.config.n_positions)?;
    let scores = score_pairs(&policy, &pairs, args.batch_pairs, tokenizer.eos_id())?;
    let mut out = Vec::new();
    for (index, (chosen, rejected)) in scores.chosen.iter().zip(&scores.rejected).enumerate() {
        writeln!(out, "{}", json!({ "index": index, "chosen_logp": chosen, "rejected_logp": rejected }))?;
    }
    match &args.out {
        Some(path) => {
            write_atomic(path, &out).with_context(|| format!("writing {}", path.display()))?;
            tracing::info!(pairs = pairs.len(), file = %path.display(), "scored");
        }
        None => std::io::stdout().write_all(&out)?,
    }
    Ok(())
}
