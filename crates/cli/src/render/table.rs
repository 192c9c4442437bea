//! Aligned text tables ([`Table`]) and the counts and shares in their cells.

use super::text::wrap;

/// One column of a [`Table::of`] table of `T`s: its header and how an item's cell is written.
pub(crate) type Column<'a, T> = (&'a str, &'a dyn Fn(&T) -> String);

/// A simple left/right aligned text table.
pub(crate) struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub(crate) fn new(header: &[&str]) -> Table {
        Table {
            header: header.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub(crate) fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// A table with one row per item: each column's header stands beside how its cells are
    /// written, so a header and its cells cannot drift apart.
    pub(crate) fn of<T>(columns: &[Column<'_, T>], items: impl IntoIterator<Item = T>) -> Table {
        let header: Vec<&str> = columns.iter().map(|c| c.0).collect();
        let mut t = Table::new(&header);
        for item in items {
            t.row(columns.iter().map(|c| (c.1)(&item)).collect());
        }
        t
    }

    /// Each column's width in characters (header and rows).
    fn widths(&self) -> Vec<usize> {
        let n = self.header.len();
        let mut width = vec![0usize; n];
        for r in std::iter::once(&self.header).chain(&self.rows) {
            for (i, c) in r.iter().enumerate().take(n) {
                width[i] = width[i].max(c.chars().count());
            }
        }
        width
    }

    /// The first `upto` cells of a row, indented by two: the first left-aligned, the rest
    /// right-aligned two spaces apart.
    fn lead(r: &[String], width: &[usize], upto: usize) -> String {
        let mut s = String::from("  ");
        for (i, c) in r.iter().enumerate().take(upto) {
            let pad = width[i] - c.chars().count();
            if i == 0 {
                s.push_str(c);
                s.push_str(&" ".repeat(pad));
            } else {
                s.push_str(&" ".repeat(pad + 2));
                s.push_str(c);
            }
        }
        s
    }

    pub(crate) fn render(&self) -> String {
        let n = self.header.len();
        let width = self.widths();
        let line = |r: &Vec<String>| Self::lead(r, &width, n).trim_end().to_string();
        let mut out = line(&self.header);
        out.push('\n');
        out.push_str("  ");
        out.push_str(&"-".repeat(width.iter().sum::<usize>() + 2 * (n - 1)));
        for r in &self.rows {
            out.push('\n');
            out.push_str(&line(r));
        }
        out.push('\n');
        out
    }

    /// As [`Table::render`], fitted to `width` columns: the last column (words, such as a
    /// list of changes) is left-aligned and wrapped onto continuation lines under itself.
    pub(crate) fn render_fit(&self, width: usize) -> String {
        let n = self.header.len();
        if n < 2 {
            return self.render();
        }
        let widths = self.widths();
        let lead: usize = 2 + widths[..n - 1].iter().sum::<usize>() + 2 * (n - 1);
        let room = width.saturating_sub(lead).max(20);
        let last_w = widths[n - 1].min(room);
        let line = |r: &Vec<String>| -> String {
            let mut s = Self::lead(r, &widths, n - 1);
            s.push_str("  ");
            let last = r.get(n - 1).map(String::as_str).unwrap_or("");
            let wrapped = wrap(last, last_w, 0);
            let mut lines = wrapped.lines();
            s.push_str(lines.next().unwrap_or(""));
            for more in lines {
                s.push('\n');
                s.push_str(&" ".repeat(lead));
                s.push_str(more);
            }
            s.trim_end().to_string()
        };
        let mut out = line(&self.header);
        out.push('\n');
        out.push_str("  ");
        out.push_str(&"-".repeat(lead - 2 + last_w));
        for r in &self.rows {
            out.push('\n');
            out.push_str(&line(r));
        }
        out.push('\n');
        out
    }
}

/// Thousands separators for counts.
pub(crate) fn fmt_count(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

pub(crate) fn pct(part: u64, whole: u64) -> String {
    if whole == 0 {
        "-".into()
    } else {
        format!("{:.1} %", 100.0 * part as f64 / whole as f64)
    }
}

/// A prediction's relative error against a measurement, signed, in percent with `decimals`
/// digits ("+1.234 %"); "-" when there is nothing measured.
pub(crate) fn rel_err_pct(predicted: u64, measured: u64, decimals: usize) -> String {
    if measured == 0 {
        "-".into()
    } else {
        format!(
            "{:+.*} %",
            decimals,
            100.0 * (predicted as f64 / measured as f64 - 1.0)
        )
    }
}
