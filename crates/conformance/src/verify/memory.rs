//! How many variants fit at once: the predicted memory of the reference and of each variant
//! ([`MemoryPlan`], [`plan_memory`]).

use super::error::{Result, VerifyError};
use super::reference::{reference_file_bytes, reference_spec, VerifyOptions};
use super::variant::Variant;
use crate::error::EngineError;
use ditmem_budget::Spec;
use serde::Serialize;

/// What `verify` will hold at its peak, predicted before it starts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryPlan {
    /// Variants computed at once.
    pub jobs: usize,
    /// The budget's peak of the fp64 reference step (0 when the reference is read from a file),
    /// without the optimizer state no later step needs ([`step_peak`]).
    pub reference_step: u64,
    /// The budget's peaks of the `jobs` largest variant steps ([`step_peak`]), summed, with
    /// `gemm`'s per-thread slabs (which running variants share) counted once.
    pub variant_steps: u64,
    /// What verification itself keeps per running variant: the comparison buffers
    /// ([`COMPARE_BUFFERS`] f64 copies of the largest trained tensor) and the read buffer.
    pub keep_per_job: u64,
    /// What the report keeps: per variant a few numbers per tensor and per step.
    pub report: u64,
    /// max(reference phase, variant steps + jobs × keep) + report; the reference phase is its
    /// step + keep + the file's write buffer, or with at most one drift step the larger of its
    /// step and its optimizer phase + keep + the write buffer (nothing runs beside the file
    /// before the backward is over).
    pub peak: u64,
    /// Size of the reference file (on disk, not in memory).
    pub reference_file: u64,
}

/// f64 copies of one tensor a running comparison holds at once: the variant's value cast to f64
/// (and the copy `parameter` makes of it, in its dtype, counted as one more), the reference's
/// value and the bytes it was read from.
pub(crate) const COMPARE_BUFFERS: u64 = 4;

/// f64 copies of one tensor the reference holds while it writes it to its file: a weight's copy
/// (`Trainer::parameter`) and the values taken out of it (`to_f64`'s vector); a gradient needs
/// only the second (`Trainer::gradient` returns the buffer itself under fp64). With an EMA the
/// rule of the comparisons ([`COMPARE_BUFFERS`]) stands.
pub(crate) const REFERENCE_WRITE_COPIES: u64 = 2;

/// Predict the peak of `verify` on `variants` of `base` with `jobs` variants at once: the
/// budget's estimate of each step it runs, plus what verification keeps (see [`MemoryPlan`]).
/// The reference runs alone before the variants; `computes_reference` is false when it is read
/// from a file. The steps run in this process, so they are budgeted on its CPU (the spec's `cpu`
/// section, else this process's: its threads and `gemm`'s per-thread slab).
pub fn plan_memory(
    base: &Spec,
    variants: &[Variant],
    opts: &VerifyOptions,
    jobs: usize,
    computes_reference: bool,
) -> Result<MemoryPlan> {
    let base = &crate::host::resolve(base);
    let shapes: Vec<_> = crate::model::param_shapes(base)?
        .into_iter()
        .filter(|p| p.trainable)
        .collect();
    let largest = shapes.iter().map(|p| p.numel()).max().unwrap_or(0);
    let trained: u64 = shapes.iter().map(|p| p.numel()).sum();
    let budget = |s: &Spec| -> Result<ditmem_budget::Budget> {
        ditmem_budget::estimate(s).map_err(|e| VerifyError::Engine(EngineError::Spec(e)))
    };
    let estimate = |s: &Spec| -> Result<u64> {
        budget(s).map(|b| step_peak(&b, opts.steps, largest, trained))
    };
    let keep = COMPARE_BUFFERS * 8 * largest;
    // The reference phase: its step, and what writing the file adds (the write buffer and the
    // copies of the tensor being written). The file is opened once the first backward is over:
    // with at most one drift step no forward or backward runs after it, so it adds to what the
    // optimizer phase holds without the state (weights, gradients), not to the backward's peak,
    // and to each tensor's copies, not to the update's (one tensor's state is not live while a
    // tensor is written); with more steps, later backwards run beside it (`keep`, as before).
    let (reference_step, reference_phase) = if computes_reference {
        let b = budget(&reference_spec(base))?;
        let step = step_peak(&b, opts.steps, largest, trained);
        let phase = if opts.steps <= 1 {
            let writing = b
                .phase_peaks
                .iter()
                .find(|p| p.0 == ditmem_budget::Phase::Optimizer)
                .map_or(b.peak_bytes, |p| p.1)
                .saturating_sub(b.static_bytes.optimizer_state)
                + if base.recipe.ema.enabled {
                    keep
                } else {
                    REFERENCE_WRITE_COPIES * 8 * largest
                }
                + super::store::WRITE_BUFFER;
            step.max(writing)
        } else {
            step + keep + super::store::WRITE_BUFFER
        };
        (step, phase)
    } else {
        (0, 0)
    };
    // gemm's packing slabs belong to the pool's threads, not to a step: variants that run at once
    // share them, so the sum counts them once (each step's estimate holds them).
    let slabs = |s: &Spec| {
        if ditmem_budget::ditmem_cpu::step_uses_gemm(s) {
            ditmem_budget::ditmem_cpu::gemm_workspace_bytes(&s.cpu())
        } else {
            0
        }
    };
    let mut steps: Vec<(u64, u64)> = variants
        .iter()
        .map(|v| {
            let s = v.apply(base);
            let slab = slabs(&s);
            estimate(&s).map(|e| (e.saturating_sub(slab), slab))
        })
        .collect::<Result<_>>()?;
    steps.sort_unstable_by(|a, b| b.cmp(a));
    let jobs = jobs.clamp(1, variants.len().max(1));
    let running = &steps[..jobs.min(steps.len())];
    let variant_steps: u64 =
        running.iter().map(|s| s.0).sum::<u64>() + running.iter().map(|s| s.1).max().unwrap_or(0);
    let tensors = shapes.len() as u64;
    let report = variants.len() as u64 * (tensors * 96 + (u64::from(opts.steps) + 1) * 48 + 4096);
    let peak = reference_phase.max(variant_steps + jobs as u64 * keep) + report;
    Ok(MemoryPlan {
        jobs,
        reference_step,
        variant_steps,
        keep_per_job: keep,
        report,
        peak,
        reference_file: reference_file_bytes(base, opts)?,
    })
}

/// The peak of one of verify's runs of a spec whose budget (a steady-state training step, the
/// optimizer's state live throughout) is `b`, for `steps` drift steps. Every run of verify
/// starts from fresh weights, and the optimizer's state is needed only by a step that follows:
/// the last step frees each tensor's state right after its update
/// ([`Trainer::release_optimizer_state_after_next_step`]). So with at most one step, no
/// phase holds the state but the optimizer's, which holds one tensor's at a time (the largest,
/// `largest` of the `trained` values: the state is per value); with two or more, the first step
/// keeps it for the second, as the budget counts.
pub(crate) fn step_peak(b: &ditmem_budget::Budget, steps: u32, largest: u64, trained: u64) -> u64 {
    if steps >= 2 {
        return b.peak_bytes;
    }
    let state = b.static_bytes.optimizer_state;
    let one = state_of_one(b, largest, trained);
    b.phase_peaks
        .iter()
        .filter_map(|&(phase, peak)| match phase {
            ditmem_budget::Phase::Optimizer if steps == 0 => None,
            ditmem_budget::Phase::Optimizer => Some(peak.saturating_sub(state) + one),
            _ => Some(peak.saturating_sub(state)),
        })
        .max()
        .unwrap_or(b.peak_bytes)
}

/// The optimizer state of the largest of `trained` values' tensors, `largest` values:
/// ceil(state × largest / trained), exact for a state held per value (AdamW's m and v).
pub(super) fn state_of_one(b: &ditmem_budget::Budget, largest: u64, trained: u64) -> u64 {
    if trained == 0 {
        return 0;
    }
    let state = u128::from(b.static_bytes.optimizer_state);
    (state * u128::from(largest)).div_ceil(u128::from(trained)) as u64
}
