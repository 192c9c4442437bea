//! Shared helpers of the conformance tests that measure an agreement grid's specs.
#![allow(dead_code)]

use ditmem_budget::Spec;
use ditmem_conformance::agree::{measure_and_compare, Agreement};
use ditmem_engine::CountingAlloc;

// The engine tests' tensor helpers (max |a − b| among them), one file for both crates.
#[path = "../../../engine/tests/common/tensors.rs"]
mod tensors;
#[allow(unused_imports)] // not every test binary that includes `common` uses them
pub use tensors::*;

/// One spec of an agreement grid measured against its budget (one step after warm-up), with
/// the line the suite prints for it.
pub fn agreement_logged(name: &str, spec: &Spec, alloc: &CountingAlloc) -> Agreement {
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
