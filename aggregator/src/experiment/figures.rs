//! The experiment's PNG figures, per study: each metric per round (mean line, shaded band
//! of ± one standard deviation over seeds, one colour and marker per grid cell), held-out
//! accuracy per device for pFedDPO cells, and final accuracy against a numeric grid axis,
//! each accuracy beside its Bayes ceiling where the personas have one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Result;
use plotters::style::RGBColor;

use super::report::{group, mean_std, per_round, RunResult};
use crate::chart::{style_of, Chart, Reference, Series};
use crate::metrics::{mean, RoundRecord};
use crate::plots::{exact_grad_norm, pseudo_grad_norm};

const GREY: RGBColor = RGBColor(90, 90, 90);
const BAND_NOTE: &str = "lines: mean over seeds; shading: ± one std";

struct Metric {
    file: &'static str,
    title: &'static str,
    y_label: &'static str,
    value: fn(&RoundRecord) -> Option<f64>,
    /// Draw the cells' Bayes ceilings, and end with the closing evaluation's value.
    ceiling: bool,
}

const METRICS: [Metric; 5] = [
    Metric {
        file: "loss",
        title: "training DPO loss",
        y_label: "DPO loss (mean over devices)",
        value: |r| Some(r.train_loss),
        ceiling: false,
    },
    Metric {
        file: "grad_norm",
        title: "global gradient norm ‖∇F(θ)‖ (measured rounds)",
        y_label: "exact gradient norm",
        value: exact_grad_norm,
        ceiling: false,
    },
    Metric {
        file: "pseudo_grad_norm",
        title: "pseudo-gradient norm ‖mean Δ‖ / (lr·E)",
        y_label: "pseudo-gradient norm",
        value: pseudo_grad_norm,
        ceiling: false,
    },
    Metric {
        file: "heldout",
        title: "held-out reward accuracy",
        y_label: "held-out accuracy (fraction of pairs, mean over devices)",
        // Round 1 starts from the reference itself, where every accuracy is 0 by definition.
        value: |r| (r.round > 1 && !r.heldout_acc.is_empty()).then(|| mean(&r.heldout_acc)),
        // The closing evaluation is the last point: the final model's accuracy.
        ceiling: true,
    },
    Metric {
        file: "kappa2",
        title: "gradient diversity κ² (measured rounds)",
        y_label: "κ² = mean ‖∇F_i − ∇F‖²",
        value: |r| r.kappa2,
        ceiling: false,
    },
];

/// A grid value in plain words: `method=pfeddpo` → `pFedDPO`, `rank=8` → `rank 8`.
pub(crate) fn plain(axis: &str, value: &str) -> String {
    let name = match value {
        "pfeddpo" => "pFedDPO",
        "feddpo" => "FedDPO",
        "centralized" => "centralized DPO",
        "shared-lora" => "shared LoRA",
        "none" => "no client term",
        "fedprox" => "FedProx",
        "scaffold" => "SCAFFOLD",
        "fedga" => "FedGA",
        "hvp" => "FedGA, HVP gradient",
        "displacement" => "FedGA, displacement gradient",
        other => other,
    };
    match axis {
        "method" | "client-term" | "fedga-mode" => name.to_string(),
        "rank" => format!("rank {value}"),
        "per-round" => format!("S = {value}"),
        "heterogeneity" => format!("heterogeneity {value}"),
        other => format!("{other} {value}"),
    }
}

/// An axis name in plain words, for an x axis.
fn plain_axis(axis: &str) -> &str {
    match axis {
        "rank" => "LoRA rank r",
        "per-round" => "devices per round S",
        "heterogeneity" => "heterogeneity (0: shared persona, 1: conflicting)",
        other => other,
    }
}

/// A cell's label in plain words.
pub(crate) fn plain_cell(run: &RunResult) -> String {
    if run.spec.cell.is_empty() {
        return run.spec.study.clone();
    }
    run.spec.cell.iter().map(|(k, v)| plain(k, v)).collect::<Vec<_>>().join(", ")
}

/// The cells' Bayes ceilings as reference lines, one per distinct value.
fn ceiling_lines(cells: &[(String, Vec<&RunResult>)]) -> Vec<Reference> {
    let mut lines: Vec<Reference> = Vec::new();
    let values: Vec<(String, f64)> = cells
        .iter()
        .filter_map(|(label, members)| {
            let ceilings: Vec<f64> = members.iter().filter_map(|r| r.ceiling()).collect();
            (!ceilings.is_empty()).then(|| (label.clone(), mean_std(&ceilings).0))
        })
        .collect();
    let mut distinct: Vec<f64> = values.iter().map(|v| (v.1 * 1000.0).round() / 1000.0).collect();
    distinct.sort_by(f64::total_cmp);
    distinct.dedup();
    for (k, value) in distinct.iter().enumerate() {
        let holders: Vec<&str> =
            values.iter().filter(|v| ((v.1 * 1000.0).round() / 1000.0) == *value).map(|v| v.0.as_str()).collect();
        let label = if distinct.len() == 1 {
            format!("Bayes ceiling {value:.3}")
        } else {
            let heterogeneity = holders.first().and_then(|h| h.split(", ").find(|p| p.starts_with("heterogeneity")));
            format!("Bayes ceiling {value:.3}{}", heterogeneity.map(|h| format!(" ({h})")).unwrap_or_default())
        };
        let shade = 40 + (k as u8).saturating_mul(50).min(150);
        lines.push(Reference { label, y: *value, color: if k == 0 { GREY } else { RGBColor(shade, shade, shade) } });
    }
    lines
}

/// Writes every figure under `dir`; returns their paths.
pub(crate) fn write_figures(dir: &Path, runs: &[RunResult]) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut written = Vec::new();
    let groups = group(runs);
    let mut studies: Vec<&String> = groups.iter().map(|(s, _, _)| s).collect();
    studies.dedup();
    for study in studies {
        let cells: Vec<(String, Vec<&RunResult>)> = groups
            .iter()
            .filter(|(s, _, _)| s == study)
            .map(|(_, _, members)| (plain_cell(members[0]), members.clone()))
            .collect();
        for metric in &METRICS {
            let series: Vec<Series> = cells
                .iter()
                .enumerate()
                .map(|(k, (label, members))| {
                    Series::new(k, label.clone(), per_round(members, &metric.value, metric.ceiling))
                })
                .filter(|s| !s.points.is_empty())
                .collect();
            if series.is_empty() {
                continue;
            }
            let chart = Chart {
                title: format!("{study}: {}", metric.title),
                x_label: "round".into(),
                y_label: metric.y_label.into(),
                series,
                references: if metric.ceiling { ceiling_lines(&cells) } else { vec![] },
                note: Some(BAND_NOTE.into()),
            };
            let path = dir.join(format!("{study}-{}.png", metric.file));
            if chart.write(&path)? {
                written.push(path);
            }
        }
        for (label, members) in &cells {
            if members[0].spec.setting("method") != "pfeddpo" {
                continue;
            }
            let devices: std::collections::BTreeSet<String> =
                members.iter().flat_map(|r| r.records.iter().flat_map(|x| x.heldout_acc.keys().cloned())).collect();
            let mut references = Vec::new();
            let series: Vec<Series> = devices
                .iter()
                .enumerate()
                .map(|(k, d)| {
                    let ceilings: Vec<f64> = members.iter().filter_map(|r| r.ceilings.get(d).copied()).collect();
                    if !ceilings.is_empty() {
                        let (color, _) = style_of(k);
                        let c = mean_std(&ceilings).0;
                        references.push(Reference { label: format!("{d}'s Bayes ceiling {c:.3}"), y: c, color });
                    }
                    let acc = |r: &RoundRecord| r.heldout_acc.get(d).copied().filter(|_| r.round > 1);
                    Series::new(k, d.clone(), per_round(members, &acc, true))
                })
                .collect();
            let chart = Chart {
                title: format!("{study}, {label}: held-out accuracy per device"),
                x_label: "round".into(),
                y_label: "held-out accuracy (fraction of pairs)".into(),
                series,
                references,
                note: Some("each device has its own persona; dashed: its ceiling".into()),
            };
            let path = dir.join(format!("{study}-devices-{}.png", members[0].spec.dir_name()));
            if chart.write(&path)? {
                written.push(path);
            }
        }
        if let Some(path) = final_against_axis(dir, study, &cells)? {
            written.push(path);
        }
    }
    Ok(written)
}

/// Final held-out accuracy against the study's last numeric grid axis with two values or
/// more (rank, participation S, heterogeneity), one line per value of the other axes, and
/// the Bayes ceiling along the same axis.
fn final_against_axis(dir: &Path, study: &str, cells: &[(String, Vec<&RunResult>)]) -> Result<Option<PathBuf>> {
    let spec = &cells[0].1[0].spec;
    let numeric = |axis: &str| {
        let values: std::collections::BTreeSet<String> = cells.iter().map(|c| c.1[0].spec.setting(axis)).collect();
        values.len() > 1 && values.iter().all(|v| v.parse::<f64>().is_ok())
    };
    let Some(axis) = spec.cell.iter().map(|(k, _)| k.as_str()).rfind(|a| numeric(a)) else {
        return Ok(None);
    };
    let mut lines: BTreeMap<String, Vec<(f64, f64, f64)>> = BTreeMap::new();
    let mut ceilings: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
    for (_, members) in cells {
        let s = &members[0].spec;
        let rest: Vec<String> = s.cell.iter().filter(|(k, _)| k != axis).map(|(k, v)| plain(k, v)).collect();
        let x: f64 = s.setting(axis).parse().unwrap_or(f64::NAN);
        let finals: Vec<f64> = members.iter().filter_map(|r| r.final_heldout()).collect();
        let (m, sd) = mean_std(&finals);
        let key = if rest.is_empty() { study.to_string() } else { rest.join(", ") };
        lines.entry(key).or_default().push((x, m, sd));
        ceilings.entry(x.to_bits()).or_default().extend(members.iter().filter_map(|r| r.ceiling()));
    }
    let mut series: Vec<Series> = lines
        .into_iter()
        .enumerate()
        .map(|(k, (label, mut points))| {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            Series::new(k, label, points)
        })
        .collect();
    let mut ceiling: Vec<(f64, f64)> =
        ceilings.into_iter().filter(|(_, v)| !v.is_empty()).map(|(x, v)| (f64::from_bits(x), mean_std(&v).0)).collect();
    ceiling.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut references = Vec::new();
    match ceiling.as_slice() {
        [] => {}
        [(_, y)] => references.push(Reference { label: format!("Bayes ceiling {y:.3}"), y: *y, color: GREY }),
        _ if ceiling.windows(2).all(|w| (w[0].1 - w[1].1).abs() < 5e-4) => {
            let y = ceiling[0].1;
            references.push(Reference { label: format!("Bayes ceiling {y:.3}"), y, color: GREY });
        }
        _ => {
            let mut line = Series::plain(series.len(), "Bayes ceiling", ceiling);
            line.color = GREY;
            series.push(line);
        }
    }
    let chart = Chart {
        title: format!("{study}: final held-out accuracy by {}", plain_axis(axis)),
        x_label: plain_axis(axis).into(),
        y_label: "final held-out accuracy (fraction of pairs)".into(),
        series,
        references,
        note: Some(BAND_NOTE.into()),
    };
    let path = dir.join(format!("{study}-final.png"));
    Ok(chart.write(&path)?.then_some(path))
}
