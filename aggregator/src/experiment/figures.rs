//! The experiment's PNG figures, per study: each metric per round with mean ± std over
//! seeds (one colour per grid cell, thin lines at ± one standard deviation), per-device
//! held-out accuracy for pFedDPO cells, and final accuracy against a numeric grid axis.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Result;

use super::report::{group, mean_std, per_round, RunResult};
use crate::metrics::{mean, RoundRecord};
use crate::plots::{line_chart, Series, PALETTE};

type Metric = (&'static str, &'static str, fn(&RoundRecord) -> Option<f64>);

const METRICS: [Metric; 4] = [
    ("loss", "training DPO loss", |r| Some(r.train_loss)),
    ("grad_norm", "global gradient norm", |r| Some(r.grad_norm)),
    ("heldout", "held-out reward accuracy (mean over devices)", |r| {
        (!r.heldout_acc.is_empty()).then(|| mean(&r.heldout_acc))
    }),
    ("kappa2", "gradient diversity κ²", |r| r.kappa2),
];

/// Mean line plus thin ± std lines.
fn banded(label: &str, color: plotters::style::RGBColor, points: &[(f64, f64, f64)]) -> Vec<Series> {
    let line = |f: &dyn Fn(&(f64, f64, f64)) -> f64, thin: bool| Series {
        label: label.to_string(),
        points: points.iter().map(|p| (p.0, f(p))).collect(),
        color,
        thin,
    };
    vec![line(&|p| p.1, false), line(&|p| p.1 + p.2, true), line(&|p| p.1 - p.2, true)]
}

/// Writes every figure under `dir`; returns their paths.
pub(crate) fn write_figures(dir: &Path, runs: &[RunResult]) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut written = Vec::new();
    let groups = group(runs);
    let mut studies: Vec<&String> = groups.iter().map(|(s, _, _)| s).collect();
    studies.dedup();
    for study in studies {
        let cells: Vec<&(String, String, Vec<&RunResult>)> = groups.iter().filter(|(s, _, _)| s == study).collect();
        for (name, title, f) in METRICS {
            let mut series = Vec::new();
            for (k, (_, label, members)) in cells.iter().enumerate() {
                let points = per_round(members, &f);
                if !points.is_empty() {
                    series.extend(banded(label, PALETTE[k % PALETTE.len()], &points));
                }
            }
            if series.is_empty() {
                continue;
            }
            let path = dir.join(format!("{study}-{name}.png"));
            line_chart(&path, &format!("{study}: {title}"), "round", name, &series)?;
            written.push(path);
        }
        for (_, label, members) in &cells {
            if members[0].spec.setting("method") != "pfeddpo" {
                continue;
            }
            let devices: std::collections::BTreeSet<String> =
                members.iter().flat_map(|r| r.records.iter().flat_map(|x| x.heldout_acc.keys().cloned())).collect();
            let series: Vec<Series> = devices
                .iter()
                .enumerate()
                .flat_map(|(k, d)| {
                    let points = per_round(members, &|r: &RoundRecord| r.heldout_acc.get(d).copied());
                    banded(d, PALETTE[k % PALETTE.len()], &points)
                })
                .collect();
            let path = dir.join(format!("{study}-devices-{}.png", members[0].spec.dir_name()));
            line_chart(
                &path,
                &format!("{study}, {label}: held-out accuracy per device"),
                "round",
                "accuracy",
                &series,
            )?;
            written.push(path);
        }
        if let Some(path) = final_against_axis(dir, study, &cells)? {
            written.push(path);
        }
    }
    Ok(written)
}

/// Final held-out accuracy against the study's last numeric grid axis with two values or
/// more (rank, participation S, heterogeneity), one line per value of the other axes.
fn final_against_axis(
    dir: &Path,
    study: &str,
    cells: &[&(String, String, Vec<&RunResult>)],
) -> Result<Option<PathBuf>> {
    let spec = &cells[0].2[0].spec;
    let numeric = |axis: &str| {
        let values: std::collections::BTreeSet<String> = cells.iter().map(|c| c.2[0].spec.setting(axis)).collect();
        values.len() > 1 && values.iter().all(|v| v.parse::<f64>().is_ok())
    };
    let Some(axis) = spec.cell.iter().map(|(k, _)| k.as_str()).rfind(|a| numeric(a)) else {
        return Ok(None);
    };
    let mut lines: BTreeMap<String, Vec<(f64, f64, f64)>> = BTreeMap::new();
    for (_, _, members) in cells {
        let s = &members[0].spec;
        let rest: Vec<String> = s.cell.iter().filter(|(k, _)| k != axis).map(|(k, v)| format!("{k}={v}")).collect();
        let x: f64 = s.setting(axis).parse().unwrap_or(f64::NAN);
        let finals: Vec<f64> = members
            .iter()
            .filter_map(|r| {
                let last = r.records.iter().rev().find(|x| x.evaluation).or(r.records.last())?;
                (!last.heldout_acc.is_empty()).then(|| mean(&last.heldout_acc))
            })
            .collect();
        let (m, sd) = mean_std(&finals);
        let key = if rest.is_empty() { study.to_string() } else { rest.join(",") };
        lines.entry(key).or_default().push((x, m, sd));
    }
    let series: Vec<Series> = lines
        .iter_mut()
        .enumerate()
        .flat_map(|(k, (label, points))| {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            banded(label, PALETTE[k % PALETTE.len()], points)
        })
        .collect();
    let path = dir.join(format!("{study}-final.png"));
    line_chart(&path, &format!("{study}: final held-out accuracy by {axis}"), axis, "accuracy", &series)?;
    Ok(Some(path))
}
