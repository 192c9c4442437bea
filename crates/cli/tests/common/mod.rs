//! Shared helpers of the CLI tests: run the built binary, and a per-test temporary folder.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A command line's words, as the shell splits one without quotes: `argv("plan --gpu h100")`.
pub(crate) fn argv(line: &str) -> Vec<&str> {
    line.split_whitespace().collect()
}

/// [`argv`] of a line with `{}` words, each replaced by the next of `values` in order (kept
/// whole, spaces and all): `argv_with("estimate --preset {} --json", &[preset])`.
pub(crate) fn argv_with<'a>(line: &'a str, values: &[&'a str]) -> Vec<&'a str> {
    let mut next = values.iter();
    let words: Vec<&str> = line
        .split_whitespace()
        .map(|w| match w {
            "{}" => *next.next().expect("a value for each {}"),
            w => w,
        })
        .collect();
    assert!(next.next().is_none(), "more values than {{}} in {line:?}");
    words
}

/// Run `ditmem` with `args`: (exit code, stdout, stderr).
pub(crate) fn ditmem(args: &[&str]) -> (i32, String, String) {
    ditmem_env(&[], args)
}

/// Run `ditmem` with `args` and environment variables set for the child only.
pub(crate) fn ditmem_env(env: &[(&str, &str)], args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ditmem"))
        .envs(env.iter().copied())
        .args(args)
        .output()
        .expect("the binary runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Start `ditmem` with `args` and `stdin`, its stdout and stderr piped.
pub(crate) fn spawn_piped<S: AsRef<OsStr>>(args: &[S], stdin: Stdio) -> Child {
    Command::new(env!("CARGO_BIN_EXE_ditmem"))
        .args(args)
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs")
}

/// Wait for `child` until `deadline`, looking every `poll`: its exit status, or `None` for a child
/// still running at the deadline (then killed and reaped).
pub(crate) fn wait_until(
    child: &mut Child,
    deadline: Instant,
    poll: Duration,
) -> Option<ExitStatus> {
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(poll);
    }
}

/// Run `ditmem` with `args`, expect exit code `code` and a stderr that names `needle` (a
/// refusal names its flag or field): that stderr.
pub(crate) fn exits_naming(args: &[&str], code: i32, needle: &str) -> String {
    let (c, _, err) = ditmem(args);
    assert_eq!(c, code, "{args:?}: {err}");
    assert!(err.contains(needle), "{args:?}: {err}");
    err
}

/// Run `ditmem` with `args`: (exit code, its stdout read as JSON), whatever the code.
pub(crate) fn code_and_json(args: &[&str]) -> (i32, serde_json::Value) {
    let (code, out, err) = ditmem(args);
    let v = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {out}\nstderr: {err}"));
    (code, v)
}

/// Run `ditmem` with `args`, expect exit code `code`: its stdout read as JSON.
pub(crate) fn json_exit(args: &[&str], code: i32) -> serde_json::Value {
    let (c, v) = code_and_json(args);
    assert_eq!(c, code, "{args:?}: {v}");
    v
}

/// Run `ditmem` with `args` (exit 0): its stdout read as JSON.
pub(crate) fn json(args: &[&str]) -> serde_json::Value {
    json_exit(args, 0)
}

/// Run `ditmem` with `args` and `--json` (exit 0): its stdout read as JSON.
pub(crate) fn json_of(args: &[&str]) -> serde_json::Value {
    json(&[args, &["--json"]].concat())
}

/// A JSON array of strings (a command line, a list of changes) as `&str`s.
pub(crate) fn strs(v: &serde_json::Value) -> Vec<&str> {
    let list = v.as_array().unwrap_or_else(|| panic!("not an array: {v}"));
    list.iter()
        .map(|x| x.as_str().unwrap_or_else(|| panic!("not a string: {x}")))
        .collect()
}

/// Every line at most 100 characters (what a pipe, a log or an issue comment shows).
pub(crate) fn assert_fits_100(what: &str, out: &str) {
    for line in out.lines() {
        assert!(
            line.chars().count() <= 100,
            "{what}: a line of {} columns: {line}",
            line.chars().count()
        );
    }
}

/// A fresh folder for one test of one suite (process-unique).
pub(crate) fn temp_dir(suite: &str, test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ditmem-{suite}-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&d).expect("a temporary folder");
    d
}

/// Run `ditmem` with `args`: (exit code, stdout, the child's peak resident set in bytes), read
/// from the kernel's accounting of that one process (`wait4`'s `ru_maxrss`), so tests running at
/// once in this binary do not mix in.
#[cfg(target_os = "linux")]
pub(crate) fn ditmem_max_rss(args: &[&str]) -> (i32, String, u64) {
    use std::io::Read;
    use std::process::Stdio;
    // Reaped by `wait4` below, which `Child::wait` cannot replace: it alone returns the rusage.
    #[allow(clippy::zombie_processes)]
    let mut child = Command::new(env!("CARGO_BIN_EXE_ditmem"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the binary runs");
    let mut stdout = child.stdout.take().expect("piped");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        stdout.read_to_string(&mut s).map(|_| s)
    });
    let mut status = 0;
    // SAFETY: rusage is plain old data that wait4 overwrites; the pid is our own unwaited child.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = child.id() as libc::pid_t;
    // SAFETY: `status` and `usage` are ours to write for the call's duration.
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(r, pid, "wait4 on the child");
    let out = reader.join().expect("reader").expect("stdout is UTF-8");
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        -1
    };
    // Linux reports ru_maxrss in KiB.
    (code, out, usage.ru_maxrss as u64 * 1024)
}
