//! `fedpo-aggregator experiment FILE.toml`: a grid of simulations, then CSVs, a summary
//! table and figures.
//!
//! Every run goes through `simulate` (the same aggregator, devices and MQTT), into
//! `OUT/<study>/<cell>/seed-<n>/`. A run whose `summary.json` exists is kept, and one with
//! only a checkpoint is resumed, so an interrupted experiment continues where it stopped.
//! Every run's command line is checked before the first one starts.

mod config;
mod figures;
mod report;

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use clap::Args;

use crate::checkpoint::CheckpointDir;
use config::{ExperimentFile, RunSpec};
use report::RunResult;

#[derive(Debug, Args)]
pub(crate) struct ExperimentArgs {
    /// The experiment file (see experiments/smoke.toml).
    file: PathBuf,
    /// Output directory [default: runs/<name from the file>].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Only rebuild the CSVs, summary and figures from the runs already in --out.
    #[arg(long)]
    report_only: bool,
}

fn run_dir(out: &Path, spec: &RunSpec) -> PathBuf {
    out.join(&spec.study).join(spec.dir_name()).join(format!("seed-{}", spec.seed))
}

pub(crate) fn run(args: ExperimentArgs) -> Result<()> {
    let file = ExperimentFile::load(&args.file)?;
    let out = args.out.clone().unwrap_or_else(|| PathBuf::from("runs").join(&file.name));
    let runs = file.runs();
    for spec in &runs {
        crate::check_command_line(spec.args(&run_dir(&out, spec), false))
            .map_err(|e| anyhow!("study `{}`, {} (seed {}): {e}", spec.study, spec.label(), spec.seed))?;
    }
    let total = runs.len();
    if !args.report_only {
        println!("experiment `{}`: {total} runs into {}", file.name, out.display());
        for (i, spec) in runs.iter().enumerate() {
            let dir = run_dir(&out, spec);
            let tag = format!("[{}/{total}] {} / {} / seed {}", i + 1, spec.study, spec.label(), spec.seed);
            if dir.join("summary.json").exists() {
                println!("{tag}: done before, kept");
                continue;
            }
            let resume = CheckpointDir::new(&dir).exists();
            println!("{tag}{}", if resume { ": resuming" } else { "" });
            crate::run_cli(spec.args(&dir, resume)).with_context(|| format!("{tag} failed"))?;
        }
    }
    let mut results = Vec::with_capacity(total);
    for spec in runs {
        let dir = run_dir(&out, &spec);
        match crate::plots::read_records(&dir) {
            Ok(records) => results.push(RunResult { spec, records }),
            Err(e) if args.report_only => tracing::warn!(run = %dir.display(), error = %e, "no metrics; left out"),
            Err(e) => return Err(e.context(format!("reading {}", dir.join("metrics.jsonl").display()))),
        }
    }
    report::write_csvs(&out, &results)?;
    let table = report::write_summary(&out, &report::summarize(&results))?;
    let figures = figures::write_figures(&out.join("figures"), &results)?;
    println!("\n{table}");
    println!("results.csv, devices.csv, summary.csv, summary.md and {} figures in {}", figures.len(), out.display());
    Ok(())
}
