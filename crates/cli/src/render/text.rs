//! Plain text to a terminal's width: [`width`], word wrapping ([`wrap`], [`wrap_at_most`]),
//! lines fitted to a width ([`fit_lines`]).

/// The columns human output fits: the terminal's width when stdout is one, else 100.
pub(crate) fn width() -> usize {
    use std::io::IsTerminal;
    const PIPED: usize = 100;
    if !std::io::stdout().is_terminal() {
        return PIPED;
    }
    // SAFETY: `winsize` is plain old data; all zeroes is a valid value.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: TIOCGWINSZ fills a `winsize` on a terminal file descriptor and touches nothing
    // else; on failure the struct stays zeroed and the width falls back.
    let ok = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut ws) } == 0;
    if ok && ws.ws_col >= 40 {
        usize::from(ws.ws_col)
    } else {
        PIPED
    }
}

/// `text` broken at spaces into lines of at most `width` columns, continuation lines indented
/// by `indent` spaces (a word longer than a line stays whole). Each line ends with a newline.
pub(crate) fn wrap(text: &str, width: usize, indent: usize) -> String {
    let mut out = String::new();
    let mut line = String::new();
    let mut cols = 0usize;
    // A number and its unit stay on one line ("16.6 GiB", "30 %").
    let mut words: Vec<String> = Vec::new();
    for word in text.split(' ').filter(|w| !w.is_empty()) {
        let unit = matches!(
            word.trim_end_matches([',', ';', ')', ':', '.']),
            "B" | "KiB" | "MiB" | "GiB" | "TiB" | "%" | "s" | "ms"
        );
        match words.last_mut() {
            Some(prev) if unit && prev.ends_with(|c: char| c.is_ascii_digit()) => {
                prev.push(' ');
                prev.push_str(word);
            }
            _ => words.push(word.to_string()),
        }
    }
    for word in &words {
        let word = word.as_str();
        let n = word.chars().count();
        if cols > 0 && cols + 1 + n > width {
            out.push_str(line.trim_end());
            out.push('\n');
            line = " ".repeat(indent);
            cols = indent;
        } else if cols > 0 {
            line.push(' ');
            cols += 1;
        }
        line.push_str(word);
        cols += n;
    }
    out.push_str(line.trim_end());
    out.push('\n');
    out
}

/// Every line of `text` longer than `width` wrapped at spaces (continuations indented by two
/// spaces more than the line's own indent); tables and short lines pass unchanged.
pub(crate) fn fit_lines(text: &str, width: usize) -> String {
    let mut out = String::new();
    for line in text.lines() {
        if line.chars().count() <= width {
            out.push_str(line);
            out.push('\n');
        } else {
            let indent = line.len() - line.trim_start().len();
            out.push_str(&" ".repeat(indent));
            out.push_str(&wrap(
                line.trim_start(),
                width - indent.min(width / 2),
                indent + 2,
            ));
        }
    }
    out
}

/// The clauses of `text`: its parts between "; " outside parentheses (a clause may hold a
/// parenthesised aside with its own "; ", which stays whole).
pub(crate) fn clauses(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ';' if depth == 0 && text[i + 1..].starts_with(' ') => {
                out.push(&text[start..i]);
                start = i + 2;
            }
            _ => {}
        }
    }
    out.push(&text[start..]);
    out
}

/// `text`'s [`clauses`] in order, each kept when it still fits in `lines` lines (whole, or else
/// without its long asides), with `more` appended; `None` when the first clause does not fit
/// even without its asides.
fn clauses_within(
    text: &str,
    width: usize,
    indent: usize,
    lines: usize,
    more: &str,
) -> Option<String> {
    let fits = |kept: &[String], next: &str| {
        let mut all = kept.to_vec();
        all.push(next.to_string());
        wrap(&format!("{}; {more}", all.join("; ")), width, indent)
            .lines()
            .count()
            <= lines
    };
    let mut kept: Vec<String> = Vec::new();
    for clause in clauses(text) {
        let lean = without_long_asides(clause);
        if fits(&kept, clause) {
            kept.push(clause.to_string());
        } else if fits(&kept, &lean) {
            kept.push(lean);
        } else if kept.is_empty() {
            return None;
        }
    }
    Some(wrap(&format!("{}; {more}", kept.join("; ")), width, indent))
}

/// `text` without its parenthesised asides of more than a few words (a list of changes, a
/// source), the short ones ("(73 %)", "(ZeRO)") kept: the detail a short form drops first.
fn without_long_asides(text: &str) -> String {
    const LONG: usize = 24;
    let mut out = String::new();
    let mut aside = String::new();
    let mut depth = 0usize;
    for c in text.chars() {
        match (c, depth) {
            ('(', _) => {
                depth += 1;
                aside.push(c);
            }
            (')', 1) => {
                depth = 0;
                aside.push(c);
                if aside.chars().count() <= LONG + 2 {
                    out.push_str(&aside);
                } else {
                    out.truncate(out.trim_end().len());
                }
                aside.clear();
            }
            (')', d) if d > 1 => {
                depth -= 1;
                aside.push(c);
            }
            (_, 0) => out.push(c),
            _ => aside.push(c),
        }
    }
    // An aside left open keeps its text.
    out.push_str(&aside);
    out
}

/// At most `lines` lines of `text` wrapped to `width`: its [`clauses`] in order, each kept when
/// it still fits (whole, or else without its long asides), with `more` appended when anything
/// was left out; a first clause too long even without its asides is cut by characters.
pub(crate) fn wrap_at_most(
    text: &str,
    width: usize,
    indent: usize,
    lines: usize,
    more: &str,
) -> String {
    let whole = wrap(text, width, indent);
    if whole.lines().count() <= lines {
        return whole;
    }
    if let Some(cut) = clauses_within(text, width, indent, lines, more) {
        return cut;
    }
    // The first clause alone is longer than the lines, even without its asides: cut it by
    // characters, shorter until the wrapped cut fits (wrapping at spaces wastes line ends).
    let text = without_long_asides(text);
    let mut budget =
        (lines * width.saturating_sub(indent)).saturating_sub(more.chars().count() + 2);
    loop {
        let head: String = text.chars().take(budget).collect();
        let cut = wrap(&format!("{}… {more}", head.trim_end()), width, indent);
        if cut.lines().count() <= lines || budget < 10 {
            return cut;
        }
        budget -= 10;
    }
}
