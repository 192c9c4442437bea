//! `ditmem compare --runtime pytorch` (issue 49): the spec's own peer (the real diffusers class
//! for a family spec, LoRA included), found from any working folder, what it cannot run refused
//! by name before Python starts, and the measured model's parameter count equal to the spec's.

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

fn ditmem(args: &[&str], cwd: &Path) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_ditmem"))
        .args(args)
        .current_dir(cwd)
        .env_remove("DITMEM_TORCH_PEER")
        .output()
        .expect("ditmem runs");
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// What the peers do not run is refused by name (exit 2, one line), before the peer's Python is
/// looked for: these hold with or without the venv.
#[test]
fn what_the_peer_cannot_run_is_refused_by_name() {
    let tmp = std::env::temp_dir();
    let cases: [(&[&str], &str); 4] = [
        (&["--preset", "dit-s-2", "--lora-rank", "4"], "recipe.lora"),
        (
            &[
                "--preset",
                "flux.1-dev",
                "--lora-rank",
                "4",
                "--base-quant",
                "nf4",
            ],
            "recipe.base_quant",
        ),
        (
            &["--preset", "sd3-medium", "--optimizer", "adamw-8bit"],
            "adamw-8bit",
        ),
        (
            &["--preset", "sd3-medium", "--precision", "bf16-pure"],
            "recipe.precision",
        ),
    ];
    for (extra, needle) in cases {
        let mut args = vec![
            "compare",
            "--runtime",
            "pytorch",
            "--resolution",
            "256",
            "--batch",
            "1",
        ];
        args.extend_from_slice(extra);
        let (c, out, err) = ditmem(&args, &tmp);
        assert_eq!(c, 2, "{args:?}: {err}");
        assert!(out.is_empty(), "{out}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(
            err.contains(needle) && err.contains("peer"),
            "{args:?}: {err}"
        );
    }
}

/// A missing peer folder is a missing tool (exit 5) that says how to name it.
#[test]
fn a_missing_peer_folder_is_exit_5() {
    let tmp = std::env::temp_dir();
    let o = Command::new(env!("CARGO_BIN_EXE_ditmem"))
        .args([
            "compare",
            "--runtime",
            "pytorch",
            "--preset",
            "dit-s-2",
            "--batch",
            "1",
        ])
        .current_dir(&tmp)
        .env("DITMEM_TORCH_PEER", tmp.join("ditmem-no-such-peer"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(5), "{err}");
    assert!(err.contains("DITMEM_TORCH_PEER"), "{err}");
}

/// The measured model is the spec's: run from a folder outside the checkout, the family peer
/// builds the real diffusers class with PEFT's adapters, and its parameter counts (all, and
/// trained) equal the budget's. Skipped, saying so, when the peer's venv is absent
/// (`bench/torch_peer/setup_diffusers.sh` installs it).
#[test]
fn the_measured_model_has_the_specs_parameter_count() {
    let root = root();
    let python = root.join("bench/torch_peer/.venv/bin/python");
    let ok = Command::new(&python)
        .args(["-c", "import diffusers, peft"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!(
            "SKIPPED: {} with diffusers and peft is absent (run bench/torch_peer/setup_diffusers.sh)",
            python.display()
        );
        return;
    }
    let tmp = std::env::temp_dir();
    for spec in ["sd3-bf16-lora4-none-loop", "pixart-fp32-none-loop"] {
        let path = root.join(format!("bench/torch_peer/specs/families/{spec}.json"));
        let (c, out, err) = ditmem(
            &[
                "compare",
                "--runtime",
                "pytorch",
                "--config",
                path.to_str().unwrap(),
                "--json",
            ],
            &tmp,
        );
        assert_eq!(c, 0, "{spec}: {err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["peer"], "family_peer.py", "{spec}");
        let p = &v["params"];
        assert!(p["predicted"]["total"].as_u64().unwrap() > 0, "{p}");
        assert_eq!(
            p["predicted"]["total"], p["measured"]["total"],
            "{spec}: {p}"
        );
        assert_eq!(
            p["predicted"]["trained"], p["measured"]["trained"],
            "{spec}: {p}"
        );
        let cond = &v["measurement"]["conditions"];
        assert_eq!(cond["family"], spec.split('-').next().unwrap(), "{cond}");
        if spec.contains("lora") {
            assert!(
                p["measured"]["trained"].as_u64() < p["measured"]["total"].as_u64(),
                "{p}"
            );
        }
        assert!(v["measured_peak_bytes"].as_u64().unwrap() > 0);
    }
}
