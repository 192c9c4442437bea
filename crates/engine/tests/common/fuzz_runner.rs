//! The property tests' runner, one file for the budget, engine and CLI crates' tests (each
//! includes it by path): a bounded case count and proptest's fixed seed, so that CI runs the same
//! cases every time; `DITMEM_FUZZ_CASES=N` raises the count and draws from entropy.
#![allow(dead_code)]

use proptest::test_runner::{Config, TestRng, TestRunner};

/// Cases of one property: `default` in the suite, `DITMEM_FUZZ_CASES` when set.
pub(crate) fn fuzz_cases(default: u32) -> u32 {
    std::env::var("DITMEM_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A runner of `cases` cases that shrinks a failure at most `max_shrink_iters` times, with the
/// suite's fixed seed (from entropy when `DITMEM_FUZZ_CASES` is set: a long run).
pub(crate) fn fuzz_runner(cases: u32, max_shrink_iters: u32) -> TestRunner {
    let config = Config {
        cases,
        failure_persistence: None,
        max_shrink_iters,
        ..Config::default()
    };
    if std::env::var_os("DITMEM_FUZZ_CASES").is_some() {
        TestRunner::new(config)
    } else {
        let rng = TestRng::deterministic_rng(config.rng_algorithm);
        TestRunner::new_with_rng(config, rng)
    }
}
