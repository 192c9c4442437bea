//! `ditmem oom` as a user runs it: the real messages of `tests/data/oom` (each parsed, its key
//! figures right), fragmentation against a true shortage, the levers for a spec that does not fit
//! a 24 GB card, stdin, and what is not a message (exit 2, one line).

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use common::{argv_with, assert_fits_100, ditmem, json_of, spawn_piped};
use serde_json::Value;

const GIB: f64 = 1073741824.0;
const MIB: f64 = 1048576.0;

/// `ditmem oom --file` on a message of the test data, as JSON.
fn oom_json(file: &str) -> Value {
    json_of(&["oom", "--file", data(file).to_str().unwrap()])
}

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/oom")
        .join(name)
}

/// `ditmem` with `input` on stdin: (exit code, stdout, stderr).
fn ditmem_stdin(args: &[&str], input: &str) -> (i32, String, String) {
    let mut child = spawn_piped(args, Stdio::piped());
    let mut stdin = child.stdin.take().expect("piped");
    let text = input.to_string();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(text.as_bytes());
    });
    let out = child.wait_with_output().expect("it ends");
    writer.join().expect("writer");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A figure as printed (two decimals of `unit`), within what the print can say.
fn about(v: &Value, want: f64, unit: f64) {
    let got = v.as_u64().unwrap_or_else(|| panic!("a byte count: {v}")) as f64;
    assert!(
        (got - want * unit).abs() <= 0.005 * unit + 1.0,
        "got {got} B, want {want} × {unit}"
    );
}

/// (file, device, requested MiB, total GiB, allocated GiB, cause).
const MESSAGES: [(&str, u64, f64, f64, f64, &str); 10] = [
    (
        "sd3_dreambooth_rtx4090_diffusers_8560.txt",
        0,
        48.0,
        23.64,
        22.81,
        "fragmentation",
    ),
    (
        "flux_dev_lora_rtx4090_lora_fast_1.txt",
        0,
        90.0,
        23.55,
        22.72,
        "fragmentation",
    ),
    (
        "flux_kontext_lora_rtx4090_t2itrainer_37.txt",
        0,
        180.0,
        23.53,
        21.58,
        "fragmentation",
    ),
    (
        "flux_dev_lora_l40s_kohya_ss_2724.txt",
        0,
        18.0,
        44.53,
        42.17,
        "fragmentation",
    ),
    (
        "flux_lora_8xa100_rank7_x_flux_24.txt",
        7,
        18.0,
        79.15,
        77.43,
        "fragmentation",
    ),
    (
        "flux2_dev_rtx_a6000_flux2_23.txt",
        0,
        648.0,
        47.53,
        47.08,
        "shortage",
    ),
    (
        "hip_rocm_autotrain_advanced_737.txt",
        0,
        124.0,
        19.94,
        15.87,
        "fragmentation",
    ),
    (
        "legacy_lora_rtx2070s_kohya_ss_108.txt",
        0,
        58.0,
        8.00,
        6.74,
        "fragmentation",
    ),
    (
        "legacy_fragmented_maddog_11.txt",
        0,
        2.87 * 1024.0,
        14.76,
        8.77,
        "fragmentation",
    ),
    (
        "flux_webui_rtx4090_flux_webui_11.txt",
        0,
        20.0,
        23.61,
        21.72,
        "fragmentation",
    ),
];

#[test]
fn every_real_message_reads_with_its_figures() {
    let listed = std::fs::read_dir(data(""))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "txt")
        })
        .count();
    assert_eq!(listed, MESSAGES.len(), "every data file has a row here");
    let readme = std::fs::read_to_string(data("README.md")).unwrap();
    for (file, device, req_mib, total_gib, alloc_gib, cause) in MESSAGES {
        assert!(readme.contains(file), "{file} has its source in README.md");
        let path = data(file);
        let j = json_of(&["oom", "--file", path.to_str().unwrap()]);
        let m = &j["message"];
        assert_eq!(m["device"], device, "{file}");
        about(&m["requested_bytes"], req_mib, MIB);
        about(&m["total_bytes"], total_gib, GIB);
        about(&m["allocated_bytes"], alloc_gib, GIB);
        assert_eq!(j["diagnosis"]["cause"], cause, "{file}");
        // The text report reads too, within 100 columns.
        let (code, out, err) = ditmem(&["oom", "--file", path.to_str().unwrap()]);
        assert_eq!(code, 0, "{file}: {err}");
        assert!(out.starts_with("ditmem oom — "), "{out}");
        assert_fits_100(file, &out);
    }
}

#[test]
fn wordings_details_are_read() {
    let j = oom_json("flux_lora_8xa100_rank7_x_flux_24.txt");
    assert_eq!(j["message"]["rank"], 7);
    assert_eq!(j["message"]["wording"], "current");
    // The 2.1 wording lists the process by its host pid: taken as this one, not another.
    let j = oom_json("sd3_dreambooth_rtx4090_diffusers_8560.txt");
    assert_eq!(j["diagnosis"]["other_processes_bytes"], 0);
    let j = oom_json("flux_kontext_lora_rtx4090_t2itrainer_37.txt");
    about(&j["diagnosis"]["other_processes_bytes"], 1056.0, MIB);
    let j = oom_json("hip_rocm_autotrain_advanced_737.txt");
    assert_eq!(j["message"]["backend"], "HIP");
    assert_eq!(j["message"]["messages_in_text"], 2);
    let j = oom_json("legacy_lora_rtx2070s_kohya_ss_108.txt");
    assert_eq!(j["message"]["wording"], "legacy");
    assert_eq!(j["message"]["free_bytes"], 0);
    about(&j["diagnosis"]["reserved_bytes"], 6.93, GIB);
    // A 24 GB total matches the 24 GB cards of the catalog.
    let j = oom_json("flux_dev_lora_rtx4090_lora_fast_1.txt");
    let cands = j["diagnosis"]["gpu"]["candidates"].as_array().unwrap();
    assert!(cands.iter().any(|c| c == "rtx-4090"), "{cands:?}");
}

#[test]
fn fragmentation_against_a_true_shortage() {
    // Free + reserved-but-unallocated (1.20 + 1.60 GiB) covers the 2 GiB request: fragmentation.
    let frag = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.65 GiB of which 1.20 GiB is free. Including non-PyTorch memory, this process has 22.43 GiB memory in use. Of the allocated memory 20.30 GiB is allocated by PyTorch, and 1.60 GiB is reserved by PyTorch but unallocated.";
    let j = json_of(&["oom", frag]);
    assert_eq!(j["diagnosis"]["cause"], "fragmentation");
    let (_, out, _) = ditmem(&["oom", frag]);
    assert!(
        out.contains("FRAGMENTATION") && out.contains("expandable_segments:True"),
        "{out}"
    );
    // 0.20 + 0.10 GiB does not: a true shortage, 1.70 GiB short.
    let short = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.65 GiB of which 204.80 MiB is free. Including non-PyTorch memory, this process has 23.33 GiB memory in use. Of the allocated memory 22.70 GiB is allocated by PyTorch, and 102.40 MiB is reserved by PyTorch but unallocated.";
    let j = json_of(&["oom", short]);
    assert_eq!(j["diagnosis"]["cause"], "shortage");
    about(&j["diagnosis"]["shortfall_bytes"], 1.70, GIB);
    let (_, out, _) = ditmem(&["oom", short]);
    assert!(out.contains("TRUE SHORTAGE"), "{out}");
}

#[test]
fn a_spec_that_does_not_fit_a_24_gb_card_gets_a_lever_that_fits() {
    // PixArt-Σ full fine-tune at 1024², batch 4, on the 4090 of a real message.
    let msg = data("flux_dev_lora_rtx4090_lora_fast_1.txt");
    let args = [
        "oom",
        "--file",
        msg.to_str().unwrap(),
        "--preset",
        "pixart-sigma-1024",
        "--resolution",
        "1024",
        "--batch",
        "4",
        "--gpu",
        "rtx-4090",
    ];
    let j = json_of(&args);
    let l = &j["levers"];
    assert_eq!(j["gpu"], "rtx-4090");
    assert_eq!(l["base"]["fits"], false, "{l}");
    let levers = l["levers"].as_array().unwrap();
    assert!(levers[0]["fits"] == true, "the first lever fits: {l}");
    // Ranked: every fitting lever before every other, fitting ones by step time.
    let fits: Vec<bool> = levers.iter().map(|x| x["fits"] == true).collect();
    assert!(fits.windows(2).all(|w| w[0] || !w[1]), "{fits:?}");
    let times: Vec<f64> = levers
        .iter()
        .filter(|x| x["fits"] == true)
        .map(|x| x["step_time_s"].as_f64().unwrap())
        .collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    // The usable capacity is the message's total (23.55 GiB) less 5 % headroom.
    let usable = l["usable_bytes"].as_u64().unwrap() as f64;
    assert!((usable - 23.55 * GIB * 0.95).abs() < 0.01 * GIB, "{usable}");
    for x in levers.iter().filter(|x| x["fits"] == true) {
        assert!(x["device_peak_bytes"].as_u64().unwrap() as f64 <= usable);
    }
    assert!(j["agreement"]["ratio"].as_f64().unwrap() > 0.0);
    let (code, out, err) = ditmem(&args[..]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("levers on rtx-4090"), "{out}");
    assert_fits_100(&format!("{args:?}"), &out);
}

#[test]
fn when_nothing_fits_the_flag_offered_is_for_what_was_not_tried() {
    // Flux LoRA at 1024² on the 4090 of a real message: no lever fits; LoRA is already on, so
    // what is left to allow is the quantized base alone.
    let msg = data("flux_dev_lora_rtx4090_lora_fast_1.txt");
    let (code, out, err) = ditmem(&[
        "oom",
        "--file",
        msg.to_str().unwrap(),
        "--preset",
        "flux.1-dev",
        "--lora-rank",
        "16",
        "--resolution",
        "1024",
        "--gpu",
        "rtx-4090",
    ]);
    assert_eq!(code, 0, "{err}");
    let line = out
        .lines()
        .skip_while(|l| !l.starts_with("nothing fits: "))
        .take_while(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    assert!(line.contains("(--allow quant)"), "{out}");
    assert!(!line.contains("lora"), "{out}");
}

#[test]
fn zero_is_tried_over_the_runs_ranks() {
    // SD3-medium full fine-tune, 8 ranks, on the L40S of a real message.
    let msg = data("flux_dev_lora_l40s_kohya_ss_2724.txt");
    let j = json_of(&argv_with(
        "oom --file {} --preset sd3-medium --resolution 1024 --batch 8 --ranks 8 --gpu l40s",
        &[msg.to_str().unwrap()],
    ));
    let levers = j["levers"]["levers"].as_array().unwrap();
    assert!(levers.iter().any(|x| x["lever"] == "ZeRO"), "{levers:?}");
}

#[test]
fn stdin_reads_the_message() {
    let text = std::fs::read_to_string(data("flux2_dev_rtx_a6000_flux2_23.txt")).unwrap();
    let log = format!("Traceback (most recent call last):\n  File \"app.py\", line 81\n{text}");
    for args in [&["oom"][..], &["oom", "-"][..], &["oom", "-", "--json"][..]] {
        let (code, out, err) = ditmem_stdin(args, &log);
        assert_eq!(code, 0, "{args:?}: {err}");
        assert!(out.contains("47.53") || out.contains("shortage"), "{out}");
    }
}

#[test]
fn what_is_not_a_message_exits_2_with_one_line() {
    for (args, input) in [
        (vec!["oom", "hello world"], ""),
        (vec!["oom", "RuntimeError: CUDA error: out of memory"], ""),
        (vec!["oom", "-"], "just some log line\nand another\n"),
        (vec!["oom"], ""),
        (vec!["oom", "--file", "/dev/null"], ""),
        (vec!["oom", "--file", "/nonexistent/oom.txt"], ""),
    ] {
        let (code, out, err) = ditmem_stdin(&args, input);
        assert_eq!(code, 2, "{args:?}: {out} {err}");
        assert!(out.is_empty(), "{out}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(err.starts_with("ditmem: invalid input: "), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let (_, _, err) = ditmem(&["oom", "hello world"]);
    assert!(
        err.contains("expected a PyTorch out-of-memory message"),
        "{err}"
    );
    let (code, _, err) = ditmem(&["oom", "x", "--allow", "wings"]);
    assert_eq!(code, 2);
    assert!(err.contains("--allow"), "{err}");
}
