//! `fedpo-device export`: a device's model and private adapter in the directories
//! transformers and PEFT read.
//!
//! Nothing leaves the device by itself: the export is a local directory, written only when
//! its owner asks, and what they do with their adapter is their choice.

use std::path::PathBuf;

use anyhow::{bail, Result};
use candle_core::{DType, Device};
use clap::Args;
use fedpo_model::export::{write_dir_atomically, write_peft_dir, write_transformers_dir};
use fedpo_model::{Gpt2Tokenizer, GPT2_VOCAB_SIZE};

use crate::cli::generate::load_state_dir;

#[derive(Debug, Args)]
pub(crate) struct ExportArgs {
    /// The device's state directory.
    #[arg(long)]
    state_dir: PathBuf,
    /// Where to write `model/` (transformers) and `adapter/` (PEFT).
    #[arg(long)]
    out: PathBuf,
    /// Write the model with the adapter merged into its weights (`model/` alone, no PEFT
    /// needed to use it).
    #[arg(long)]
    merged: bool,
    /// Replace --out if it exists.
    #[arg(long)]
    force: bool,
    /// What `adapter_config.json` names as its base model.
    #[arg(long, default_value = "../model")]
    base_model: String,
}

pub(crate) fn run(args: ExportArgs) -> Result<()> {
    let loaded = load_state_dir(&args.state_dir, DType::F32, &Device::Cpu)?;
    let vocab = loaded.policy.spec.config.vocab_size;
    if vocab != GPT2_VOCAB_SIZE {
        bail!(
            "this model has {vocab} tokens, not GPT-2's {GPT2_VOCAB_SIZE}: a job on a trimmed vocabulary \
             (simulate --trim-vocab) numbers its tokens its own way, and no tokenizer.json describes them"
        );
    }
    let tokenizer = Gpt2Tokenizer::gpt2()?;
    let policy = &loaded.policy;
    let adapter = loaded.adapted && !args.merged;
    write_dir_atomically(&args.out, args.force, |dir| {
        write_transformers_dir(policy, Some(&tokenizer), args.merged, &dir.join("model"))?;
        if adapter {
            write_peft_dir(policy, &args.base_model, &dir.join("adapter"))?;
        }
        Ok(())
    })?;
    let what = match (loaded.adapted, args.merged) {
        (true, true) => "model/ (the adapter merged in)",
        (true, false) => "model/ (transformers) and adapter/ (PEFT)",
        (false, _) => "model/ (this job has no private adapter)",
    };
    println!("{}: {what}, from {}", args.out.display(), loaded.source);
    Ok(())
}
