//! The step's memory over time ([`timeline_chart`]): the predicted curve, the measured one,
//! rules and spans for the phases and limits, the breakdown bar at the peak.

use super::canvas::{
    around, axes, decimate, heading, legend, polyline, shorten, text_box, Anchor, Canvas, Label,
    Rect, Scale, Swatch, ASCENT_EM, SIZE,
};

/// A horizontal line across the plot (a capacity, a budget) or a vertical one (on the Pareto
/// chart's peak axis), with its label.
#[derive(Debug, Clone)]
pub(crate) struct Rule {
    pub at: f64,
    pub label: String,
    pub color: &'static str,
}

/// One span of the step (a phase of one microbatch) on the time axis.
#[derive(Debug, Clone)]
pub(crate) struct Span {
    pub t0: f64,
    pub t1: f64,
    pub name: String,
    /// Two- or three-letter name for narrow spans.
    pub short: String,
    pub fill: &'static str,
}

/// The timeline of `estimate --plot` and `compare --plot`: live bytes over the step's time, the
/// phases as shaded spans, capacity and budget lines, the peak, and the categories at the peak
/// as a bar on the same scale.
#[derive(Debug, Clone, Default)]
pub(crate) struct TimelineChart {
    pub title: String,
    pub subtitles: Vec<String>,
    pub x_desc: String,
    pub y_desc: String,
    /// Predicted (time, value) of every event.
    pub predicted: Vec<(f64, f64)>,
    pub predicted_name: String,
    /// Measured (time, value) points, joined.
    pub measured: Option<(String, Vec<(f64, f64)>)>,
    pub spans: Vec<Span>,
    pub rules: Vec<Rule>,
    pub peak: Option<(f64, f64, String)>,
    /// Categories at the peak (name, value) — drawn bottom-up as one bar.
    pub bar: Vec<(String, f64)>,
    pub bar_title: String,
}

/// A rule more than this many times the data's top is not drawn to scale (see [`timeline_chart`]).
pub(crate) const OFF_CHART: f64 = 4.0;

pub(crate) const BLUE: &str = "#1f77b4";
pub(crate) const RED: &str = "#d62728";
pub(crate) const GREEN: &str = "#2ca02c";
pub(crate) const ORANGE: &str = "#ff7f0e";
pub(super) const BAR_COLORS: [&str; 11] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#bab0ac", "#333333",
];

/// Render a timeline chart as a [`SIZE`] SVG: the legend, the phase spans, the axes, the
/// curves, the peak, the lines (said in words when far above the data), the bar at the peak.
pub(crate) fn timeline_chart(t: &TimelineChart) -> String {
    let (w, h) = SIZE;
    let mut c = Canvas::new(w, h);
    let items = legend_items(t);
    let top = heading(&mut c, &t.title, &t.subtitles);
    let ly = legend(&mut c, 12.0, top + 20.0, w - 12.0, &items);
    let bar_w = if t.bar.is_empty() { 0.0 } else { 290.0 };
    // Phase names in a strip above the plot area, the y title above its ticks.
    let strip = ly + 22.0;
    let area = Rect::new(76.0, strip + 10.0, w - 16.0 - bar_w, h - 46.0);
    let Scales { xs, ys, on, above } = scales(t, &area);
    spans(&mut c, t, &xs, &area);
    axes(&mut c, &area, &xs, &ys, &t.x_desc, &t.y_desc);
    span_names(&mut c, t, &xs, &area, strip);
    curves(&mut c, t, &xs, &ys, &area);
    let inner = area.grow(-2.0);
    // The peak first: it is what the chart is for.
    if let Some((x, y, label)) = &t.peak {
        let (px, py) = (xs.at(*x), ys.at(*y));
        c.raw(&format!(
            "<circle cx=\"{px:.1}\" cy=\"{py:.1}\" r=\"4.5\" fill=\"black\"/>"
        ));
        c.occupy(Rect::new(px - 5.0, py - 5.0, px + 5.0, py + 5.0));
        let label = shorten(label, 12.0, inner.x1 - inner.x0);
        c.place(
            px,
            py,
            &around(8.0, 12.0),
            &inner,
            Label::new(&label, 12.0, "fill=\"#111\""),
        );
    }
    if !above.is_empty() {
        above_note(&mut c, &above, &inner);
    }
    for r in &on {
        rule(&mut c, r, &ys, &area);
    }
    if !t.bar.is_empty() {
        bar(&mut c, t, &ys, &area);
    }
    c.finish()
}

/// The legend's entries: the predicted curve, the measured points, each phase's shade once
/// (narrow spans have no room for a name).
fn legend_items(t: &TimelineChart) -> Vec<(Swatch, String)> {
    let mut items = vec![(Swatch::Line(BLUE), t.predicted_name.clone())];
    if let Some((name, _)) = &t.measured {
        items.push((Swatch::Dot(ORANGE), name.clone()));
    }
    for sp in &t.spans {
        if !items.iter().any(|(_, n)| *n == sp.name) {
            items.push((Swatch::Block(sp.fill), sp.name.clone()));
        }
    }
    items
}

/// A timeline's scales, and its rules split by whether they are drawn to them.
struct Scales<'a> {
    /// Time to x.
    xs: Scale,
    /// Bytes to y.
    ys: Scale,
    /// Rules drawn to scale.
    on: Vec<&'a Rule>,
    /// Rules more than [`OFF_CHART`] times the data's top, said in words instead.
    above: Vec<&'a Rule>,
}

/// The time and byte scales over `area` that hold the data, the spans and the rules drawn.
fn scales<'a>(t: &'a TimelineChart, area: &Rect) -> Scales<'a> {
    let (mut x0, mut x1) = (f64::INFINITY, f64::NEG_INFINITY);
    let mut ymax: f64 = 0.0;
    let all = t
        .predicted
        .iter()
        .chain(t.measured.iter().flat_map(|(_, p)| p.iter()));
    for &(x, y) in all {
        if x.is_finite() && y.is_finite() {
            x0 = x0.min(x);
            x1 = x1.max(x);
            ymax = ymax.max(y);
        }
    }
    for s in &t.spans {
        x0 = x0.min(s.t0);
        x1 = x1.max(s.t1);
    }
    // A line far above the data (an 80 GiB card under a 1 GiB step) would flatten the curve
    // to the axis: such lines are said in words at the top instead.
    let (on, above): (Vec<&Rule>, Vec<&Rule>) = t
        .rules
        .iter()
        .partition(|r| ymax <= 0.0 || r.at <= OFF_CHART * ymax);
    for r in &on {
        ymax = ymax.max(r.at);
    }
    if !x0.is_finite() || x1 <= x0 {
        (x0, x1) = (0.0, 1.0);
    }
    if ymax <= 0.0 {
        ymax = 1.0;
    }
    let xs = Scale {
        d0: x0,
        d1: x1,
        p0: area.x0,
        p1: area.x1,
    };
    let ys = Scale {
        d0: 0.0,
        d1: ymax * 1.12,
        p0: area.y1,
        p1: area.y0,
    };
    Scales { xs, ys, on, above }
}

/// The phase spans, shaded the height of the plot area.
fn spans(c: &mut Canvas, t: &TimelineChart, xs: &Scale, area: &Rect) {
    for s in &t.spans {
        let (a, b) = (xs.at(s.t0), xs.at(s.t1));
        c.raw(&format!(
            "<rect x=\"{a:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\"/>",
            area.y0,
            (b - a).max(0.0),
            area.y1 - area.y0,
            s.fill
        ));
    }
}

/// Each span's name (or its short name) in the strip above the plot, when it fits the span.
fn span_names(c: &mut Canvas, t: &TimelineChart, xs: &Scale, area: &Rect, strip: f64) {
    let strip_box = Rect::new(area.x0, strip - 14.0, area.x1, area.y0);
    for s in &t.spans {
        let (a, b) = (xs.at(s.t0), xs.at(s.t1));
        let within = Rect::new(a + 1.0, strip_box.y0, b - 1.0, strip_box.y1);
        for name in [&s.name, &s.short] {
            let bx = text_box((a + b) / 2.0, strip, 11.0, Anchor::Middle, name);
            if c.free(&bx, &within) {
                c.text(
                    (a + b) / 2.0,
                    strip,
                    11.0,
                    Anchor::Middle,
                    name,
                    "fill=\"#555\"",
                );
                break;
            }
        }
    }
}

/// The predicted curve (decimated to the plot's width) and the measured points.
fn curves(c: &mut Canvas, t: &TimelineChart, xs: &Scale, ys: &Scale, area: &Rect) {
    let px: Vec<(f64, f64)> = t
        .predicted
        .iter()
        .map(|&(x, y)| (xs.at(x), ys.at(y)))
        .collect();
    let px = decimate(&px, (area.x1 - area.x0) as usize);
    polyline(c, &px, BLUE, 2.0);
    c.data_points(&px);
    if let Some((_, m)) = &t.measured {
        let pm: Vec<(f64, f64)> = m.iter().map(|&(x, y)| (xs.at(x), ys.at(y))).collect();
        // Markers only: boundaries are sparse in places (none inside the optimizer), and a line
        // between them would draw a curve nobody measured.
        for &(x, y) in &pm {
            c.raw(&format!(
                "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"3\" fill=\"{ORANGE}\" fill-opacity=\"0.85\"/>"
            ));
        }
        c.data_points(&pm);
    }
}

/// The lines above the scale, named in one note at the plot's top.
fn above_note(c: &mut Canvas, above: &[&Rule], inner: &Rect) {
    let words: Vec<&str> = above
        .iter()
        .map(|r| r.label.split(" (").next().unwrap_or(&r.label))
        .collect();
    let note = format!("above this scale: {}", words.join("; "));
    let note = shorten(&note, 11.0, inner.x1 - inner.x0 - 8.0);
    let cands = [
        (inner.x1 - 4.0, inner.y0 + 12.0, Anchor::End),
        (inner.x1 - 4.0, inner.y0 + 28.0, Anchor::End),
        (inner.x0 + 4.0, inner.y0 + 12.0, Anchor::Start),
        (inner.x1 - 4.0, inner.y0 + 44.0, Anchor::End),
    ];
    c.place(
        0.0,
        0.0,
        &cands,
        inner,
        Label::new(&note, 11.0, "fill=\"#b22222\"").no_leader(),
    );
}

/// A rule drawn to scale: a dashed line across the plot, its label above or below it.
fn rule(c: &mut Canvas, r: &Rule, ys: &Scale, area: &Rect) {
    let inner = area.grow(-2.0);
    let y = ys.at(r.at);
    c.raw(&format!(
        "<line x1=\"{:.1}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"{}\" stroke-width=\"1.5\" stroke-dasharray=\"6 3\"/>",
        area.x0, area.x1, r.color
    ));
    let label = shorten(&r.label, 11.0, inner.x1 - inner.x0);
    let d = 4.0 + ASCENT_EM * 11.0;
    let cands = [
        (inner.x1, y - 4.0, Anchor::End),
        (inner.x1, y + d, Anchor::End),
        (inner.x0 + 4.0, y - 4.0, Anchor::Start),
        (inner.x0 + 4.0, y + d, Anchor::Start),
        ((inner.x0 + inner.x1) / 2.0, y - 4.0, Anchor::Middle),
        ((inner.x0 + inner.x1) / 2.0, y + d, Anchor::Middle),
        (inner.x1, y - 4.0 - 14.0, Anchor::End),
        (inner.x1, y + d + 14.0, Anchor::End),
    ]
    .map(|(x, yy, a)| (x, yy - y, a));
    c.place(
        0.0,
        y,
        &cands,
        &inner,
        Label::new(&label, 11.0, &format!("fill=\"{}\"", r.color)).no_leader(),
    );
}

/// The categories at the peak, one stacked bar on the timeline's scale, each named beside it.
pub(super) fn bar(c: &mut Canvas, t: &TimelineChart, ys: &Scale, area: &Rect) {
    let bx0 = area.x1 + 24.0;
    let bx1 = bx0 + 30.0;
    let total: f64 = t.bar.iter().map(|(_, v)| v.max(0.0)).sum();
    c.text(
        bx0,
        area.y0 - 8.0,
        12.0,
        Anchor::Start,
        &t.bar_title,
        "fill=\"#222\"",
    );
    let mut bottom = 0.0;
    let within = Rect::new(bx1 + 4.0, area.y0, c.w - 4.0, area.y1 + 10.0);
    let mut segs = Vec::new();
    for (i, (name, v)) in t.bar.iter().enumerate() {
        let v = v.max(0.0);
        let (ya, yb) = (ys.at(bottom), ys.at(bottom + v));
        let col = BAR_COLORS[i % BAR_COLORS.len()];
        c.raw(&format!(
            "<rect x=\"{bx0:.1}\" y=\"{yb:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{col}\" stroke=\"white\" stroke-width=\"0.5\"/>",
            bx1 - bx0,
            (ya - yb).max(0.0)
        ));
        segs.push((name, v, (ya + yb) / 2.0, col));
        bottom += v;
    }
    c.occupy(Rect::new(bx0, ys.at(bottom), bx1, ys.at(0.0)));
    // Labels in the bar's order, each as near its segment's middle as the ones below it allow
    // (a row apart), the column then shifted down if it ran out of the top; then each is
    // placed there (or near, if that is taken).
    let size = 11.0;
    let row = 15.0;
    let (top, floor) = (within.y0 + ASCENT_EM * size, area.y1 + 4.0);
    let mut ys_: Vec<f64> = Vec::new();
    for (k, s) in segs.iter().enumerate() {
        let want = (s.2 + 4.0).min(floor);
        let y = if k == 0 {
            want
        } else {
            want.min(ys_[k - 1] - row)
        };
        ys_.push(y);
    }
    if let Some(&last) = ys_.last() {
        if last < top {
            let shift = top - last;
            for y in ys_.iter_mut() {
                *y += shift;
            }
        }
    }
    let lx = bx1 + 26.0;
    for (k, (name, v, ymid, col)) in segs.into_iter().enumerate() {
        let share = if total > 0.0 { 100.0 * v / total } else { 0.0 };
        let label = format!("{name} {v:.1} ({share:.0} %)");
        let label = shorten(&label, size, within.x1 - lx);
        let mut cands = vec![(lx - bx1, ys_[k] - ymid, Anchor::Start)];
        for j in 1..20 {
            let d = j as f64 * row / 2.0;
            cands.push((lx - bx1, ys_[k] - ymid - d, Anchor::Start));
            cands.push((lx - bx1, ys_[k] - ymid + d, Anchor::Start));
        }
        let placed = c.place(
            bx1,
            ymid,
            &cands,
            &within,
            Label::new(&label, size, "fill=\"#222\"").no_leader(),
        );
        if let Some(b) = placed {
            let sy = (b.y0 + b.y1) / 2.0;
            c.raw(&format!(
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"8\" height=\"8\" fill=\"{col}\"/>",
                b.x0 - 11.0,
                sy - 4.0
            ));
            c.raw(&format!(
                "<polyline points=\"{bx1:.1},{ymid:.1} {:.1},{ymid:.1} {:.1},{sy:.1}\" fill=\"none\" stroke=\"#aaa\" stroke-width=\"0.8\"/>",
                bx1 + 5.0,
                b.x0 - 14.0
            ));
        }
    }
}
