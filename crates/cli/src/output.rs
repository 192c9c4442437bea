//! Writing results: JSON to stdout, files written atomically (temp file, then rename), and the
//! timeline as a table.

use std::io::Write;
use std::path::Path;

use anyhow::Context;
use ditmem_budget::fmt_bytes;
use ditmem_budget::Timeline;
use serde::Serialize;

use crate::render::Table;

pub fn print_json<T: Serialize>(value: &T) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(value).context("serialising JSON")?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{text}").context("writing to stdout")?;
    Ok(())
}

/// Write `bytes` to `path` through a temporary file in the same folder and a rename, so that a
/// reader never sees a half-written file and an interrupted write leaves the old file intact.
#[allow(dead_code)]
pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .with_context(|| format!("'{}' is not a file path", path.display()))?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| -> anyhow::Result<()> {
        let mut f = std::fs::File::create(&tmp)
            .with_context(|| format!("cannot create '{}'", tmp.display()))?;
        f.write_all(bytes)
            .with_context(|| format!("cannot write '{}'", tmp.display()))?;
        f.sync_all().ok();
        std::fs::rename(&tmp, path)
            .with_context(|| format!("cannot move the output into '{}'", path.display()))?;
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

pub fn timeline_table(t: &Timeline) -> String {
    let mut table = Table::new(&[
        "#",
        "phase",
        "event",
        "mb",
        "live",
        "activations",
        "gradients",
        "workspace",
    ]);
    for (i, e) in t.events.iter().enumerate() {
        let mark = if i == t.peak_index { " ← peak" } else { "" };
        table.row(vec![
            i.to_string(),
            e.phase.name().into(),
            format!("{}{mark}", e.label),
            e.microbatch.to_string(),
            fmt_bytes(e.total()),
            fmt_bytes(e.live.activations),
            fmt_bytes(e.live.gradients),
            fmt_bytes(e.live.workspace),
        ]);
    }
    format!("\ntimeline\n{}", table.render())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_whole_file() {
        let dir = std::env::temp_dir().join(format!("ditmem-out-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("x.json");
        write_atomic(&p, b"first").unwrap();
        write_atomic(&p, b"second").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"second");
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn atomic_write_to_missing_dir_fails_cleanly() {
        let p = Path::new("/nonexistent-ditmem-dir/out.json");
        assert!(write_atomic(p, b"x").is_err());
    }
}
