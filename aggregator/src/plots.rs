//! PNG plots of a job's rounds: loss, accuracies and gradient norm.

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use crate::metrics::{mean, RoundRecord};

const DARK_GREEN: RGBColor = RGBColor(0, 140, 60);

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans-subset.ttf");

fn ensure_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if register_font("sans-serif", FontStyle::Normal, FONT).is_err() {
            tracing::warn!("could not register the plot font; plot text may be missing");
        }
    });
}

/// One line on a chart.
pub(crate) struct Series {
    pub(crate) label: String,
    pub(crate) points: Vec<(f64, f64)>,
    pub(crate) color: RGBColor,
    /// Thin, faint and left out of the legend (per-device lines, ± std bounds).
    pub(crate) thin: bool,
}

/// Distinct colours for series, in order.
pub(crate) const PALETTE: [RGBColor; 8] = [
    RGBColor(214, 39, 40),
    RGBColor(31, 119, 180),
    DARK_GREEN,
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
    RGBColor(140, 86, 75),
    RGBColor(0, 0, 0),
];

/// An x tick label: integers only when every x is one (rounds, ranks), else up to two
/// decimals without trailing zeros.
fn tick(x: f64, integer_x: bool) -> String {
    if integer_x {
        return if (x - x.round()).abs() < 1e-6 { format!("{}", x.round()) } else { String::new() };
    }
    let s = format!("{x:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

pub(crate) fn line_chart(path: &Path, title: &str, x_desc: &str, y_label: &str, series: &[Series]) -> Result<()> {
    ensure_font();
    let all: Vec<(f64, f64)> = series.iter().flat_map(|s| s.points.iter().copied()).collect();
    if all.is_empty() {
        return Ok(());
    }
    let all: Vec<(f64, f64)> = all.into_iter().filter(|p| p.0.is_finite() && p.1.is_finite()).collect();
    if all.is_empty() {
        return Ok(());
    }
    let (x_min, x_max, y_min, y_max) =
        all.iter().fold((f64::INFINITY, f64::NEG_INFINITY, f64::INFINITY, f64::NEG_INFINITY), |(a, b, lo, hi), p| {
            (a.min(p.0), b.max(p.0), lo.min(p.1), hi.max(p.1))
        });
    let pad = ((y_max - y_min) * 0.08).max(1e-3);
    let integer_x = all.iter().all(|p| p.0.fract() == 0.0);
    let root = BitMapBackend::new(path, (900, 540)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| anyhow!("plotting {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(x_min - 0.5..x_max + 0.5, (y_min - pad)..(y_max + pad))
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .x_label_formatter(&|x| tick(*x, integer_x))
        .light_line_style(WHITE)
        .y_desc(y_label)
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .draw()
        .map_err(|e| err(&e))?;
    for s in series {
        let style = if s.thin { s.color.mix(0.45).stroke_width(1) } else { s.color.stroke_width(3) };
        let drawn = chart.draw_series(LineSeries::new(s.points.clone(), style)).map_err(|e| err(&e))?;
        if !s.thin {
            let color = s.color;
            drawn
                .label(s.label.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3)));
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// Writes `loss.png`, `accuracy.png` and `grad_norm.png` into `out`.
pub(crate) fn write_plots(out: &Path, method: &str, records: &[RoundRecord]) -> Result<()> {
    let training: Vec<&RoundRecord> = records.iter().filter(|r| !r.evaluation).collect();
    let points = |f: &dyn Fn(&RoundRecord) -> Option<f64>| -> Vec<(f64, f64)> {
        training.iter().filter_map(|r| Some((r.round as f64, f(r)?))).collect()
    };
    line_chart(
        &out.join("loss.png"),
        &format!("{method}: training DPO loss"),
        "round",
        "loss",
        &[Series { label: "train loss".into(), points: points(&|r| Some(r.train_loss)), color: RED, thin: false }],
    )?;
    let mut acc = vec![
        Series {
            label: "train reward acc (mean)".into(),
            points: points(&|r| (!r.reward_acc.is_empty()).then(|| mean(&r.reward_acc))),
            color: BLUE,
            thin: false,
        },
        Series {
            label: "held-out reward acc (mean)".into(),
            points: points(&|r| (!r.heldout_acc.is_empty()).then(|| mean(&r.heldout_acc))),
            color: DARK_GREEN,
            thin: false,
        },
    ];
    let devices: std::collections::BTreeSet<&String> = training.iter().flat_map(|r| r.heldout_acc.keys()).collect();
    for d in devices {
        acc.push(Series {
            label: d.clone(),
            points: points(&|r| r.heldout_acc.get(d).copied()),
            color: DARK_GREEN,
            thin: true,
        });
    }
    line_chart(
        &out.join("accuracy.png"),
        &format!("{method}: reward accuracy (thin: each device, held-out)"),
        "round",
        "accuracy",
        &acc,
    )?;
    line_chart(
        &out.join("grad_norm.png"),
        &format!("{method}: global gradient norm"),
        "round",
        "‖g‖",
        &[Series { label: "grad norm".into(), points: points(&|r| Some(r.grad_norm)), color: MAGENTA, thin: false }],
    )
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
