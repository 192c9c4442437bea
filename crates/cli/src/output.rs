//! Writing results: JSON to stdout, files checked before any work and written atomically (temp
//! file, then rename; only over regular files or new paths), and the timeline as a table.

use std::io::Write;
use std::path::Path;

use anyhow::Context;
use ditmem_budget::{fmt_bytes, Phase, SpecError, Timeline};
use serde::Serialize;

use crate::render::Table;

pub fn print_json<T: Serialize>(value: &T) -> anyhow::Result<()> {
    let captured = CAPTURE.with(|c| {
        c.borrow_mut().as_mut().map(|cap| -> anyhow::Result<()> {
            cap.json = Some(serde_json::to_value(value).context("serialising JSON")?);
            Ok(())
        })
    });
    if let Some(done) = captured {
        return done;
    }
    let mut text = serde_json::to_string_pretty(value).context("serialising JSON")?;
    text.push('\n');
    say(&text)
}

/// What a command printed while [`capture`] held its output: the `--json` value and any text.
#[derive(Debug, Default)]
pub struct Captured {
    pub json: Option<serde_json::Value>,
    pub text: String,
}

thread_local! {
    /// Set while [`capture`] runs a command on this thread: its output goes here, not to stdout.
    static CAPTURE: std::cell::RefCell<Option<Captured>> = const { std::cell::RefCell::new(None) };
}

/// Run `f` with this thread's standard output ([`say`], [`print_json`]) kept instead of
/// printed: the API (`ditmem serve`, the Python package) runs the very commands the CLI runs and
/// takes their `--json` value. Errors (stderr, [`note`]) are not captured.
pub fn capture<R>(f: impl FnOnce() -> R) -> (R, Captured) {
    let previous = CAPTURE.with(|c| c.borrow_mut().replace(Captured::default()));
    // Restores the previous sink even if `f` unwinds.
    struct Restore(Option<Option<Captured>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(prev) = self.0.take() {
                CAPTURE.with(|c| *c.borrow_mut() = prev);
            }
        }
    }
    let mut restore = Restore(Some(previous));
    let r = f();
    let prev = restore.0.take().unwrap_or(None);
    let got = CAPTURE.with(|c| std::mem::replace(&mut *c.borrow_mut(), prev));
    (r, got.unwrap_or_default())
}

/// Set once stdout's reader has gone (a broken pipe): later output is dropped.
static STDOUT_CLOSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The one path every command's standard output takes. A write that fails is an error (exit 1,
/// "writing to stdout: No space left on device"); a reader that has gone (`ditmem … | head -3`,
/// a broken pipe) is not: like a Unix filter, the rest of the output is dropped quietly and the
/// command finishes its work (files it was asked to write are still written) and exits 0.
/// `print!` would panic in both cases.
pub fn say(text: &str) -> anyhow::Result<()> {
    use std::sync::atomic::Ordering;
    let captured = CAPTURE.with(|c| {
        c.borrow_mut()
            .as_mut()
            .map(|cap| cap.text.push_str(text))
            .is_some()
    });
    if captured {
        return Ok(());
    }
    if STDOUT_CLOSED.load(Ordering::Relaxed) {
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            STDOUT_CLOSED.store(true, Ordering::Relaxed);
            Ok(())
        }
        Err(e) => Err(anyhow::Error::new(e).context("writing to stdout")),
        Ok(()) => Ok(()),
    }
}

/// A line for standard error (errors, warnings, progress) that never panics: when stderr itself
/// cannot be written there is no one left to tell, so the failure is dropped.
pub fn note(text: &str) {
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(text.as_bytes()).and_then(|()| err.flush());
}

/// What a path that exists but is not a regular file is, for messages.
pub fn file_kind(ft: std::fs::FileType) -> &'static str {
    use std::fs::FileType;
    use std::os::unix::fs::FileTypeExt;
    type IsKind = fn(&FileType) -> bool;
    let kinds: [(IsKind, &'static str); 7] = [
        (FileType::is_symlink, "a symbolic link"),
        (FileType::is_dir, "a directory"),
        (FileType::is_fifo, "a FIFO (named pipe)"),
        (FileType::is_char_device, "a character device"),
        (FileType::is_block_device, "a block device"),
        (FileType::is_socket, "a socket"),
        (FileType::is_file, "a regular file"),
    ];
    kinds
        .iter()
        .find(|(is, _)| is(&ft))
        .map_or("not a regular file", |&(_, kind)| kind)
}

pub(crate) fn folder_of(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Longest file name most Linux file systems take (NAME_MAX), in bytes.
const NAME_MAX: usize = 255;

/// The temporary file an output is written to before the rename: `.{name}.{pid}.tmp` in the
/// same folder, the name's bytes as they are (not lossily re-encoded). A name too long for that
/// (a valid name of up to 255 bytes plus the dot and the suffix can pass NAME_MAX) keeps its
/// first bytes and a hash of the whole name instead, so every valid name has a temporary name
/// of at most 255 bytes that no other output of this process shares.
fn temp_path(dir: &Path, name: &std::ffi::OsStr) -> std::path::PathBuf {
    use std::hash::{Hash, Hasher};
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    let suffix = format!(".{}.tmp", std::process::id());
    let bytes = name.as_bytes();
    let mut out = Vec::with_capacity(NAME_MAX);
    out.push(b'.');
    if 1 + bytes.len() + suffix.len() <= NAME_MAX {
        out.extend_from_slice(bytes);
    } else {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        bytes.hash(&mut h);
        let tag = format!("~{:016x}", h.finish());
        let keep = NAME_MAX - 1 - suffix.len() - tag.len();
        out.extend_from_slice(&bytes[..keep.min(bytes.len())]);
        out.extend_from_slice(tag.as_bytes());
    }
    out.extend_from_slice(suffix.as_bytes());
    dir.join(std::ffi::OsString::from_vec(out))
}

/// Whether `path` names a folder rather than a file the way the rename reads it: it ends in a
/// slash (`out/new/`), in `/.` or `/..`, or is `.`/`..` itself. `Path::file_name` reads past a
/// trailing slash (`out/new/` has the name `new`), but `rename(2)` onto such a path fails with
/// "Not a directory" after the work is done.
fn names_a_folder(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let b = path.as_os_str().as_bytes();
    b.ends_with(b"/") || b.ends_with(b"/.") || b.ends_with(b"/..") || b == b"." || b == b".."
}

/// Check that `flag`'s output `path` can be written, before any work: its folder exists and is
/// writable, and the path is new or a regular file.
///
/// A target that exists and is anything else is refused: a device node, FIFO, socket or
/// directory would be replaced by the rename (as root, `/dev/full` would become a regular file).
/// A symbolic link is refused too, even one to a regular file: the rename would replace the link
/// itself, and writing through it instead would put the output where the link points, which the
/// user did not name; the message says to name the link's target.
pub fn check_output(flag: &str, path: &Path) -> Result<(), SpecError> {
    let shown = || crate::flags::show(&path.display().to_string());
    let bad = |why: String| SpecError::invalid(flag, format!("{} {why}", shown()));
    if names_a_folder(path) {
        return Err(bad(
            "names a folder (it ends in a slash, `.` or `..`); allowed: a file path, e.g. \
             out/plan.toml"
                .into(),
        ));
    }
    let name = path.file_name().ok_or_else(|| {
        bad("is not a file path; allowed: a file name in an existing folder".into())
    })?;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            return Err(bad(
                "is a symbolic link; allowed: a regular file or a new path (name the link's \
                 target instead)"
                    .into(),
            ))
        }
        Ok(m) if !m.file_type().is_file() => {
            return Err(bad(format!(
                "is {}; allowed: a regular file or a new path",
                file_kind(m.file_type())
            )))
        }
        Ok(_) => {}
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
            ) => {}
        Err(e) => {
            return Err(bad(format!(
                "cannot be inspected ({e}); allowed: a writable path"
            )))
        }
    }
    let dir = folder_of(path);
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(m) => {
            return Err(bad(format!(
                "is in {} that is {}; allowed: a path in an existing folder",
                crate::flags::show(&dir.display().to_string()),
                file_kind(m.file_type())
            )))
        }
        Err(_) => {
            return Err(bad(format!(
                "is in a folder that does not exist ({}); allowed: a path in an existing folder",
                crate::flags::show(&dir.display().to_string())
            )))
        }
    }
    // Writable: the output goes through a temporary file in that folder, so try one.
    let probe = temp_path(dir, name);
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
    {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(bad(format!(
            "cannot be written in its folder ({e}); allowed: a path in a writable folder"
        ))),
    }
}

/// Check every output path of a command at once (see [`check_output`]).
pub fn check_outputs(outputs: &[(&str, Option<&Path>)]) -> Result<(), SpecError> {
    for (flag, path) in outputs {
        if let Some(p) = path {
            check_output(flag, p)?;
        }
    }
    Ok(())
}

/// Write `flag`'s output to `path`: checked again (see [`check_output`]), then written to a new
/// temporary file in the same folder and renamed over the path, so that a reader never sees a
/// half-written file and an interrupted write leaves the old file intact.
pub fn write_output(flag: &str, path: &Path, bytes: &[u8]) -> Result<(), crate::CliError> {
    check_output(flag, path)?;
    write_atomic(path, bytes)?;
    Ok(())
}

/// The temporary file and the rename, without the checks (for paths this program made).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let dir = folder_of(path);
    let name = path
        .file_name()
        .with_context(|| format!("'{}' is not a file path", path.display()))?;
    let tmp = temp_path(dir, name);
    let result = (|| -> anyhow::Result<()> {
        // create_new: never follow a link planted at the temporary name.
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
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
    let last_laid_out = t.events.iter().rposition(|e| {
        t.repeated
            .is_some_and(|r| e.microbatch == r.as_microbatch && e.phase != Phase::Optimizer)
    });
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
        if let (Some(r), Some(true)) = (t.repeated, last_laid_out.map(|j| j == i)) {
            // The microbatches that are not laid out, in one row where they would be.
            table.row(vec![
                "…".into(),
                e.phase.name().into(),
                r.describe(),
                format!("{}..={}", r.first, r.last),
                String::new(),
                String::new(),
                String::new(),
                String::new(),
            ]);
        }
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
    fn every_valid_name_has_a_short_temporary_name() {
        use std::os::unix::ffi::OsStrExt;
        let dir = std::env::temp_dir().join(format!("ditmem-long-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for n in [1, 200, 240, 250, 255] {
            let name = "n".repeat(n);
            let tmp = temp_path(&dir, std::ffi::OsStr::new(&name));
            assert!(tmp.file_name().unwrap().as_bytes().len() <= NAME_MAX, "{n}");
            let p = dir.join(&name);
            check_output("--out", &p).unwrap();
            write_atomic(&p, b"x").unwrap();
            assert_eq!(std::fs::read(&p).unwrap(), b"x");
        }
        // Two long names that share their first bytes get different temporary names.
        let a = temp_path(&dir, std::ffi::OsStr::new(&format!("{}a", "n".repeat(250))));
        let b = temp_path(&dir, std::ffi::OsStr::new(&format!("{}b", "n".repeat(250))));
        assert_ne!(a, b);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_trailing_slash_is_refused_before_the_work() {
        for p in ["out/new/", "file.txt/", "./", ".", "..", "a/..", "a/."] {
            let e = check_output("--out", Path::new(p)).unwrap_err();
            assert_eq!(e.field(), Some("--out"), "{p}");
        }
        assert!(names_a_folder(Path::new("x/")));
        assert!(!names_a_folder(Path::new("x/y.json")));
    }

    #[test]
    fn atomic_write_to_missing_dir_fails_cleanly() {
        let p = Path::new("/nonexistent-ditmem-dir/out.json");
        assert!(write_atomic(p, b"x").is_err());
    }
}
