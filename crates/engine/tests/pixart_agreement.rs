//! PixArt's memory: the `ditmem-cpu` budget against the counting allocator on a small subset of
//! the PixArt agreement grid (precisions, recompute, both attention modes, accumulation, an odd
//! caption length), each held to 2 % of the measured step peak.

use ditmem_engine::agree::{measure_and_compare, pixart_grid, summarize};
use ditmem_engine::CountingAlloc;

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

#[test]
fn budget_predicts_pixarts_measured_step_peak_within_two_percent() {
    let all = std::env::var("DITMEM_PIXART_ALL").is_ok();
    let grid = pixart_grid().unwrap();
    let n = grid.len();
    let mut results = Vec::new();
    for (name, spec) in grid.into_iter().step_by(if all { 1 } else { 3 }) {
        let (a, _, _) = measure_and_compare(&name, &spec, 1, &A).expect("the grid spec runs");
        eprintln!(
            "{name}: predicted {} measured {} ({:+.3} %) [{}]",
            a.predicted_peak_bytes,
            a.measured_peak_bytes,
            100.0 * a.rel_error,
            a.predicted_peak_label
        );
        results.push(a);
    }
    for a in &results {
        assert!(
            a.rel_error.abs() <= 0.02,
            "{}: predicted {} vs measured {} ({:+.3} %)",
            a.name,
            a.predicted_peak_bytes,
            a.measured_peak_bytes,
            100.0 * a.rel_error
        );
    }
    let s = summarize(&results);
    assert!(n >= 10 && s.specs >= 4);
    eprintln!(
        "{} specs: max {:.3} % ({}), median {:.3} %",
        s.specs,
        100.0 * s.max_abs_rel_error,
        s.worst,
        100.0 * s.median_abs_rel_error
    );
}
