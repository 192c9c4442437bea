//! `ditmem compare --snapshot FILE` on the snapshot test files of `tests/data/snapshots/`.
//!
//! Those files are SYNTHETIC (no GPU was at hand): the PyTorch peer's CPU step laid out in the
//! `_dump_snapshot` format by `bench/torch_peer/snapshot_from_trace.py` (see the folder's
//! README). The expected peaks were computed from the files by the generator's own allocator
//! model (`bench/torch_peer/snapshot_check.py`: the blocks before the trace allocated first, the
//! trace replayed with every address checked, allocated = the live blocks' sizes, unsplit blocks
//! whole), not by the code under test.

mod common;

use std::path::PathBuf;

use common::{argv_with, ditmem, exits_naming, json, temp_dir};

fn data(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/snapshots")
        .join(name)
        .display()
        .to_string()
}

#[test]
fn compare_snapshot_json_reports_the_files_peaks_and_the_prediction() {
    for (name, spec) in [
        ("dit-s2-fp32.pickle", "dit-s2-fp32.spec.json"),
        (
            "dit-s2-fp32-recompute.pickle",
            "dit-s2-fp32-recompute.spec.json",
        ),
    ] {
        let (file, spec) = (data(name), data(spec));
        let v = json(&["compare", "--snapshot", &file, "--config", &spec, "--json"]);
        let m = &v["measured"];
        // From `snapshot_check.py`.
        assert_eq!(m["max_allocated"], 154_036_736, "{name}");
        assert_eq!(m["max_reserved"], 163_577_856, "{name}");
        assert_eq!(m["allocated_before"], 51_271_680, "{name}");
        assert_eq!(m["reserved_before"], 69_206_016, "{name}");
        assert_eq!(m["final_segments"], 15, "{name}");
        // The at-peak origins add up to the peak.
        let sum: u64 = m["at_peak"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["bytes"].as_u64().unwrap())
            .sum();
        assert_eq!(sum, 154_036_736, "{name}");
        // The thinned timelines keep each curve's highest point.
        let top = |k: &str| {
            v["timelines"][k]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p[1].as_u64().unwrap())
                .max()
                .unwrap()
        };
        assert_eq!(top("snapshot_allocated"), 154_036_736, "{name}");
        assert_eq!(top("snapshot_reserved"), 163_577_856, "{name}");
        // The prediction is the estimate's CUDA figures for the same spec.
        let e = json(&["estimate", "--config", &spec, "--json"]);
        let p = &v["predicted"];
        assert_eq!(
            p["max_allocated"], e["cuda"]["max_allocated_bytes"],
            "{name}"
        );
        assert_eq!(p["max_reserved"], e["cuda"]["max_reserved_bytes"], "{name}");
        assert_eq!(
            p["max_allocated"].as_u64().unwrap(),
            top("predicted_allocated"),
            "{name}"
        );
        let rel = v["allocated_rel_error"].as_f64().unwrap();
        let want = p["max_allocated"].as_f64().unwrap() / 154_036_736.0 - 1.0;
        assert!((rel - want).abs() < 1e-12, "{name}: {rel} vs {want}");
        assert!(v["threshold_bytes"].as_u64().unwrap() >= 1 << 20);
    }
}

#[test]
fn compare_snapshot_table_and_plot() {
    let dir = temp_dir("snapshot", "plot");
    let svg = dir.join("snap.svg");
    let (code, out, err) = ditmem(&argv_with(
        "compare --snapshot {} --config {} --plot {}",
        &[
            &data("dit-s2-fp32.pickle"),
            &data("dit-s2-fp32.spec.json"),
            svg.to_str().unwrap(),
        ],
    ));
    assert_eq!(code, 0, "{err}");
    for want in [
        "max allocated",
        "max reserved",
        "where they part",
        "optimizer state",
    ] {
        assert!(out.contains(want), "missing '{want}':\n{out}");
    }
    let text = std::fs::read_to_string(&svg).unwrap();
    for want in [
        "snapshot allocated",
        "snapshot reserved",
        "predicted allocated",
        "predicted reserved",
        "MiB",
    ] {
        assert!(text.contains(want), "the SVG lacks '{want}'");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Bad files: exit 2, one line that names the file and what is wrong, nothing else.
#[test]
fn bad_snapshot_files_exit_2_with_one_line() {
    let dir = temp_dir("snapshot", "bad");
    let good = std::fs::read(data("dit-s2-fp32.pickle")).unwrap();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "text.pickle",
            b"segments,device_traces\n".to_vec(),
            "not a Python pickle",
        ),
        ("half.pickle", good[..good.len() / 2].to_vec(), "truncated"),
        ("list.pickle", b"\x80\x04]\x94.".to_vec(), "expected a dict"),
        ("empty.pickle", Vec::new(), "empty"),
        (
            "nokeys.pickle",
            b"\x80\x04}\x94(\x8c\x08segments\x94]\x94u.".to_vec(),
            "missing key 'device_traces'",
        ),
    ];
    for (name, bytes, want) in cases {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        let (code, out, err) = ditmem(&["compare", "--snapshot", p.to_str().unwrap()]);
        assert_eq!(code, 2, "{name}: {err}");
        assert!(out.is_empty(), "{name}: {out}");
        assert_eq!(err.trim_end().lines().count(), 1, "{name}: {err}");
        assert!(err.contains(name) && err.contains(want), "{name}: {err}");
    }
    // Over the size cap: a sparse file, refused before it is read.
    let huge = dir.join("huge.pickle");
    let f = std::fs::File::create(&huge).unwrap();
    f.set_len((1 << 30) + 1).unwrap();
    let (code, _, err) = ditmem(&["compare", "--snapshot", huge.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("huge.pickle") && err.contains("larger than"),
        "{err}"
    );
    // A folder, a missing file.
    for p in [dir.clone(), dir.join("missing.pickle")] {
        let (code, _, err) = ditmem(&["compare", "--snapshot", p.to_str().unwrap()]);
        assert_eq!(code, 2, "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_snapshot_is_held_against_pytorch_cuda_only() {
    exits_naming(
        &argv_with(
            "compare --snapshot {} --runtime ditmem-cpu",
            &[&data("dit-s2-fp32.pickle")],
        ),
        2,
        "pytorch:cuda",
    );
    exits_naming(
        &argv_with(
            "compare --snapshot {} --config {} --device 7",
            &[&data("dit-s2-fp32.pickle"), &data("dit-s2-fp32.spec.json")],
        ),
        2,
        "--device",
    );
}
