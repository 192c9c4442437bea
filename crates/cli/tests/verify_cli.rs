//! `ditmem verify` as a user runs it: JSON fields, a stored reference reloaded, a mismatched or
//! corrupted reference, the drift plot, and bad input.

use std::path::PathBuf;
mod common;

use common::{argv, argv_with, ditmem, exits_naming};

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ditmem-verify-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

const FEW: &str = "fp32/none/materialized,fp32/all/materialized,bf16-mixed/none/memory-efficient";

#[test]
fn json_has_the_documented_fields_and_a_reference_reloads() {
    let refp = temp("ref.safetensors");
    let svg = temp("drift.svg");
    let (code, out, err) = ditmem(&argv_with(
        "verify --variants {} --steps 3 --json --save-reference {} --plot {}",
        &[FEW, refp.to_str().unwrap(), svg.to_str().unwrap()],
    ));
    assert_eq!(code, 0, "stderr: {err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("valid JSON");
    let vars = v["variants"].as_array().unwrap();
    assert_eq!(vars.len(), 3);
    for x in vars {
        for f in [
            "name",
            "verdict",
            "loss_rel_err",
            "grad_rel_err_max",
            "drift_final",
        ] {
            assert!(!x[f].is_null(), "{f} missing in {x}");
        }
        assert_eq!(x["verdict"], "pass");
    }
    assert_eq!(vars[1]["twins"][0]["kind"], "bitwise");
    assert_eq!(vars[1]["twins"][0]["ok"], true);
    assert_eq!(v["reference_variant"], "fp64/none/materialized");
    assert_eq!(v["reference_source"], "computed");
    assert_eq!(v["conditions"]["device"], "cpu");
    // Which bf16 product path ran is part of the conditions (it changes speed and workspace).
    let path = v["conditions"]["bf16_products"].as_str().unwrap_or("");
    assert!(
        ["AVX512-BF16 kernel", "widened to f32"].contains(&path),
        "bf16_products = {path:?}"
    );
    assert_eq!(v["options"]["steps"], 3);
    assert!(v["tolerances"].as_array().unwrap().len() == 5);
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.contains("<svg") && text.contains("fp32"));

    // Reloaded: the same numbers, the reference not recomputed, steps taken from the file.
    let (code, out2, err) = ditmem(&argv_with(
        "verify --variants {} --json --reference {}",
        &[FEW, refp.to_str().unwrap()],
    ));
    assert_eq!(code, 0, "stderr: {err}");
    let w: serde_json::Value = serde_json::from_str(&out2).unwrap();
    assert_eq!(w["reference_source"], refp.to_str().unwrap());
    for (a, b) in vars.iter().zip(w["variants"].as_array().unwrap()) {
        assert_eq!(a["grad_rel_err_max"], b["grad_rel_err_max"]);
        assert_eq!(a["drift_final"], b["drift_final"]);
    }

    // Another spec is refused with one line and exit 2.
    let (code, _, err) = ditmem(&argv_with(
        "verify --variants {} --resolution 64 --reference {}",
        &[FEW, refp.to_str().unwrap()],
    ));
    assert_eq!(code, 2, "stderr: {err}");
    assert!(
        err.contains("does not match") && err.contains("workload.height"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

/// Multiply the stored reference loss by 1.5 in place (safetensors: u64 header length, JSON
/// header, then the data; offsets relative to the data).
fn corrupt_loss(path: &PathBuf) {
    let mut bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let off = header["loss"]["data_offsets"][0].as_u64().unwrap() as usize + 8 + n;
    let loss = f64::from_le_bytes(bytes[off..off + 8].try_into().unwrap());
    bytes[off..off + 8].copy_from_slice(&(loss * 1.5).to_le_bytes());
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn a_failing_variant_exits_4() {
    let refp = temp("bad-ref.safetensors");
    let (code, _, err) = ditmem(&argv_with(
        "verify --variants fp32/none/materialized --steps 0 --json --save-reference {}",
        &[refp.to_str().unwrap()],
    ));
    assert_eq!(code, 0, "stderr: {err}");
    corrupt_loss(&refp);
    let (code, out, err) = ditmem(&argv_with(
        "verify --variants fp32/none/materialized --reference {}",
        &[refp.to_str().unwrap()],
    ));
    assert_eq!(code, 4, "stdout: {out} stderr: {err}");
    assert!(out.contains("FAIL") && out.contains("loss error"), "{out}");
    assert!(err.contains("verification failed"), "{err}");
}

#[test]
fn bad_input_is_one_line_and_exit_2() {
    for args in [
        vec!["verify", "--variants", "fp33/none/materialized"],
        vec!["verify", "--variants", "fp32/none/flash"],
        vec!["verify", "--reference", "/nonexistent/ref.safetensors"],
        vec!["verify", "--lr=-1"],
        vec!["verify", "--jobs", "0"],
        vec!["verify", "--steps", "0", "--plot", "/tmp/x.svg"],
    ] {
        let (code, _, err) = ditmem(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        assert!(err.starts_with("ditmem: "), "{err}");
    }
    // A file that is not a reference.
    let junk = temp("junk.safetensors");
    std::fs::write(&junk, b"not safetensors").unwrap();
    exits_naming(
        &["verify", "--reference", junk.to_str().unwrap()],
        2,
        "reference",
    );
}

#[test]
fn memory_is_predicted_and_refused_before_work() {
    // A spec far beyond this machine: refused with exit 3 naming the predicted figure, at once.
    let (code, _, err) = ditmem(&argv(
        "verify --preset dit-xl-2 --resolution 1024 --batch 64",
    ));
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("predicts a peak of") && err.contains("verify"),
        "{err}"
    );
    // With verify's own levers: one drift step (its figure), one block, a lower resolution.
    assert!(
        err.contains("`--steps 1` (")
            && err.contains("`--depth 1`")
            && err.contains("`--resolution`"),
        "{err}"
    );
    // A reference into a missing folder is bad input before any work.
    exits_naming(
        &argv("verify --save-reference /nonexistent-ditmem-dir/ref.safetensors"),
        2,
        "--save-reference",
    );
    // The JSON names the predicted peak and its parts, and each variant's margin.
    let (code, out, err) = ditmem(&argv(
        "verify --variants fp32/none/materialized --steps 1 --json",
    ));
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let peak = v["memory"]["peak"].as_u64().unwrap();
    assert!(peak > v["memory"]["variant_steps"].as_u64().unwrap());
    assert!(v["memory"]["reference_file"].as_u64().unwrap() > 0);
    let m = v["variants"][0]["grad_margin"].as_f64().unwrap();
    assert!(m > 0.0 && m <= 1.0, "margin {m}");
}

#[test]
fn a_reference_the_disk_cannot_hold_is_refused_before_work() {
    // DITMEM_TEST_FREE_DISK (a test hook) stands for the file system's free space: one byte short
    // of the predicted file is refused with exit 3 naming both figures, and nothing is written.
    let dir = common::temp_dir("verify-cli", "disk");
    let refp = dir.join("ref.safetensors");
    let args = [
        "verify",
        "--variants",
        "fp32/none/materialized",
        "--steps",
        "2",
        "--json",
        "--save-reference",
        refp.to_str().unwrap(),
    ];
    let (code, out, err) = common::ditmem_env(&[("DITMEM_TEST_FREE_DISK", "1000")], &args);
    assert_eq!(code, 3, "{err}");
    assert!(out.is_empty(), "{out}");
    assert!(
        err.contains("reference file needs") && err.contains("(1000 B) free"),
        "{err}"
    );
    let need: u64 = err
        .split("needs ")
        .nth(1)
        .and_then(|t| t.split(" B)").next())
        .and_then(|t| t.rsplit('(').next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no byte figure in {err}"));
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "nothing may be written"
    );
    // The prediction is the file: with exactly that much free it runs, and writes that size or
    // a few bytes less (the one figure not known before the run is written at its longest).
    let (code, _, err) = common::ditmem_env(&[("DITMEM_TEST_FREE_DISK", &need.to_string())], &args);
    assert_eq!(code, 0, "{err}");
    let len = std::fs::metadata(&refp).unwrap().len();
    assert!(
        len <= need && need - len < 32,
        "file {len} B, predicted {need} B"
    );
    let (code, _, err) =
        common::ditmem_env(&[("DITMEM_TEST_FREE_DISK", &(need - 1).to_string())], &args);
    assert_eq!(code, 3, "{err}");
    // Saving a stored reference again (a copy) needs its size too.
    let again = dir.join("again.safetensors");
    let (code, _, err) = common::ditmem_env(
        &[("DITMEM_TEST_FREE_DISK", "1000")],
        &argv_with(
            "verify --variants fp32/none/materialized --reference {} --save-reference {}",
            &[refp.to_str().unwrap(), again.to_str().unwrap()],
        ),
    );
    assert_eq!(code, 3, "{err}");
    assert!(!again.exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_killed_verify_leaves_no_reference_file_behind() {
    // The reference of a run that does not save it lies in a file without a name: nothing of it
    // is ever visible in the temporary folder, and a kill frees it. (Before, each killed run
    // left a `.ditmem-verify-reference-*.tmp` of 8 B × parameters × (steps + 2) there: 13 GB for
    // the default DiT-S/2 256² run.)
    let dir = common::temp_dir("verify-cli", "killed");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ditmem"))
        .env("TMPDIR", &dir)
        .args([
            "verify",
            "--variants",
            "fp32/none/materialized",
            "--steps",
            "400",
            "--json",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("the binary runs");
    // Watch the folder while the reference is computed (400 steps: seconds), then kill.
    let start = std::time::Instant::now();
    let mut seen = Vec::new();
    while start.elapsed() < std::time::Duration::from_millis(1500) {
        seen.extend(
            std::fs::read_dir(&dir)
                .unwrap()
                .filter_map(|e| e.ok().map(|e| e.file_name())),
        );
        if child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let finished_early = child.try_wait().unwrap().is_some();
    let _ = child.kill();
    let _ = child.wait();
    assert!(!finished_early, "the run ended before it could be killed");
    assert!(seen.is_empty(), "visible while running: {seen:?}");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
}

/// The resident set of a `verify` with two jobs stays within its predicted peak (plus what the
/// binary itself maps before any work, measured on a command that runs no step). With glibc's
/// default of an arena per thread it did not: the f64 reference's memory, freed on one thread,
/// stayed in that thread's arena while the workers filled arenas of their own (1.75 GiB RSS for
/// this run against 1.04 GiB predicted; see `ditmem_engine::malloc`).
// glibc only: the one-arena policy is glibc's `mallopt`; other C libraries keep their defaults.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn two_jobs_stay_within_the_predicted_peak_in_resident_memory() {
    let (code, _, binary) = common::ditmem_max_rss(&["params", "--preset", "dit-s-4"]);
    assert_eq!(code, 0);
    let (code, out, rss) = common::ditmem_max_rss(&[
        "verify",
        "--preset",
        "dit-s-4",
        "--resolution",
        "32",
        "--batch",
        "2",
        "--steps",
        "2",
        "--jobs",
        "2",
        "--variants",
        "fp32/none/materialized,bf16-mixed/all/memory-efficient,fp16-mixed/none/materialized,\
         bf16-pure/none/materialized",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("valid JSON");
    assert_eq!(v["memory"]["jobs"], 2);
    let peak = v["memory"]["peak"].as_u64().expect("memory.peak");
    eprintln!("verify: max RSS {rss} B, predicted peak {peak} B + binary {binary} B");
    assert!(
        rss <= peak + binary,
        "max RSS {rss} B > predicted {peak} B + the binary's own {binary} B"
    );
}

/// With one drift step no run of verify keeps AdamW's moments past its update (issue 51: the
/// fp64 reference of FLUX.1 at one block needed 16.5 GiB with them, 32 B per parameter). On a
/// preset at its real width (DiT-XL/2, one block, 30 M parameters): what the run adds to the
/// heap stays within the prediction (+1 %) and within +25 % of it, and the run holds at least
/// 8 B per trained parameter less than the budget's steady-state fp64 step (which keeps 16 B of
/// moments per parameter), in its heap and in its resident set.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn one_drift_step_keeps_no_optimizer_state_at_real_width() {
    let shape = argv("--preset dit-xl-2 --depth 1 --resolution 64 --batch 1");
    let (code, out, err) = ditmem(
        &[
            &["estimate"][..],
            &shape,
            &["--precision", "fp64", "--runtime", "ditmem-cpu", "--json"],
        ]
        .concat(),
    );
    assert_eq!(code, 0, "{err}");
    let e: serde_json::Value = serde_json::from_str(&out).unwrap();
    let trained = e["params"]["trained"].as_u64().unwrap();
    let steady = e["peak_bytes"].as_u64().unwrap();
    assert_eq!(
        e["static_bytes"]["optimizer_state"].as_u64(),
        Some(16 * trained)
    );
    let (code, _, binary) = common::ditmem_max_rss(&["params", "--preset", "dit-s-4"]);
    assert_eq!(code, 0);
    let (code, out, rss) = common::ditmem_max_rss(
        &[
            &["verify"][..],
            &shape,
            &argv("--steps 1 --jobs 1 --variants fp32/none/materialized --json"),
        ]
        .concat(),
    );
    assert_eq!(code, 0, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("valid JSON");
    let peak = v["memory"]["peak"].as_u64().expect("memory.peak");
    // What the run added to the heap, the prediction's scope (the process's own bytes before it
    // are the binary's, as `binary` is for the resident set).
    let heap = v["measured"]["heap_peak_bytes"]
        .as_u64()
        .expect("measured heap")
        - v["measured"]["heap_before_bytes"]
            .as_u64()
            .expect("heap before");
    eprintln!(
        "verify: heap peak {heap} B, max RSS {rss} B, predicted {peak} B ({:+.1} %), \
         steady-state fp64 step {steady} B, {trained} trained",
        100.0 * (peak as f64 / heap as f64 - 1.0)
    );
    // The reference's backward is the peak here, predicted by the budget's step alone (no
    // verify buffer beside it), which agrees with the engine within 1 % (`compare`, `agree`):
    // measured 40.7 KB (0.007 %) above it on this preset.
    assert!(
        heap as f64 <= 1.01 * peak as f64,
        "measured {heap} B > 1.01 × predicted {peak} B"
    );
    assert!(
        peak as f64 <= 1.25 * heap as f64,
        "predicted {peak} B > 1.25 × measured {heap} B"
    );
    // The resident set adds the heap's freed holes to the heap (+8.7 % over the prediction here:
    // the reference's freed activations, then the variant's; the two-jobs test above bounds it
    // where verify's buffers give slack); the saving shows in it all the same.
    assert!(
        rss + 8 * trained <= steady + binary,
        "max RSS {rss} B: not 8 B/parameter below the steady-state step's {steady} B"
    );
    assert!(
        heap + 8 * trained <= steady,
        "measured {heap} B: not 8 B/parameter below the steady-state step's {steady} B"
    );
}

/// Two jobs with the pool's size set by the user: each worker steps on a one-thread pool of its
/// own, so the variants' specs must follow it. They named the global pool's two threads and
/// every variant was refused (`cpu.threads: 2 but this process's pool has 1`, exit 2) — after
/// the whole fp64 reference had run (5.5 minutes on DiT-XL/2).
#[test]
fn two_jobs_run_when_the_user_sets_the_pool_size() {
    let (code, out, err) = common::ditmem_env(
        &[("RAYON_NUM_THREADS", "2")],
        &argv("verify --preset dit-s-4 --resolution 32 --batch 2 --steps 1 --jobs 2 --variants fp32/none/materialized,bf16-mixed/none/memory-efficient --json"),
    );
    assert_eq!(code, 0, "stderr: {err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("valid JSON");
    assert_eq!(v["memory"]["jobs"], 2);
    for x in v["variants"].as_array().unwrap() {
        assert_eq!(x["verdict"], "pass", "{x}");
    }
}
