//! Shared helpers of the conformance tests: one test at a time where a test binary's state is
//! process-wide, and an agreement grid's specs measured and held to a bound.
#![allow(dead_code)]

use ditmem_budget::Spec;
use ditmem_conformance::agree::{measure_and_compare, Agreement};
use ditmem_engine::CountingAlloc;

// The engine tests' tensor helpers (max |a − b| among them), one file for both crates.
#[path = "../../../engine/tests/common/tensors.rs"]
mod tensors;
#[allow(unused_imports)] // not every test binary that includes `common` uses them
pub(crate) use tensors::*;

/// One spec of an agreement grid measured against its budget (one step after warm-up), with
/// the line the suite prints for it.
pub(crate) fn agreement_logged(name: &str, spec: &Spec, alloc: &CountingAlloc) -> Agreement {
    let (a, _, _) = measure_and_compare(name, spec, 1, alloc).expect("the grid spec runs");
    eprintln!(
        "{name}: predicted {} measured {} ({:+.3} %) [{}]",
        a.predicted_peak_bytes,
        a.measured_peak_bytes,
        100.0 * a.rel_error,
        a.predicted_peak_label
    );
    a
}

/// The counting allocator, a planted mutation: what a test binary holds process-wide, so its
/// tests take this lock and run one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub(crate) fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// The budget's step peak within `bound` (relative) of the measured one.
pub(crate) fn assert_peak_within(a: &Agreement, bound: f64) {
    assert!(
        a.rel_error.abs() <= bound,
        "{}: predicted {} vs measured {} ({:+.3} %), peak at {}",
        a.name,
        a.predicted_peak_bytes,
        a.measured_peak_bytes,
        100.0 * a.rel_error,
        a.predicted_peak_label
    );
}

/// The budget's segment boundaries within `bound` of the measured ones (relative to the measured
/// peak).
pub(crate) fn assert_boundaries_within(a: &Agreement, bound: f64) {
    assert!(
        a.boundary_max_rel_error <= bound,
        "{}: boundary gap {:.3} %",
        a.name,
        100.0 * a.boundary_max_rel_error
    );
}
