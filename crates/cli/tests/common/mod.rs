//! Shared helpers of the CLI tests: run the built binary, and a per-test temporary folder.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

/// Run `ditmem` with `args`: (exit code, stdout, stderr).
pub fn ditmem(args: &[&str]) -> (i32, String, String) {
    ditmem_env(&[], args)
}

/// Run `ditmem` with `args` and environment variables set for the child only.
pub fn ditmem_env(env: &[(&str, &str)], args: &[&str]) -> (i32, String, String) {
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

/// A fresh folder for one test of one suite (process-unique).
pub fn temp_dir(suite: &str, test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ditmem-{suite}-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&d).expect("a temporary folder");
    d
}
