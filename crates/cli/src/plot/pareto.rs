//! The planner's memory-vs-time Pareto front ([`pareto_chart`]).

use super::canvas::{
    around, axes, heading, legend, polyline, shorten, Anchor, Canvas, Label, Rect, Scale, Swatch,
    SIZE,
};
use super::timeline::{Rule, BLUE, GREEN, RED};

/// One point of a Pareto chart.
#[derive(Debug, Clone)]
pub(crate) struct FrontPoint {
    pub x: f64,
    pub y: f64,
    pub label: String,
    pub fits: bool,
}

/// The Pareto front of `plan --plot`: peak against step time, each point named by its change,
/// the usable and budget lines, the base and the plan marked.
#[derive(Debug, Clone, Default)]
pub(crate) struct ParetoChart {
    pub title: String,
    pub subtitles: Vec<String>,
    pub x_desc: String,
    pub y_desc: String,
    pub front: Vec<FrontPoint>,
    pub rules: Vec<Rule>,
    /// Marked points (base, plan), labelled before the front's.
    pub marks: Vec<(f64, f64, String)>,
}

/// The order in which points of a front get their labels: both ends, then the middle of the
/// widest gap between labelled ones, and so on.
pub(crate) fn spread_order(n: usize) -> Vec<usize> {
    if n == 0 {
        return Vec::new();
    }
    let mut out = vec![0];
    if n > 1 {
        out.push(n - 1);
    }
    let mut gaps = vec![(0usize, n - 1)];
    while let Some(k) = (0..gaps.len()).max_by_key(|&k| (gaps[k].1 - gaps[k].0, usize::MAX - k)) {
        let (a, b) = gaps.remove(k);
        if b - a < 2 {
            if gaps.iter().all(|(a, b)| b - a < 2) {
                break;
            }
            continue;
        }
        let m = (a + b) / 2;
        out.push(m);
        gaps.push((a, m));
        gaps.push((m, b));
    }
    out
}

/// Render a Pareto chart as a [`SIZE`] SVG: the legend, the axes, the rules, the front and
/// the marks drawn, then their labels (rules, marks, the front's points in [`spread_order`]).
pub(crate) fn pareto_chart(p: &ParetoChart) -> String {
    let (w, h) = SIZE;
    let mut c = Canvas::new(w, h);
    let top = heading(&mut c, &p.title, &p.subtitles);
    let items = vec![
        (Swatch::Line(BLUE), "Pareto front".to_string()),
        (Swatch::Dot(GREEN), "fits the usable memory".to_string()),
        (Swatch::Dot(RED), "does not fit".to_string()),
        (Swatch::Ring, "base and plan".to_string()),
    ];
    let ly = legend(&mut c, 12.0, top + 20.0, w - 12.0, &items);
    let area = Rect::new(76.0, ly + 30.0, w - 20.0, h - 46.0);
    let (xs, ys) = scales(p, &area);
    axes(&mut c, &area, &xs, &ys, &p.x_desc, &p.y_desc);
    let inner = area.grow(-2.0);
    let pts: Vec<(f64, f64)> = p.front.iter().map(|f| (xs.at(f.x), ys.at(f.y))).collect();
    for r in &p.rules {
        let x = xs.at(r.at);
        c.raw(&format!(
            "<line x1=\"{x:.1}\" y1=\"{:.1}\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"{}\" stroke-width=\"1.5\" stroke-dasharray=\"6 3\"/>",
            area.y0, area.y1, r.color
        ));
        c.data_points(&[(x, area.y0), (x, area.y1)]);
    }
    polyline(&mut c, &pts, BLUE, 1.5);
    c.data_points(&pts);
    for (f, &(x, y)) in p.front.iter().zip(&pts) {
        let col = if f.fits { GREEN } else { RED };
        c.raw(&format!(
            "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"4.5\" fill=\"{col}\"/>"
        ));
        c.occupy(Rect::new(x - 5.0, y - 5.0, x + 5.0, y + 5.0));
    }
    let mpts: Vec<(f64, f64)> = p.marks.iter().map(|m| (xs.at(m.0), ys.at(m.1))).collect();
    for &(x, y) in &mpts {
        c.raw(&format!(
            "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"7\" fill=\"none\" stroke=\"black\" stroke-width=\"2\"/>"
        ));
        c.occupy(Rect::new(x - 8.0, y - 8.0, x + 8.0, y + 8.0));
    }
    rule_labels(&mut c, p, &xs, &area);
    for (m, &(x, y)) in p.marks.iter().zip(&mpts) {
        let label = shorten(&m.2, 12.0, inner.x1 - inner.x0);
        c.place(
            x,
            y,
            &around(10.0, 12.0),
            &inner,
            Label::new(&label, 12.0, "font-weight=\"bold\" fill=\"#111\""),
        );
    }
    point_labels(&mut c, p, &pts, &area);
    c.finish()
}

/// The peak and time scales over `area`: every point, mark and rule inside, with a margin.
fn scales(p: &ParetoChart, area: &Rect) -> (Scale, Scale) {
    let xsv = p
        .front
        .iter()
        .map(|f| f.x)
        .chain(p.marks.iter().map(|m| m.0))
        .chain(p.rules.iter().map(|r| r.at));
    let ysv: Vec<f64> = p
        .front
        .iter()
        .map(|f| f.y)
        .chain(p.marks.iter().map(|m| m.1))
        .filter(|v| v.is_finite())
        .collect();
    let (mut x0, mut x1) = (f64::INFINITY, f64::NEG_INFINITY);
    for x in xsv.filter(|v| v.is_finite()) {
        x0 = x0.min(x);
        x1 = x1.max(x);
    }
    let (mut y0, mut y1) = ysv
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    if !x0.is_finite() {
        (x0, x1) = (0.0, 1.0);
    }
    if !y0.is_finite() {
        (y0, y1) = (0.0, 1.0);
    }
    let (dx, dy) = (
        (x1 - x0).max(x1.abs() * 0.05).max(1e-9),
        (y1 - y0).max(y1.abs() * 0.05).max(1e-9),
    );
    let xs = Scale {
        d0: (x0 - 0.06 * dx).max(0.0),
        d1: x1 + 0.06 * dx,
        p0: area.x0,
        p1: area.x1,
    };
    let ys = Scale {
        d0: (y0 - 0.15 * dy).max(0.0),
        d1: y1 + 0.15 * dy,
        p0: area.y1,
        p1: area.y0,
    };
    (xs, ys)
}

/// Rule labels along the top of the plot area, beside their line.
fn rule_labels(c: &mut Canvas, p: &ParetoChart, xs: &Scale, area: &Rect) {
    let inner = area.grow(-2.0);
    for r in &p.rules {
        let x = xs.at(r.at);
        let mut cands = Vec::new();
        for k in 0..6 {
            let y = 14.0 + 14.0 * k as f64;
            cands.push((4.0, y, Anchor::Start));
            cands.push((-4.0, y, Anchor::End));
        }
        c.place(
            x,
            area.y0,
            &cands,
            &inner,
            Label::new(&r.label, 11.0, &format!("fill=\"{}\"", r.color)),
        );
    }
}

/// The front's labels in [`spread_order`] where there is room; a note counts those left
/// unnamed.
fn point_labels(c: &mut Canvas, p: &ParetoChart, pts: &[(f64, f64)], area: &Rect) {
    let inner = area.grow(-2.0);
    let mut unlabelled = 0;
    for i in spread_order(p.front.len()) {
        let (x, y) = pts[i];
        let label = shorten(&p.front[i].label, 11.0, 300.0);
        if label.is_empty() {
            continue;
        }
        let placed = c.place(
            x,
            y,
            &around(7.0, 11.0),
            &inner,
            Label::new(&label, 11.0, "fill=\"#333\""),
        );
        if placed.is_none() {
            unlabelled += 1;
        }
    }
    if unlabelled > 0 {
        let note = format!(
            "{unlabelled} of {} points left unnamed (no free room; `ditmem plan` lists them all)",
            p.front.len()
        );
        let note = shorten(&note, 11.0, inner.x1 - inner.x0 - 8.0);
        let y = area.y1 - 6.0;
        c.place(
            inner.x1,
            y,
            &[(-4.0, 0.0, Anchor::End), (-4.0, -16.0, Anchor::End)],
            &inner,
            Label::new(&note, 11.0, "fill=\"#666\""),
        );
    }
}
