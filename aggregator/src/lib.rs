//! `fedpo-aggregator`: coordinates federated DPO rounds over MQTT.
//!
//! The binary is a thin wrapper over [`run_cli`], which tests call in-process.
//!
//! ```text
//! fedpo-aggregator simulate --devices 5 --rounds 20 --method pfeddpo --out runs/demo
//! fedpo-aggregator serve --broker mqtt://broker:1883 --job lab --min-devices 10 --out runs/lab
//! fedpo-aggregator experiment experiments/smoke.toml
//! ```

mod algorithms;
mod broker_args;
mod chart;
mod checkpoint;
mod combine;
mod combined_update;
mod diagnostics;
mod downlink;
mod experiment;
mod fleet_bench;
mod global_model;
mod job_args;
mod metrics;
mod partitions;
mod plots;
mod server;
mod simulate;
mod weighted_sum;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use fedpo_transport::{LinkOptions, MqttLink};

#[derive(Parser)]
#[command(name = "fedpo-aggregator", version, about = "fedpo aggregator: federated DPO rounds over MQTT")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log more: -v for each round's progress (info), -vv for timings (debug). RUST_LOG,
    /// where set, decides instead.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
}

#[derive(Subcommand)]
enum Command {
    /// Coordinate devices through a broker: wait for registrations, run the rounds,
    /// checkpoint after each.
    Serve(ServeArgs),
    /// Simulate a fleet on this machine: embedded broker, aggregator and N devices.
    Simulate(simulate::SimulateArgs),
    /// Run a grid of simulations from a TOML file; write CSVs, a summary table and figures.
    Experiment(experiment::ExperimentArgs),
    /// Aggregation at fleet scale: a real aggregator, N synthetic devices (one MQTT
    /// connection each) sending a fixed update; rounds per second and peak memory.
    BenchFleet(fleet_bench::FleetBenchArgs),
    /// Redraw loss.png, accuracy.png and grad_norm.png from a job's metrics.jsonl.
    Plot {
        /// The job's output directory.
        out: PathBuf,
    },
}

#[derive(Debug, Args)]
struct ServeArgs {
    #[command(flatten)]
    job: job_args::JobArgs,
    #[command(flatten)]
    broker: broker_args::BrokerArgs,
    /// Output directory: metrics.jsonl, summary.json and checkpoint/.
    #[arg(long)]
    out: PathBuf,
    /// Continue from the checkpoint in --out.
    #[arg(long)]
    resume: bool,
    /// MiB of received messages that may wait to be processed before the aggregator stops
    /// reading from the broker, which then holds the rest (Mosquitto: raise
    /// max_queued_messages to a round's chunks). 0: no limit. Not used with the embedded
    /// broker, whose queues are bounded already and which disconnects a client that
    /// stops reading for long.
    #[arg(long, value_name = "MIB", default_value_t = 64)]
    inbound_budget_mib: usize,
}

fn serve(args: ServeArgs) -> Result<()> {
    args.job.validate()?;
    server::check_out_dir(&args.out, args.resume)?;
    let (url, embedded) = args.broker.resolve(false)?;
    let mut opts = LinkOptions::new(format!("fedpo-{}-aggregator", args.job.job));
    opts.tls = args.broker.tls();
    opts.inbound_budget = (args.inbound_budget_mib > 0 && embedded.is_none()).then_some(args.inbound_budget_mib << 20);
    let link = MqttLink::connect(&url, &opts)?;
    tracing::info!(broker = %url, job = %args.job.job, "aggregator connected");
    let mut server = server::Aggregator::new(link, args.job, &args.out, args.resume)?;
    if let Some(broker) = &embedded {
        broker.fit_transfer(usize::try_from(server.global().wire_bytes_bound()).unwrap_or(usize::MAX));
    }
    if let Some(logins) = args.broker.broker_logins()? {
        server.authenticate_devices(logins);
    }
    let summary = server.run()?;
    tracing::info!(digest = %server.global().digest_hex(), rounds = summary.rounds, "job finished");
    Ok(())
}

/// Checks that a command line parses and that its job settings are valid, without
/// running it.
pub(crate) fn check_command_line(args: Vec<String>) -> Result<()> {
    match Cli::try_parse_from(args)?.command {
        Command::Simulate(args) => args.job.validate(),
        Command::Serve(args) => args.job.validate(),
        _ => Ok(()),
    }
}

/// The log level a command line asks for when `RUST_LOG` is unset. A simulation or an
/// experiment prints its own per-round table, so it logs warnings only; `serve` is a
/// service whose log is its record, so it logs every round's events.
pub fn default_log_level<I, T>(args: I) -> &'static str
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let Ok(cli) = Cli::try_parse_from(args) else { return "warn" };
    let quiet = matches!(cli.command, Command::Simulate(_) | Command::Experiment(_) | Command::Plot { .. });
    match (quiet, cli.verbose) {
        (true, 0) => "warn",
        (false, 0) | (_, 1) => "info",
        (_, 2) => "debug",
        _ => "trace",
    }
}

/// Parses a `fedpo-aggregator` command line (program name first) and runs it.
pub fn run_cli<I, T>(args: I) -> Result<()>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    match Cli::try_parse_from(args)?.command {
        Command::Serve(args) => serve(args),
        // In-process devices train, and allocate and free the same large activations
        // every step: without this each step page-faults them back in (a quarter of a
        // DistilGPT-2 round's CPU went to zeroing fresh pages).
        Command::Simulate(args) => {
            fedpo_process::allocator::keep_freed_memory_in_heap();
            fedpo_process::allocator::share_one_arena();
            simulate::run(args).map(|_| ())
        }
        Command::Experiment(args) => {
            fedpo_process::allocator::keep_freed_memory_in_heap();
            fedpo_process::allocator::share_one_arena();
            experiment::run(args)
        }
        Command::BenchFleet(args) => fleet_bench::run(args),
        Command::Plot { out } => {
            let records = plots::read_records(&out)?;
            let method = records.first().map_or("fedpo".to_string(), |r| r.method.clone());
            plots::write_plots(&out, &method, &records)
        }
    }
}
