//! `fedpo-device`: what runs on every edge device.
//!
//! ```text
//! fedpo-device train-local --synthetic --model tiny --steps 200      # centralized DPO
//! fedpo-device score --model DIR --adapter A.safetensors --data pairs.jsonl
//! fedpo-device bench --tiny --pairs 4 --steps 8                       # DPO step time, peak RSS
//! fedpo-device run --broker mqtt://agg:1883 --id pi-7 --data pairs.jsonl --state-dir /var/lib/fedpo
//! fedpo-device run --config /etc/fedpo/device.toml                   # flags from a file
//! ```

mod cli;

use cli::{bench, bench_generate, config_file, export, generate, run, score, train_local};

use anyhow::Result;
use clap::{Parser, Subcommand};
use fedpo_process::logging;

#[derive(Parser)]
#[command(name = "fedpo-device", version, about = "fedpo edge device: local DPO training, scoring and benchmarks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// TOML file of this subcommand's flags (keys are long flag names); flags on the
    /// command line override it. Goes after the subcommand.
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<std::path::PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Centralized DPO on this device's pairs; writes metrics.jsonl, summary.json and the
    /// trained adapter and/or model.
    TrainLocal(train_local::TrainLocalArgs),
    /// Summed response log-probs of every pair under a model (and adapter), as JSONL.
    Score(score::ScoreArgs),
    /// Take part in a federated job: train each round that selects this device and upload
    /// only the shared update; the private adapter stays in --state-dir.
    Run(run::RunArgs),
    /// Write a device's model (transformers) and private adapter (PEFT) to a directory;
    /// --merged writes the model with the adapter merged in.
    Export(export::ExportArgs),
    /// Time generation (prefill and decode tokens/s, peak memory), with the peer script's
    /// flags (`scripts/generate_bench.py`).
    BenchGenerate(bench_generate::BenchGenerateArgs),
    /// Complete a prompt with the personalized model (a device's --state-dir, or --model
    /// with --adapter), streamed to stdout; --compare shows the global base's beside it.
    Generate(generate::GenerateArgs),
    /// Time one DPO optimizer step and report peak memory, with the peer script's flags.
    Bench(bench::BenchArgs),
}

fn main() {
    fedpo_process::threads::park_idle_candle_workers_quickly();
    fedpo_process::allocator::keep_freed_memory_in_heap();
    logging::init("info");
    if let Err(e) = run_command() {
        logging::exit_with(&e);
    }
}

fn run_command() -> Result<()> {
    let args = config_file::expand(std::env::args_os().collect())?;
    match Cli::parse_from(args).command {
        Command::TrainLocal(args) => train_local::run(args),
        Command::Score(args) => score::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Export(args) => export::run(args),
        Command::BenchGenerate(args) => bench_generate::run(args),
        Command::Run(args) => run::run(args),
    }
}
