//! Issue 50: property tests of the parsers that live in the binary, through the binary: the
//! resolution, the alloc-conf, recompute and runtime strings as flags (round trips through
//! `ditmem spec --json`), and a checkpoint's safetensors header (`params --weights`) over
//! mutated files. Each case: exit 0 with the value read back, or exit 2 with one line that names
//! the flag or field; never a panic, an abort or a hang.
//!
//! `fuzz_cli.rs` holds issue 19's random argument vectors; these properties are per parser.
//! Bounded (128–256 cases each, a fixed seed); `DITMEM_FUZZ_CASES=N` raises the count.

mod common;

use std::io::Read;
use std::process::Stdio;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{TestCaseError, TestRunner};
use serde_json::Value;

#[path = "../../engine/tests/common/fuzz_runner.rs"]
mod fuzz_runner;
use fuzz_runner::{fuzz_cases, fuzz_runner};

fn runner(default: u32) -> TestRunner {
    fuzz_runner(fuzz_cases(default), 512)
}

/// Run the binary (stdin closed, 60 s at most): (exit code, stdout, stderr).
fn run(args: &[String]) -> Result<(i32, String, String), TestCaseError> {
    let t0 = Instant::now();
    let mut child = common::spawn_piped(args, Stdio::null());
    let (mut out, mut err) = (String::new(), String::new());
    let mut so = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = so.read_to_string(&mut s);
        s
    });
    child.stderr.take().unwrap().read_to_string(&mut err).ok();
    let deadline = t0 + Duration::from_secs(60);
    let Some(status) = common::wait_until(&mut child, deadline, Duration::from_millis(2)) else {
        return Err(TestCaseError::fail(format!("{args:?}: hangs")));
    };
    out.push_str(&reader.join().unwrap());
    let code = status.code();
    prop_assert!(
        matches!(code, Some(0 | 2)),
        "{args:?}: exit {code:?} (None: a signal): {err}"
    );
    prop_assert!(!err.contains("panicked"), "{args:?}: {err}");
    if code != Some(0) {
        prop_assert_eq!(err.trim_end().lines().count(), 1, "{:?}: {}", args, err);
    }
    Ok((code.unwrap(), out, err))
}

fn spec_json(extra: &[String]) -> Result<Result<Value, String>, TestCaseError> {
    let mut args: Vec<String> = ["spec", "--preset", "dit-s-2", "--json"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend_from_slice(extra);
    let (code, out, err) = run(&args)?;
    Ok(if code == 0 {
        Ok(serde_json::from_str(&out).expect("spec --json prints JSON"))
    } else {
        Err(err)
    })
}

/// A refusal names the flag or the field it is about, and what is allowed.
fn names(err: &str, any_of: &[&str]) -> Result<(), TestCaseError> {
    prop_assert!(
        any_of.iter().any(|n| err.contains(n)),
        "names one of {any_of:?}: {err}"
    );
    Ok(())
}

/// `--resolution`: `H`, `HxW`, mutated (spaces, other separators, signs, huge, unicode digits,
/// pieces missing): a valid one reads back as the spec's height and width; any other is
/// refused naming `--resolution` or the workload field.
#[test]
fn resolution_round_trips_or_is_refused_by_name() {
    let side = prop_oneof![
        4 => (1u32..=64).prop_map(|k| (16 * k).to_string()),
        1 => prop::sample::select(vec![
            "0", "1", "15", "17", "65536", "65537", "4294967296", "-16", "+16", "16.0", "1e3",
            "١٦", "１６", " 16", "", "0x10", "99999999999999999999999",
        ])
        .prop_map(str::to_string),
    ];
    let sep = prop::sample::select(vec!["x", "x", "x", "X", "×", "*", ",", " x ", "xx", ""]);
    let text = prop_oneof![
        side.clone(),
        (side.clone(), sep, side).prop_map(|(h, s, w)| format!("{h}{s}{w}")),
        "\\PC{0,12}",
    ];
    runner(256)
        .run(&text, |t| {
            match spec_json(&[format!("--resolution={t}")])? {
                Ok(v) => {
                    // `x`, `X` or `×` between the sides, each side trimmed (as the README's `HxW`
                    // is read): the spec holds those numbers.
                    let (h, w) = match t.split_once(['x', 'X', '×']) {
                        Some((h, w)) => (h.trim().parse::<u64>(), w.trim().parse::<u64>()),
                        None => (t.trim().parse::<u64>(), t.trim().parse::<u64>()),
                    };
                    let (h, w) = (
                        h.map_err(|_| TestCaseError::fail(format!("{t:?} accepted")))?,
                        w.map_err(|_| TestCaseError::fail(format!("{t:?} accepted")))?,
                    );
                    prop_assert_eq!(&v["workload"]["height"], &Value::from(h), "{}", t);
                    prop_assert_eq!(&v["workload"]["width"], &Value::from(w), "{}", t);
                }
                Err(err) => names(&err, &["--resolution", "workload."])?,
            }
            Ok(())
        })
        .unwrap();
}

/// `--alloc-conf` (with `--runtime pytorch:cuda`): an accepted value is the spec's
/// `cuda.alloc_conf` as given; a refused one names PYTORCH_CUDA_ALLOC_CONF or the flag.
#[test]
fn alloc_conf_flag_round_trips_or_is_refused_by_name() {
    let token = prop_oneof![
        3 => prop::sample::select(vec![
            "expandable_segments", "max_split_size_mb", "roundup_power2_divisions",
            "garbage_collection_threshold", "backend", "pinned_num_register_threads", "bogus",
        ]),
        3 => prop::sample::select(vec![":", ",", "[", "]", " ", ">"]),
        3 => prop::sample::select(vec![
            "True", "False", "128", "20", "19", "4", "0.5", "1", "native", "18446744073709551616",
            "😀", "\u{1b}",
        ]),
    ];
    runner(128)
        .run(&prop::collection::vec(token, 1..10), |toks| {
            let conf = toks.concat();
            let r = spec_json(&[
                "--runtime=pytorch:cuda".into(),
                format!("--alloc-conf={conf}"),
            ])?;
            match r {
                Ok(v) => {
                    let got = v["cuda"]["alloc_conf"].as_str().unwrap_or("");
                    prop_assert_eq!(got, conf.as_str());
                }
                Err(err) => names(
                    &err,
                    &["PYTORCH_CUDA_ALLOC_CONF", "--alloc-conf", "alloc_conf"],
                )?,
            }
            Ok(())
        })
        .unwrap();
}

/// `--recompute` and `--runtime`: an accepted value reads back from the spec's JSON as the
/// same policy or runtime (its canonical text parses to the same spec); a refused one names
/// its field.
#[test]
fn recompute_and_runtime_flags_round_trip_or_are_refused_by_name() {
    let recompute = prop_oneof![
        prop::sample::select(vec![
            "none",
            "all",
            "attention-only",
            "attention",
            "every-1",
            "every-5",
            "every-0",
            "every-",
            "blocks:",
            "blocks:0",
            "blocks:11,0,3,3",
            "blocks: 1 ,2",
            "blocks:12",
            "blocks:4294967296",
            "all ",
            "ALL",
        ])
        .prop_map(str::to_string),
        ("[a-z]{0,8}", "[-:0-9, ]{0,12}").prop_map(|(a, b)| format!("{a}{b}")),
    ];
    let runtime = prop_oneof![
        prop::sample::select(vec![
            "ditmem-cpu",
            "ditmem",
            "engine",
            "pytorch",
            "pytorch:cpu",
            "pytorch:cuda",
            "pytorch:cuda:flash",
            "pytorch:cuda:sdpa-math",
            "pytorch:cuda:cudnn",
            "pytorch:cuda:bogus",
            "pytorch::",
            "pytorch:",
            "torch",
            "",
        ])
        .prop_map(str::to_string),
        "pytorch(:[a-z-]{0,8}){0,3}",
    ];
    runner(128)
        .run(&(recompute, runtime), |(rc, rt)| {
            for (flag, value, field, key) in [
                (
                    "--recompute",
                    &rc,
                    "recipe.recompute",
                    ("recipe", "recompute"),
                ),
                ("--runtime", &rt, "runtime", ("", "runtime")),
            ] {
                match spec_json(&[format!("{flag}={value}")])? {
                    Ok(v) => {
                        let got = if key.0.is_empty() {
                            v[key.1].clone()
                        } else {
                            v[key.0][key.1].clone()
                        };
                        let canonical = got.as_str().expect("a string").to_string();
                        // The canonical text reads back to the same spec.
                        let again = spec_json(&[format!("{flag}={canonical}")])?;
                        prop_assert_eq!(
                            again.ok(),
                            Some(v),
                            "{} {:?} → {}",
                            flag,
                            value,
                            canonical
                        );
                    }
                    Err(err) => names(&err, &[flag, field])?,
                }
            }
            Ok(())
        })
        .unwrap();
}

/// A safetensors file: length, JSON header, data.
fn safetensors(header: &[u8], declared: Option<u64>, data: usize) -> Vec<u8> {
    let mut b = declared
        .unwrap_or(header.len() as u64)
        .to_le_bytes()
        .to_vec();
    b.extend_from_slice(header);
    b.extend(std::iter::repeat_n(0u8, data));
    b
}

/// `params --weights` over safetensors headers built from parts (dtypes, shapes and offsets
/// valid, huge, negative, reversed, of the wrong type; the length prefix huge or past the file;
/// the header not JSON, nested deep, not an object) and with bytes flipped or cut: exit 0 or
/// exit 2 naming `--weights`, never a panic or a hang.
#[test]
fn safetensors_headers_read_or_are_refused_by_name() {
    let dir = common::temp_dir("proptest", "safetensors");
    let dim = prop_oneof![
        4 => (0u64..8).prop_map(Value::from),
        1 => Just(Value::from(u64::MAX)),
        1 => Just(Value::from(1u64 << 62)),
        1 => Just(Value::from(-1)),
        1 => Just(Value::from(1.5)),
        1 => Just(Value::Null),
        1 => Just(Value::from("2")),
    ];
    let entry = (
        prop::sample::select(vec!["F32", "BF16", "F16", "F64", "I8", "BOOL", "F128", "", "f32"]),
        prop::collection::vec(dim.clone(), 0..4),
        prop::collection::vec(dim, 0..3),
    )
        .prop_map(|(dt, shape, offs)| {
            serde_json::json!({"dtype": dt, "shape": shape, "data_offsets": offs})
        });
    let header = prop_oneof![
        6 => prop::collection::btree_map("[a-z._\u{1b}😀]{0,12}", entry, 0..4).prop_map(|m| {
            serde_json::to_vec(&m).unwrap()
        }),
        1 => Just(b"[1, 2]".to_vec()),
        1 => Just(b"{\"a\": null}".to_vec()),
        1 => Just(b"{not json".to_vec()),
        1 => (1usize..100_000).prop_map(|n| ["[".repeat(n), "]".repeat(n)].concat().into_bytes()),
        1 => Just(b"{\"__metadata__\": {\"format\": [1]}}".to_vec()),
    ];
    let declared = prop_oneof![
        6 => Just(None),
        1 => Just(Some(u64::MAX)),
        1 => Just(Some(100_000_001)),
        1 => (0u64..64).prop_map(Some),
    ];
    let strategy = (
        header,
        declared,
        0usize..256,
        prop::collection::vec((any::<usize>(), any::<u8>()), 0..3),
        prop::option::of(any::<usize>()),
    );
    runner(128)
        .run(&strategy, |(h, decl, data, flips, cut)| {
            let mut b = safetensors(&h, decl, data);
            for (i, x) in flips {
                let i = i % b.len();
                b[i] ^= x;
            }
            if let Some(c) = cut {
                b.truncate(c % (b.len() + 1));
            }
            let f = dir.join("w.safetensors");
            std::fs::write(&f, &b).unwrap();
            let args: Vec<String> = [
                "params",
                "--preset",
                "dit-xl-2-256",
                "--weights",
                f.to_str().unwrap(),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            let (code, _, err) = run(&args)?;
            if code != 0 {
                names(&err, &["--weights"])?;
            }
            Ok(())
        })
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
