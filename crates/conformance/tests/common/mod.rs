//! Shared helpers of the conformance tests that measure an agreement grid's specs.
#![allow(dead_code)]

use candle_core::{DType, Tensor};
use ditmem_budget::Spec;
use ditmem_conformance::agree::{measure_and_compare, Agreement};
use ditmem_engine::CountingAlloc;

/// max |a − b| over two tensors of one shape, in f64.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar()
        .unwrap()
}

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
