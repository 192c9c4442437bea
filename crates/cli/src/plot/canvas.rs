//! The hand-drawn SVG charts' canvas: text measured in em ([`text_width`], [`wrap`]), boxes that
//! must not overlap ([`Rect`]), the [`Canvas`] itself, axes with nice ticks ([`Scale`]), titles,
//! legends, polylines, and two charts side by side ([`side_by_side`]).

/// Width and height of a chart's viewBox and of its `width`/`height` attributes: fits a laptop
/// screen without scaling.
pub(crate) const SIZE: (f64, f64) = (960.0, 540.0);

/// Average glyph advance of the sans-serif fonts a browser picks (DejaVu Sans, Arial,
/// Helvetica), in em, on the generous side: DejaVu's digits are 0.64 em, its lower case about
/// 0.57 em on average, Arial's narrower.
pub(crate) const GLYPH_EM: f64 = 0.64;
/// A text's box above its baseline and below it, in em (ascenders and descenders).
pub(crate) const ASCENT_EM: f64 = 0.8;
pub(crate) const DESCENT_EM: f64 = 0.25;

pub(super) const FONT: &str = "DejaVu Sans, Arial, Helvetica, sans-serif";

/// An axis-aligned box in SVG pixels (y grows downwards).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Rect {
    pub x0: f64,
    pub y0: f64,
    pub x1: f64,
    pub y1: f64,
}

impl Rect {
    pub(crate) fn new(x0: f64, y0: f64, x1: f64, y1: f64) -> Rect {
        Rect { x0, y0, x1, y1 }
    }
    pub(crate) fn overlaps(&self, o: &Rect) -> bool {
        self.x0 < o.x1 && o.x0 < self.x1 && self.y0 < o.y1 && o.y0 < self.y1
    }
    pub(crate) fn inside(&self, o: &Rect) -> bool {
        self.x0 >= o.x0 && self.x1 <= o.x1 && self.y0 >= o.y0 && self.y1 <= o.y1
    }
    pub(super) fn grow(&self, by: f64) -> Rect {
        Rect::new(self.x0 - by, self.y0 - by, self.x1 + by, self.y1 + by)
    }
}

/// Where a text's `x` is: its start, middle or end (SVG `text-anchor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Anchor {
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
pub(crate) fn text_width(text: &str, size: f64) -> f64 {
    text.chars().count() as f64 * size * GLYPH_EM
}

/// Estimated box of a text drawn at (x, y) (y its baseline).
pub(crate) fn text_box(x: f64, y: f64, size: f64, anchor: Anchor, text: &str) -> Rect {
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
pub(crate) fn wrap(text: &str, size: f64, width: f64, max_lines: usize) -> Vec<String> {
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
pub(crate) fn shorten(text: &str, size: f64, width: f64) -> String {
    if text_width(text, size) <= width {
        return text.to_string();
    }
    let keep = ((width / (size * GLYPH_EM)).floor() as usize).saturating_sub(1);
    let mut s: String = text.chars().take(keep).collect();
    s = s.trim_end().to_string();
    s.push('…');
    s
}

pub(super) fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Candidate positions of a label around a point, in the order tried: (dx, dy, anchor) with dy
/// the baseline's offset. Right and above first, then left, below, and further out.
pub(crate) fn around(gap: f64, size: f64) -> Vec<(f64, f64, Anchor)> {
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
pub(crate) struct Canvas {
    pub w: f64,
    pub h: f64,
    body: String,
    texts: Vec<Rect>,
    data: Vec<Rect>,
}

impl Canvas {
    pub(crate) fn new(w: f64, h: f64) -> Canvas {
        Canvas {
            w,
            h,
            body: String::new(),
            texts: Vec::new(),
            data: Vec::new(),
        }
    }

    pub(crate) fn frame(&self) -> Rect {
        Rect::new(2.0, 2.0, self.w - 2.0, self.h - 2.0)
    }

    pub(crate) fn raw(&mut self, s: &str) {
        self.body.push_str(s);
        self.body.push('\n');
    }

    /// Mark a box as taken by something that is not text (a legend swatch, a bar), so labels
    /// keep off it.
    pub(crate) fn occupy(&mut self, r: Rect) {
        self.texts.push(r);
    }

    /// Mark the data (points and lines) that labels should rather not cover.
    pub(crate) fn data_points(&mut self, pts: &[(f64, f64)]) {
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
    pub(crate) fn text(
        &mut self,
        x: f64,
        y: f64,
        size: f64,
        anchor: Anchor,
        text: &str,
        style: &str,
    ) {
        self.texts.push(text_box(x, y, size, anchor, text));
        self.emit_text(x, y, size, anchor, text, style);
    }

    /// An axis tick's label (11 px, grey) at (x, y), drawn only where it fits the frame clear of
    /// every placed text (crowded ticks drop their labels).
    fn tick_label(&mut self, x: f64, y: f64, anchor: Anchor, label: &str) {
        const TICK: f64 = 11.0;
        if self.free(&text_box(x, y, TICK, anchor, label), &self.frame()) {
            self.text(x, y, TICK, anchor, label, "fill=\"#444\"");
        }
    }

    /// Whether a text there would be free: inside `within`, clear of every placed text.
    pub(crate) fn free(&self, b: &Rect, within: &Rect) -> bool {
        b.inside(within) && !self.texts.iter().any(|t| t.overlaps(&b.grow(1.0)))
    }

    /// Place a label near (x, y): the first candidate offset whose box stays inside `within` and
    /// overlaps no placed text, preferring one that also clears the data. Draws it (white halo,
    /// and a thin leader line when it sits far from its point, unless [`Label::no_leader`]) and
    /// returns where, or None when every candidate is taken.
    pub(crate) fn place(
        &mut self,
        x: f64,
        y: f64,
        cands: &[(f64, f64, Anchor)],
        within: &Rect,
        label: Label,
    ) -> Option<Rect> {
        let Label {
            text,
            size,
            style,
            leader,
        } = label;
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

    pub(crate) fn finish(self) -> String {
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
pub(crate) fn nice_ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
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
pub(crate) fn fmt_tick(v: f64, step: f64) -> String {
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

/// A label for [`Canvas::place`]: its text, font size and SVG style, and whether a thin
/// leader line joins it to its point when it lands far away.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Label<'a> {
    pub text: &'a str,
    pub size: f64,
    pub style: &'a str,
    pub leader: bool,
}

impl<'a> Label<'a> {
    /// A label with its leader line.
    pub(crate) fn new(text: &'a str, size: f64, style: &'a str) -> Label<'a> {
        Label {
            text,
            size,
            style,
            leader: true,
        }
    }

    /// The same label without a leader line (a note, a rule's or a bar segment's name).
    pub(crate) fn no_leader(self) -> Label<'a> {
        Label {
            leader: false,
            ..self
        }
    }
}

/// A linear map from data to pixels.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scale {
    pub d0: f64,
    pub d1: f64,
    pub p0: f64,
    pub p1: f64,
}

impl Scale {
    pub(crate) fn at(&self, v: f64) -> f64 {
        let span = if self.d1 > self.d0 {
            self.d1 - self.d0
        } else {
            1.0
        };
        self.p0 + (v - self.d0) / span * (self.p1 - self.p0)
    }

    /// Round ticks over the data range, about one per `spacing` of an axis `length` pixels
    /// long (two at least): each tick's pixel and its label.
    fn ticks(&self, length: f64, spacing: f64) -> Vec<(f64, String)> {
        let t = nice_ticks(self.d0, self.d1, (length / spacing).max(2.0) as usize);
        let step = if t.len() > 1 { t[1] - t[0] } else { 1.0 };
        t.iter().map(|&v| (self.at(v), fmt_tick(v, step))).collect()
    }
}

/// The axes of a plot area: frame, ticks and their labels, grid, and the axes' titles (the x
/// title centred under the area, the y title above the y ticks).
pub(super) fn axes(
    c: &mut Canvas,
    area: &Rect,
    xs: &Scale,
    ys: &Scale,
    x_desc: &str,
    y_desc: &str,
) {
    c.raw(&format!(
        "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"none\" stroke=\"#888\"/>",
        area.x0,
        area.y0,
        area.x1 - area.x0,
        area.y1 - area.y0
    ));
    for (x, label) in xs.ticks(area.x1 - area.x0, 90.0) {
        c.raw(&format!(
            "<line x1=\"{x:.1}\" y1=\"{:.1}\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"#eee\"/>",
            area.y0, area.y1
        ));
        c.tick_label(x, area.y1 + 18.0, Anchor::Middle, &label);
    }
    for (y, label) in ys.ticks(area.y1 - area.y0, 45.0) {
        c.raw(&format!(
            "<line x1=\"{:.1}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#eee\"/>",
            area.x0, area.x1
        ));
        c.tick_label(area.x0 - 6.0, y + 4.0, Anchor::End, &label);
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
pub(super) fn heading(c: &mut Canvas, title: &str, subtitles: &[String]) -> f64 {
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
pub(crate) enum Swatch {
    Line(&'static str),
    Dot(&'static str),
    Ring,
    Block(&'static str),
}

/// A legend in one row (wrapping onto more when it does not fit) from (x, y); returns the y of
/// its last row.
pub(super) fn legend(
    c: &mut Canvas,
    x: f64,
    mut y: f64,
    right: f64,
    items: &[(Swatch, String)],
) -> f64 {
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

pub(super) fn polyline(c: &mut Canvas, pts: &[(f64, f64)], col: &str, width: f64) {
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
pub(crate) fn decimate(pts: &[(f64, f64)], columns: usize) -> Vec<(f64, f64)> {
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

/// Two SVG documents next to each other in one.
pub(crate) fn side_by_side(left: &str, lw: u32, right: &str, rw: u32, h: u32) -> String {
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
