//! Line charts a reader takes in at a glance: mean lines with shaded ± std bands, a
//! distinct colour and marker per line (so a line drawn over another still shows),
//! dashed reference lines (a Bayes ceiling), and the legend beside the data, not on it.

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans-subset.ttf");

fn ensure_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if register_font("sans-serif", FontStyle::Normal, FONT).is_err() {
            tracing::warn!("could not register the plot font; plot text may be missing");
        }
    });
}

/// Distinct colours, in order (a colour-blind-safe set first, then more).
pub(crate) const PALETTE: [RGBColor; 10] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(120, 120, 120),
];

/// Marker shapes, in order, paired with the palette by index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Marker {
    Circle,
    Triangle,
    Square,
    Cross,
    Ring,
    Diamond,
}

const MARKERS: [Marker; 6] =
    [Marker::Circle, Marker::Triangle, Marker::Square, Marker::Cross, Marker::Ring, Marker::Diamond];

/// The colour and marker of the `k`-th line of a chart.
pub(crate) fn style_of(k: usize) -> (RGBColor, Marker) {
    (PALETTE[k % PALETTE.len()], MARKERS[k % MARKERS.len()])
}

/// One line: the mean, and its ± std band where `std > 0`.
pub(crate) struct Series {
    pub(crate) label: String,
    /// (x, mean, std) in x order.
    pub(crate) points: Vec<(f64, f64, f64)>,
    pub(crate) color: RGBColor,
    pub(crate) marker: Marker,
}

impl Series {
    /// The `k`-th line of a chart, in its colour and marker.
    pub(crate) fn new(k: usize, label: impl Into<String>, points: Vec<(f64, f64, f64)>) -> Self {
        let (color, marker) = style_of(k);
        Self { label: label.into(), points, color, marker }
    }

    /// A line without a band.
    pub(crate) fn plain(k: usize, label: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self::new(k, label, points.into_iter().map(|(x, y)| (x, y, 0.0)).collect())
    }
}

/// A dashed horizontal line across the chart, e.g. a Bayes ceiling.
pub(crate) struct Reference {
    pub(crate) label: String,
    pub(crate) y: f64,
    pub(crate) color: RGBColor,
}

/// A chart: title, plain-word axis labels, lines and references.
pub(crate) struct Chart {
    pub(crate) title: String,
    pub(crate) x_label: String,
    pub(crate) y_label: String,
    pub(crate) series: Vec<Series>,
    pub(crate) references: Vec<Reference>,
    /// A line under the legend explaining the bands, when any is drawn.
    pub(crate) note: Option<String>,
}

const SIZE: (u32, u32) = (1180, 560);
const LEGEND_WIDTH: u32 = 330;

/// An x tick label: integers only when every x is one (rounds, ranks), else up to two
/// decimals without trailing zeros.
fn tick(x: f64, integer_x: bool) -> String {
    if integer_x {
        return if (x - x.round()).abs() < 1e-6 { format!("{}", x.round()) } else { String::new() };
    }
    let s = format!("{:.2}", x + 0.0); // + 0.0 turns −0 into 0
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn marker_at<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    at: (i32, i32),
    marker: Marker,
    color: RGBColor,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let (x, y) = at;
    let (fill, line) = (color.filled(), color.stroke_width(2));
    match marker {
        Marker::Circle => area.draw(&Circle::new(at, 4, fill)),
        Marker::Ring => area.draw(&Circle::new(at, 4, line)),
        Marker::Triangle => area.draw(&Polygon::new(vec![(x, y - 5), (x - 5, y + 4), (x + 5, y + 4)], fill)),
        Marker::Square => area.draw(&Rectangle::new([(x - 4, y - 4), (x + 4, y + 4)], fill)),
        Marker::Diamond => area.draw(&Polygon::new(vec![(x, y - 5), (x + 5, y), (x, y + 5), (x - 5, y)], fill)),
        Marker::Cross => {
            area.draw(&PathElement::new(vec![(x - 4, y - 4), (x + 4, y + 4)], line))?;
            area.draw(&PathElement::new(vec![(x - 4, y + 4), (x + 4, y - 4)], line))
        }
    }
}

impl Chart {
    /// Writes the chart as a PNG. A chart with nothing finite to draw writes nothing.
    pub(crate) fn write(&self, path: &Path) -> Result<bool> {
        ensure_font();
        let finite = |p: &&(f64, f64, f64)| p.0.is_finite() && p.1.is_finite();
        let points: Vec<(f64, f64, f64)> =
            self.series.iter().flat_map(|s| s.points.iter().filter(finite).copied()).collect();
        if points.is_empty() {
            return Ok(false);
        }
        let (mut x_min, mut x_max, mut y_min, mut y_max) =
            (f64::INFINITY, f64::NEG_INFINITY, f64::INFINITY, f64::NEG_INFINITY);
        for &(x, y, sd) in &points {
            let sd = if sd.is_finite() { sd } else { 0.0 };
            (x_min, x_max, y_min, y_max) = (x_min.min(x), x_max.max(x), y_min.min(y - sd), y_max.max(y + sd));
        }
        for r in self.references.iter().filter(|r| r.y.is_finite()) {
            (y_min, y_max) = (y_min.min(r.y), y_max.max(r.y));
        }
        let pad = ((y_max - y_min) * 0.06).max(1e-3);
        let integer_x = points.iter().all(|p| p.0.fract() == 0.0);
        let x_pad = if integer_x { 0.5 } else { ((x_max - x_min) * 0.04).max(1e-3) };
        let err = |e: &dyn std::fmt::Display| anyhow!("plotting {}: {e}", path.display());

        let root = BitMapBackend::new(path, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let (plot_area, legend_area) = root.split_horizontally(SIZE.0 - LEGEND_WIDTH);
        let mut chart = ChartBuilder::on(&plot_area)
            .caption(&self.title, ("sans-serif", 22))
            .margin(14)
            .x_label_area_size(46)
            .y_label_area_size(70)
            .build_cartesian_2d(x_min - x_pad..x_max + x_pad, (y_min - pad)..(y_max + pad))
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc(&self.x_label)
            .x_label_formatter(&|x| tick(*x, integer_x))
            .light_line_style(WHITE)
            .y_desc(&self.y_label)
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 16))
            .draw()
            .map_err(|e| err(&e))?;
        for s in &self.series {
            let band: Vec<&(f64, f64, f64)> = s.points.iter().filter(finite).filter(|p| p.2 > 0.0).collect();
            if band.len() >= 2 {
                let upper = band.iter().map(|p| (p.0, p.1 + p.2));
                let lower = band.iter().rev().map(|p| (p.0, p.1 - p.2));
                let polygon: Vec<(f64, f64)> = upper.chain(lower).collect();
                chart
                    .draw_series(std::iter::once(Polygon::new(polygon, s.color.mix(0.14).filled())))
                    .map_err(|e| err(&e))?;
            }
        }
        for r in self.references.iter().filter(|r| r.y.is_finite()) {
            let line = [(x_min - x_pad, r.y), (x_max + x_pad, r.y)];
            chart.draw_series(DashedLineSeries::new(line, 10, 6, r.color.stroke_width(2))).map_err(|e| err(&e))?;
        }
        for (k, s) in self.series.iter().enumerate() {
            let line: Vec<(f64, f64)> = s.points.iter().filter(finite).map(|p| (p.0, p.1)).collect();
            chart.draw_series(LineSeries::new(line.clone(), s.color.stroke_width(2))).map_err(|e| err(&e))?;
            // Every point when few; otherwise about 16 per line, staggered between lines so
            // that lines drawn on top of each other still show each one's markers.
            let every = line.len().div_ceil(16).max(1);
            for (i, p) in line.iter().enumerate() {
                if (i + k) % every == 0 {
                    // backend_coord is in the whole image's pixels, which are root's.
                    marker_at(&root, chart.backend_coord(p), s.marker, s.color).map_err(|e| err(&e))?;
                }
            }
        }
        self.draw_legend(&legend_area).map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
        Ok(true)
    }

    fn draw_legend<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
    ) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
        let font = ("sans-serif", 14).into_font().color(&BLACK);
        let mut y = 60;
        for s in &self.series {
            area.draw(&PathElement::new(vec![(8, y), (44, y)], s.color.stroke_width(2)))?;
            marker_at(area, (26, y), s.marker, s.color)?;
            area.draw_text(&s.label, &font, (52, y - 8))?;
            y += 24;
        }
        for r in &self.references {
            for x in [8, 22, 36] {
                area.draw(&PathElement::new(vec![(x, y), (x + 8, y)], r.color.stroke_width(2)))?;
            }
            area.draw_text(&r.label, &font, (52, y - 8))?;
            y += 24;
        }
        if let Some(note) = &self.note {
            let small = ("sans-serif", 13).into_font().color(&RGBColor(90, 90, 90));
            area.draw_text(note, &small, (8, y + 6))?;
        }
        Ok(())
    }
}
