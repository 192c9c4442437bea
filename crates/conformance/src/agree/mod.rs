//! Budget against measurement: run a spec on the engine with the counting allocator and hold the
//! budget's timeline against what was measured, boundary by boundary.
//!
//! The compared quantity is the step's own memory: the peak above the live bytes just before the
//! step (after warm-up, so optimizer state exists). What lives before the step is compared
//! separately (`resident`): model states, the batch and candle's per-thread matmul packing
//! buffers are predicted; the trainer's own bookkeeping (parameter names, maps) is not, and shows
//! as the small remaining overhead.
//!
//! The grids of specs compared: each family's in its file (`crate::families::<family>::grid`,
//! re-exported at the end of this file), written with `builder.rs`'s vocabulary.

use ditmem_budget::Phase as BudgetPhase;
use ditmem_budget::{Budget, Spec};
use serde::Serialize;

pub(crate) mod builder;

use crate::measure::{MemoryProbe, Phase};
use crate::run::{run, Measurement, RunOptions};
use crate::Result;

/// One boundary of the step: predicted and measured live bytes above the step's start.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BoundaryPoint {
    pub phase: String,
    pub label: String,
    pub predicted_bytes: u64,
    pub measured_bytes: u64,
}

/// The comparison of one spec.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Agreement {
    pub name: String,
    /// Predicted peak above the step's start.
    pub predicted_peak_bytes: u64,
    /// Measured peak above the live bytes before the step.
    pub measured_peak_bytes: u64,
    /// predicted / measured − 1.
    pub rel_error: f64,
    /// Per phase (forward, backward, optimizer): (predicted, measured) above the step's start.
    pub phase_peaks: Vec<(String, u64, u64)>,
    /// Live bytes before the step: the budget's model states and batch, and the measurement
    /// (above the process's own heap before the trainer existed).
    pub predicted_resident_bytes: u64,
    pub measured_resident_bytes: u64,
    /// measured − predicted resident: the trainer's bookkeeping.
    pub runtime_overhead_bytes: i64,
    /// Boundaries of the last measured step, when their labels line up.
    pub boundaries: Vec<BoundaryPoint>,
    /// Largest |predicted − measured| over the boundaries, relative to the measured peak.
    pub boundary_max_rel_error: f64,
    pub predicted_peak_label: String,
    pub step_time_s: Vec<f64>,
}

fn budget_phase(p: Phase) -> BudgetPhase {
    match p {
        Phase::Forward => BudgetPhase::Forward,
        Phase::Backward => BudgetPhase::Backward,
        Phase::Optimizer => BudgetPhase::Optimizer,
    }
}

/// Compare a finished measurement with the budget of the same spec.
pub fn compare(name: &str, budget: &Budget, m: &Measurement, baseline: u64) -> Agreement {
    let tl = &budget.timeline;
    let start = tl.events.first().map_or(0, |e| e.total());
    let pred_peak = budget.peak_bytes.saturating_sub(start);
    let meas_peak = m.peak_bytes.saturating_sub(m.resident_bytes);
    let rel = |p: u64, q: u64| {
        if q == 0 {
            0.0
        } else {
            p as f64 / q as f64 - 1.0
        }
    };
    let phase_peaks = [Phase::Forward, Phase::Backward, Phase::Optimizer]
        .into_iter()
        .map(|ph| {
            let bp = budget_phase(ph);
            let pred = tl
                .events
                .iter()
                .filter(|e| e.phase == bp)
                .map(|e| e.total())
                .max()
                .unwrap_or(start)
                .saturating_sub(start);
            let meas = m.phase_peak_bytes.get(ph).saturating_sub(m.resident_bytes);
            (ph.name().to_string(), pred, meas)
        })
        .collect();
    // The engine measures every microbatch; the budget lays out two and says the others repeat
    // the second, so its boundaries are expanded to the whole step (as long as the measured one)
    // and every measured microbatch is held against a prediction.
    let all_events = tl.expanded_events();
    let predicted_boundaries: Vec<_> = all_events
        .iter()
        .filter(|e| !e.inside && e.phase != BudgetPhase::Start && e.phase != BudgetPhase::Encode)
        .collect();
    let mut boundaries = Vec::new();
    if predicted_boundaries.len() == m.timeline.len() {
        for (p, q) in predicted_boundaries.iter().zip(&m.timeline) {
            boundaries.push(BoundaryPoint {
                phase: q.phase.name().to_string(),
                label: q.label.clone(),
                predicted_bytes: p.total().saturating_sub(start),
                measured_bytes: q.live_bytes.saturating_sub(m.resident_bytes),
            });
        }
    }
    let boundary_max_rel_error = boundaries
        .iter()
        .map(|b| {
            (b.predicted_bytes as f64 - b.measured_bytes as f64).abs() / meas_peak.max(1) as f64
        })
        .fold(0.0, f64::max);
    let measured_resident = m.resident_bytes.saturating_sub(baseline);
    Agreement {
        name: name.to_string(),
        predicted_peak_bytes: pred_peak,
        measured_peak_bytes: meas_peak,
        rel_error: rel(pred_peak, meas_peak),
        phase_peaks,
        predicted_resident_bytes: start,
        measured_resident_bytes: measured_resident,
        runtime_overhead_bytes: measured_resident as i64 - start as i64,
        boundaries,
        boundary_max_rel_error,
        predicted_peak_label: budget.peak.label.clone(),
        step_time_s: m.step_times_s.clone(),
    }
}

/// Run `spec` (one warm-up and `steps` measured steps) and compare it with its budget.
pub fn measure_and_compare(
    name: &str,
    spec: &Spec,
    steps: u32,
    probe: &dyn MemoryProbe,
) -> Result<(Agreement, Budget, Measurement)> {
    // The budget of the CPU this runs on (the spec's own `cpu` section, else this process's).
    let spec = &crate::host::resolve(spec);
    let budget = ditmem_budget::estimate(spec)?;
    let baseline = probe.live();
    let opts = RunOptions {
        warmup: 1,
        steps: steps.max(1),
        ..RunOptions::default()
    };
    let m = run(spec, &opts, Some(probe), &mut |_| true)?;
    let a = compare(name, &budget, &m, baseline);
    Ok((a, budget, m))
}

/// Summary over a grid: max and median |pred/meas − 1| and the worst spec.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GridSummary {
    pub specs: usize,
    pub max_abs_rel_error: f64,
    pub median_abs_rel_error: f64,
    pub worst: String,
}

pub fn summarize(results: &[Agreement]) -> GridSummary {
    let mut errs: Vec<(f64, &str)> = results
        .iter()
        .map(|a| (a.rel_error.abs(), a.name.as_str()))
        .collect();
    errs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let median = if errs.is_empty() {
        0.0
    } else if errs.len() % 2 == 1 {
        errs[errs.len() / 2].0
    } else {
        (errs[errs.len() / 2 - 1].0 + errs[errs.len() / 2].0) / 2.0
    };
    let (max, worst) = errs.last().map_or((0.0, ""), |&(e, n)| (e, n));
    GridSummary {
        specs: results.len(),
        max_abs_rel_error: max,
        median_abs_rel_error: median,
        worst: worst.to_string(),
    }
}

// The grids, each in its family's file (`crate::families::<family>`), for the `agree` command
// and the tests.
pub use crate::families::dit::grid;
pub use crate::families::dit_diffusers::dit_diffusers_grid;
pub use crate::families::flux::{flux_grid, flux_grid_base};
pub use crate::families::pixart::{pixart_grid, pixart_grid_base};
pub use crate::families::sana::sana_grid;
pub use crate::families::sd3::{sd3_grid, sd3_grid_base};
pub use crate::families::wan::{wan_grid, wan_grid_base};
pub use builder::lora_specs;
