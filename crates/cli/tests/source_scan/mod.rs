//! Reading the workspace's sources as code: cut into code, comments, strings and character
//! literals (`pieces`), or with all but the code blanked (`blank`, line breaks kept); the members
//! from the root `Cargo.toml`, their `.rs` files. Shared by the tests that hold a rule over every crate (`no_import_cycles.rs`, `function_length.rs`,
//! `public_items.rs`).
#![allow(dead_code)] // each test uses part of it

use std::fs;
use std::path::{Path, PathBuf};

/// What a stretch of Rust source is, as these tests read it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    Code,
    /// A line or (nested) block comment.
    Comment,
    /// A string literal: plain, byte (`b"…"`) or raw (`r#"…"#`, `br"…"`).
    Str,
    /// A character or byte literal (`'x'`, `'\n'`, `b'x'`); a lifetime's `'` is code.
    Char,
}

/// Chars `start..end` of the source, of one [`Kind`]; for a [`Kind::Str`], `text` is the range
/// of its contents between the quotes (escapes left as written).
#[derive(Clone, Copy, Debug)]
pub struct Piece {
    pub kind: Kind,
    pub start: usize,
    pub end: usize,
    pub text: (usize, usize),
}

/// The source's chars `c` cut into code, comments, strings and character literals, in order and
/// covering every char (consecutive code is one piece). The one place these tests know Rust's
/// literal and comment syntax: [`blank`] and the import-circle lexer both read it.
pub fn pieces(c: &[char]) -> Vec<Piece> {
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut out: Vec<Piece> = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let rest = &c[i..];
        let starts = |p: &str| rest.iter().take(p.len()).copied().eq(p.chars());
        let after_ident = i > 0 && ident(c[i - 1]);
        // A byte string or byte literal's `b` belongs to the literal.
        let prefix = usize::from(!after_ident && (starts("b\"") || starts("b'")));
        let (kind, len, text) = if starts("//") {
            let end = rest.iter().position(|&ch| ch == '\n').unwrap_or(rest.len());
            (Kind::Comment, end, (0, 0))
        } else if starts("/*") {
            (Kind::Comment, block_comment_len(rest), (0, 0))
        } else if (starts("r\"") || starts("r#") || starts("br\"") || starts("br#")) && !after_ident
        {
            raw_string(rest)
        } else if rest[prefix] == '"' {
            let mut j = prefix + 1;
            while j < rest.len() && rest[j] != '"' {
                j += if rest[j] == '\\' { 2 } else { 1 };
            }
            (
                Kind::Str,
                (j + 1).min(rest.len()),
                (prefix + 1, j.min(rest.len())),
            )
        } else if rest[prefix] == '\'' {
            char_literal(rest, prefix)
        } else {
            (Kind::Code, 1, (0, 0))
        };
        let text = (i + text.0, i + text.1);
        match out.last_mut() {
            Some(last) if kind == Kind::Code && last.kind == Kind::Code => last.end = i + len,
            _ => out.push(Piece {
                kind,
                start: i,
                end: i + len,
                text,
            }),
        }
        i += len;
    }
    out
}

/// The length of the block comment `rest` starts with (Rust's block comments nest).
fn block_comment_len(rest: &[char]) -> usize {
    let (mut depth, mut j) = (0usize, 0usize);
    while j < rest.len() {
        if rest[j..].starts_with(&['/', '*']) {
            depth += 1;
            j += 2;
        } else if rest[j..].starts_with(&['*', '/']) {
            depth -= 1;
            j += 2;
            if depth == 0 {
                break;
            }
        } else {
            j += 1;
        }
    }
    j.min(rest.len())
}

/// The raw string `rest` starts with, r#…#"…"#…# (no escapes), or one char of code where it is
/// an identifier such as `r#type` or `br`.
fn raw_string(rest: &[char]) -> (Kind, usize, (usize, usize)) {
    let r = rest.iter().position(|&ch| ch == 'r').unwrap_or(0);
    let hashes = rest[r + 1..].iter().take_while(|&&ch| ch == '#').count();
    if rest.get(r + 1 + hashes) != Some(&'"') {
        return (Kind::Code, 1, (0, 0));
    }
    let open = r + 2 + hashes;
    let mut j = open;
    while j < rest.len() {
        if rest[j] == '"' && rest[j + 1..].iter().take(hashes).all(|&ch| ch == '#') {
            return (Kind::Str, (j + 1 + hashes).min(rest.len()), (open, j));
        }
        j += 1;
    }
    (Kind::Str, rest.len(), (open, rest.len()))
}

/// The character literal `rest` starts with after `prefix` chars ('x', '\n', '\u{1F600}', b'x'),
/// or one char of code: a lifetime's `'` ('a, 'static), an unclosed quote, a lone `b`.
fn char_literal(rest: &[char], prefix: usize) -> (Kind, usize, (usize, usize)) {
    let q = &rest[prefix..];
    let len = if q.get(1) == Some(&'\\') {
        q.iter().skip(2).position(|&ch| ch == '\'').map(|p| p + 3)
    } else if q.get(2) == Some(&'\'') {
        Some(3)
    } else {
        None
    };
    match len {
        Some(n) => (Kind::Char, (prefix + n).min(rest.len()), (0, 0)),
        None => (Kind::Code, 1, (0, 0)),
    }
}

/// `src` with comments, strings and character literals replaced by spaces (line breaks kept).
pub fn blank(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    for p in pieces(&c) {
        for &ch in &c[p.start..p.end] {
            out.push(if p.kind == Kind::Code || ch == '\n' {
                ch
            } else {
                ' '
            });
        }
    }
    out
}

/// The workspace's member directories, from the `members = [...]` list of `<root>/Cargo.toml`
/// (the Python binding's crate under `python/` included); every directory under `<root>/crates`
/// when the manifest has no such list.
pub fn members(root: &Path) -> Vec<PathBuf> {
    let manifest = fs::read_to_string(root.join("Cargo.toml")).unwrap_or_default();
    let listed = manifest
        .split_once("\nmembers = [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(list, _)| {
            list.split(',')
                .filter_map(|m| {
                    let m = m.trim().trim_matches('"');
                    (!m.is_empty()).then(|| root.join(m))
                })
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    if !listed.is_empty() {
        return listed;
    }
    fs::read_dir(root.join("crates"))
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default()
}

pub fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The workspace root (two folders above this crate).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}
