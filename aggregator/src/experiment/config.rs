//! An experiment file: shared settings, seeds, and studies that each sweep a grid.
//!
//! ```toml
//! name = "smoke"
//! seeds = [0, 1]
//!
//! [defaults]            # `simulate` flags for every run
//! devices = 3
//! rounds = 2
//! freeze-embeddings = true
//!
//! [[study]]
//! name = "rank"
//! fixed = { method = "pfeddpo" }
//! grid = { rank = [2, 4, 8, 16] }
//! ```
//!
//! Every key is a `simulate` flag without its dashes; `true` passes a switch, `false`
//! leaves it off. A run is defaults ∪ the study's `fixed` ∪ one grid cell, with `--seed`
//! from `seeds`.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Deserialize;

/// Flags the runner sets itself.
const RESERVED: [&str; 3] = ["out", "resume", "seed"];

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ExperimentFile {
    pub(crate) name: String,
    #[serde(default = "default_seeds")]
    pub(crate) seeds: Vec<u64>,
    #[serde(default)]
    pub(crate) defaults: BTreeMap<String, toml::Value>,
    pub(crate) study: Vec<Study>,
}

fn default_seeds() -> Vec<u64> {
    vec![0]
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Study {
    pub(crate) name: String,
    #[serde(default)]
    pub(crate) fixed: BTreeMap<String, toml::Value>,
    #[serde(default)]
    pub(crate) grid: BTreeMap<String, Vec<toml::Value>>,
}

/// One run of the grid.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RunSpec {
    pub(crate) study: String,
    /// The grid cell, axis by axis, e.g. `[("rank", "8")]`.
    pub(crate) cell: Vec<(String, String)>,
    pub(crate) seed: u64,
    /// Every setting of the run (defaults, fixed, cell), as flag → value.
    pub(crate) settings: BTreeMap<String, toml::Value>,
}

impl RunSpec {
    /// `rank=8,method=pfeddpo`; `base` for a study without a grid.
    pub(crate) fn label(&self) -> String {
        if self.cell.is_empty() {
            return "base".into();
        }
        self.cell.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
    }

    /// A directory name for the label.
    pub(crate) fn dir_name(&self) -> String {
        self.label().chars().map(|c| if c.is_ascii_alphanumeric() || "-_=.".contains(c) { c } else { '_' }).collect()
    }

    /// A setting as text (`""` if unset).
    pub(crate) fn setting(&self, key: &str) -> String {
        self.settings.get(key).map(value_text).unwrap_or_default()
    }

    /// The `simulate` command line for this run, writing into `out`.
    pub(crate) fn args(&self, out: &Path, resume: bool) -> Vec<String> {
        let mut args = vec!["fedpo-aggregator".to_string(), "simulate".to_string()];
        for (key, value) in &self.settings {
            match value {
                toml::Value::Boolean(true) => args.push(format!("--{key}")),
                toml::Value::Boolean(false) => {}
                v => {
                    args.push(format!("--{key}"));
                    args.push(value_text(v));
                }
            }
        }
        args.extend(["--seed".to_string(), self.seed.to_string(), "--out".to_string()]);
        args.push(out.display().to_string());
        if resume {
            args.push("--resume".into());
        }
        args
    }
}

/// A TOML scalar as a command-line value.
pub(crate) fn value_text(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn check_settings(where_: &str, settings: &BTreeMap<String, toml::Value>) -> Result<()> {
    for (key, value) in settings {
        if RESERVED.contains(&key.as_str()) {
            bail!("{where_}: `{key}` is set by the runner (seeds come from `seeds`, the output from --out)");
        }
        if matches!(value, toml::Value::Array(_) | toml::Value::Table(_) | toml::Value::Datetime(_)) {
            bail!("{where_}: `{key}` must be a string, number or boolean");
        }
    }
    Ok(())
}

impl ExperimentFile {
    pub(crate) fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let file: Self =
            toml::from_str(&text).with_context(|| format!("{} is not a valid experiment", path.display()))?;
        if file.seeds.is_empty() {
            bail!("{}: `seeds` is empty", path.display());
        }
        if file.study.is_empty() {
            bail!("{}: no [[study]]", path.display());
        }
        check_settings("[defaults]", &file.defaults)?;
        let mut names = std::collections::BTreeSet::new();
        for s in &file.study {
            if !names.insert(&s.name) || s.name.is_empty() || s.name.contains(['/', '\\']) {
                bail!("study name `{}` is empty, repeated or holds a path separator", s.name);
            }
            check_settings(&format!("study `{}` fixed", s.name), &s.fixed)?;
            for (axis, values) in &s.grid {
                if values.is_empty() {
                    bail!("study `{}`: grid axis `{axis}` has no values", s.name);
                }
                let as_table = values.iter().map(|v| (axis.clone(), v.clone())).collect();
                check_settings(&format!("study `{}` grid", s.name), &as_table)?;
            }
        }
        Ok(file)
    }

    /// Every run, study by study, cell by cell (grid axes in name order, values in file
    /// order), seed by seed.
    pub(crate) fn runs(&self) -> Vec<RunSpec> {
        let mut runs = Vec::new();
        for study in &self.study {
            let mut cells: Vec<Vec<(String, toml::Value)>> = vec![Vec::new()];
            for (axis, values) in &study.grid {
                cells = cells
                    .into_iter()
                    .flat_map(|cell| {
                        values.iter().map(move |v| {
                            let mut c = cell.clone();
                            c.push((axis.clone(), v.clone()));
                            c
                        })
                    })
                    .collect();
            }
            for cell in cells {
                let mut settings = self.defaults.clone();
                settings.extend(study.fixed.clone());
                settings.extend(cell.iter().cloned());
                for &seed in &self.seeds {
                    runs.push(RunSpec {
                        study: study.name.clone(),
                        cell: cell.iter().map(|(k, v)| (k.clone(), value_text(v))).collect(),
                        seed,
                        settings: settings.clone(),
                    });
                }
            }
        }
        runs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ExperimentFile> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.toml");
        std::fs::write(&path, text).unwrap();
        ExperimentFile::load(&path)
    }

    #[test]
    fn grid_expands_to_every_cell_and_seed_with_settings_layered() {
        let file = parse(
            r#"
            name = "t"
            seeds = [3, 4]
            [defaults]
            rounds = 2
            method = "feddpo"
            freeze-embeddings = true
            [[study]]
            name = "ablation"
            fixed = { method = "pfeddpo" }
            grid = { rank = [2, 8], per-round = [1, 3] }
            "#,
        )
        .unwrap();
        let runs = file.runs();
        assert_eq!(runs.len(), 2 * 2 * 2);
        assert_eq!(runs[0].label(), "per-round=1,rank=2");
        assert_eq!(runs[1].seed, 4);
        assert_eq!(runs[0].setting("method"), "pfeddpo", "fixed overrides defaults");
        let args = runs[0].args(Path::new("/o"), false);
        assert!(args.windows(2).any(|w| w == ["--rank", "2"]));
        assert!(args.contains(&"--freeze-embeddings".to_string()));
        assert_eq!(args[args.len() - 4..], ["--seed", "3", "--out", "/o"]);
    }

    #[test]
    fn reserved_keys_unknown_fields_and_empty_axes_are_refused_by_name() {
        let base = "name = \"t\"\n[[study]]\nname = \"s\"\n";
        let err = parse(&format!("{base}fixed = {{ seed = 1 }}")).unwrap_err().to_string();
        assert!(err.contains("`seed`"), "{err}");
        let err = format!("{:#}", parse(&format!("{base}grid = {{ rank = [] }}")).unwrap_err());
        assert!(err.contains("`rank`"), "{err}");
        let err = format!("{:#}", parse(&format!("{base}colour = 1")).unwrap_err());
        assert!(err.contains("colour"), "{err}");
    }
}
