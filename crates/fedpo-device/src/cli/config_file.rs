//! `--config FILE`: a TOML file whose keys are a subcommand's long flags, so that a board's
//! settings live in `/etc/fedpo/device.toml` while the command line can still override any
//! of them (cross/device.toml is an example).
//!
//! The file is turned into flags placed before the command line's own, leaving out every
//! flag the command line gives itself: the command line wins.

use std::ffi::OsString;
use std::path::Path;

use anyhow::{bail, Context, Result};

/// Expands `--config FILE` (or `--config=FILE`) after the subcommand into flags.
pub(crate) fn expand(args: Vec<OsString>) -> Result<Vec<OsString>> {
    let Some(at) = args.iter().position(|a| a == "--config" || a.to_string_lossy().starts_with("--config=")) else {
        return Ok(args);
    };
    let (path, consumed) = match args[at].to_string_lossy().strip_prefix("--config=") {
        Some(p) => (OsString::from(p), 1),
        None => match args.get(at + 1) {
            Some(p) => (p.clone(), 2),
            None => bail!("--config needs a file"),
        },
    };
    // Flags from the file go right after the subcommand (args[0] is the program, args[1]
    // the subcommand), ahead of everything the user typed.
    if at < 2 {
        bail!("--config goes after the subcommand, e.g. `fedpo-device run --config device.toml`");
    }
    let typed: Vec<OsString> = args[2..at].iter().chain(&args[at + consumed..]).cloned().collect();
    let given = |flag: &str| {
        typed.iter().any(|a| {
            let a = a.to_string_lossy();
            a == flag || a.strip_prefix(flag).is_some_and(|rest| rest.starts_with('='))
        })
    };
    let mut out: Vec<OsString> = args[..2].to_vec();
    for (flag, value) in flags_from_file(Path::new(&path))? {
        if !given(&flag) {
            out.push(flag.into());
            out.extend(value.map(OsString::from));
        }
    }
    out.extend(typed);
    Ok(out)
}

/// `(--flag, value)` for each key; booleans are bare flags, `false` is left out.
fn flags_from_file(path: &Path) -> Result<Vec<(String, Option<String>)>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading --config {}", path.display()))?;
    let table: toml::Table = text.parse().with_context(|| format!("--config {} is not valid TOML", path.display()))?;
    let mut flags = Vec::new();
    for (key, value) in table {
        if key == "config" {
            bail!("{}: `config` cannot name another file", path.display());
        }
        let flag = format!("--{key}");
        match value {
            toml::Value::String(s) => flags.push((flag, Some(s))),
            toml::Value::Integer(i) => flags.push((flag, Some(i.to_string()))),
            toml::Value::Float(f) => flags.push((flag, Some(f.to_string()))),
            toml::Value::Boolean(true) => flags.push((flag, None)),
            toml::Value::Boolean(false) => {}
            other => bail!(
                "{}: `{key}` is a {}; a flag's value must be a string, number or boolean",
                path.display(),
                other.type_str()
            ),
        }
    }
    Ok(flags)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn command_line_flags_override_the_file_and_false_booleans_are_left_out() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("device.toml");
        std::fs::write(&file, "id = \"pi-7\"\nmax-memory = 3000\nskip-bad = true\nsynthetic = false\n").unwrap();
        let args =
            os(&["fedpo-device", "run", "--config", file.to_str().unwrap(), "--id", "pi-8", "--max-memory=2000"]);
        let expanded = expand(args).unwrap();
        assert_eq!(expanded, os(&["fedpo-device", "run", "--skip-bad", "--id", "pi-8", "--max-memory=2000"]));
    }

    /// cross/device.toml is what boards are flashed with: a key that is no `run` flag, or
    /// a value that does not parse, would stop the service at boot.
    #[test]
    fn the_example_board_config_in_cross_parses_as_run_flags() {
        use clap::Parser;
        let file = concat!(env!("CARGO_MANIFEST_DIR"), "/../../cross/device.toml");
        let args = expand(os(&["fedpo-device", "run", "--config", file])).unwrap();
        let cli = crate::Cli::try_parse_from(args).unwrap_or_else(|e| panic!("{file}: {e}"));
        let crate::Command::Run(run) = cli.command else { panic!("{file} did not parse as `run`") };
        let run = format!("{run:?}");
        assert!(run.contains("max_memory: Some(3000)") && run.contains("id: \"pi-7\""), "{run}");
    }

    #[test]
    fn a_table_value_or_a_missing_file_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("bad.toml");
        std::fs::write(&file, "[tls]\nca = \"x\"\n").unwrap();
        let err = expand(os(&["fedpo-device", "run", &format!("--config={}", file.display())])).unwrap_err();
        assert!(err.to_string().contains("bad.toml") && err.to_string().contains("`tls`"), "{err}");
        let missing = expand(os(&["fedpo-device", "run", "--config", "/nonexistent/device.toml"])).unwrap_err();
        assert!(format!("{missing:#}").contains("/nonexistent/device.toml"), "{missing:#}");
    }
}
