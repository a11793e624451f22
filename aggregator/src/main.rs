//! `fedpo-aggregator`: see the library's [`fedpo_aggregator::run_cli`].

use tracing_subscriber::EnvFilter;

fn main() {
    // In-process devices train here too (simulate, experiment).
    fedpo_device::threads::park_idle_candle_workers_quickly();
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,rumqttd=off,rumqttc=warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = fedpo_aggregator::run_cli(std::env::args_os()) {
        // clap's own errors (and --help) print themselves in their usual form.
        if let Some(clap_err) = e.downcast_ref::<clap::Error>() {
            clap_err.exit();
        }
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
