//! SVG charts (plotters, SVG backend): line charts with phase markers and annotations, and
//! horizontal bars. Every command that draws (`compare`, `verify`, `plan`) goes through here.

use anyhow::{anyhow, Result};
use plotters::prelude::*;

/// One named curve.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    /// Draw markers at the points (for sparse data such as a Pareto front).
    pub markers: bool,
}

/// A vertical line with a label (a phase boundary).
#[derive(Debug, Clone)]
pub struct Marker {
    pub x: f64,
    pub label: String,
}

/// A labelled point (the peak).
#[derive(Debug, Clone)]
pub struct Note {
    pub x: f64,
    pub y: f64,
    pub label: String,
}

/// Everything a line chart shows.
#[derive(Debug, Clone, Default)]
pub struct LineChart {
    pub title: String,
    pub x_desc: String,
    pub y_desc: String,
    pub series: Vec<Series>,
    pub markers: Vec<Marker>,
    pub notes: Vec<Note>,
    /// Log scale on y (drift over steps spans decades).
    pub log_y: bool,
}

const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

pub fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

fn err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("drawing the chart failed: {e}")
}

fn bounds(chart: &LineChart) -> (f64, f64, f64, f64) {
    let pts = chart.series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::INFINITY,
        f64::NEG_INFINITY,
    );
    for &(x, y) in pts {
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
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
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
pub fn line_chart(chart: &LineChart, size: (u32, u32)) -> Result<String> {
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
                for m in &chart.markers {
                    c.draw_series(LineSeries::new(
                        vec![(m.x, y0), (m.x, y1)],
                        BLACK.mix(0.25).stroke_width(1),
                    ))
                    .map_err(err)?;
                    c.draw_series(std::iter::once(Text::new(
                        m.label.clone(),
                        (m.x, y1),
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
                    c.draw_series(LineSeries::new(pts.clone(), col.stroke_width(2)))
                        .map_err(err)?
                        .label(s.name.clone())
                        .legend(move |(x, y)| {
                            PathElement::new(vec![(x, y), (x + 18, y)], col.stroke_width(2))
                        });
                    if s.markers {
                        c.draw_series(pts.iter().map(|&p| Circle::new(p, 3, col.filled())))
                            .map_err(err)?;
                    }
                }
                for n in &chart.notes {
                    c.draw_series(std::iter::once(Circle::new((n.x, n.y), 4, BLACK.filled())))
                        .map_err(err)?;
                    c.draw_series(std::iter::once(Text::new(
                        n.label.clone(),
                        (n.x, n.y),
                        ("sans-serif", 13).into_font(),
                    )))
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

/// Render labelled horizontal bars (e.g. bytes by category at the peak) to an SVG string.
/// Each row may carry several bars (e.g. predicted and measured), drawn side by side.
pub fn bar_chart(
    title: &str,
    x_desc: &str,
    rows: &[(String, Vec<f64>)],
    legend: &[&str],
    size: (u32, u32),
) -> Result<String> {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, size).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let n = rows.len().max(1);
        let k = rows.iter().map(|r| r.1.len()).max().unwrap_or(1).max(1);
        let xmax = rows
            .iter()
            .flat_map(|r| r.1.iter().copied())
            .fold(0.0f64, f64::max)
            .max(1e-9)
            * 1.1;
        let mut c = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(130)
            .build_cartesian_2d(0.0..xmax, -0.5..n as f64 - 0.5)
            .map_err(err)?;
        let labels: Vec<String> = rows.iter().map(|r| r.0.clone()).collect();
        c.configure_mesh()
            .x_desc(x_desc)
            .y_labels(n)
            .y_label_formatter(&|y| {
                // Row i is centred on y = n − 1 − i; ticks between rows stay blank.
                let r = y.round();
                let i = n as f64 - 1.0 - r;
                if (y - r).abs() < 1e-6 && i >= 0.0 && (i as usize) < labels.len() {
                    labels[i as usize].clone()
                } else {
                    String::new()
                }
            })
            .light_line_style(WHITE.mix(0.0))
            .draw()
            .map_err(err)?;
        let h = 0.8 / k as f64;
        for j in 0..k {
            let col = color(j);
            let bars = rows.iter().enumerate().filter_map(|(i, r)| {
                r.1.get(j).map(|&v| {
                    let top = n as f64 - 1.0 - i as f64 + 0.4 - j as f64 * h;
                    Rectangle::new([(0.0, top - h), (v, top)], col.filled())
                })
            });
            let s = c.draw_series(bars).map_err(err)?;
            if let Some(name) = legend.get(j) {
                s.label(name.to_string()).legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 12, y + 5)], col.filled())
                });
            }
        }
        if !legend.is_empty() {
            c.configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK.mix(0.3))
                .position(SeriesLabelPosition::LowerRight)
                .draw()
                .map_err(err)?;
        }
        root.present().map_err(err)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_chart_has_series_and_labels() {
        let chart = LineChart {
            title: "live bytes".into(),
            x_desc: "event".into(),
            y_desc: "MiB".into(),
            series: vec![Series {
                name: "predicted".into(),
                points: vec![(0.0, 1.0), (1.0, 3.0), (2.0, 2.0)],
                markers: false,
            }],
            markers: vec![Marker {
                x: 1.0,
                label: "backward".into(),
            }],
            notes: vec![Note {
                x: 1.0,
                y: 3.0,
                label: "peak".into(),
            }],
            log_y: false,
        };
        let svg = line_chart(&chart, (600, 400)).unwrap();
        assert!(svg.starts_with("<svg"));
        assert!(svg.contains("predicted"));
        assert!(svg.contains("backward"));
        assert!(svg.contains("peak"));
    }

    #[test]
    fn log_chart_ignores_non_positive() {
        let chart = LineChart {
            series: vec![Series {
                name: "drift".into(),
                points: vec![(0.0, 0.0), (1.0, 1e-6), (2.0, 1e-4)],
                markers: true,
            }],
            log_y: true,
            ..LineChart::default()
        };
        assert!(line_chart(&chart, (400, 300)).unwrap().contains("drift"));
    }

    #[test]
    fn bars_render() {
        let rows = vec![
            ("activations".to_string(), vec![10.0, 12.0]),
            ("weights".to_string(), vec![3.0, 3.0]),
        ];
        let svg = bar_chart(
            "at the peak",
            "MiB",
            &rows,
            &["predicted", "measured"],
            (500, 300),
        )
        .unwrap();
        assert!(svg.contains("activations") && svg.contains("measured"));
    }
}
