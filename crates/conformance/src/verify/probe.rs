//! The attention-score probe: the reference's first forward replayed in f64 from its own
//! weights, block by block, to measure what the rounding error of the attention scales with —
//! the score bound S = max over blocks, samples, heads of d_h^−½ · maxᵢ ‖qᵢ‖ · maxⱼ ‖kⱼ‖
//! (Cauchy–Schwarz: every |sᵢⱼ| ≤ S, and rounding q and k to a dtype with unit roundoff u moves
//! a score by up to ≈ u·S, which moves e^(sᵢⱼ − mᵢ) by a relative u·S).
//!
//! The replay composes the engine's own pieces ([`block_forward`], [`final_forward`], the
//! embedders) as the trainer does and checks itself: its loss must equal the reference step's
//! loss to 1e-9 relative, so a probe that no longer follows the model is an error, not a quiet
//! misestimate. It runs before the reference step, while the trainer holds only its weights:
//! one block's activations and weight copies at a time, below the step's own peak.
//!
//! Each family's replay is in `crate::families::<family>` ([`crate::families::VerifyFamily::probe`]);
//! the pieces they share in [`super::replay`].

use ditmem_budget::Spec;

use super::error::{bad, Result};
use super::replay::Probe;
use crate::diffusion::Batch;
use crate::families;
use crate::trainer::Trainer;

/// Relative difference allowed between the probe's loss and the reference step's (both f64,
/// summed in other orders: ~1e-15 expected).
const LOSS_AGREEMENT: f64 = 1e-9;

/// The prefixes of the tensors whose gradients come out of a cancellation the probe measures:
/// the `to_q` and `to_k` of each Sana block's linear attention.
pub(super) fn amplified_tensors(spec: &Spec) -> Result<Vec<String>> {
    let arch = ditmem_engine::families::Arch::of(spec)?;
    families::of(&arch).amplified_tensors(spec)
}

/// [`Probe`] of the first step of `spec` (the reference spec: f64, nothing recomputed) with the
/// weights of `t` (fresh, not yet stepped) on `batch`.
pub(super) fn probe(spec: &Spec, t: &Trainer, seed: u64, batch: &Batch) -> Result<Probe> {
    let arch = ditmem_engine::families::Arch::of(spec)?;
    families::of(&arch).probe(spec, t, seed, batch)
}

/// The replay must reproduce the step's loss: a probe that no longer follows the model is an
/// error, not a quiet misestimate of S.
pub(super) fn check_loss(probe_loss: f64, loss: f64) -> Result<()> {
    // NaN disagrees.
    let agrees = (probe_loss - loss).abs() <= LOSS_AGREEMENT * loss.abs();
    if !agrees {
        return Err(bad(
            "attention-score probe",
            format!(
                "its replay of the reference forward gives loss {probe_loss:e}, the step {loss:e}: \
                 the probe no longer follows the model"
            ),
        ));
    }
    Ok(())
}
