//! `fedpo-aggregator`: see the library's [`fedpo_aggregator::run_cli`].

use fedpo_process::logging;

fn main() {
    // In-process devices train here too (simulate, experiment).
    fedpo_process::threads::park_idle_candle_workers_quickly();
    let args: Vec<_> = std::env::args_os().collect();
    logging::init(fedpo_aggregator::default_log_level(&args));
    if let Err(e) = fedpo_aggregator::run_cli(args) {
        // clap's own errors (and --help) print themselves in their usual form.
        if let Some(clap_err) = e.downcast_ref::<clap::Error>() {
            clap_err.exit();
        }
        logging::exit_with(&e);
    }
}
