//! Verify: correct first, then save. Every precision / recompute / attention variant of a spec is
//! held against a float64 reference computed from the same initial weights and the same data.
//!
//! 1. **One step on a fixed batch** ([`SyntheticData::step_batch`]`(0)`: fixed seeds for latents,
//!    noise, timesteps and label dropout). Loss relative error; per trained tensor the gradient
//!    relative error ‖g − g_ref‖ / ‖g_ref‖ (max, median, worst tensor); the cosine similarity of
//!    the whole gradient; the share of non-finite gradient values.
//! 2. **Tolerances by dtype** ([`tolerance`]): the unit roundoff of the compute dtype times what
//!    the rounding error scales with — the chained rounding stages P, the longest reduction n
//!    (where sums accumulate in the compute dtype), the attention-score bound S of the reference
//!    ([`Growth`]) — each weighted by a factor per precision policy set from the measured error
//!    spread of correct runs (see [`Tolerance`]), tight enough that realistic precision bugs fail
//!    (`tests/verify_mutations.rs`).
//! 3. **Twins**: variants that differ only by recompute (same precision and attention) must match
//!    bitwise, because recomputing a block replays exactly the same ops on the same inputs.
//!    Variants that differ only by the attention mode are each held to the reference (so they are
//!    within two tolerances of each other).
//! 4. **Drift over K steps** of the spec's optimizer (AdamW, lr [`DEFAULT_LR`]) on the batches
//!    `step_batch(0..K)`: per step the loss divergence |ℓ − ℓ_ref| / |ℓ_ref| and the parameter
//!    divergence ‖θ − θ_ref‖ / ‖θ_ref‖. After the last step that divergence, as a share of the
//!    distance the reference trained ([`Drift::vs_travel`]), is held to the drift tolerance
//!    ([`Tolerance::drift`]: κ_d × the gradient tolerance, measured like it) — a bug in the
//!    update itself (AdamW moments in bf16) leaves the gradients alone and shows only here. A
//!    variant whose divergence grows faster than its first step predicts is also flagged
//!    ([`DRIFT_GROWTH_FACTOR`]).
//! 5. **Verdicts** pass / warn / fail per variant ([`Verdict`]).
//!
//! The reference (gradients, loss, trajectory) is computed once per run into a safetensors file
//! ([`compute_reference`], [`Reference::open`]) with its spec and seeds as metadata, so a later run
//! against a different spec is refused; variants are compared with it one tensor at a time.

pub(crate) mod cancellation;
pub(crate) mod chain;
mod drift;
pub(crate) mod error;
mod judge;
pub(crate) mod key_bias;
pub(crate) mod kink;
mod memory;
mod metrics;
mod one_step;
mod probe;
mod reference;
pub(crate) mod replay;
mod report;
mod roundoff;
mod run;
pub(crate) mod softmax;
mod store;
mod terms;
mod tolerance;
pub(crate) mod upstream;
mod variant;
mod verdict;

pub use drift::*;
pub use error::{Result, VerifyError};
pub use judge::*;
pub use memory::*;
pub use metrics::*;
pub use one_step::*;
pub use reference::*;
pub use report::*;
pub use roundoff::unit_roundoff;
pub use tolerance::*;
pub use variant::*;
pub use verdict::*;

use ditmem_budget::{Precision, Spec};

use crate::error::EngineError;
use judge::{check_twins, judge};
use run::{run_all, Run};

/// Verify `variants` of `base` against `reference` (which must match; see
/// [`Reference::check_matches`]) with `jobs` variants at once.
pub fn verify(
    base: &Spec,
    variants: &[Variant],
    opts: &VerifyOptions,
    reference: &Reference,
    jobs: usize,
    progress: &mut dyn FnMut(Event<'_>),
) -> Result<Report> {
    opts.check()?;
    reference.check_matches(base, opts)?;
    let growth = Growth::of(base)?.with_score(reference.score_bound);
    let results = run_all(base, variants, opts, reference, jobs, progress);
    let mut runs: Vec<Option<Run>> = Vec::with_capacity(variants.len());
    let mut reports: Vec<VariantReport> = Vec::with_capacity(variants.len());
    for (v, result) in variants.iter().zip(results) {
        let tol = tolerance(v.precision, &growth);
        let mut rep = VariantReport {
            name: v.name(),
            precision: v.precision,
            recompute: v.recompute.to_string(),
            attention: v.attention,
            verdict: Verdict::Pass,
            reasons: Vec::new(),
            loss: None,
            loss_rel_err: None,
            grad_rel_err_max: None,
            grad_rel_err_median: None,
            grad_norm_rel_err: None,
            worst_tensor: None,
            cosine: None,
            nonfinite_share: None,
            loss_scale: None,
            tolerance_grad: tol.grad,
            tolerance_loss: tol.loss,
            grad_margin: None,
            loss_margin: None,
            tolerance_drift: tol.drift,
            drift_margin: None,
            twins: Vec::new(),
            drift_final: None,
            drift_one_step: None,
            drift_predicted_max: None,
            loss_drift_final: None,
            ema_drift_final: None,
            skipped_steps: None,
            drift: None,
            per_tensor: Vec::new(),
        };
        match result {
            Ok(run) => {
                judge(&mut rep, &run, &tol);
                runs.push(Some(run));
            }
            Err(VerifyError::Engine(EngineError::Unsupported { feature, why })) => {
                rep.verdict = Verdict::Skip;
                rep.reasons
                    .push(format!("{feature} is not supported by the engine: {why}"));
                runs.push(None);
            }
            Err(e) => return Err(e),
        }
        reports.push(rep);
    }
    check_twins(variants, &runs, &mut reports);
    let count = |x: Verdict| reports.iter().filter(|r| r.verdict == x).count();
    Ok(Report {
        reference_spec: reference.spec.clone(),
        reference_variant: Variant::reference().name(),
        reference_loss: reference.loss,
        options: opts.clone(),
        growth,
        tolerances: Precision::ALL
            .iter()
            .map(|&p| tolerance(p, &growth))
            .collect(),
        warn_factor: WARN_FACTOR,
        drift_growth_factor: DRIFT_GROWTH_FACTOR,
        passed: count(Verdict::Pass),
        warned: count(Verdict::Warn),
        failed: count(Verdict::Fail),
        skipped: count(Verdict::Skip),
        variants: reports,
    })
}
