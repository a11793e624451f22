//! What an experiment measured: per-round CSVs, and each grid cell summarised over its
//! seeds as mean ± standard deviation.
//!
//! Only measured quantities go into the CSVs (no wall times), printed to six decimals, so
//! two runs of the same file with the same seeds give the same bytes.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::Result;

use super::config::RunSpec;
use crate::metrics::{mean, RoundRecord};

/// One finished run.
pub(crate) struct RunResult {
    pub(crate) spec: RunSpec,
    pub(crate) records: Vec<RoundRecord>,
    /// Each device's held-out Bayes ceiling (drawn personas), else empty.
    pub(crate) ceilings: BTreeMap<String, f64>,
}

impl RunResult {
    fn training(&self) -> impl Iterator<Item = &RoundRecord> {
        self.records.iter().filter(|r| !r.evaluation)
    }

    /// The closing evaluation round, or the last training round without one.
    fn final_record(&self) -> Option<&RoundRecord> {
        self.records.iter().rev().find(|r| r.evaluation).or_else(|| self.training().last())
    }

    /// The run's Bayes ceiling: the mean of its devices' (a centralized run holds all
    /// their held-out pairs, in equal shares).
    pub(crate) fn ceiling(&self) -> Option<f64> {
        (!self.ceilings.is_empty()).then(|| mean(&self.ceilings))
    }

    pub(crate) fn final_heldout(&self) -> Option<f64> {
        self.final_record().filter(|r| !r.heldout_acc.is_empty()).map(|r| mean(&r.heldout_acc))
    }

    fn final_train(&self) -> Option<f64> {
        self.final_record().filter(|r| !r.reward_acc.is_empty()).map(|r| mean(&r.reward_acc))
    }

    /// Relative fall of κ² from the first training round to the mean of the last quarter
    /// of them (at least one round): κ² swings from round to round, so one last value
    /// would say more about the final round than about the trend.
    fn kappa2_drop(&self) -> Option<f64> {
        let values: Vec<f64> = self.training().filter_map(|r| r.kappa2).collect();
        let first = *values.first()?;
        let tail = values.len().div_ceil(4);
        let late = values[values.len() - tail..].iter().sum::<f64>() / tail as f64;
        (first > 0.0).then(|| 1.0 - late / first)
    }
}

/// Mean and sample standard deviation (0 for a single value).
pub(crate) fn mean_std(values: &[f64]) -> (f64, f64) {
    if values.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let n = values.len() as f64;
    let m = values.iter().sum::<f64>() / n;
    if values.len() < 2 {
        return (m, 0.0);
    }
    (m, (values.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (n - 1.0)).sqrt())
}

fn num(v: Option<f64>) -> String {
    v.map_or(String::new(), |v| format!("{v:.6}"))
}

fn axes(runs: &[RunResult]) -> Vec<String> {
    let mut axes: Vec<String> = runs.iter().flat_map(|r| r.spec.cell.iter().map(|(k, _)| k.clone())).collect();
    axes.sort();
    axes.dedup();
    axes
}

/// `results.csv`: one row per run and round. `devices.csv`: one row per run, round and
/// device.
pub(crate) fn write_csvs(out: &Path, runs: &[RunResult]) -> Result<()> {
    let axes = axes(runs);
    let mut rounds = format!(
        "study,label,{}seed,round,evaluation,train_loss,grad_norm,kappa2,train_acc,heldout_acc,bytes_up\n",
        axes.iter().map(|a| format!("{a},")).collect::<String>()
    );
    let mut devices = String::from("study,label,seed,round,device,train_acc,heldout_acc\n");
    for run in runs {
        let label = run.spec.label();
        let cells: String = axes.iter().map(|a| format!("{},", run.spec.setting(a))).collect();
        for r in &run.records {
            let train = (!r.reward_acc.is_empty()).then(|| mean(&r.reward_acc));
            let held = (!r.heldout_acc.is_empty()).then(|| mean(&r.heldout_acc));
            writeln!(
                rounds,
                "{},\"{label}\",{cells}{},{},{},{},{},{},{},{},{}",
                run.spec.study,
                run.spec.seed,
                r.round,
                r.evaluation,
                num(Some(r.train_loss)),
                num(Some(r.grad_norm)),
                num(r.kappa2),
                num(train),
                num(held),
                r.bytes_up
            )?;
            for (device, acc) in &r.reward_acc {
                let h = r.heldout_acc.get(device).copied();
                writeln!(
                    devices,
                    "{},\"{label}\",{},{},{device},{},{}",
                    run.spec.study,
                    run.spec.seed,
                    r.round,
                    num(Some(*acc)),
                    num(h)
                )?;
            }
        }
    }
    fedpo_process::files::write_atomic(&out.join("results.csv"), rounds.as_bytes())?;
    fedpo_process::files::write_atomic(&out.join("devices.csv"), devices.as_bytes())?;
    Ok(())
}

/// One grid cell over its seeds.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct CellSummary {
    pub(crate) study: String,
    pub(crate) label: String,
    pub(crate) seeds: usize,
    pub(crate) heldout: (f64, f64),
    pub(crate) train: (f64, f64),
    pub(crate) loss: (f64, f64),
    pub(crate) grad_norm: (f64, f64),
    pub(crate) kappa2_drop: Option<(f64, f64)>,
    /// Mean ± std over seeds of the runs' Bayes ceilings.
    pub(crate) ceiling: Option<(f64, f64)>,
}

/// Runs grouped by study and cell, in file order.
pub(crate) fn group(runs: &[RunResult]) -> Vec<(String, String, Vec<&RunResult>)> {
    let mut groups: Vec<(String, String, Vec<&RunResult>)> = Vec::new();
    for run in runs {
        let (study, label) = (run.spec.study.clone(), run.spec.label());
        match groups.iter_mut().find(|(s, l, _)| *s == study && *l == label) {
            Some((_, _, members)) => members.push(run),
            None => groups.push((study, label, vec![run])),
        }
    }
    groups
}

pub(crate) fn summarize(runs: &[RunResult]) -> Vec<CellSummary> {
    group(runs)
        .into_iter()
        .map(|(study, label, members)| {
            let collect =
                |f: &dyn Fn(&RunResult) -> Option<f64>| members.iter().filter_map(|r| f(r)).collect::<Vec<_>>();
            let last = |f: fn(&RoundRecord) -> f64| move |r: &RunResult| r.training().last().map(f);
            let drops = collect(&|r| r.kappa2_drop());
            let ceilings = collect(&|r| r.ceiling());
            CellSummary {
                study,
                label,
                seeds: members.len(),
                heldout: mean_std(&collect(&|r| r.final_heldout())),
                train: mean_std(&collect(&|r| r.final_train())),
                loss: mean_std(&collect(&last(|r| r.train_loss))),
                grad_norm: mean_std(&collect(&last(|r| r.grad_norm))),
                kappa2_drop: (!drops.is_empty()).then(|| mean_std(&drops)),
                ceiling: (!ceilings.is_empty()).then(|| mean_std(&ceilings)),
            }
        })
        .collect()
}

/// `summary.csv` and `summary.md` (a Markdown table, mean ± std over seeds).
pub(crate) fn write_summary(out: &Path, cells: &[CellSummary]) -> Result<String> {
    let mut csv = String::from(
        "study,label,seeds,heldout_mean,heldout_std,train_mean,train_std,loss_mean,loss_std,grad_norm_mean,grad_norm_std,kappa2_drop_mean,kappa2_drop_std,ceiling_mean,ceiling_std\n",
    );
    let mut md = String::from(
        "| study | run | seeds | held-out acc | Bayes ceiling² | train acc | final loss | grad norm | κ² fall¹ |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    let pm = |(m, s): (f64, f64), digits: usize| format!("{m:.digits$} ± {s:.digits$}");
    for c in cells {
        let (km, ks) = c.kappa2_drop.map_or((None, None), |(m, s)| (Some(m), Some(s)));
        writeln!(
            csv,
            "{},\"{}\",{},{},{},{},{},{},{},{},{},{},{},{},{}",
            c.study,
            c.label,
            c.seeds,
            num(Some(c.heldout.0)),
            num(Some(c.heldout.1)),
            num(Some(c.train.0)),
            num(Some(c.train.1)),
            num(Some(c.loss.0)),
            num(Some(c.loss.1)),
            num(Some(c.grad_norm.0)),
            num(Some(c.grad_norm.1)),
            num(km),
            num(ks),
            num(c.ceiling.map(|c| c.0)),
            num(c.ceiling.map(|c| c.1))
        )?;
        let ceiling = c.ceiling.map_or("–".to_string(), |c| pm(c, 3));
        let drop = c.kappa2_drop.map_or("–".to_string(), |(m, s)| format!("{:.0} ± {:.0} %", 100.0 * m, 100.0 * s));
        writeln!(
            md,
            "| {} | {} | {} | {} | {ceiling} | {} | {} | {} | {drop} |",
            c.study,
            c.label,
            c.seeds,
            pm(c.heldout, 3),
            pm(c.train, 3),
            pm(c.loss, 3),
            pm(c.grad_norm, 3)
        )?;
    }
    md.push_str(
        "\n¹ 1 − (mean κ² over the last quarter of the measured rounds) / (κ² of round 1); – with one participant.\n",
    );
    md.push_str("² The held-out accuracy of each device's true utility, mean over devices (drawn personas only).\n");
    fedpo_process::files::write_atomic(&out.join("summary.csv"), csv.as_bytes())?;
    fedpo_process::files::write_atomic(&out.join("summary.md"), md.as_bytes())?;
    Ok(md)
}

/// Per round, mean ± std over a cell's seeds of `f`.
/// With `evaluation`, the closing evaluation round is the last point.
pub(crate) fn per_round(
    members: &[&RunResult],
    f: &dyn Fn(&RoundRecord) -> Option<f64>,
    evaluation: bool,
) -> Vec<(f64, f64, f64)> {
    let mut by_round: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
    for run in members {
        for r in run.records.iter().filter(|r| evaluation || !r.evaluation) {
            if let Some(v) = f(r) {
                by_round.entry(r.round).or_default().push(v);
            }
        }
    }
    by_round
        .into_iter()
        .map(|(round, values)| {
            let (m, s) = mean_std(&values);
            (round as f64, m, s)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_std_uses_the_sample_deviation() {
        let (m, s) = mean_std(&[1.0, 2.0, 3.0, 4.0]);
        assert!((m - 2.5).abs() < 1e-12 && (s - (5.0f64 / 3.0).sqrt()).abs() < 1e-12);
        assert_eq!(mean_std(&[7.0]), (7.0, 0.0));
    }
}
