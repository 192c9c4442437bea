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
    /// Join the points with a line (false: markers only, e.g. which points fit).
    pub line: bool,
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

const PALETTE: [RGBColor; 11] = [
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

pub fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

fn err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("drawing the chart failed: {e}")
}

fn bounds(chart: &LineChart) -> (f64, f64, f64, f64) {
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
pub fn stacked_bar(
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

/// Width and height of a chart's viewBox and of its `width`/`height` attributes: fits a laptop
/// screen without scaling.
pub const SIZE: (f64, f64) = (960.0, 540.0);

/// Average glyph advance of the sans-serif fonts a browser picks (DejaVu Sans, Arial,
/// Helvetica), in em, on the generous side: DejaVu's digits are 0.64 em, its lower case about
/// 0.57 em on average, Arial's narrower.
pub const GLYPH_EM: f64 = 0.64;
/// A text's box above its baseline and below it, in em (ascenders and descenders).
pub const ASCENT_EM: f64 = 0.8;
pub const DESCENT_EM: f64 = 0.25;

const FONT: &str = "DejaVu Sans, Arial, Helvetica, sans-serif";

/// An axis-aligned box in SVG pixels (y grows downwards).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rect {
    pub x0: f64,
    pub y0: f64,
    pub x1: f64,
    pub y1: f64,
}

impl Rect {
    pub fn new(x0: f64, y0: f64, x1: f64, y1: f64) -> Rect {
        Rect { x0, y0, x1, y1 }
    }
    pub fn overlaps(&self, o: &Rect) -> bool {
        self.x0 < o.x1 && o.x0 < self.x1 && self.y0 < o.y1 && o.y0 < self.y1
    }
    pub fn inside(&self, o: &Rect) -> bool {
        self.x0 >= o.x0 && self.x1 <= o.x1 && self.y0 >= o.y0 && self.y1 <= o.y1
    }
    fn grow(&self, by: f64) -> Rect {
        Rect::new(self.x0 - by, self.y0 - by, self.x1 + by, self.y1 + by)
    }
}

/// Where a text's `x` is: its start, middle or end (SVG `text-anchor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Anchor {
    Start,
    Middle,
    End,
}

impl Anchor {
    fn svg(self) -> &'static str {
        match self {
            Anchor::Start => "start",
            Anchor::Middle => "middle",
            Anchor::End => "end",
        }
    }
}

/// Estimated width of a text in pixels: characters × font size × [`GLYPH_EM`].
pub fn text_width(text: &str, size: f64) -> f64 {
    text.chars().count() as f64 * size * GLYPH_EM
}

/// Estimated box of a text drawn at (x, y) (y its baseline).
pub fn text_box(x: f64, y: f64, size: f64, anchor: Anchor, text: &str) -> Rect {
    let w = text_width(text, size);
    let x0 = match anchor {
        Anchor::Start => x,
        Anchor::Middle => x - w / 2.0,
        Anchor::End => x - w,
    };
    Rect::new(x0, y - ASCENT_EM * size, x0 + w, y + DESCENT_EM * size)
}

/// Break `text` at spaces into lines no wider than `width` at `size`; at most `max_lines`, the
/// last shortened with "…" when the rest does not fit.
pub fn wrap(text: &str, size: f64, width: f64, max_lines: usize) -> Vec<String> {
    let fits = |s: &str| text_width(s, size) <= width;
    let mut lines: Vec<String> = Vec::new();
    let mut cur = String::new();
    for word in text.split_whitespace() {
        let next = if cur.is_empty() {
            word.to_string()
        } else {
            format!("{cur} {word}")
        };
        if fits(&next) || cur.is_empty() {
            cur = next;
        } else {
            lines.push(std::mem::replace(&mut cur, word.to_string()));
        }
    }
    if !cur.is_empty() {
        lines.push(cur);
    }
    if lines.len() > max_lines.max(1) {
        let rest = lines.split_off(max_lines.max(1) - 1).join(" ");
        lines.push(rest);
    }
    for l in lines.iter_mut() {
        if !fits(l) {
            *l = shorten(l, size, width);
        }
    }
    lines
}

/// `text` cut to fit `width` at `size`, ending in "…" when cut.
pub fn shorten(text: &str, size: f64, width: f64) -> String {
    if text_width(text, size) <= width {
        return text.to_string();
    }
    let keep = ((width / (size * GLYPH_EM)).floor() as usize).saturating_sub(1);
    let mut s: String = text.chars().take(keep).collect();
    s = s.trim_end().to_string();
    s.push('…');
    s
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Candidate positions of a label around a point, in the order tried: (dx, dy, anchor) with dy
/// the baseline's offset. Right and above first, then left, below, and further out.
pub fn around(gap: f64, size: f64) -> Vec<(f64, f64, Anchor)> {
    let up = -gap;
    let down = gap + ASCENT_EM * size;
    let mid = (ASCENT_EM - DESCENT_EM) * size / 2.0;
    let mut v = Vec::new();
    for k in [1.0, 2.2, 3.6, 5.5] {
        v.extend([
            (gap, up * k, Anchor::Start),
            (-gap, up * k, Anchor::End),
            (0.0, up * k - 2.0, Anchor::Middle),
        ]);
        if k == 1.0 {
            v.extend([
                (gap + 2.0, mid, Anchor::Start),
                (-gap - 2.0, mid, Anchor::End),
            ]);
        }
        v.extend([
            (gap, down * k, Anchor::Start),
            (-gap, down * k, Anchor::End),
            (0.0, down * k + 2.0, Anchor::Middle),
        ]);
    }
    v
}

/// An SVG being drawn: its elements, and the boxes of what is placed so far (texts: never to be
/// overlapped; data: overlapped only when nothing else is free).
pub struct Canvas {
    pub w: f64,
    pub h: f64,
    body: String,
    texts: Vec<Rect>,
    data: Vec<Rect>,
}

impl Canvas {
    pub fn new(w: f64, h: f64) -> Canvas {
        Canvas {
            w,
            h,
            body: String::new(),
            texts: Vec::new(),
            data: Vec::new(),
        }
    }

    pub fn frame(&self) -> Rect {
        Rect::new(2.0, 2.0, self.w - 2.0, self.h - 2.0)
    }

    pub fn raw(&mut self, s: &str) {
        self.body.push_str(s);
        self.body.push('\n');
    }

    /// Mark a box as taken by something that is not text (a legend swatch, a bar), so labels
    /// keep off it.
    pub fn occupy(&mut self, r: Rect) {
        self.texts.push(r);
    }

    /// Mark the data (points and lines) that labels should rather not cover.
    pub fn data_points(&mut self, pts: &[(f64, f64)]) {
        for w in pts.windows(2) {
            let (a, b) = (w[0], w[1]);
            let n = (((b.0 - a.0).hypot(b.1 - a.1)) / 4.0).ceil().max(1.0) as usize;
            for k in 0..=n {
                let t = k as f64 / n as f64;
                let (x, y) = (a.0 + t * (b.0 - a.0), a.1 + t * (b.1 - a.1));
                self.data
                    .push(Rect::new(x - 1.5, y - 1.5, x + 1.5, y + 1.5));
            }
        }
        if pts.len() == 1 {
            let (x, y) = pts[0];
            self.data
                .push(Rect::new(x - 4.0, y - 4.0, x + 4.0, y + 4.0));
        }
    }

    fn emit_text(&mut self, x: f64, y: f64, size: f64, anchor: Anchor, text: &str, style: &str) {
        self.body.push_str(&format!(
            "<text x=\"{x:.1}\" y=\"{y:.1}\" font-size=\"{size}\" text-anchor=\"{}\" {style}>{}</text>\n",
            anchor.svg(),
            esc(text)
        ));
    }

    /// Draw a text where it is told to (titles, ticks), and keep its box.
    pub fn text(&mut self, x: f64, y: f64, size: f64, anchor: Anchor, text: &str, style: &str) {
        self.texts.push(text_box(x, y, size, anchor, text));
        self.emit_text(x, y, size, anchor, text, style);
    }

    /// Whether a text there would be free: inside `within`, clear of every placed text.
    pub fn free(&self, b: &Rect, within: &Rect) -> bool {
        b.inside(within) && !self.texts.iter().any(|t| t.overlaps(&b.grow(1.0)))
    }

    /// Place a label near (x, y): the first candidate offset whose box stays inside `within` and
    /// overlaps no placed text, preferring one that also clears the data. Draws it (white halo,
    /// and a thin leader line when it sits far from its point) and returns where, or None
    /// when every candidate is taken.
    #[allow(clippy::too_many_arguments)]
    pub fn place(
        &mut self,
        x: f64,
        y: f64,
        cands: &[(f64, f64, Anchor)],
        size: f64,
        text: &str,
        within: &Rect,
        style: &str,
    ) -> Option<Rect> {
        self.place_with(x, y, cands, size, text, within, style, true)
    }

    /// [`Canvas::place`], with or without its leader line.
    #[allow(clippy::too_many_arguments)]
    pub fn place_with(
        &mut self,
        x: f64,
        y: f64,
        cands: &[(f64, f64, Anchor)],
        size: f64,
        text: &str,
        within: &Rect,
        style: &str,
        leader: bool,
    ) -> Option<Rect> {
        let boxes: Vec<(f64, f64, Anchor, Rect)> = cands
            .iter()
            .map(|&(dx, dy, a)| (x + dx, y + dy, a, text_box(x + dx, y + dy, size, a, text)))
            .filter(|(_, _, _, b)| self.free(b, within))
            .collect();
        let clear = |b: &Rect| !self.data.iter().any(|d| d.overlaps(b));
        let pick = boxes
            .iter()
            .find(|(_, _, _, b)| clear(b))
            .or_else(|| boxes.first())
            .copied();
        let (tx, ty, a, b) = pick?;
        let far = (ty - y).abs() > 3.0 * size;
        if far && leader {
            let ly = if ty < y { b.y1 } else { b.y0 };
            let lx = x.clamp(b.x0, b.x1);
            self.raw(&format!(
                "<line x1=\"{x:.1}\" y1=\"{y:.1}\" x2=\"{lx:.1}\" y2=\"{ly:.1}\" stroke=\"#999\" stroke-width=\"0.8\"/>"
            ));
        }
        self.texts.push(b);
        let halo =
            "stroke=\"white\" stroke-width=\"3\" stroke-linejoin=\"round\" paint-order=\"stroke\"";
        self.emit_text(tx, ty, size, a, text, &format!("{halo} {style}"));
        Some(b)
    }

    pub fn finish(self) -> String {
        format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" font-family=\"{FONT}\">\n\
             <rect x=\"0\" y=\"0\" width=\"{w}\" height=\"{h}\" fill=\"white\"/>\n{}</svg>\n",
            self.body,
            w = self.w,
            h = self.h,
        )
    }
}

/// About `n` round tick values covering `lo..=hi`.
pub fn nice_ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    if hi <= lo || !lo.is_finite() || !hi.is_finite() {
        return vec![lo];
    }
    let raw = (hi - lo) / n.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step).floor() as i64;
    (first..=last).map(|k| k as f64 * step).collect()
}

/// A tick value with as many decimals as its step needs.
pub fn fmt_tick(v: f64, step: f64) -> String {
    // The fewest decimals that write the step exactly (0.25 → 2, 50 → 0).
    let dec = (0..=6)
        .find(|&d| {
            let k = step * 10f64.powi(d);
            (k - k.round()).abs() < 1e-6 * k.abs().max(1.0)
        })
        .unwrap_or(6) as usize;
    let s = format!("{v:.dec$}");
    if s == "-0" {
        "0".into()
    } else {
        s
    }
}

/// A linear map from data to pixels.
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    pub d0: f64,
    pub d1: f64,
    pub p0: f64,
    pub p1: f64,
}

impl Scale {
    pub fn at(&self, v: f64) -> f64 {
        let span = if self.d1 > self.d0 {
            self.d1 - self.d0
        } else {
            1.0
        };
        self.p0 + (v - self.d0) / span * (self.p1 - self.p0)
    }
}

/// The axes of a plot area: frame, ticks and their labels, grid, and the axes' titles (the x
/// title centred under the area, the y title above the y ticks).
fn axes(c: &mut Canvas, area: &Rect, xs: &Scale, ys: &Scale, x_desc: &str, y_desc: &str) {
    c.raw(&format!(
        "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"none\" stroke=\"#888\"/>",
        area.x0,
        area.y0,
        area.x1 - area.x0,
        area.y1 - area.y0
    ));
    let tick = 11.0;
    let xt = nice_ticks(xs.d0, xs.d1, ((area.x1 - area.x0) / 90.0).max(2.0) as usize);
    let xstep = if xt.len() > 1 { xt[1] - xt[0] } else { 1.0 };
    for &v in &xt {
        let x = xs.at(v);
        c.raw(&format!(
            "<line x1=\"{x:.1}\" y1=\"{:.1}\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"#eee\"/>",
            area.y0, area.y1
        ));
        let label = fmt_tick(v, xstep);
        let b = text_box(x, area.y1 + 18.0, tick, Anchor::Middle, &label);
        if c.free(&b, &c.frame()) {
            c.text(
                x,
                area.y1 + 18.0,
                tick,
                Anchor::Middle,
                &label,
                "fill=\"#444\"",
            );
        }
    }
    let yt = nice_ticks(ys.d0, ys.d1, ((area.y1 - area.y0) / 45.0).max(2.0) as usize);
    let ystep = if yt.len() > 1 { yt[1] - yt[0] } else { 1.0 };
    for &v in &yt {
        let y = ys.at(v);
        c.raw(&format!(
            "<line x1=\"{:.1}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#eee\"/>",
            area.x0, area.x1
        ));
        let label = fmt_tick(v, ystep);
        let b = text_box(area.x0 - 6.0, y + 4.0, tick, Anchor::End, &label);
        if c.free(&b, &c.frame()) {
            c.text(
                area.x0 - 6.0,
                y + 4.0,
                tick,
                Anchor::End,
                &label,
                "fill=\"#444\"",
            );
        }
    }
    let width = c.w - 8.0;
    let xd = shorten(x_desc, 12.0, width);
    let cx = ((area.x0 + area.x1) / 2.0)
        .max(4.0 + text_width(&xd, 12.0) / 2.0)
        .min(c.w - 4.0 - text_width(&xd, 12.0) / 2.0);
    c.text(
        cx,
        area.y1 + 34.0,
        12.0,
        Anchor::Middle,
        &xd,
        "fill=\"#222\"",
    );
    let yd = shorten(y_desc, 12.0, area.x1 - 8.0);
    c.text(
        8.0,
        area.y0 - 8.0,
        12.0,
        Anchor::Start,
        &yd,
        "fill=\"#222\"",
    );
}

/// The title (wrapped to two lines at most) and the lines under it; returns the y below them.
fn heading(c: &mut Canvas, title: &str, subtitles: &[String]) -> f64 {
    let mut y = 8.0;
    for line in wrap(title, 16.0, c.w - 24.0, 2) {
        y += 20.0;
        c.text(
            12.0,
            y,
            16.0,
            Anchor::Start,
            &line,
            "font-weight=\"bold\" fill=\"#111\"",
        );
    }
    for s in subtitles {
        for line in wrap(s, 12.0, c.w - 24.0, 2) {
            y += 16.0;
            c.text(12.0, y, 12.0, Anchor::Start, &line, "fill=\"#444\"");
        }
    }
    y
}

/// How a legend entry is drawn.
#[derive(Debug, Clone, Copy)]
pub enum Swatch {
    Line(&'static str),
    Dot(&'static str),
    Ring,
    Block(&'static str),
}

/// A legend in one row (wrapping onto more when it does not fit) from (x, y); returns the y of
/// its last row.
fn legend(c: &mut Canvas, x: f64, mut y: f64, right: f64, items: &[(Swatch, String)]) -> f64 {
    let size = 12.0;
    let mut cx = x;
    for (sw, label) in items {
        let w = 22.0 + text_width(label, size) + 16.0;
        if cx > x && cx + w > right {
            cx = x;
            y += 18.0;
        }
        let sy = y - 4.0;
        match sw {
            Swatch::Line(col) => c.raw(&format!(
                "<line x1=\"{cx:.1}\" y1=\"{sy:.1}\" x2=\"{:.1}\" y2=\"{sy:.1}\" stroke=\"{col}\" stroke-width=\"2.5\"/>",
                cx + 18.0
            )),
            Swatch::Block(col) => c.raw(&format!(
                "<rect x=\"{cx:.1}\" y=\"{:.1}\" width=\"18\" height=\"10\" fill=\"{col}\" stroke=\"#ccc\" stroke-width=\"0.5\"/>",
                sy - 5.0
            )),
            Swatch::Ring => c.raw(&format!(
                "<circle cx=\"{:.1}\" cy=\"{sy:.1}\" r=\"5\" fill=\"none\" stroke=\"black\" stroke-width=\"2\"/>",
                cx + 9.0
            )),
            Swatch::Dot(col) => c.raw(&format!(
                "<circle cx=\"{:.1}\" cy=\"{sy:.1}\" r=\"4\" fill=\"{col}\"/>",
                cx + 9.0
            )),
        }
        c.occupy(Rect::new(cx, sy - 5.0, cx + 18.0, sy + 5.0));
        c.text(cx + 22.0, y, size, Anchor::Start, label, "fill=\"#222\"");
        cx += w;
    }
    y
}

fn polyline(c: &mut Canvas, pts: &[(f64, f64)], col: &str, width: f64) {
    if pts.is_empty() {
        return;
    }
    let d: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
    c.raw(&format!(
        "<polyline points=\"{}\" fill=\"none\" stroke=\"{col}\" stroke-width=\"{width}\" stroke-linejoin=\"round\"/>",
        d.join(" ")
    ));
}

/// At most about `2 × columns` points: per pixel column the lowest and highest (in order), so
/// peaks survive.
pub fn decimate(pts: &[(f64, f64)], columns: usize) -> Vec<(f64, f64)> {
    if pts.len() <= 2 * columns.max(1) {
        return pts.to_vec();
    }
    let (x0, x1) = (pts[0].0, pts[pts.len() - 1].0);
    let span = (x1 - x0).max(f64::MIN_POSITIVE);
    let mut out = Vec::new();
    let mut i = 0;
    while i < pts.len() {
        let col = (((pts[i].0 - x0) / span) * columns as f64) as usize;
        let mut j = i;
        let (mut lo, mut hi) = (i, i);
        while j < pts.len() && (((pts[j].0 - x0) / span) * columns as f64) as usize == col {
            if pts[j].1 < pts[lo].1 {
                lo = j;
            }
            if pts[j].1 > pts[hi].1 {
                hi = j;
            }
            j += 1;
        }
        let (a, b) = if lo <= hi { (lo, hi) } else { (hi, lo) };
        out.push(pts[a]);
        if b != a {
            out.push(pts[b]);
        }
        i = j;
    }
    out
}

/// A horizontal line across the plot (a capacity, a budget) or a vertical one (on the Pareto
/// chart's peak axis), with its label.
#[derive(Debug, Clone)]
pub struct Rule {
    pub at: f64,
    pub label: String,
    pub color: &'static str,
}

/// One span of the step (a phase of one microbatch) on the time axis.
#[derive(Debug, Clone)]
pub struct Span {
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
pub struct TimelineChart {
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
pub const OFF_CHART: f64 = 4.0;

pub const BLUE: &str = "#1f77b4";
pub const RED: &str = "#d62728";
pub const GREEN: &str = "#2ca02c";
pub const ORANGE: &str = "#ff7f0e";
const BAR_COLORS: [&str; 11] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#bab0ac", "#333333",
];

/// Render a timeline chart as a [`SIZE`] SVG.
pub fn timeline_chart(t: &TimelineChart) -> String {
    let (w, h) = SIZE;
    let mut c = Canvas::new(w, h);
    let mut items = vec![(Swatch::Line(BLUE), t.predicted_name.clone())];
    if let Some((name, _)) = &t.measured {
        items.push((Swatch::Dot(ORANGE), name.clone()));
    }
    // The phases' shades, named once here (narrow spans have no room for a name).
    for sp in &t.spans {
        if !items.iter().any(|(_, n)| *n == sp.name) {
            items.push((Swatch::Block(sp.fill), sp.name.clone()));
        }
    }
    let top = heading(&mut c, &t.title, &t.subtitles);
    let ly = legend(&mut c, 12.0, top + 20.0, w - 12.0, &items);
    let bar_w = if t.bar.is_empty() { 0.0 } else { 290.0 };
    // Phase names in a strip above the plot area, the y title above its ticks.
    let strip = ly + 22.0;
    let area = Rect::new(76.0, strip + 10.0, w - 16.0 - bar_w, h - 46.0);
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
    // Phase spans: shaded, named in the strip when the name fits the span.
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
    axes(&mut c, &area, &xs, &ys, &t.x_desc, &t.y_desc);
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
    // Data.
    let px: Vec<(f64, f64)> = t
        .predicted
        .iter()
        .map(|&(x, y)| (xs.at(x), ys.at(y)))
        .collect();
    let px = decimate(&px, (area.x1 - area.x0) as usize);
    polyline(&mut c, &px, BLUE, 2.0);
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
            12.0,
            &label,
            &inner,
            "fill=\"#111\"",
        );
    }
    if !above.is_empty() {
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
        c.place_with(
            0.0,
            0.0,
            &cands,
            11.0,
            &note,
            &inner,
            "fill=\"#b22222\"",
            false,
        );
    }
    for r in &on {
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
        c.place_with(
            0.0,
            y,
            &cands,
            11.0,
            &label,
            &inner,
            &format!("fill=\"{}\"", r.color),
            false,
        );
    }
    if !t.bar.is_empty() {
        bar(&mut c, t, &ys, &area);
    }
    c.finish()
}

/// The categories at the peak, one stacked bar on the timeline's scale, each named beside it.
fn bar(c: &mut Canvas, t: &TimelineChart, ys: &Scale, area: &Rect) {
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
        let placed = c.place_with(
            bx1,
            ymid,
            &cands,
            size,
            &label,
            &within,
            "fill=\"#222\"",
            false,
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

/// One point of a Pareto chart.
#[derive(Debug, Clone)]
pub struct FrontPoint {
    pub x: f64,
    pub y: f64,
    pub label: String,
    pub fits: bool,
}

/// The Pareto front of `plan --plot`: peak against step time, each point named by its change,
/// the usable and budget lines, the base and the plan marked.
#[derive(Debug, Clone, Default)]
pub struct ParetoChart {
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
pub fn spread_order(n: usize) -> Vec<usize> {
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

/// Render a Pareto chart as a [`SIZE`] SVG.
pub fn pareto_chart(p: &ParetoChart) -> String {
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
    // Rule labels along the top of the plot area, beside their line.
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
            11.0,
            &r.label,
            &inner,
            &format!("fill=\"{}\"", r.color),
        );
    }
    for (m, &(x, y)) in p.marks.iter().zip(&mpts) {
        let label = shorten(&m.2, 12.0, inner.x1 - inner.x0);
        c.place(
            x,
            y,
            &around(10.0, 12.0),
            12.0,
            &label,
            &inner,
            "font-weight=\"bold\" fill=\"#111\"",
        );
    }
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
            11.0,
            &label,
            &inner,
            "fill=\"#333\"",
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
            11.0,
            &note,
            &inner,
            "fill=\"#666\"",
        );
    }
    c.finish()
}

/// Two SVG documents next to each other in one.
pub fn side_by_side(left: &str, lw: u32, right: &str, rw: u32, h: u32) -> String {
    let strip = |s: &str| s.trim_start_matches(|c| c != '<').to_string();
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\">\n\
         <svg x=\"0\" y=\"0\" width=\"{lw}\" height=\"{h}\">{l}</svg>\n\
         <svg x=\"{lw}\" y=\"0\" width=\"{rw}\" height=\"{h}\">{r}</svg>\n</svg>\n",
        w = lw + rw,
        l = strip(left),
        r = strip(right),
    )
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
                line: true,
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
                line: true,
            }],
            log_y: true,
            ..LineChart::default()
        };
        assert!(line_chart(&chart, (400, 300)).unwrap().contains("drift"));
    }

    #[test]
    fn stacked_bar_names_every_segment() {
        let segs = vec![
            ("activations".to_string(), 30.0),
            ("optimizer state".to_string(), 10.0),
        ];
        let svg = stacked_bar("at the peak", "MiB", &segs, (400, 400)).unwrap();
        assert!(svg.contains("activations: 30.0 (75.0 %)"));
        assert!(svg.contains("optimizer state: 10.0 (25.0 %)"));
    }

    #[test]
    fn placed_labels_never_overlap_or_leave_the_frame() {
        // Thirty labels wanting the same point: each one placed is clear of the others and of
        // the frame; those with no free candidate are left out, not drawn over.
        let mut c = Canvas::new(300.0, 200.0);
        let within = Rect::new(10.0, 10.0, 290.0, 190.0);
        let mut placed = Vec::new();
        for k in 0..30 {
            let label = format!("recompute {k}/28, mb 2×acc 4");
            if let Some(b) = c.place(150.0, 100.0, &around(6.0, 11.0), 11.0, &label, &within, "") {
                placed.push(b);
            }
        }
        assert!(placed.len() >= 4, "{}", placed.len());
        assert!(placed.len() < 30, "some must be left out");
        for (i, a) in placed.iter().enumerate() {
            assert!(a.inside(&within), "{a:?}");
            for b in &placed[i + 1..] {
                assert!(!a.overlaps(b), "{a:?} {b:?}");
            }
        }
        // A label wider than the frame is never placed.
        let long = "x".repeat(60);
        assert!(c
            .place(150.0, 100.0, &around(6.0, 11.0), 11.0, &long, &within, "")
            .is_none());
    }

    #[test]
    fn titles_wrap_and_shorten_to_fit() {
        let t = "DiT-XL/2: peak vs predicted step time (rtx-4090 (roofline: datasheet peaks × 0.6 matmul, × 0.8 bandwidth; assumed, not measured))";
        let lines = wrap(t, 16.0, 400.0, 2);
        assert_eq!(lines.len(), 2);
        for l in &lines {
            assert!(text_width(l, 16.0) <= 400.0, "{l}");
        }
        assert!(lines[1].ends_with('…'));
        assert_eq!(wrap("short", 16.0, 400.0, 2), vec!["short".to_string()]);
    }

    #[test]
    fn ticks_are_round() {
        assert_eq!(
            nice_ticks(0.0, 56.0, 7),
            vec![0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
        );
        assert_eq!(fmt_tick(0.25, 0.25), "0.25");
        assert_eq!(fmt_tick(500.0, 50.0), "500");
        assert_eq!(fmt_tick(1.5, 0.5), "1.5");
        assert_eq!(spread_order(5), vec![0, 4, 2, 1, 3]);
    }
}
