//! Results that stay findable: every run folder `bench/<peer>/runs/<date>-<cpu>-<label>/` is cited.
//!
//! A run is cited when its folder name (or a file name found in no other run) appears in a file
//! outside the run folders — a doc, a README, the CHANGELOG, a script, a test — or in the notes of
//! `bench/torch_peer/runs/README.md` (its prose, not the rows of its file index, which lists every
//! file and so would cite everything), or in a run that is itself cited. A run nothing cites is a
//! notebook page: delete it (git keeps it) or cite it where its figures are used.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The text of every file under `dir`, skipping what git ignores here (build output, virtualenvs,
/// browser profiles) and files too large to be prose.
fn texts(dir: &Path, out: &mut Vec<(PathBuf, String)>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.')
            || ["target", "node_modules", "wheels", "__pycache__"].contains(&name.as_str())
        {
            continue;
        }
        if p.is_dir() {
            texts(&p, out);
        } else if e.metadata().map(|m| m.len() < 4 << 20).unwrap_or(false) {
            if let Ok(t) = fs::read_to_string(&p) {
                out.push((p, t));
            }
        }
    }
}

#[test]
fn every_run_folder_is_cited() {
    let root = repo();
    let mut runs: BTreeMap<PathBuf, Vec<String>> = BTreeMap::new();
    let bench = root.join("bench");
    for peer in fs::read_dir(&bench).unwrap().flatten() {
        let Ok(dirs) = fs::read_dir(peer.path().join("runs")) else {
            continue;
        };
        for d in dirs.flatten().filter(|d| d.path().is_dir()) {
            let files = fs::read_dir(d.path())
                .unwrap()
                .flatten()
                .map(|f| f.file_name().to_string_lossy().into_owned())
                .collect();
            runs.insert(d.path(), files);
        }
    }
    assert!(
        runs.len() > 10,
        "found only {} run folders under {}",
        runs.len(),
        bench.display()
    );
    // A file name is a key only where one run holds it and it is distinctive.
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for files in runs.values() {
        for f in files {
            *seen.entry(f.as_str()).or_default() += 1;
        }
    }
    let keys: BTreeMap<&PathBuf, Vec<String>> = runs
        .iter()
        .map(|(dir, files)| {
            let mut k = vec![dir.file_name().unwrap().to_string_lossy().into_owned()];
            k.extend(
                files
                    .iter()
                    .filter(|f| seen[f.as_str()] == 1 && f.len() > 14)
                    .cloned(),
            );
            (dir, k)
        })
        .collect();

    let mut all = Vec::new();
    texts(&root, &mut all);
    let index = bench.join("torch_peer/runs/README.md");
    let in_run = |p: &Path| runs.keys().find(|d| p.starts_with(d));
    let mut citing = String::new();
    let mut run_text: BTreeMap<&PathBuf, String> = BTreeMap::new();
    for (p, t) in &all {
        if p.canonicalize().ok() == index.canonicalize().ok() {
            for line in t.lines().filter(|l| !l.starts_with("| 2026")) {
                citing.push_str(line);
                citing.push('\n');
            }
        } else if let Some(d) = in_run(p) {
            run_text.entry(d).or_default().push_str(t);
        } else {
            citing.push_str(t);
        }
    }
    let mut cited: BTreeSet<&PathBuf> = BTreeSet::new();
    loop {
        let before = cited.len();
        for (d, k) in &keys {
            if !cited.contains(d) && k.iter().any(|k| citing.contains(k.as_str())) {
                cited.insert(d);
                if let Some(t) = run_text.get(d) {
                    citing.push_str(t);
                }
            }
        }
        if cited.len() == before {
            break;
        }
    }
    let uncited: Vec<String> = keys
        .keys()
        .filter(|d| !cited.contains(*d))
        .map(|d| d.strip_prefix(&root).unwrap_or(d).display().to_string())
        .collect();
    assert!(
        uncited.is_empty(),
        "{} run folder(s) that nothing cites (cite each where its figures are used, or delete it):\n{}",
        uncited.len(),
        uncited.join("\n")
    );
}
