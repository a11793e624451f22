//! How fedpo's two binaries log and report failure, so that `fedpo-device` and
//! `fedpo-aggregator` read the same on a terminal, in a file and in the journal.
//!
//! - Logs go to stderr; stdout stays for what a command produces (tables, JSON).
//! - `RUST_LOG` replaces the command's default level, as usual for `tracing`. rumqttc's
//!   routine chatter stays at warnings unless `RUST_LOG` names it.
//! - Colour only on a terminal, and never with `NO_COLOR` set (<https://no-color.org>):
//!   a redirected log or the journal gets plain text.
//! - A failure prints its chain of causes on one line, without a backtrace: a user's bad
//!   input is not a bug in fedpo, whatever `RUST_BACKTRACE` says (it is for panics).
//!   `RUST_LIB_BACKTRACE=1`, the variable that asks for errors' backtraces alone, adds it.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber. `default` is the filter when `RUST_LOG` is unset or
/// empty, e.g. `"info"` or `"warn"`.
pub fn init(default: &str) {
    let from_env = std::env::var("RUST_LOG").ok().filter(|v| !v.trim().is_empty());
    let filter = EnvFilter::try_new(directives(from_env.as_deref(), default))
        .unwrap_or_else(|_| EnvFilter::new(directives(None, default)));
    // Errors here mean a subscriber is already installed (a test harness): keep it.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour(std::io::stderr().is_terminal(), std::env::var_os("NO_COLOR").as_deref()))
        .try_init();
}

/// The filter directives: the user's `RUST_LOG` or the default, with the MQTT client's
/// routine chatter turned down unless the user named it.
fn directives(rust_log: Option<&str>, default: &str) -> String {
    let base = rust_log.unwrap_or(default);
    let mut out = base.to_string();
    for (target, level) in [("rumqttc", "warn")] {
        if !base.contains(target) {
            out.push_str(&format!(",{target}={level}"));
        }
    }
    out
}

/// Whether to colour the log: only on a terminal, and not when `NO_COLOR` is set to
/// anything but the empty string.
fn colour(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

/// Prints `error: <the chain of causes>` to stderr and exits with status 1; with
/// `RUST_LIB_BACKTRACE` set (and not `0`), the causes one per line and the backtrace.
pub fn exit_with(error: &anyhow::Error) -> ! {
    if std::env::var_os("RUST_LIB_BACKTRACE").is_some_and(|v| v != "0") {
        eprintln!("error: {error:?}");
    } else {
        eprintln!("error: {error:#}");
    }
    std::process::exit(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mqtt_client_logs_warnings_only_unless_rust_log_names_it() {
        assert_eq!(directives(None, "info"), "info,rumqttc=warn");
        assert_eq!(directives(Some("debug"), "info"), "debug,rumqttc=warn");
        assert_eq!(directives(Some("rumqttc=trace"), "info"), "rumqttc=trace");
    }

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour(true, None));
        assert!(!colour(false, None), "a redirected log is plain text");
        assert!(!colour(true, Some("1".as_ref())), "NO_COLOR turns colour off");
        assert!(colour(true, Some("".as_ref())), "an empty NO_COLOR does not (no-color.org)");
    }
}
