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

/// At most `lines` lines of `text` wrapped to `width`: its clauses ("; "-separated) in order,
/// each kept when it still fits, with `more` appended when any was left out.
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
    let mut kept: Vec<&str> = Vec::new();
    for clause in text.split("; ") {
        kept.push(clause);
        let trial = wrap(&format!("{}; {more}", kept.join("; ")), width, indent);
        if trial.lines().count() > lines && kept.len() > 1 {
            kept.pop();
        }
    }
    let cut = wrap(&format!("{}; {more}", kept.join("; ")), width, indent);
    if cut.lines().count() <= lines {
        return cut;
    }
    // The first clause alone is longer than the lines: cut it by characters, shorter until
    // the wrapped cut fits (wrapping at spaces wastes the ends of lines).
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
