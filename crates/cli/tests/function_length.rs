//! No function over 100 lines without a line that says why it is kept whole, and no source
//! file over 1,000 lines.
//!
//! Issue 45's house rule: a function a newcomer reads should fit on a screen or two; one that is
//! longer on purpose (one drawing top to bottom, one sequence of allocator events whose order is
//! the rule) says so in a `// Kept whole (> 100 lines): <why>` line among the comments and
//! attributes right above it.
//!
//! # What is read
//! Every `.rs` file under `src/` of every member of the workspace (the root `Cargo.toml`'s
//! `members`). Comments, string literals (raw and byte strings included) and character literals
//! are blanked first, keeping the line breaks, so a brace in a string or a doc comment is not
//! code. A function is `fn name` with a body; its length runs from the line of `fn` to the line of
//! its closing brace. Trait methods without a body are not functions here. Tests and benches are
//! not read: a test's table of cases may be long.
mod common;
mod source_scan;

use common::temp_dir;
use source_scan::{blank, members, root, rust_files};
use std::fs;

/// The most lines a function may have without a "Kept whole" line.
const MAX_LINES: usize = 100;
/// The most lines a `.rs` file of a member (its `src/`, `tests/`, `benches/`) may have: issue
/// 45's "files ≤ ~1,000 lines". A longer one is split by concern (as `tests/module_tree/`
/// came out of `no_import_cycles.rs`), not given a reason.
const MAX_FILE_LINES: usize = 1000;
/// What the line above a longer function starts with (after `//`), followed by why.
const KEPT_WHOLE: &str = "Kept whole (> 100 lines):";

/// A function of a file: its name, the 1-based line of `fn` and its length in lines.
#[derive(Debug, PartialEq)]
struct Function {
    name: String,
    line: usize,
    lines: usize,
}

/// The functions with a body in `src`, nested ones included.
fn functions(src: &str) -> Vec<Function> {
    let code: Vec<char> = blank(src).chars().collect();
    let line_of = |at: usize| code[..at].iter().filter(|&&ch| ch == '\n').count() + 1;
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut found = Vec::new();
    let mut i = 0;
    while i + 2 < code.len() {
        let is_fn = code[i] == 'f'
            && code[i + 1] == 'n'
            && code[i + 2].is_whitespace()
            && (i == 0 || !ident(code[i - 1]));
        if !is_fn {
            i += 1;
            continue;
        }
        let mut j = i + 2;
        while j < code.len() && code[j].is_whitespace() {
            j += 1;
        }
        let name: String = code[j..].iter().take_while(|&&ch| ident(ch)).collect();
        if name.is_empty() {
            i += 2; // `fn(` of a function pointer type
            continue;
        }
        // The body's `{` at bracket depth 0, or `;` there for a declaration without one.
        let mut depth = 0i64;
        let mut open = None;
        while j < code.len() {
            match code[j] {
                '(' | '[' => depth += 1,
                ')' | ']' => depth -= 1,
                '{' if depth == 0 => {
                    open = Some(j);
                    break;
                }
                ';' if depth == 0 => break,
                _ => {}
            }
            j += 1;
        }
        if let Some(open) = open {
            let mut braces = 0i64;
            let mut k = open;
            while k < code.len() {
                match code[k] {
                    '{' => braces += 1,
                    '}' => {
                        braces -= 1;
                        if braces == 0 {
                            break;
                        }
                    }
                    _ => {}
                }
                k += 1;
            }
            let line = line_of(i);
            found.push(Function {
                name,
                line,
                lines: line_of(k.min(code.len() - 1)) - line + 1,
            });
        }
        i += 2;
    }
    found
}

/// Whether the comments and attributes right above line `line` (1-based) of `src` hold a
/// "Kept whole" line with a reason after it.
fn says_why(src: &str, line: usize) -> bool {
    let lines: Vec<&str> = src.lines().collect();
    lines[..line.saturating_sub(1).min(lines.len())]
        .iter()
        .rev()
        .map(|l| l.trim())
        .take_while(|l| l.starts_with("//") || l.starts_with("#[") || l.starts_with("#!["))
        .filter_map(|l| l.trim_start_matches('/').trim().strip_prefix(KEPT_WHOLE))
        .any(|why| !why.trim().is_empty())
}

/// `file:line fn name (N lines)` for each function of `src` over [`MAX_LINES`] without a reason.
fn too_long(src: &str, file: &str) -> Vec<String> {
    functions(src)
        .into_iter()
        .filter(|f| f.lines > MAX_LINES && !says_why(src, f.line))
        .map(|f| format!("{file}:{} fn {} ({} lines)", f.line, f.name, f.lines))
        .collect()
}

#[test]
fn no_function_over_100_lines_without_a_reason() {
    let root = root();
    let mut files = Vec::new();
    for m in members(&root) {
        rust_files(&m.join("src"), &mut files);
    }
    files.sort();
    assert!(files.len() > 100, "read only {} files", files.len());
    let mut long = Vec::new();
    let mut read = 0;
    for f in &files {
        let src = fs::read_to_string(f).expect("a source file");
        read += functions(&src).len();
        let name = f.strip_prefix(&root).unwrap_or(f).display().to_string();
        long.extend(too_long(&src, &name));
    }
    assert!(read > 1000, "found only {read} functions");
    assert!(
        long.is_empty(),
        "functions over {MAX_LINES} lines without a `// {KEPT_WHOLE} <why>` line above them:\n{}",
        long.join("\n")
    );
}

/// Every `.rs` file of the members' `src/`, `tests/` and `benches/` over [`MAX_FILE_LINES`]
/// lines, as `path (n lines)`.
fn long_files(root: &std::path::Path) -> (usize, Vec<String>) {
    let mut files = Vec::new();
    for m in members(root) {
        for dir in ["src", "tests", "benches"] {
            rust_files(&m.join(dir), &mut files);
        }
    }
    files.sort();
    let long = files
        .iter()
        .filter_map(|f| {
            let n = fs::read_to_string(f)
                .expect("a source file")
                .lines()
                .count();
            let name = f.strip_prefix(root).unwrap_or(f).display().to_string();
            (n > MAX_FILE_LINES).then(|| format!("{name} ({n} lines)"))
        })
        .collect();
    (files.len(), long)
}

#[test]
fn no_source_file_over_1000_lines() {
    let (read, long) = long_files(&root());
    assert!(read > 200, "read only {read} files");
    assert!(
        long.is_empty(),
        "files over {MAX_FILE_LINES} lines (split them by concern):\n{}",
        long.join("\n")
    );
}

#[test]
fn a_file_over_the_limit_is_reported() {
    let dir = temp_dir("function_length", "file_limit");
    let src = dir.join("crates/x/src");
    fs::create_dir_all(&src).unwrap();
    fs::write(
        dir.join("Cargo.toml"),
        "[workspace]\nmembers = [\"crates/x\"]\n",
    )
    .unwrap();
    fs::write(src.join("ok.rs"), "fn f() {}\n".repeat(MAX_FILE_LINES)).unwrap();
    fs::write(
        src.join("long.rs"),
        "fn f() {}\n".repeat(MAX_FILE_LINES + 1),
    )
    .unwrap();
    let (read, long) = long_files(&dir);
    fs::remove_dir_all(&dir).unwrap();
    assert_eq!(read, 2);
    assert_eq!(long, ["crates/x/src/long.rs (1001 lines)"]);
}

/// A function `name` of `body_lines` statement lines (`n + 2` lines with its signature and
/// closing brace), under `above`.
fn sample(above: &str, name: &str, body_lines: usize) -> String {
    let body = "    let x = 1;\n".repeat(body_lines);
    format!("{above}pub(crate) fn {name}<'a>(s: &'a str) -> [u8; 2] {{\n{body}}}\n")
}

#[test]
fn a_long_function_needs_a_reason_and_a_short_one_does_not() {
    assert_eq!(too_long(&sample("", "f", 98), "a.rs"), Vec::<String>::new());
    assert_eq!(
        too_long(&sample("", "f", 99), "a.rs"),
        ["a.rs:1 fn f (101 lines)"]
    );
    let why = "// Kept whole (> 100 lines): one drawing, top to bottom.\n/// Docs.\n#[inline]\n";
    assert!(too_long(&sample(why, "f", 150), "a.rs").is_empty());
    // The line must give a reason, and stand right above (not behind code).
    let empty = "// Kept whole (> 100 lines):\n";
    assert_eq!(too_long(&sample(empty, "f", 150), "a.rs").len(), 1);
    let far = "// Kept whole (> 100 lines): why.\nconst A: u8 = 1;\n";
    assert_eq!(too_long(&sample(far, "f", 150), "a.rs").len(), 1);
}

#[test]
fn braces_in_strings_comments_and_chars_are_not_code() {
    let src = "fn f() {\n    let s = \"}}}\";\n    let r = r#\"{ \"# ;\n    // }\n    /* { /* } */ } */\n    let c = '}';\n    let d = '\\u{7d}';\n    let l: &'static str = \"\";\n}\nfn g() {}\n";
    let fs = functions(src);
    assert_eq!(
        fs,
        [
            Function {
                name: "f".into(),
                line: 1,
                lines: 9
            },
            Function {
                name: "g".into(),
                line: 10,
                lines: 1
            }
        ]
    );
}

#[test]
fn declarations_and_function_pointers_are_not_functions() {
    let src = "trait T {\n    fn a(&self) -> [u8; 3];\n    fn b(&self) {}\n}\nstruct S { f: fn(u8) -> u8 }\n";
    let names: Vec<String> = functions(src).into_iter().map(|f| f.name).collect();
    assert_eq!(names, ["b"]);
}
