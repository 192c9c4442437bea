//! Flag values and messages: the value parsers of numeric flags (each rejection names what is
//! allowed), clap's rejections reduced to one line, and the tidying of every message that echoes
//! a user's value (escaped, shortened).

use clap::error::{ContextKind, ContextValue, ErrorKind};

/// Longest user value echoed in a message, in characters; longer ones end in "…".
pub(crate) const MAX_ECHO: usize = 60;

/// A user's value as it appears in a message: `{:?}`-escaped (no raw control characters) and at
/// most [`MAX_ECHO`] characters of it.
pub(crate) fn show(value: &str) -> String {
    let n = value.chars().count();
    if n > MAX_ECHO {
        let head: String = value.chars().take(MAX_ECHO).collect();
        format!("{head:?}… ({n} characters)")
    } else {
        format!("{value:?}")
    }
}

/// A float for a message: plain when short, scientific otherwise (never 309 digits).
pub(crate) fn fmt_float(x: f64) -> String {
    if x == 0.0 || !x.is_finite() || (1e-4..1e6).contains(&x.abs()) {
        format!("{x}")
    } else {
        format!("{x:e}")
    }
}

/// One line, whatever the message holds: control characters escaped, runs of more than 80
/// non-blank characters (a pasted value) cut to [`MAX_ECHO`], and at most 1,000 characters.
pub(crate) fn tidy(message: &str) -> String {
    let mut escaped = String::with_capacity(message.len());
    for c in message.chars() {
        if c.is_control() {
            escaped.extend(c.escape_default());
        } else {
            escaped.push(c);
        }
    }
    let mut out = String::with_capacity(escaped.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        let n = word.chars().count();
        if n > 80 {
            // Keep the closing punctuation of the cut word (a quote, a semicolon).
            let tail: String = word
                .chars()
                .rev()
                .take_while(|c| "'\";,:)".contains(*c))
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            out.extend(word.chars().take(MAX_ECHO));
            out.push_str(&format!("… ({n} characters){tail}"));
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for c in escaped.chars() {
        if c == ' ' {
            flush(&mut word, &mut out);
            out.push(c);
        } else {
            word.push(c);
        }
    }
    flush(&mut word, &mut out);
    if out.chars().count() > 1000 {
        let mut cut: String = out.chars().take(999).collect();
        cut.push('…');
        cut
    } else {
        out
    }
}

fn int_range<T>(text: &str, min: T, max: T, what: &str) -> Result<T, String>
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display + Copy,
{
    let allowed = format!("allowed: {what} from {min} to {max}");
    let t = text.trim();
    let digits = t.strip_prefix('+').unwrap_or(t);
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        return match t.parse::<T>() {
            Ok(v) if v >= min && v <= max => Ok(v),
            _ => Err(format!("{} is out of range; {allowed}", show(text))),
        };
    }
    if let Some(neg) = t.strip_prefix('-') {
        if !neg.is_empty() && neg.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!("{} is negative; {allowed}", show(text)));
        }
    }
    if t.is_empty() {
        return Err(format!("is empty; {allowed}"));
    }
    Err(format!("{} is not an integer; {allowed}", show(text)))
}

/// 1 ..= u32::MAX (batch sizes, ranks, steps).
pub(crate) fn positive_u32(text: &str) -> Result<u32, String> {
    int_range(text, 1, u32::MAX, "a positive integer")
}

/// 0 ..= u32::MAX (warm-up steps, a LoRA rank where 0 turns it off).
pub(crate) fn count_u32(text: &str) -> Result<u32, String> {
    int_range(text, 0, u32::MAX, "an integer")
}

/// 0 ..= u64::MAX (seeds).
pub(crate) fn seed_u64(text: &str) -> Result<u64, String> {
    int_range(text, 0, u64::MAX, "an integer")
}

/// 1 ..= 2²⁰ (worker threads, every-N).
pub(crate) fn positive_usize(text: &str) -> Result<usize, String> {
    int_range(text, 1, 1 << 20, "a positive integer")
}

/// A ZeRO stage: 0 ..= 3.
pub(crate) fn zero_stage(text: &str) -> Result<u8, String> {
    int_range(text, 0, 3, "a ZeRO stage")
}

fn float(text: &str) -> Result<f64, String> {
    let t = text.trim();
    if t.is_empty() {
        return Err("is empty".into());
    }
    t.parse::<f64>()
        .map_err(|_| format!("{} is not a number", show(text)))
}

/// Smallest and largest learning rate `run` and `verify` take. AdamW and SGD steps of DiT
/// training sit between 1e-6 and 1e-2; below 1e-8 an update vanishes under f32 rounding of
/// the weights (and 5e-324, a subnormal, makes every variant "fail" verify against a reference
/// that does not move), above 1 the first steps diverge to NaN. The range keeps a margin on both
/// sides of what a user would run.
pub(crate) const LEARNING_RATES: (f64, f64) = (1e-8, 1.0);

/// A learning rate: in [`LEARNING_RATES`].
pub(crate) fn learning_rate(text: &str) -> Result<f64, String> {
    const ALLOWED: &str = "allowed: a number from 1e-8 to 1, e.g. 1e-4";
    let (lo, hi) = LEARNING_RATES;
    match float(text) {
        Ok(v) if (lo..=hi).contains(&v) => Ok(v),
        Ok(_) => Err(format!("{} is out of range; {ALLOWED}", show(text))),
        Err(e) => Err(format!("{e}; {ALLOWED}")),
    }
}

/// The planner's headroom: 0 ≤ h < 0.9.
pub(crate) fn headroom(text: &str) -> Result<f64, String> {
    const ALLOWED: &str = "allowed: a fraction 0 ≤ headroom < 0.9, e.g. 0.1";
    match float(text) {
        Ok(v) if (0.0..0.9).contains(&v) => Ok(v),
        Ok(_) => Err(format!("{} is out of range; {ALLOWED}", show(text))),
        Err(e) => Err(format!("{e}; {ALLOWED}")),
    }
}

fn context_string(e: &clap::Error, kind: ContextKind) -> Option<String> {
    match e.get(kind)? {
        ContextValue::String(s) => Some(s.clone()),
        ContextValue::Strings(v) => Some(v.join(", ")),
        ContextValue::StyledStr(s) => Some(s.to_string()),
        ContextValue::StyledStrs(v) => Some(
            v.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", "),
        ),
        ContextValue::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// `--batch <BATCH>` → `--batch`.
fn flag_name(arg: &str) -> String {
    arg.split([' ', '=']).next().unwrap_or(arg).to_string()
}

/// clap's rejection as one line naming the flag and what is allowed (without "ditmem: ").
pub(crate) fn clap_line(e: &clap::Error, command: &str) -> String {
    let arg = context_string(e, ContextKind::InvalidArg).map(|a| flag_name(&a));
    let value = context_string(e, ContextKind::InvalidValue);
    let help = if command.is_empty() {
        "see `ditmem --help`".to_string()
    } else {
        format!("see `ditmem {command} --help`")
    };
    let first_line = || {
        let text = e.render().to_string();
        let line = text.lines().next().unwrap_or("").trim().to_string();
        line.strip_prefix("error: ").unwrap_or(&line).to_string()
    };
    match e.kind() {
        ErrorKind::ValueValidation => {
            let why = std::error::Error::source(e)
                .map(ToString::to_string)
                .unwrap_or_else(|| "is not valid".into());
            format!("{}: {why}", arg.unwrap_or_else(|| "a flag".into()))
        }
        ErrorKind::InvalidValue => {
            let allowed = context_string(e, ContextKind::ValidValue)
                .filter(|v| !v.is_empty())
                .map(|v| format!("allowed: {v}"))
                .unwrap_or_else(|| format!("allowed: a value, {help}"));
            match value.as_deref() {
                None | Some("") => format!(
                    "{}: given without a value; {allowed}",
                    arg.unwrap_or_else(|| "a flag".into())
                ),
                Some(v) => format!(
                    "{}: {} is not allowed; {allowed}",
                    arg.unwrap_or_else(|| "a flag".into()),
                    show(v)
                ),
            }
        }
        ErrorKind::UnknownArgument => {
            let suggestion = context_string(e, ContextKind::SuggestedArg)
                .map(|s| format!("did you mean {s}? "))
                .unwrap_or_default();
            format!(
                "{} is not a flag{}; {suggestion}allowed: the flags that {} lists",
                show(&arg.unwrap_or_default()),
                if command.is_empty() {
                    String::new()
                } else {
                    format!(" of `ditmem {command}`")
                },
                help.trim_start_matches("see ")
            )
        }
        ErrorKind::InvalidSubcommand => format!(
            "{} is not a command; allowed: estimate, plan, run, compare, agree, verify, spec \
             (see `ditmem --help`)",
            show(
                &context_string(e, ContextKind::InvalidSubcommand)
                    .or(arg)
                    .or(value)
                    .unwrap_or_default()
            )
        ),
        ErrorKind::ArgumentConflict => {
            let prior = context_string(e, ContextKind::PriorArg).map(|a| flag_name(&a));
            let a = arg.unwrap_or_else(|| "a flag".into());
            match prior {
                Some(p) if p == a => format!("{a}: given more than once; allowed: once"),
                Some(p) => format!("{a}: cannot be used with {p}; allowed: one of them"),
                None => format!("{a}: given more than once; allowed: once"),
            }
        }
        ErrorKind::MissingRequiredArgument => format!(
            "{}: required; {help}",
            arg.unwrap_or_else(|| "a flag".into())
        ),
        ErrorKind::NoEquals
        | ErrorKind::TooManyValues
        | ErrorKind::TooFewValues
        | ErrorKind::WrongNumberOfValues => format!(
            "{}: {}; allowed: one value",
            arg.unwrap_or_else(|| "a flag".into()),
            first_line()
        ),
        _ => format!("{}; {help}", first_line()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_name_what_is_allowed() {
        assert_eq!(positive_u32("8"), Ok(8));
        assert!(positive_u32("-1").unwrap_err().contains("negative"));
        assert!(positive_u32("0").unwrap_err().contains("positive integer"));
        assert!(positive_u32("99999999999")
            .unwrap_err()
            .contains("out of range"));
        assert!(positive_u32("").unwrap_err().contains("empty"));
        assert_eq!(zero_stage("3"), Ok(3));
        assert!(zero_stage("4").is_err());
    }

    #[test]
    fn floats_are_finite_and_in_range() {
        for bad in [
            "NaN", "inf", "-inf", "-1", "0", "", "x", "5e-324", "1e308", "1.5",
        ] {
            let e = learning_rate(bad).unwrap_err();
            assert!(e.contains("allowed: a number from 1e-8 to 1"), "{bad}: {e}");
        }
        assert_eq!(learning_rate("1e-4"), Ok(1e-4));
        assert_eq!(learning_rate("1e-8"), Ok(1e-8));
        assert_eq!(learning_rate("1"), Ok(1.0));
        assert!(headroom("0.95").is_err());
        assert_eq!(fmt_float(-1e308), "-1e308");
        assert_eq!(fmt_float(0.25), "0.25");
    }

    #[test]
    fn echoed_values_are_short_and_escaped() {
        let long = "a".repeat(5000);
        let s = show(&long);
        assert!(s.chars().count() < 100, "{s}");
        assert!(s.contains("5000 characters"));
        assert_eq!(show("a\u{1b}[31mb"), "\"a\\u{1b}[31mb\"");
        let t = tidy(&format!("x '{long}' \u{1b}[2J y\nz"));
        assert!(t.chars().count() < 200, "{t}");
        assert!(!t.chars().any(char::is_control), "{t}");
    }
}
