//! Public items only where another crate uses them.
//!
//! Issue 45's house rule, beside the compiler's `unreachable_pub` (which each library crate
//! denies under CI's `-D warnings`): an item a crate exports (`pub` and reachable from its root)
//! is there for another crate. Every `pub fn`, `struct`, `enum`, `trait`, `const`, `type` or
//! `static` under `src/` of the library crates below must be
//! - named in the code of another member of the workspace (its sources, tests and benches, the
//!   Python binding's), or in the crate's own tests and benches (they use it from outside), or
//! - named in the definition of such an item (a field's type, a parameter or return type, a
//!   variant's payload), so that another crate reaches it through that item.
//!
//! Names are matched as whole words of code, comments and strings blanked: a name another crate
//! mentions only in a comment does not keep an item public. A method named like an item used
//! elsewhere passes (the match is by name, not by resolved path), so the check is lenient, never
//! strict: what it reports is `pub` for no other crate.
mod source_scan;

use source_scan::{blank, root, rust_files};
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

/// The library crates whose exports are held; the cli is the top (its library serves the binary
/// and the Python binding, which are read as users of the others).
const LIBRARIES: [&str; 4] = ["spec", "budget", "engine", "conformance"];
const KINDS: [&str; 8] = [
    "fn", "struct", "enum", "trait", "const", "type", "static", "union",
];

/// A `pub` item: file, 1-based line, name and the text of its definition (a function's
/// signature; a type's whole body).
#[derive(Debug)]
struct Item {
    file: String,
    line: usize,
    name: String,
    definition: String,
}

fn words(code: &str) -> BTreeSet<&str> {
    code.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .collect()
}

/// The `pub` items of one blanked file.
fn items(file: &str, code: &str) -> Vec<Item> {
    let mut found = Vec::new();
    let mut at = 0;
    for (n, line) in code.split_inclusive('\n').enumerate() {
        let start = at;
        at += line.len();
        let Some(rest) = line.trim_start().strip_prefix("pub ") else {
            continue;
        };
        let mut toks = rest.split_whitespace();
        let mut kind = toks.next().unwrap_or("");
        // `pub const fn`, `pub unsafe fn`, `pub async fn`, `pub extern "C" fn`
        while matches!(kind, "unsafe" | "async" | "extern")
            || (kind == "const" && rest.contains("const fn"))
        {
            kind = toks.next().unwrap_or("");
        }
        if !KINDS.contains(&kind) {
            continue;
        }
        let name: String = toks
            .next()
            .unwrap_or("")
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            continue;
        }
        let def = &code[start..];
        let stop = def.find(['{', ';']).unwrap_or(def.len());
        let end = if kind != "fn" && def[stop..].starts_with('{') {
            let mut depth = 0;
            def.char_indices()
                .skip_while(|(i, _)| *i < stop)
                .find(|(_, c)| {
                    match c {
                        '{' => depth += 1,
                        '}' => depth -= 1,
                        _ => {}
                    }
                    depth == 0
                })
                .map_or(def.len(), |(i, _)| i + 1)
        } else {
            stop
        };
        found.push(Item {
            file: file.to_string(),
            line: n + 1,
            name,
            definition: def[..end].to_string(),
        });
    }
    found
}

/// The items of `own` (file → blanked code) that no code in `others` names, directly or through
/// the definition of an item it names.
fn unused(own: &BTreeMap<String, String>, others: &str) -> Vec<String> {
    let outside = words(others);
    let all: Vec<Item> = own.iter().flat_map(|(f, c)| items(f, c)).collect();
    let mut used: BTreeSet<&str> = all
        .iter()
        .map(|i| i.name.as_str())
        .filter(|n| outside.contains(n))
        .collect();
    loop {
        let reached: BTreeSet<&str> = all
            .iter()
            .filter(|i| used.contains(i.name.as_str()))
            .flat_map(|i| words(&i.definition))
            .collect();
        let before = used.len();
        used.extend(
            all.iter()
                .map(|i| i.name.as_str())
                .filter(|n| reached.contains(n)),
        );
        if used.len() == before {
            break;
        }
    }
    all.iter()
        .filter(|i| !used.contains(i.name.as_str()))
        .map(|i| format!("{}:{} {}", i.file, i.line, i.name))
        .collect()
}

fn blanked(root: &Path, dir: &Path) -> BTreeMap<String, String> {
    let mut files = Vec::new();
    rust_files(dir, &mut files);
    files
        .into_iter()
        .map(|f| {
            let name = f.strip_prefix(root).unwrap_or(&f).display().to_string();
            (name, blank(&fs::read_to_string(&f).expect("a source file")))
        })
        .collect()
}

#[test]
fn every_exported_item_is_used_by_another_crate() {
    let root = root();
    let mut code = blanked(&root, &root.join("crates"));
    code.extend(blanked(&root, &root.join("python/src")));
    assert!(code.len() > 300, "read only {} files", code.len());
    let mut unused_items = Vec::new();
    let mut held = 0;
    for lib in LIBRARIES {
        let src = format!("crates/{lib}/src/");
        let own: BTreeMap<String, String> = code
            .iter()
            .filter(|(f, _)| f.starts_with(&src))
            .map(|(f, c)| (f.clone(), c.clone()))
            .collect();
        let others: String = code
            .iter()
            .filter(|(f, _)| !f.starts_with(&src))
            .map(|(_, c)| c.as_str())
            .collect::<Vec<_>>()
            .join("\n");
        held += own.values().map(|c| items("", c).len()).sum::<usize>();
        unused_items.extend(unused(&own, &others));
    }
    assert!(held > 500, "found only {held} pub items");
    assert!(
        unused_items.is_empty(),
        "pub items no other crate uses (make them pub(crate)):\n{}",
        unused_items.join("\n")
    );
}

#[test]
fn an_item_is_kept_public_by_a_use_elsewhere_or_through_a_used_item() {
    let own: BTreeMap<String, String> = [(
        "a.rs".to_string(),
        blank(
            "pub struct Report { pub part: Part }\npub struct Part(u8);\n\
             pub fn helper() -> u8 { 1 }\npub fn run(x: Input) -> Report { todo!() }\n\
             pub enum Input { A(Detail) }\npub struct Detail;\n\
             pub const UNUSED: u8 = 2; // Report\n",
        ),
    )]
    .into();
    // Another crate calls `run` and names `helper` only in a comment and a string.
    let others = blank("fn main() { a::run(todo!()); } // helper\nconst S: &str = \"UNUSED\";");
    assert_eq!(
        unused(&own, &others),
        ["a.rs:3 helper", "a.rs:7 UNUSED"],
        "run is used; Report, Input (its signature), Part and Detail (their bodies) are reached"
    );
}
