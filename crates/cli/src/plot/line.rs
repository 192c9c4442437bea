//! Line charts with phase markers and annotations, and horizontal stacked bars, on plotters'
//! SVG backend ([`line_chart`], [`stacked_bar`]).

use anyhow::{anyhow, Result};
use plotters::prelude::*;

/// One named curve.
#[derive(Debug, Clone)]
pub(crate) struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    /// Draw markers at the points (for sparse data such as a Pareto front).
    pub markers: bool,
    /// Join the points with a line (false: markers only, e.g. which points fit).
    pub line: bool,
}

/// A vertical line with a label (a phase boundary).
#[derive(Debug, Clone)]
pub(crate) struct Marker {
    pub x: f64,
    pub label: String,
}

/// A labelled point (the peak).
#[derive(Debug, Clone)]
pub(crate) struct Note {
    pub x: f64,
    pub y: f64,
    pub label: String,
}

/// Everything a line chart shows.
#[derive(Debug, Clone, Default)]
pub(crate) struct LineChart {
    pub title: String,
    pub x_desc: String,
    pub y_desc: String,
    pub series: Vec<Series>,
    pub markers: Vec<Marker>,
    pub notes: Vec<Note>,
    /// Log scale on y (drift over steps spans decades).
    pub log_y: bool,
}

pub(super) const PALETTE: [RGBColor; 11] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(0, 0, 0),
];

pub(crate) fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

pub(super) fn err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("drawing the chart failed: {e}")
}

pub(super) fn bounds(chart: &LineChart) -> (f64, f64, f64, f64) {
    // Every point, note and marker is inside the frame (a base far off the front included).
    let notes = chart.notes.iter().map(|n| (n.x, n.y));
    let pts: Vec<(f64, f64)> = chart
        .series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .chain(notes)
        .collect();
    let marker_x: Vec<f64> = chart.markers.iter().map(|m| m.x).collect();
    let (mut x0, mut x1, mut y0, mut y1) = (
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::INFINITY,
        f64::NEG_INFINITY,
    );
    for &(x, y) in &pts {
        if x.is_finite() && y.is_finite() && (!chart.log_y || y > 0.0) {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y0 = y0.min(y);
            y1 = y1.max(y);
        }
    }
    if !x0.is_finite() {
        return (0.0, 1.0, if chart.log_y { 1e-12 } else { 0.0 }, 1.0);
    }
    for &x in marker_x.iter().filter(|x| x.is_finite()) {
        x0 = x0.min(x);
        x1 = x1.max(x);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    // Room for the labels at the right end.
    x1 += (x1 - x0) * 0.06;
    if chart.log_y {
        if y1 <= y0 {
            y1 = y0 * 10.0;
        }
        (x0, x1, y0 / 2.0, y1 * 2.0)
    } else {
        let y0 = y0.min(0.0);
        if y1 <= y0 {
            y1 = y0 + 1.0;
        }
        (x0, x1, y0, y1 * 1.08)
    }
}

/// Render a line chart to an SVG string.
pub(crate) fn line_chart(chart: &LineChart, size: (u32, u32)) -> Result<String> {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, size).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let (x0, x1, y0, y1) = bounds(chart);
        let mut builder = ChartBuilder::on(&root);
        builder
            .caption(&chart.title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(70);
        macro_rules! draw {
            ($ctx:expr) => {{
                let mut c = $ctx;
                c.configure_mesh()
                    .x_desc(chart.x_desc.as_str())
                    .y_desc(chart.y_desc.as_str())
                    .light_line_style(WHITE.mix(0.0))
                    .draw()
                    .map_err(err)?;
                for (k, m) in chart.markers.iter().enumerate() {
                    c.draw_series(LineSeries::new(
                        vec![(m.x, y0), (m.x, y1)],
                        BLACK.mix(0.25).stroke_width(1),
                    ))
                    .map_err(err)?;
                    // Labels of neighbouring lines on alternate rows, beside their line.
                    let row = if chart.log_y {
                        y1 / (1.0 + 0.25 * k as f64)
                    } else {
                        y1 - (y1 - y0) * 0.035 * (k % 3) as f64
                    };
                    c.draw_series(std::iter::once(Text::new(
                        format!(" {}", m.label),
                        (m.x, row),
                        ("sans-serif", 12).into_font().color(&BLACK.mix(0.6)),
                    )))
                    .map_err(err)?;
                }
                for (i, s) in chart.series.iter().enumerate() {
                    let col = color(i);
                    let pts: Vec<(f64, f64)> = s
                        .points
                        .iter()
                        .copied()
                        .filter(|&(x, y)| {
                            x.is_finite() && y.is_finite() && (!chart.log_y || y > 0.0)
                        })
                        .collect();
                    if s.line {
                        c.draw_series(LineSeries::new(pts.clone(), col.stroke_width(2)))
                            .map_err(err)?
                            .label(s.name.clone())
                            .legend(move |(x, y)| {
                                PathElement::new(vec![(x, y), (x + 18, y)], col.stroke_width(2))
                            });
                    }
                    if s.markers {
                        let dots = c
                            .draw_series(pts.iter().map(|&p| Circle::new(p, 4, col.filled())))
                            .map_err(err)?;
                        if !s.line {
                            dots.label(s.name.clone())
                                .legend(move |(x, y)| Circle::new((x + 9, y), 4, col.filled()));
                        }
                    }
                }
                for n in &chart.notes {
                    // The label beside its dot, up and to the right (pixel offsets).
                    c.draw_series(std::iter::once(
                        EmptyElement::at((n.x, n.y))
                            + Circle::new((0, 0), 4, BLACK.filled())
                            + Text::new(n.label.clone(), (7, -16), ("sans-serif", 13).into_font()),
                    ))
                    .map_err(err)?;
                }
                c.configure_series_labels()
                    .background_style(WHITE.mix(0.85))
                    .border_style(BLACK.mix(0.3))
                    .position(SeriesLabelPosition::LowerRight)
                    .draw()
                    .map_err(err)?;
            }};
        }
        if chart.log_y {
            draw!(builder
                .build_cartesian_2d(x0..x1, (y0..y1).log_scale())
                .map_err(err)?);
        } else {
            draw!(builder.build_cartesian_2d(x0..x1, y0..y1).map_err(err)?);
        }
        root.present().map_err(err)?;
    }
    Ok(out)
}

/// One vertical bar split into stacked segments (e.g. bytes by category at the peak), with a
/// legend naming each segment and its value.
pub(crate) fn stacked_bar(
    title: &str,
    y_desc: &str,
    segments: &[(String, f64)],
    size: (u32, u32),
) -> Result<String> {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, size).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let total: f64 = segments
            .iter()
            .map(|(_, v)| v.max(0.0))
            .sum::<f64>()
            .max(1e-9);
        let mut c = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(10)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..1.0, 0.0..total * 1.05)
            .map_err(err)?;
        c.configure_mesh()
            .y_desc(y_desc)
            .disable_x_mesh()
            .disable_x_axis()
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(err)?;
        let mut bottom = 0.0;
        for (i, (name, v)) in segments.iter().enumerate() {
            let v = v.max(0.0);
            let col = color(i);
            let share = 100.0 * v / total;
            c.draw_series(std::iter::once(Rectangle::new(
                [(0.04, bottom), (0.3, bottom + v)],
                col.filled(),
            )))
            .map_err(err)?
            .label(format!("{name}: {v:.1} ({share:.1} %)"))
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], col.filled()));
            bottom += v;
        }
        c.configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(err)?;
        root.present().map_err(err)?;
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Charts drawn by hand (no plotters): every text is placed, not just drawn. The timeline
// (`estimate --plot`, `compare --plot`) and the Pareto front (`plan --plot`) go through here.
