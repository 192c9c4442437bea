//! The source layout the docs describe is the tree: every file or folder that `README.md` and
//! `docs/architecture.md` name in backticks exists.
//!
//! A backticked span is a path when it has no space and either a `/` or a file extension of the
//! repository's kinds (`.rs`, `.md`, `.py`, …); spans with placeholders (`<family>`, `*`, `{…}`),
//! Rust paths (`a::b`), URL paths (`/api/plan`) and calls are not paths, and what the build makes
//! (`target/…`, a `.venv`) is not held. The docs name a file relative to the folder they are
//! describing (`ops/sizes.rs` in the `ditmem-cpu` runtime's row), so a path resolves when it is
//! the tail of a path in the tree: `ops/sizes.rs` is
//! `crates/budget/src/runtime/ditmem_cpu/ops/sizes.rs`, and a bare `spec.rs` any file of that name.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// Named on purpose though not in the tree: what the architecture doc replaced, a file that became
/// a folder (the history of the import circles), and the user's own diffusers config.
const NOT_IN_TREE: [&str; 3] = ["shared/DESIGN.md", "compare_cmd.rs", "config.json"];

const EXTENSIONS: [&str; 11] = [
    "rs", "md", "py", "sh", "toml", "json", "yaml", "txt", "svg", "png", "html",
];

/// A folder the build makes (cargo's `target/`, the virtualenvs, caches): a fresh clone has none,
/// so a doc may name what is in it (`target/release/ditmem`, `python/.venv`) without the test
/// holding it.
fn build_output(segment: &str) -> bool {
    segment == "target"
        || segment.starts_with(".venv")
        || ["node_modules", "__pycache__"].contains(&segment)
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository root")
}

/// Every file and folder under `dir`, as paths relative to `root` with `/` separators (git's own
/// folder left out, build outputs not entered).
fn tree(root: &Path, dir: &Path, out: &mut BTreeSet<String>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name == ".git" || name == ".pytest_cache" || build_output(&name) {
            continue;
        }
        let p = e.path();
        if p.is_dir() {
            tree(root, &p, out);
        }
        let rel = p.strip_prefix(root).expect("under the root");
        out.insert(rel.to_string_lossy().replace('\\', "/"));
    }
}

/// The backticked spans of `text` that are paths (see the module doc).
fn paths_named(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|s| !s.is_empty() && !s.contains(char::is_whitespace))
        .filter(|s| !s.contains("::") && !s.contains("://"))
        .filter(|s| !s.contains(['<', '>', '*', '{', '}', '(', '=', '$', '|', ',']))
        .filter(|s| !s.starts_with(['-', '/']))
        .filter(|s| !s.split('/').any(build_output))
        .filter(|s| {
            s.contains('/')
                || s.rsplit_once('.')
                    .is_some_and(|(stem, ext)| !stem.is_empty() && EXTENSIONS.contains(&ext))
        })
        .map(str::to_string)
        .collect()
}

/// Every path under `root` (see [`tree`]).
fn tree_of(root: &Path) -> BTreeSet<String> {
    let mut all = BTreeSet::new();
    tree(root, root, &mut all);
    all
}

/// The paths of `text` that are the tail of none of `all` (see the module doc).
fn missing(text: &str, all: &BTreeSet<String>) -> Vec<String> {
    paths_named(text)
        .into_iter()
        .filter(|p| !NOT_IN_TREE.contains(&p.as_str()))
        .filter(|p| {
            let rel = p.trim_end_matches('/');
            let tail = format!("/{rel}");
            !all.iter().any(|t| t == rel || t.ends_with(&tail))
        })
        .collect()
}

#[test]
fn every_path_the_layout_docs_name_exists() {
    let root = repo();
    let all = tree_of(&root);
    let mut checked = 0;
    for doc in ["README.md", "docs/architecture.md"] {
        let text = fs::read_to_string(root.join(doc)).expect("the doc");
        checked += paths_named(&text).len();
        let gone = missing(&text, &all);
        assert!(
            gone.is_empty(),
            "{doc} names paths that are not in the tree (moved or deleted? update the doc): {gone:?}"
        );
    }
    // The scan really read the layout (a broken split would check nothing).
    assert!(checked > 150, "only {checked} paths named");
}

#[test]
fn a_path_that_is_not_there_is_reported_and_other_spans_are_not_paths() {
    let root = repo();
    let text = "`crates/budget/src/plan/` `ops/sizes.rs` `spec.rs` `crates/gone/src/x.rs` \
                `nowhere.rs` `ps/sizes.rs` `families/<family>/` `ditmem plan` `a::b` `--json` `0.5` `e.g` \
                `/api/plan` `target/release/ditmem` `python/.venv`";
    // A tail must end at a folder boundary: `ps/sizes.rs` is not `ops/sizes.rs`.
    assert_eq!(
        missing(text, &tree_of(&root)),
        ["crates/gone/src/x.rs", "nowhere.rs", "ps/sizes.rs"]
    );
    assert_eq!(
        paths_named(text),
        [
            "crates/budget/src/plan/",
            "ops/sizes.rs",
            "spec.rs",
            "crates/gone/src/x.rs",
            "nowhere.rs",
            "ps/sizes.rs"
        ]
    );
}
