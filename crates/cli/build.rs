//! Records build facts that a run's conditions report: the candle version pinned in Cargo.lock
//! and the git revision of the source.

use std::process::Command;

fn main() {
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
    let root = std::path::Path::new(&manifest).join("../..");
    let lock = std::fs::read_to_string(root.join("Cargo.lock")).unwrap_or_default();
    let mut candle = "unknown".to_string();
    let mut lines = lock.lines();
    while let Some(l) = lines.next() {
        if l.trim() == "name = \"candle-core\"" {
            if let Some(v) = lines
                .next()
                .and_then(|v| v.trim().strip_prefix("version = "))
            {
                candle = v.trim_matches('"').to_string();
            }
            break;
        }
    }
    println!("cargo:rustc-env=DITMEM_CANDLE_VERSION={candle}");
    let rev = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(&root)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let dirty = Command::new("git")
        .args(["status", "--porcelain", "--untracked-files=no"])
        .current_dir(&root)
        .output()
        .ok()
        .is_some_and(|o| !o.stdout.is_empty());
    println!(
        "cargo:rustc-env=DITMEM_GIT_REV={rev}{}",
        if dirty { "+dirty" } else { "" }
    );
    println!("cargo:rerun-if-changed=../../Cargo.lock");
    // The git folder's HEAD and index (a worktree's `.git` is a file naming its own folder): a
    // path that does not exist would make Cargo rerun this script, and rebuild the crate, on
    // every build; a source tree without git watches nothing.
    let git_dir = Command::new("git")
        .args(["rev-parse", "--absolute-git-dir"])
        .current_dir(&root)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| std::path::PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    if let Some(dir) = git_dir {
        for name in ["HEAD", "index"] {
            let path = dir.join(name);
            if path.exists() {
                println!("cargo:rerun-if-changed={}", path.display());
            }
        }
    }
}
