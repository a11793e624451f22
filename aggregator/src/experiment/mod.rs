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

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
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
    /// Runs at once. Each gets an equal share of the cores for its kernels and devices
    /// (RAYON_NUM_THREADS and --concurrency, unless set): small models use cores better
    /// as several runs than as one.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    parallel: u64,
}

fn run_dir(out: &Path, spec: &RunSpec) -> PathBuf {
    out.join(&spec.study).join(spec.dir_name()).join(format!("seed-{}", spec.seed))
}

/// Each of `parallel` runs' share of the cores, when runs go to child processes.
fn share_cores(parallel: usize) -> Option<usize> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (parallel > 1).then(|| (cores / parallel).max(1))
}

/// This binary's path, for the child runs. Linux names a binary replaced on disk while it
/// runs (a rebuild during a long experiment) `PATH (deleted)`; its path then holds the new
/// build, which is what a child should start.
fn this_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("finding this binary to start runs")?;
    match exe.to_str().and_then(|s| s.strip_suffix(" (deleted)")) {
        Some(path) if !exe.exists() => Ok(PathBuf::from(path)),
        _ => Ok(exe),
    }
}

/// One run of the grid, skipped if finished before, resumed if interrupted. With a core
/// share, it is a child `simulate` process whose kernels and devices use that many threads
/// (RAYON_NUM_THREADS and --concurrency, unless set), logging to `simulate.log`: runs in
/// one process would share one kernel thread pool and wait on each other.
fn run_one(out: &Path, spec: &RunSpec, counter: &str, cores: Option<usize>) -> Result<()> {
    let dir = run_dir(out, spec);
    let tag = format!("{counter} {} / {} / seed {}", spec.study, spec.label(), spec.seed);
    if dir.join("summary.json").exists() {
        println!("{tag}: done before, kept");
        return Ok(());
    }
    let resume = CheckpointDir::new(&dir).exists();
    println!("{tag}{}", if resume { ": resuming" } else { "" });
    let started = Instant::now();
    let mut args = spec.args(&dir, resume);
    match cores {
        None => crate::run_cli(args).with_context(|| format!("{tag} failed"))?,
        Some(n) => {
            if !spec.settings.contains_key("concurrency") {
                args.extend(["--concurrency".to_string(), n.to_string()]);
            }
            std::fs::create_dir_all(&dir)?;
            let log_path = dir.join("simulate.log");
            let log = std::fs::File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
            let mut child = Command::new(this_binary()?);
            child.args(&args[1..]).stdout(log.try_clone()?).stderr(log);
            if std::env::var_os("RAYON_NUM_THREADS").is_none() {
                child.env("RAYON_NUM_THREADS", n.to_string());
            }
            let status = child.status().with_context(|| format!("{tag}: starting simulate"))?;
            if !status.success() {
                bail!("{tag} failed ({status}); see {}", log_path.display());
            }
        }
    }
    println!("{tag}: done in {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

pub(crate) fn run(args: ExperimentArgs) -> Result<()> {
    let file = ExperimentFile::load(&args.file)?;
    let out = args.out.clone().unwrap_or_else(|| PathBuf::from("runs").join(&file.name));
    let runs = file.runs();
    for spec in &runs {
        crate::check_command_line(spec.args(&run_dir(&out, spec), false))
            .map_err(|e| anyhow!("study `{}`, {} (seed {}): {e}", spec.study, spec.label(), spec.seed))?;
    }
    // A run that another study already has (the same settings and seed) is run once and
    // read by both.
    let mut first_dir: BTreeMap<String, PathBuf> = BTreeMap::new();
    let dirs: Vec<PathBuf> = runs
        .iter()
        .map(|spec| {
            let key = format!("{:?} seed {}", spec.settings, spec.seed);
            first_dir.entry(key).or_insert_with(|| run_dir(&out, spec)).clone()
        })
        .collect();
    let distinct: Vec<&RunSpec> =
        runs.iter().zip(&dirs).filter(|(spec, dir)| run_dir(&out, spec) == **dir).map(|(s, _)| s).collect();
    let total = distinct.len();
    if !args.report_only {
        let started = Instant::now();
        let parallel = usize::try_from(args.parallel).unwrap_or(usize::MAX).min(total.max(1));
        println!(
            "experiment `{}`: {} runs, {total} distinct, into {}, {parallel} at once",
            file.name,
            runs.len(),
            out.display()
        );
        let cores = share_cores(parallel);
        let next = AtomicUsize::new(0);
        let failed = AtomicBool::new(false);
        let run_next = || -> Result<()> {
            while !failed.load(Ordering::SeqCst) {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(spec) = distinct.get(i) else { return Ok(()) };
                let result = run_one(&out, spec, &format!("[{}/{total}]", i + 1), cores);
                if result.is_err() {
                    failed.store(true, Ordering::SeqCst);
                }
                result?;
            }
            Ok(())
        };
        let results: Vec<Result<()>> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..parallel).map(|_| scope.spawn(run_next)).collect();
            workers.into_iter().map(|w| w.join().unwrap_or_else(|_| Err(anyhow!("a run panicked")))).collect()
        });
        results.into_iter().collect::<Result<Vec<()>>>()?;
        println!("all {total} runs finished in {:.0} s", started.elapsed().as_secs_f64());
    }
    let mut results = Vec::with_capacity(runs.len());
    for (spec, dir) in runs.into_iter().zip(dirs) {
        match crate::plots::read_records(&dir) {
            Ok(records) => results.push(RunResult { spec, records, ceilings: crate::plots::read_ceilings(&dir) }),
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
