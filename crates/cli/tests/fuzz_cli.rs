//! Issue 19 (c): random argument vectors to `ditmem estimate`, `plan` and `spec` through the
//! binary: exit 0, 2 or 3, and on a refusal one line on stderr, never a panic, an abort or a
//! hang. The suite runs a bounded number of cases; `DITMEM_FUZZ_CASES=N` raises it.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

fn flag_value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("0".to_string()),
        Just("-1".to_string()),
        Just("1".to_string()),
        Just("2".to_string()),
        Just("4".to_string()),
        Just("1024".to_string()),
        Just("65536".to_string()),
        Just("1048576".to_string()),
        Just("1048577".to_string()),
        Just("4294967295".to_string()),
        Just("4294967296".to_string()),
        Just("1e308".to_string()),
        Just("NaN".to_string()),
        Just("inf".to_string()),
        Just("".to_string()),
        Just("256".to_string()),
        Just("128x256".to_string()),
        Just("24GiB".to_string()),
        Just("16EiB".to_string()),
        Just("all".to_string()),
        Just("blocks:".to_string()),
        Just("every-2".to_string()),
        Just("lora,8bit".to_string()),
        Just("dit-s-2".to_string()),
        Just("pytorch:cuda:efficient".to_string()),
        Just("widen".to_string()),
        Just("2MiB".to_string()),
        (1usize..3000).prop_map(|n| "9".repeat(n)),
        "[ -~\\u{1b}\\n]{0,30}",
    ]
}

fn flag() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec![
        "--preset",
        "--resolution",
        "--batch",
        "--microbatch",
        "--accumulation",
        "--ranks",
        "--precision",
        "--optimizer",
        "--attention",
        "--recompute",
        "--lora-rank",
        "--zero",
        "--latents",
        "--ema",
        "--runtime",
        "--cpu-threads",
        "--bf16-products",
        "--gemm-l2",
        "--budget",
        "--allow",
        "--headroom",
        "--json",
        "--bogus",
    ])
}

fn argv() -> impl Strategy<Value = Vec<String>> {
    (
        prop::sample::select(vec!["estimate", "plan", "spec"]),
        prop::collection::vec((flag(), flag_value(), 0u8..8), 0..6),
    )
        .prop_map(|(cmd, flags)| {
            let mut v = vec![cmd.to_string()];
            if cmd == "plan" {
                v.extend(["--budget".into(), "24GiB".into()]);
            }
            // Small by default, so that the budget's work stays short.
            v.extend(["--preset".into(), "dit-s-2".into()]);
            for (f, val, how) in flags {
                v.push(f.to_string());
                match how {
                    0 => {}                              // no value
                    1 => v.push(format!("{val} {val}")), // two words in one
                    _ => v.push(val),
                }
            }
            v
        })
}

#[test]
fn random_argument_vectors_exit_0_2_or_3_with_one_line() {
    let n: u32 = std::env::var("DITMEM_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(32);
    let bin = env!("CARGO_BIN_EXE_ditmem");
    let mut r = TestRunner::new(Config {
        cases: n,
        failure_persistence: None,
        ..Config::default()
    });
    let slowest = std::cell::RefCell::new((Duration::ZERO, Vec::new()));
    r.run(&argv(), |args| {
        let t0 = Instant::now();
        let mut child = Command::new(bin)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the binary starts");
        let deadline = t0 + Duration::from_secs(60);
        let Some(status) = common::wait_until(&mut child, deadline, Duration::from_millis(5))
        else {
            prop_assert!(false, "{args:?}: hangs");
            unreachable!("prop_assert! returned")
        };
        let elapsed = t0.elapsed();
        let mut err = String::new();
        use std::io::Read;
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        let code = status.code();
        prop_assert!(
            matches!(code, Some(0 | 2 | 3)),
            "{args:?}: exit {code:?} (a signal when None): {err}"
        );
        prop_assert!(!err.contains("panicked"), "{args:?}: {err}");
        if code != Some(0) {
            prop_assert_eq!(err.trim_end().lines().count(), 1, "{:?}: {}", args, err);
        }
        if elapsed > slowest.borrow().0 {
            *slowest.borrow_mut() = (elapsed, args.clone());
        }
        Ok(())
    })
    .unwrap();
    if std::env::var_os("DITMEM_FUZZ_REPORT").is_some() {
        let s = slowest.into_inner();
        eprintln!(
            "CLI: {n} cases; slowest {:.3} s: {:?}",
            s.0.as_secs_f64(),
            s.1
        );
    }
}
