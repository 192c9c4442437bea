//! The workspace's module tree as `no_import_cycles.rs` reads it: a small lexer (`lex`), the
//! modules of every crate root followed through `mod` declarations (`Tree`, built by
//! `workspace`), what each module defines, binds by `use` and names by path, and how a path
//! resolves to the file that defines its item (`Tree::resolve`, `Target`). The graph of those
//! edges and its circles are the test's own (`no_import_cycles.rs`).

use super::source_scan::{members, pieces, Kind};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

// ---------------------------------------------------------------- lexing

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Tok {
    Ident(String),
    Str(String),
    PathSep,
    Punct(char),
}

#[derive(Clone, Debug)]
pub(crate) struct Token {
    pub(crate) tok: Tok,
    pub(crate) line: usize,
}

/// Rust tokens, with comments dropped and literals reduced to `Str` (string) or skipped (chars,
/// numbers): `source_scan::pieces` cuts the literals and comments, this tokenizes the code between
/// them. Good enough for `mod`, `use` and path expressions; not a full lexer.
pub(crate) fn lex(src: &str) -> Vec<Token> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    for p in pieces(&c) {
        match p.kind {
            Kind::Code => lex_code(&c[p.start..p.end], line, &mut out),
            Kind::Str => out.push(Token {
                tok: Tok::Str(c[p.text.0..p.text.1].iter().collect()),
                line,
            }),
            Kind::Comment | Kind::Char => {}
        }
        line += c[p.start..p.end].iter().filter(|&&ch| ch == '\n').count();
    }
    out
}

/// The tokens of a stretch of code (no comment or literal in it) starting on `line`: identifiers
/// (`r#name` as `name`), `::`, other punctuation; numbers and lifetimes skipped.
pub(crate) fn lex_code(c: &[char], mut line: usize, out: &mut Vec<Token>) {
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    let word = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '\'' {
            // A lifetime ('a, 'static): `pieces` leaves only those in code.
            i += 1;
            while word(at(i)) {
                i += 1;
            }
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i + if ch == 'r' && at(i + 1) == '#' { 2 } else { 0 };
            i = start;
            while word(at(i)) {
                i += 1;
            }
            out.push(Token {
                tok: Tok::Ident(c[start..i].iter().collect()),
                line,
            });
        } else if ch.is_ascii_digit() {
            while word(at(i)) || (at(i) == '.' && at(i + 1).is_ascii_digit()) {
                i += 1;
            }
        } else if ch == ':' && at(i + 1) == ':' {
            out.push(Token {
                tok: Tok::PathSep,
                line,
            });
            i += 2;
        } else {
            out.push(Token {
                tok: Tok::Punct(ch),
                line,
            });
            i += 1;
        }
    }
}

// ---------------------------------------------------------------- module tree

/// Keywords that define a module-level item named by the next identifier.
pub(crate) const ITEM_KEYWORDS: [&str; 8] = [
    "fn", "struct", "enum", "union", "trait", "type", "const", "static",
];

pub(crate) type ModId = usize;

#[derive(Debug)]
pub(crate) struct Module {
    pub(crate) crate_name: String,
    pub(crate) file: PathBuf,
    pub(crate) parent: Option<ModId>,
    /// Declared child modules (file or inline).
    pub(crate) children: BTreeMap<String, ModId>,
    /// Names bound by `use` in this module: name → (path, line). `*` globs are kept as `*`n.
    pub(crate) uses: Vec<(String, Vec<String>, usize)>,
    /// Qualified paths in code: (path, line).
    pub(crate) paths: Vec<(Vec<String>, usize)>,
    /// Names of the items defined at this module's level (`fn`, `struct`, `macro_rules!`…).
    pub(crate) defs: BTreeSet<String>,
}

pub(crate) struct Tree {
    pub(crate) mods: Vec<Module>,
    /// crate name (as written in paths) → root module. Several test roots share no name.
    pub(crate) roots: HashMap<String, ModId>,
    pub(crate) problems: Vec<String>,
}

impl Tree {
    pub(crate) fn new() -> Self {
        Tree {
            mods: Vec::new(),
            roots: HashMap::new(),
            problems: Vec::new(),
        }
    }

    /// Reads a crate from its root file; `name` is the name other crates write (`ditmem_budget`),
    /// or a private name for a test or bench root.
    pub(crate) fn add_crate(&mut self, name: &str, root: &Path) {
        let id = self.load_file(name, root, None, root.parent().unwrap().to_path_buf());
        if let Some(id) = id {
            self.roots.insert(name.to_string(), id);
        }
    }

    /// Loads `file` as a module; `dir` is where its `mod x;` children live.
    pub(crate) fn load_file(
        &mut self,
        krate: &str,
        file: &Path,
        parent: Option<ModId>,
        dir: PathBuf,
    ) -> Option<ModId> {
        let src = match fs::read_to_string(file) {
            Ok(s) => s,
            Err(e) => {
                self.problems.push(format!("{}: {e}", file.display()));
                return None;
            }
        };
        let toks = lex(&src);
        let id = self.new_mod(krate, file, parent);
        self.parse(krate, file, &toks, id, dir);
        Some(id)
    }

    pub(crate) fn new_mod(&mut self, krate: &str, file: &Path, parent: Option<ModId>) -> ModId {
        self.mods.push(Module {
            crate_name: krate.to_string(),
            file: file.to_path_buf(),
            parent,
            children: BTreeMap::new(),
            uses: Vec::new(),
            paths: Vec::new(),
            defs: BTreeSet::new(),
        });
        self.mods.len() - 1
    }

    pub(crate) fn parse(
        &mut self,
        krate: &str,
        file: &Path,
        toks: &[Token],
        root: ModId,
        root_dir: PathBuf,
    ) {
        // scope stack: (module, brace depth at which it closes, dir of its children)
        let mut stack: Vec<(ModId, usize, PathBuf)> = vec![(root, 0, root_dir)];
        let mut depth = 0usize;
        let mut path_attr: Option<String> = None;
        // where the last `#[cfg(test)]` began
        let mut cfg_test_at: Option<usize> = None;
        let mut i = 0;
        let ident = |k: usize| match toks.get(k) {
            Some(Token {
                tok: Tok::Ident(s), ..
            }) => Some(s.as_str()),
            _ => None,
        };
        let punct = |k: usize, p: char| matches!(toks.get(k), Some(Token { tok: Tok::Punct(q), .. }) if *q == p);
        while i < toks.len() {
            let (cur, _, ref cur_dir) = *stack.last().unwrap();
            let cur_dir = cur_dir.clone();
            match &toks[i].tok {
                Tok::Punct('{') => {
                    depth += 1;
                    i += 1;
                }
                Tok::Punct('}') => {
                    if stack.len() > 1 && stack.last().unwrap().1 == depth {
                        stack.pop();
                    }
                    depth = depth.saturating_sub(1);
                    i += 1;
                }
                Tok::Punct('#') => {
                    // #[path = "x.rs"]
                    let k = i + 1 + usize::from(punct(i + 1, '!'));
                    if punct(k, '[')
                        && ident(k + 1) == Some("cfg")
                        && punct(k + 2, '(')
                        && ident(k + 3) == Some("test")
                        && punct(k + 4, ')')
                    {
                        cfg_test_at = Some(i);
                    }
                    if punct(k, '[') && ident(k + 1) == Some("path") && punct(k + 2, '=') {
                        if let Some(Token {
                            tok: Tok::Str(s), ..
                        }) = toks.get(k + 3)
                        {
                            path_attr = Some(s.clone());
                        }
                    }
                    i += 1;
                }
                Tok::Ident(kw)
                    if ITEM_KEYWORDS.contains(&kw.as_str())
                        && depth == stack.last().unwrap().1
                        && ident(i + 1).is_some() =>
                {
                    self.mods[cur]
                        .defs
                        .insert(ident(i + 1).unwrap().to_string());
                    i += 1;
                }
                Tok::Ident(kw)
                    if kw == "macro_rules" && punct(i + 1, '!') && ident(i + 2).is_some() =>
                {
                    self.mods[cur]
                        .defs
                        .insert(ident(i + 2).unwrap().to_string());
                    i += 2;
                }
                Tok::Ident(kw) if kw == "mod" && ident(i + 1).is_some() => {
                    let name = ident(i + 1).unwrap().to_string();
                    let test_only = cfg_test_at.is_some_and(|a| {
                        toks[a..i]
                            .iter()
                            .all(|t| !matches!(t.tok, Tok::Punct(';' | '{' | '}')))
                    });
                    if test_only {
                        // a test module: not read (see the module docs)
                        path_attr = None;
                        i += 2;
                        if punct(i, '{') {
                            let mut d = 0usize;
                            while i < toks.len() {
                                match toks[i].tok {
                                    Tok::Punct('{') => d += 1,
                                    Tok::Punct('}') => d -= 1,
                                    _ => {}
                                }
                                i += 1;
                                if d == 0 {
                                    break;
                                }
                            }
                        }
                        continue;
                    }
                    if punct(i + 2, ';') {
                        let child_dir = cur_dir.join(&name);
                        let (cand, dir): (Vec<PathBuf>, Option<PathBuf>) = match path_attr.take() {
                            Some(p) => {
                                let base = if stack.len() == 1 {
                                    file.parent().unwrap().to_path_buf()
                                } else {
                                    cur_dir.clone()
                                };
                                let f = base.join(p);
                                let d = f.parent().unwrap().join(f.file_stem().unwrap());
                                (vec![f], Some(d))
                            }
                            None => (
                                vec![cur_dir.join(format!("{name}.rs")), child_dir.join("mod.rs")],
                                None,
                            ),
                        };
                        match cand.iter().find(|p| p.exists()) {
                            Some(f) => {
                                let d = dir.unwrap_or_else(|| child_dir.clone());
                                if let Some(child) = self.load_file(krate, f, Some(cur), d) {
                                    self.mods[cur].children.insert(name, child);
                                }
                            }
                            None => self
                                .problems
                                .push(format!("{}: `mod {name};` has no file", file.display())),
                        }
                        i += 3;
                    } else if punct(i + 2, '{') {
                        let child = self.new_mod(krate, file, Some(cur));
                        self.mods[cur].children.insert(name.clone(), child);
                        depth += 1;
                        stack.push((child, depth, cur_dir.join(&name)));
                        path_attr = None;
                        i += 3;
                    } else {
                        i += 1;
                    }
                }
                Tok::Ident(kw) if kw == "use" => {
                    let line = toks[i].line;
                    let mut j = i + 1;
                    if matches!(
                        toks.get(j),
                        Some(Token {
                            tok: Tok::PathSep,
                            ..
                        })
                    ) {
                        j += 1; // `use ::std::…` is external
                        while j < toks.len() && !punct(j, ';') {
                            j += 1;
                        }
                        i = j + 1;
                        continue;
                    }
                    let mut bindings = Vec::new();
                    j = parse_use_tree(toks, j, &mut Vec::new(), &mut bindings);
                    for (name, path) in bindings {
                        self.mods[cur].uses.push((name, path, line));
                    }
                    i = j + 1;
                }
                Tok::Ident(first)
                    if matches!(
                        toks.get(i + 1),
                        Some(Token {
                            tok: Tok::PathSep,
                            ..
                        })
                    ) && !matches!(
                        i.checked_sub(1).and_then(|k| toks.get(k)),
                        Some(Token {
                            tok: Tok::PathSep,
                            ..
                        })
                    ) && !matches!(
                        i.checked_sub(1).and_then(|k| toks.get(k)),
                        Some(Token {
                            tok: Tok::Punct('$'),
                            ..
                        })
                    ) =>
                {
                    let line = toks[i].line;
                    let mut path = vec![first.clone()];
                    let mut j = i + 1;
                    while matches!(
                        toks.get(j),
                        Some(Token {
                            tok: Tok::PathSep,
                            ..
                        })
                    ) {
                        match ident(j + 1) {
                            Some(s) => {
                                path.push(s.to_string());
                                j += 2;
                            }
                            None => break,
                        }
                    }
                    self.mods[cur].paths.push((path, line));
                    i = j;
                }
                _ => i += 1,
            }
        }
    }

    /// The module a path's leading segment names, seen from `m`, and how many segments it used.
    pub(crate) fn start(
        &self,
        m: ModId,
        path: &[String],
        seen: &mut BTreeSet<(ModId, String)>,
    ) -> Option<Target> {
        let first = path.first()?.as_str();
        match first {
            "crate" => Some(Target::Mod(self.root_of(m))),
            "self" => Some(Target::Mod(m)),
            "super" => self.mods[m].parent.map(Target::Mod),
            _ => {
                if let Some(&c) = self.mods[m].children.get(first) {
                    return Some(Target::Mod(c));
                }
                if let Some(t) = self.binding(m, first, seen) {
                    return Some(t);
                }
                self.roots.get(first).map(|&r| Target::Mod(r))
            }
        }
    }

    pub(crate) fn root_of(&self, mut m: ModId) -> ModId {
        while let Some(p) = self.mods[m].parent {
            m = p;
        }
        m
    }

    /// What the name `name` bound by a `use` in module `m` refers to.
    pub(crate) fn binding(
        &self,
        m: ModId,
        name: &str,
        seen: &mut BTreeSet<(ModId, String)>,
    ) -> Option<Target> {
        if !seen.insert((m, name.to_string())) {
            return None;
        }
        let (_, path, _) = self.mods[m].uses.iter().find(|(n, _, _)| n == name)?;
        self.resolve(m, path, seen)
    }

    /// Resolves a path seen from module `m`: the deepest module it names, or the module holding
    /// the item it names.
    pub(crate) fn resolve(
        &self,
        m: ModId,
        path: &[String],
        seen: &mut BTreeSet<(ModId, String)>,
    ) -> Option<Target> {
        let mut t = self.start(m, path, seen)?;
        for seg in &path[1..] {
            let cur = match t {
                Target::Mod(c) => c,
                Target::Item(_) => return Some(t),
            };
            if seg == "super" {
                t = Target::Mod(self.mods[cur].parent?);
                continue;
            }
            if seg == "self" || seg == "*" {
                continue;
            }
            t = self.member(cur, seg, seen);
        }
        Some(t)
    }
}

impl Tree {
    /// What `seg` names inside module `cur`: a child module, an item defined there, or what a
    /// (re-)export there names — followed to the file that defines it.
    pub(crate) fn member(
        &self,
        cur: ModId,
        seg: &str,
        seen: &mut BTreeSet<(ModId, String)>,
    ) -> Target {
        if let Some(&c) = self.mods[cur].children.get(seg) {
            return Target::Mod(c);
        }
        if self.mods[cur].defs.contains(seg) {
            return Target::Item(cur);
        }
        if let Some(t) = self.binding(cur, seg, seen) {
            return t;
        }
        // a name brought in by a glob (`pub use child::*;`) that its module defines or exports
        for (name, path, _) in &self.mods[cur].uses {
            if !name.starts_with('*') || !seen.insert((cur, name.clone())) {
                continue;
            }
            if let Some(Target::Mod(g)) = self.resolve(cur, path, seen) {
                if let t @ Target::Item(d) = self.member(g, seg, seen) {
                    if self.mods[d].defs.contains(seg) {
                        return t;
                    }
                }
            }
        }
        // not found (a macro-made item, an enum variant…): count it as `cur`'s
        Target::Item(cur)
    }
}

#[derive(Clone, Copy, Debug)]
pub(crate) enum Target {
    /// The path names a module (a `use` of it binds a name; no edge by itself).
    Mod(ModId),
    /// The path names an item of this module.
    Item(ModId),
}

/// Parses one use tree from `toks[j]`; pushes (bound name, full path); returns the index of the
/// token after the tree (`;`, `,` or `}`).
pub(crate) fn parse_use_tree(
    toks: &[Token],
    mut j: usize,
    prefix: &mut Vec<String>,
    out: &mut Vec<(String, Vec<String>)>,
) -> usize {
    let start_len = prefix.len();
    loop {
        match toks.get(j).map(|t| &t.tok) {
            Some(Tok::Ident(s)) => {
                prefix.push(s.clone());
                j += 1;
                if matches!(toks.get(j).map(|t| &t.tok), Some(Tok::PathSep)) {
                    j += 1;
                    continue;
                }
                // end of a simple path, maybe `as name`
                let mut name = prefix.last().unwrap().clone();
                if matches!(toks.get(j).map(|t| &t.tok), Some(Tok::Ident(k)) if k == "as") {
                    if let Some(Tok::Ident(n)) = toks.get(j + 1).map(|t| &t.tok) {
                        name = n.clone();
                    }
                    j += 2;
                }
                if name == "self" {
                    prefix.pop();
                    name = prefix.last().cloned().unwrap_or_default();
                }
                out.push((name, prefix.clone()));
                break;
            }
            Some(Tok::Punct('*')) => {
                prefix.push("*".into());
                out.push((format!("*{}", out.len()), prefix.clone()));
                j += 1;
                break;
            }
            Some(Tok::Punct('{')) => {
                j += 1;
                loop {
                    j = parse_use_tree(toks, j, prefix, out);
                    match toks.get(j).map(|t| &t.tok) {
                        Some(Tok::Punct(',')) => {
                            j += 1;
                            if matches!(toks.get(j).map(|t| &t.tok), Some(Tok::Punct('}'))) {
                                j += 1;
                                break;
                            }
                        }
                        Some(Tok::Punct('}')) => {
                            j += 1;
                            break;
                        }
                        _ => break,
                    }
                }
                break;
            }
            _ => break,
        }
    }
    prefix.truncate(start_len);
    j
}

/// Reads every crate of the workspace ([`members`]; each root file: src/lib.rs, src/main.rs,
/// tests/*.rs, benches/*.rs).
pub(crate) fn workspace(root: &Path) -> Tree {
    let mut tree = Tree::new();
    let mut crates = members(root);
    crates.sort();
    // libraries first, so that other roots resolve their names
    for dir in &crates {
        let Ok(manifest) = fs::read_to_string(dir.join("Cargo.toml")) else {
            continue;
        };
        let name = manifest
            .lines()
            .find_map(|l| {
                l.trim()
                    .strip_prefix("name = \"")
                    .and_then(|r| r.strip_suffix('"'))
            })
            .unwrap_or("?")
            .replace('-', "_");
        if dir.join("src/lib.rs").exists() {
            tree.add_crate(&name, &dir.join("src/lib.rs"));
        }
    }
    for dir in &crates {
        let mut roots = Vec::new();
        if dir.join("src/main.rs").exists() {
            roots.push(dir.join("src/main.rs"));
        }
        for sub in ["tests", "benches"] {
            if let Ok(d) = fs::read_dir(dir.join(sub)) {
                let mut fs: Vec<PathBuf> = d
                    .filter_map(|e| e.ok())
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|e| e == "rs"))
                    .collect();
                fs.sort();
                roots.extend(fs);
            }
        }
        for r in roots {
            // a private name: `#` cannot start a path segment
            tree.add_crate(&format!("#{}", r.display()), &r);
        }
    }
    tree
}
