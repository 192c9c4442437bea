//! No import circles: no source file of any crate of the workspace uses an item of a file that
//! (directly or through other files) uses an item of it back.
//!
//! # What is read
//! Every `.rs` file reachable from a crate root of every member of the workspace (the root
//! `Cargo.toml`'s `members`: the crates under `crates/` and the Python binding) — `src/lib.rs`,
//! `src/main.rs`, each `tests/*.rs`, each `benches/*.rs` — by following `mod` declarations
//! (`#[path = "…"]` included). Comments and string literals are dropped first, so a path in a doc
//! comment or a `#[serde(with = "…")]` string is not a dependency.
//!
//! # What counts as an edge `a.rs → b.rs`
//! A path in `a.rs` that resolves to an item (a function, type, constant, macro…) defined in, or
//! re-exported by, `b.rs`:
//! - every `use` tree (`use crate::x::Y;`, `use super::Y;`, `use self::m::Y;`, grouped
//!   `use a::{b, c::d};`, `as` renames, globs `use super::*;`, the crate's own name
//!   `use ditmem_budget::spec::Spec;` from another crate, 2018-style relative `use child::Y;`),
//!   function-local ones included;
//! - every qualified path in code (`crate::timeline::simulate_step(…)`, `super::step::f(…)`,
//!   `child_module::f(…)`, and `m::f(…)` where `m` was bound by a `use` of a module).
//!
//! A path resolves through the module tree (declared modules and modules re-exported by `pub use`)
//! as deep as its segments name modules; the file of the last module reached is the target. A
//! `use` of a module alone is no edge; the paths through the name it binds are.
//!
//! # What does not count: `mod child;` alone
//! A parent's `mod child;` declaration is containment, not an edge: it places the child file in the
//! tree (the compiler's file inclusion) and does not make the parent's code depend on any item of
//! the child. Counted as an edge, every child that uses an item of its parent (`use super::X`,
//! the usual `use super::*` of a test module) would be a circle, every module tree would be one big
//! circle, and the test would say nothing. But a parent that *uses or re-exports* an item of its
//! child (`pub use child::X;`, `child::f()`) has an edge to it, so a parent re-exporting a child
//! item while that child uses the parent is a circle, and is reported.
//!
//! # What is not read: test modules
//! A module under `#[cfg(test)]` (inline `mod tests { … }`, or a file such as
//! `sharding_tests.rs`) is left out: it is built only into the crate's test harness, above
//! every file of its crate, as an integration test is; a test of `spec.rs` that builds a spec
//! through `denoiser.rs` says nothing about which of the two the library stands on. Integration
//! tests (`tests/*.rs`) and benches are read, as crates of their own.
//!
//! An edge from a file to itself is no circle.
//! A circle is a strongly connected component of two or more files; the test prints each with a
//! shortest cycle through it and the file:line of each edge.
mod module_tree;
mod source_scan;

use module_tree::{lex, workspace, Target, Tok, Tree};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

// ---------------------------------------------------------------- graph

/// file → file → the lines (`file:line path`) that make the edge.
type Graph = BTreeMap<PathBuf, BTreeMap<PathBuf, Vec<String>>>;

fn graph(tree: &Tree) -> Graph {
    let mut g: Graph = BTreeMap::new();
    for (id, m) in tree.mods.iter().enumerate() {
        g.entry(m.file.clone()).or_default();
        let mut add = |t: Option<Target>, path: &[String], line: usize| {
            if let Some(Target::Item(to)) = t {
                let to = &tree.mods[to].file;
                if *to != m.file {
                    g.entry(m.file.clone())
                        .or_default()
                        .entry(to.clone())
                        .or_default()
                        .push(format!("{}:{line} {}", m.file.display(), path.join("::")));
                }
            }
        };
        for (name, path, line) in &m.uses {
            let t = tree.resolve(id, path, &mut BTreeSet::new());
            // a glob of a module uses items of that module
            let t = match t {
                Some(Target::Mod(c)) if name.starts_with('*') => Some(Target::Item(c)),
                t => t,
            };
            add(t, path, *line);
        }
        for (path, line) in &m.paths {
            if path.len() < 2 {
                continue;
            }
            let t = tree.resolve(id, path, &mut BTreeSet::new());
            add(t, path, *line);
        }
        let _ = &m.crate_name;
    }
    g
}

/// Strongly connected components of two or more files (Tarjan).
fn circles(g: &Graph) -> Vec<Vec<PathBuf>> {
    let nodes: Vec<&PathBuf> = g.keys().collect();
    let index_of: HashMap<&PathBuf, usize> =
        nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let adj: Vec<Vec<usize>> = nodes
        .iter()
        .map(|n| {
            g[*n]
                .keys()
                .filter_map(|t| index_of.get(t).copied())
                .collect()
        })
        .collect();
    let n = nodes.len();
    let (mut index, mut low, mut on) = (vec![usize::MAX; n], vec![0; n], vec![false; n]);
    let (mut stack, mut next, mut out) = (Vec::new(), 0, Vec::new());
    // iterative Tarjan
    for s in 0..n {
        if index[s] != usize::MAX {
            continue;
        }
        let mut work: Vec<(usize, usize)> = vec![(s, 0)];
        index[s] = next;
        low[s] = next;
        next += 1;
        stack.push(s);
        on[s] = true;
        while let Some(&mut (v, ref mut k)) = work.last_mut() {
            if *k < adj[v].len() {
                let w = adj[v][*k];
                *k += 1;
                if index[w] == usize::MAX {
                    index[w] = next;
                    low[w] = next;
                    next += 1;
                    stack.push(w);
                    on[w] = true;
                    work.push((w, 0));
                } else if on[w] {
                    low[v] = low[v].min(index[w]);
                }
            } else {
                work.pop();
                if let Some(&(u, _)) = work.last() {
                    low[u] = low[u].min(low[v]);
                }
                if low[v] == index[v] {
                    let mut comp = Vec::new();
                    loop {
                        let w = stack.pop().unwrap();
                        on[w] = false;
                        comp.push(nodes[w].clone());
                        if w == v {
                            break;
                        }
                    }
                    if comp.len() > 1 {
                        comp.sort();
                        out.push(comp);
                    }
                }
            }
        }
    }
    out
}

/// A shortest cycle through the first file of a circle, with the lines of each edge.
fn describe(g: &Graph, comp: &[PathBuf], root: &Path) -> String {
    let inside: BTreeSet<&PathBuf> = comp.iter().collect();
    let s = &comp[0];
    // BFS from s back to s within the component
    let mut prev: BTreeMap<&PathBuf, &PathBuf> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([s]);
    let mut found = None;
    while let Some(v) = queue.pop_front() {
        for w in g[v].keys().filter(|w| inside.contains(w)) {
            if w == s {
                found = Some(v);
                break;
            }
            if !prev.contains_key(w) {
                prev.insert(w, v);
                queue.push_back(w);
            }
        }
        if found.is_some() {
            break;
        }
    }
    let rel = |p: &Path| p.strip_prefix(root).unwrap_or(p).display().to_string();
    let mut chain = Vec::new();
    let mut v = found.expect("a component of two or more files has a cycle through each file");
    while v != s {
        chain.push(v.clone());
        v = prev[v];
    }
    chain.reverse();
    let cycle: Vec<PathBuf> = std::iter::once(s.clone())
        .chain(chain)
        .chain([s.clone()])
        .collect();
    let mut text = format!(
        "circle of {} files: {}\n  shortest cycle: {}\n",
        comp.len(),
        comp.iter().map(|p| rel(p)).collect::<Vec<_>>().join(", "),
        cycle
            .iter()
            .map(|p| rel(p))
            .collect::<Vec<_>>()
            .join(" -> ")
    );
    for w in cycle.windows(2) {
        for why in g[&w[0]][&w[1]].iter().take(3) {
            text += &format!(
                "    {} -> {}: {}\n",
                rel(&w[0]),
                rel(&w[1]),
                why.replace(&format!("{}/", root.display()), "")
            );
        }
    }
    if std::env::var_os("DITMEM_CYCLES_ALL").is_some() {
        text += "  every edge inside it:\n";
        for a in comp {
            for (b, why) in g[a].iter().filter(|(b, _)| inside.contains(b)) {
                text += &format!(
                    "    {} -> {}: {}\n",
                    rel(a),
                    rel(b),
                    why.first()
                        .map(|w| w.replace(&format!("{}/", root.display()), ""))
                        .unwrap_or_default()
                );
            }
        }
    }
    text
}

/// The circles found: each one's files (relative to `root`) and its description.
fn check(root: &Path) -> (usize, usize, Vec<(BTreeSet<String>, String)>) {
    let tree = workspace(root);
    assert!(
        tree.problems.is_empty(),
        "unreadable module tree: {:#?}",
        tree.problems
    );
    let g = graph(&tree);
    let edges = g.values().map(|t| t.len()).sum();
    let rel = |p: &PathBuf| p.strip_prefix(root).unwrap_or(p).display().to_string();
    let found = circles(&g)
        .iter()
        .map(|c| (c.iter().map(rel).collect(), describe(&g, c, root)))
        .collect();
    (g.len(), edges, found)
}

/// Circles tolerated, each by its files: none since wave 3 (issue 45) broke the last two. Kept as
/// a ratchet for a circle that cannot be broken at once: a circle found must lie inside one of
/// these, and each of these must still be found. `docs/architecture.md` says which move broke
/// which. `DITMEM_CYCLES_ALL=1` prints every edge inside each circle found.
const KNOWN_CIRCLES: &[&[&str]] = &[];

#[test]
fn no_source_file_imports_a_file_that_imports_it_back() {
    // `DITMEM_CYCLES_ROOT=DIR` reads another checkout (an older commit's tree, to compare).
    let root = std::env::var_os("DITMEM_CYCLES_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."));
    let root = root.canonicalize().unwrap();
    if std::env::var_os("DITMEM_CYCLES_ROOT").is_none() {
        // Every library crate of this workspace is read, the spec and conformance crates and the
        // Python binding too.
        let tree = workspace(&root);
        for name in [
            "ditmem_spec",
            "ditmem_budget",
            "ditmem_engine",
            "ditmem_conformance",
            "ditmem",
            "ditmem_python",
        ] {
            assert!(tree.roots.contains_key(name), "crate {name} was not read");
        }
    }
    let (files, edges, found) = check(&root);
    // The walk really read the workspace (a broken walk would find no circle in nothing).
    assert!(files > 150, "only {files} files read");
    assert!(edges > 300, "only {edges} edges found");
    eprintln!(
        "{files} files, {edges} edges, {} circle(s):\n{}",
        found.len(),
        found
            .iter()
            .map(|(_, t)| t.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
    let known: Vec<BTreeSet<String>> = KNOWN_CIRCLES
        .iter()
        .map(|c| c.iter().map(|f| f.to_string()).collect())
        .collect();
    let new: Vec<&String> = found
        .iter()
        .filter(|(files, _)| !known.iter().any(|k| files.is_subset(k)))
        .map(|(_, text)| text)
        .collect();
    assert!(
        new.is_empty(),
        "{} new import circle(s) among {files} files and {edges} edges:\n{}",
        new.len(),
        new.iter()
            .map(|t| t.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
    let gone: Vec<&BTreeSet<String>> = known
        .iter()
        .filter(|k| !found.iter().any(|(files, _)| files.is_subset(k)))
        .collect();
    assert!(
        gone.is_empty(),
        "circles broken (good): remove them from KNOWN_CIRCLES: {gone:#?}"
    );
}

// ---------------------------------------------------------------- the checker's own tests

/// Writes a small workspace of one crate with `files` under `src/`, returns its root.
fn tiny(name: &str, files: &[(&str, &str)]) -> PathBuf {
    let root = std::env::temp_dir().join(format!("ditmem-cycles-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&root);
    let c = root.join("crates/toy");
    fs::create_dir_all(c.join("src")).unwrap();
    fs::write(c.join("Cargo.toml"), "[package]\nname = \"toy-crate\"\n").unwrap();
    for (p, text) in files {
        let f = c.join("src").join(p);
        fs::create_dir_all(f.parent().unwrap()).unwrap();
        fs::write(f, text).unwrap();
    }
    root
}

fn circles_in(name: &str, files: &[(&str, &str)]) -> Vec<String> {
    let root = tiny(name, files);
    let (_, _, found) = check(&root.canonicalize().unwrap());
    let _ = fs::remove_dir_all(&root);
    found.into_iter().map(|(_, text)| text).collect()
}

#[test]
fn siblings_using_each_other_are_a_circle() {
    let found = circles_in(
        "siblings",
        &[
            ("lib.rs", "pub mod a;\npub mod b;\n"),
            (
                "a.rs",
                "use crate::b::{Beta, other::Gamma};\npub struct Alpha;\n",
            ),
            (
                "b.rs",
                "pub mod other;\npub struct Beta;\npub fn f() { super::a::Alpha; }\n",
            ),
            ("b/other.rs", "pub struct Gamma;\n"),
        ],
    );
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].contains("a.rs") && found[0].contains("b.rs") && !found[0].contains("other.rs")
    );
}

#[test]
fn mod_declaration_alone_is_containment_not_an_edge() {
    let found = circles_in(
        "contain",
        &[
            ("lib.rs", "pub mod a;\npub mod b;\npub struct Root;\n"),
            (
                "a.rs",
                "use super::Root;\n#[cfg(test)]\nmod tests { use crate::b::Beta; }\n",
            ),
            ("b.rs", "use crate::a::*;\npub struct Beta;\n"),
        ],
    );
    assert!(found.is_empty(), "{found:?}");
}

#[test]
fn a_parent_re_exporting_a_child_that_uses_it_is_a_circle() {
    let found = circles_in(
        "reexport",
        &[
            ("lib.rs", "mod a;\npub use a::Alpha;\npub struct Root;\n"),
            ("a.rs", "use crate::Root;\npub struct Alpha;\n"),
        ],
    );
    assert_eq!(found.len(), 1, "{found:?}");
}

#[test]
fn module_aliases_globs_and_comments() {
    // `use crate::m;` then `m::f()` is an edge to m.rs; a path in a comment or string is not;
    // a glob of a module is an edge.
    let found = circles_in(
        "alias",
        &[
            ("lib.rs", "pub mod m;\npub mod n;\npub mod k;\n"),
            ("m.rs", "use crate::n;\npub fn f() { n::g(); }\n"),
            ("n.rs", "use crate::k::*;\npub fn g() {}\n"),
            (
                "k.rs",
                "// crate::m::f()\npub fn h() { let _ = \"crate::m::f\"; }\n",
            ),
        ],
    );
    assert!(found.is_empty(), "{found:?}");
    let found = circles_in(
        "alias2",
        &[
            ("lib.rs", "pub mod m;\npub mod n;\npub mod k;\n"),
            ("m.rs", "use crate::n;\npub fn f() { n::g(); }\n"),
            ("n.rs", "use crate::k::*;\npub fn g() {}\n"),
            ("k.rs", "pub fn h() { crate::m::f() }\n"),
        ],
    );
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].contains("circle of 3 files"), "{found:?}");
}

#[test]
fn the_lexer_keeps_strings_and_drops_comments_chars_numbers_and_lifetimes() {
    let src = "#[path = \"x/y.rs\"] mod r#m; // crate::a::f\n/* b::g /* nested */ */ \
               fn f<'a>(s: &'a str) { let _ = (b\"c::d\", b'e', '\\n', 1.5e3, r#\"q\"r\"#, br\"t\"); super::k::h() }";
    let toks: Vec<String> = lex(src)
        .iter()
        .map(|t| match &t.tok {
            Tok::Ident(s) => s.clone(),
            Tok::Str(s) => format!("{s:?}"),
            Tok::PathSep => "::".into(),
            Tok::Punct(c) => c.to_string(),
        })
        .collect();
    let want = "# [ path = \"x/y.rs\" ] mod m ; fn f < > ( s : & str ) { let _ = ( \"c::d\" , \
                , , , \"q\\\"r\" , \"t\" ) ; super :: k :: h ( ) }";
    assert_eq!(toks.join(" "), want);
    // Line numbers count the comment's line break.
    assert_eq!(
        lex(src)
            .iter()
            .find(|t| t.tok == Tok::Ident("fn".into()))
            .map(|t| t.line),
        Some(2)
    );
}
