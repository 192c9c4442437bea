//! Reading the workspace's sources as code: comments, strings and character literals blanked
//! (line breaks kept), the members from the root `Cargo.toml`, their `.rs` files. Shared by the
//! tests that hold a rule over every crate (`no_import_cycles.rs`, `function_length.rs`,
//! `public_items.rs`).
#![allow(dead_code)] // each test uses part of it

use std::fs;
use std::path::{Path, PathBuf};

/// `src` with comments, strings and character literals replaced by spaces (line breaks kept).
pub fn blank(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let blank_to = |out: &mut String, s: &[char]| {
        for &ch in s {
            out.push(if ch == '\n' { '\n' } else { ' ' });
        }
    };
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut i = 0;
    while i < c.len() {
        let rest = &c[i..];
        let starts = |p: &str| rest.iter().take(p.len()).copied().eq(p.chars());
        if starts("//") {
            let end = rest.iter().position(|&ch| ch == '\n').unwrap_or(rest.len());
            blank_to(&mut out, &rest[..end]);
            i += end;
        } else if starts("/*") {
            // Rust's block comments nest.
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
            blank_to(&mut out, &rest[..j.min(rest.len())]);
            i += j;
        } else if (starts("r\"") || starts("r#") || starts("br\"") || starts("br#"))
            && (i == 0 || !ident(c[i - 1]))
        {
            // A raw string: r#…#"…"#…#, no escapes.
            let r = rest.iter().position(|&ch| ch == 'r').unwrap_or(0);
            let hashes = rest[r + 1..].iter().take_while(|&&ch| ch == '#').count();
            if rest.get(r + 1 + hashes) != Some(&'"') {
                out.push(c[i]); // an identifier such as `r#type` or `br`
                i += 1;
                continue;
            }
            let mut j = r + 2 + hashes;
            while j < rest.len() {
                if rest[j] == '"' && rest[j + 1..].iter().take(hashes).all(|&ch| ch == '#') {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            blank_to(&mut out, &rest[..j.min(rest.len())]);
            i += j;
        } else if rest[0] == '"' {
            let mut j = 1;
            while j < rest.len() && rest[j] != '"' {
                j += if rest[j] == '\\' { 2 } else { 1 };
            }
            let end = (j + 1).min(rest.len());
            blank_to(&mut out, &rest[..end]);
            i += end;
        } else if rest[0] == '\'' {
            // A character literal ('x', '\n', '\u{1F600}') or a lifetime ('a, 'static).
            let len = if rest.get(1) == Some(&'\\') {
                rest.iter()
                    .skip(2)
                    .position(|&ch| ch == '\'')
                    .map(|p| p + 3)
            } else if rest.get(2) == Some(&'\'') {
                Some(3)
            } else {
                None
            };
            match len {
                Some(n) => {
                    blank_to(&mut out, &rest[..n.min(rest.len())]);
                    i += n;
                }
                None => {
                    out.push('\'');
                    i += 1;
                }
            }
        } else {
            out.push(rest[0]);
            i += 1;
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
