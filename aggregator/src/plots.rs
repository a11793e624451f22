//! PNG plots of a job's rounds: loss, accuracies and gradient norm.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Result;

use crate::chart::{Chart, Reference, Series};
use crate::metrics::{mean, RoundRecord};

/// The exact global gradient norm where the round measured --diagnostics.
pub(crate) fn exact_grad_norm(r: &RoundRecord) -> Option<f64> {
    r.diagnostics_bytes.map(|_| r.grad_norm)
}

/// The pseudo-gradient norm ‖mean Δ‖ / (lr · E) (records from before it was kept
/// separately hold it in `grad_norm` when they did not measure --diagnostics).
pub(crate) fn pseudo_grad_norm(r: &RoundRecord) -> Option<f64> {
    r.pseudo_grad_norm.or_else(|| r.diagnostics_bytes.is_none().then_some(r.grad_norm))
}

/// Each device's held-out Bayes ceiling (`ceilings.json`, written for drawn personas).
pub(crate) fn read_ceilings(out: &Path) -> BTreeMap<String, f64> {
    std::fs::read(out.join("ceilings.json"))
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        .unwrap_or_default()
}

/// Writes `loss.png`, `accuracy.png` and `grad_norm.png` into `out`.
pub(crate) fn write_plots(out: &Path, method: &str, records: &[RoundRecord]) -> Result<()> {
    let training: Vec<&RoundRecord> = records.iter().filter(|r| !r.evaluation).collect();
    let points = |f: &dyn Fn(&RoundRecord) -> Option<f64>| -> Vec<(f64, f64)> {
        training.iter().filter_map(|r| Some((r.round as f64, f(r)?))).collect()
    };
    let chart = |title: String, y_label: &str, series: Vec<Series>, references: Vec<Reference>| Chart {
        title,
        x_label: "round".into(),
        y_label: y_label.into(),
        series,
        references,
        note: None,
    };
    chart(
        format!("{method}: training DPO loss"),
        "DPO loss (mean over devices)",
        vec![Series::plain(0, "training loss", points(&|r| Some(r.train_loss)))],
        vec![],
    )
    .write(&out.join("loss.png"))?;
    let mut acc = vec![
        Series::plain(0, "training pairs (mean)", points(&|r| (!r.reward_acc.is_empty()).then(|| mean(&r.reward_acc)))),
        Series::plain(
            1,
            "held-out pairs (mean)",
            points(&|r| (!r.heldout_acc.is_empty()).then(|| mean(&r.heldout_acc))),
        ),
    ];
    let devices: std::collections::BTreeSet<&String> = training.iter().flat_map(|r| r.heldout_acc.keys()).collect();
    for (k, d) in devices.into_iter().enumerate() {
        acc.push(Series::plain(k + 2, format!("{d}, held-out"), points(&|r| r.heldout_acc.get(d).copied())));
    }
    let ceilings = read_ceilings(out);
    let references = if ceilings.is_empty() {
        vec![]
    } else {
        vec![Reference {
            label: "Bayes ceiling (mean over devices)".into(),
            y: mean(&ceilings),
            color: plotters::style::RGBColor(90, 90, 90),
        }]
    };
    chart(format!("{method}: reward accuracy"), "reward accuracy (fraction of pairs)", acc, references)
        .write(&out.join("accuracy.png"))?;
    let exact = points(&exact_grad_norm);
    let mut norms = Vec::new();
    if !exact.is_empty() {
        norms.push(Series::plain(0, "exact ‖∇F(θ)‖ (--diagnostics)", exact));
    }
    norms.push(Series::plain(1, "pseudo-gradient ‖mean Δ‖ / (lr·E)", points(&pseudo_grad_norm)));
    chart(format!("{method}: global gradient norm"), "gradient norm", norms, vec![])
        .write(&out.join("grad_norm.png"))?;
    Ok(())
}

/// Reads `metrics.jsonl` back (all rounds, across resumes).
pub(crate) fn read_records(out: &Path) -> Result<Vec<RoundRecord>> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl"))?;
    text.lines().filter(|l| !l.trim().is_empty()).map(|l| Ok(serde_json::from_str(l)?)).collect()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn plots_are_written_as_png_files_with_content() {
        let dir = tempfile::tempdir().unwrap();
        let records: Vec<RoundRecord> = (1..=6)
            .map(|r| RoundRecord {
                round: r,
                method: "pfeddpo".into(),
                train_loss: 0.7 / r as f64,
                reward_acc: BTreeMap::from([("dev-0".into(), 0.5 + r as f64 * 0.05)]),
                heldout_acc: BTreeMap::from([("dev-0".into(), 0.4 + r as f64 * 0.05), ("dev-1".into(), 0.6)]),
                grad_norm: 1.0 / r as f64,
                ..RoundRecord::default()
            })
            .collect();
        write_plots(dir.path(), "pfeddpo", &records).unwrap();
        for name in ["loss.png", "accuracy.png", "grad_norm.png"] {
            let bytes = std::fs::read(dir.path().join(name)).unwrap();
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{name} is a PNG");
            assert!(bytes.len() > 10_000, "{name} has {} bytes: axes, text and lines", bytes.len());
        }
    }
}
