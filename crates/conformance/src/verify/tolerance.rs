//! Tolerances by dtype (module docs, 2.): what the rounding error scales with ([`Growth`]), the
//! factors per precision policy ([`Kappa`], [`kappa`]) and the tolerances they make
//! ([`Tolerance`], [`tolerance`], [`tolerance_for`]).

use super::error::Result;
use super::roundoff::unit_roundoff;
use crate::model::Dims;
use ditmem_budget::{Dtype, Precision, Spec};
use serde::{Deserialize, Serialize};

/// The error-growth factors of a spec's step, from its shapes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Growth {
    /// K: the longest reduction of the step — max of the linear fan-ins (D, 4·D, the timestep
    /// features F, the patch C·p²), the attention sums over the s tokens, and the sums over
    /// microbatch × tokens that form the weight and bias gradients.
    pub reduction: u64,
    /// Rounding stages chained from the first weights to the loss on the longest path: the patch
    /// embedding, the blocks' stages from their structure ([`super::chain::block_stages`]: the DiT's 6
    /// per block — qkv, q·kᵀ, softmax, P·v, proj, fc1→fc2 as one MLP stage plus the norm — and
    /// each family's own count), and the final layer: 6·L + 2 on the DiT.
    pub forward_chain: u64,
    /// The backward retraces the forward chain to reach the first parameters: 2 × forward.
    pub gradient_chain: u64,
    /// S: the attention-score bound of the reference's first step, d_h^−½ · maxᵢ ‖qᵢ‖ · maxⱼ
    /// ‖kⱼ‖ over blocks, samples and heads (measured by replaying its forward; 0 when unknown:
    /// [`Growth::of`] sees the spec only, [`Growth::with_score`] adds the reference's).
    pub score_bound: f64,
}

impl Growth {
    pub fn of(spec: &Spec) -> Result<Growth> {
        let d = Dims::new(spec)?;
        let micro = spec.workload.microbatch as usize;
        let reduction = [
            d.hidden,
            d.mlp_hidden,
            d.freq,
            d.patch_in(),
            d.tokens,
            micro * d.tokens,
        ]
        .into_iter()
        .max()
        .unwrap_or(1) as u64;
        let arch = ditmem_engine::families::Arch::of(spec)?;
        let forward_chain =
            crate::families::of(&arch).block_stages(d.depth as u64) + super::chain::OUTSIDE_BLOCKS;
        Ok(Growth {
            reduction,
            forward_chain,
            gradient_chain: 2 * forward_chain,
            score_bound: 0.0,
        })
    }

    /// These factors with the attention-score bound S of a reference ([`Reference::score_bound`]).
    pub fn with_score(self, score_bound: f64) -> Growth {
        Growth {
            score_bound,
            ..self
        }
    }
}

/// The tolerance of one precision policy under a spec's growth factors, from the measured error
/// spread of correct runs.
///
/// Model: independent rounding errors add in quadrature, each scaled by what its bound scales
/// with, and u_c is the unit roundoff of the policy's **compute dtype**:
///
/// ```text
///     grad  = u_c · √(κ_P²·P + κ_n²·n + κ_s²·S²)
///     loss  = u_c · κ_ℓ · √P_f
///     drift = κ_d · grad          (as a share of the distance trained, see Drift::vs_travel)
/// ```
///
/// - **P** ([`Growth::gradient_chain`]; P_f = [`Growth::forward_chain`] for the loss): rounding
///   stages chained from the first weights to the loss and back, each adding u_c.
/// - **n** ([`Growth::reduction`]): the longest reduction, the row width of a sum (fan-in,
///   tokens, microbatch × tokens). A sum of n terms accumulated in a dtype errs by ≈ u·√n of its
///   terms' scale; only fp32 and fp64 accumulate in their compute dtype. The bf16/fp16 policies
///   accumulate gemms, LayerNorm statistics and softmax sums in f32, where u_f32·√n ≪ u_c: their
///   κ_n is 0, and their measured error is flat from width 64 to 384 (max err / (u·√P) 0.41 →
///   0.30), while fp32's grows (1.69 → 2.01, and 1.55 → 2.11 from b·s = 128 to 512).
/// - **S** ([`Growth::score_bound`]): the attention-score bound d_h^−½ · maxᵢ‖qᵢ‖ · maxⱼ‖kⱼ‖ of
///   the reference's first step. Rounding q and k moves a score by ≈ u_c·S, and e^(s − m) by a
///   relative u_c·S: the softmax's error grows with its logits (4.7 at the default spec's
///   initial weights, 150–180 with scores ×32, where the fp32 error is 7.5× the O(1) one).
///
/// Calibration (`tests/verify_calibrate.rs`, which prints every figure): weight seeds 0–4 ×
/// data seeds 10–14, every policy × both attention modes (recompute twins are bitwise equal),
/// K = 3 drift steps, on the default spec (`Spec::small`: depth 2, hidden 64, 64 tokens, P = 28,
/// P_f = 14) at batch 2, 4, 8; at widths 128, 256, 384; with scores ×4, 8, 16, 32; and the
/// mutation suite's spec (two microbatches, EMA) at ×1, ×32 and width 384; and K = 50 at batch
/// 2, 4, 8 — 160 variant runs per policy; release, AMD EPYC, 2 threads. Fit, per policy: c_P = the largest err / (u·√P) at
/// the smallest n (bf16/fp16: over every unscaled case); c_n = the largest excess
/// √(err²/u² − c_P²·P) / √n over the unscaled cases; c_s = the largest remaining excess / S over
/// all cases; c_ℓ the largest loss err / (u·√P_f) — for every policy
/// over the correct runs at real width too (the presets with one block, 64²–256², 10 precision ×
/// recompute variants each: `bench/verify/calibrate_loss.py`, figures in
/// `bench/verify/runs/2026-12-06-epyc-width-mutations/`), where the loss errs up to 3.2× the
/// toy widths' c_ℓ (bf16-mixed 0.0267 on SD3.5-medium's dual block, fp16-mixed 0.0489 on
/// SD3.5-large, bf16-pure 0.0241 on Sana-1600M); c_d the largest drift share / grad tolerance
/// (also over K = 50 on the default spec). Each κ = [`SPREAD_MARGIN`] × c, so a correct run sits
/// at a margin (error / tolerance) of at most 0.5 at every calibration point; a bug that doubles
/// a policy's error lands in the warning band, one that triples it fails.
///
/// Per tensor ([`Tolerance::grad_of`]) four terms measured on the reference itself join this
/// (`terms.rs`): the underflow of a loss-scaled gradient below the compute dtype's smallest
/// normal (fp16: Flux's text stream at initialisation), the cancellation a gradient comes out
/// of (Sana's linear attention, measured by the probe), and the components of q and k that
/// cross the ReLU kink of Sana's linear attention (`kink.rs`: an error that grows with √u_c),
/// and the cancellation of a saturated softmax's backward (`softmax.rs`: ‖terms‖ / ‖result‖ of
/// dS = P∘(dP − Σ P·dP), multiplying the tolerance where the softmax runs at u_c — fp32, fp64;
/// the score term κ_s·S, fitted on the DiT, holds the rounding of P). The drift tolerance follows them,
/// weighted by each tensor's share of the reference's travel ([`Tolerance::drift_of`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tolerance {
    /// The policy the tolerance is for.
    pub precision: Precision,
    /// The dtype whose unit roundoff the tolerance uses (the policy's compute dtype).
    pub dtype: Dtype,
    /// u_c
    pub unit_roundoff: f64,
    /// √(κ_P²·P + κ_n²·n + κ_s²·S²) for gradients.
    pub growth: f64,
    /// Relative gradient error allowed per tensor (pass at or below it).
    pub grad: f64,
    /// Relative loss error allowed.
    pub loss: f64,
    /// Weight divergence after the K drift steps allowed, as a share of the distance the
    /// reference trained: ‖θ_K − θ_ref,K‖ / ‖θ_ref,K − θ_ref,0‖ ([`Drift::vs_travel`]).
    pub drift: f64,
    /// The derivation in one line.
    pub reason: String,
}

/// Safety factor of the calibrated κ over the largest error measured on correct runs.
pub const SPREAD_MARGIN: f64 = 2.0;

/// The κ factors of one precision policy (see [`Tolerance`] for the model and the fit).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Kappa {
    /// κ_P: per √(chained rounding stage).
    pub chain: f64,
    /// κ_n: per √(terms of the longest reduction); 0 where sums accumulate in f32 below u_c.
    pub reduction: f64,
    /// κ_s: per unit of the attention-score bound S.
    pub score: f64,
    /// κ_ℓ: the loss, per √(forward stage).
    pub loss: f64,
    /// κ_d: the drift share, per gradient tolerance.
    pub drift: f64,
}

/// κ of a policy: [`SPREAD_MARGIN`] × the measured c (see [`Tolerance`]), rounded up to two
/// digits. The loss of fp64 variants measured exactly 0 at the toy widths (κ_ℓ was fp32's, 1.2);
/// at real width the memory-efficient variant's loss errs up to c_ℓ = 0.856 (SD3.5-medium, one
/// dual and one joint block, 128²), so its κ_ℓ is 1.8.
pub fn kappa(precision: Precision) -> Kappa {
    let k = |chain, reduction, score, loss, drift| Kappa {
        chain,
        reduction,
        score,
        loss,
        drift,
    };
    match precision {
        Precision::Fp64 => k(1.8, 0.24, 0.84, 1.8, 220.0),
        Precision::Fp32 => k(3.4, 0.59, 0.89, 1.2, 68.0),
        // κ_ℓ from the real-width runs (see [`Tolerance`]); the toy widths' were 0.024,
        // 0.031 and 0.028.
        Precision::Bf16Mixed => k(0.83, 0.0, 0.17, 0.054, 14.0),
        Precision::Fp16Mixed => k(0.85, 0.0, 0.16, 0.098, 35.0),
        Precision::Bf16Pure => k(0.88, 0.0, 0.27, 0.049, 14.0),
    }
}

/// Pass ≤ 1 × tolerance < warn ≤ WARN_FACTOR × tolerance < fail. The tolerance is the scale of
/// random-sign rounding errors; a sum that cancels more than random signs can land above it, but
/// an error twice the rounding scale is no longer rounding.
pub const WARN_FACTOR: f64 = 2.0;

/// Drift growth rule (a warning, beside the drift tolerance): warn when the final parameter
/// divergence exceeds `DRIFT_GROWTH_FACTOR × K × (divergence after the first step)`. Each step
/// injects about the error of one step; K steps whose errors all add up in the same direction
/// give K times that (random directions give √K). The factor allows one decade of amplification
/// by the training dynamics themselves (a stated allowance, not derived: on the default spec the
/// fp64 memory-efficient twin, a perturbation at the f64 roundoff, grows 7× beyond linear over
/// 50 steps); beyond it, the error per step grows — a step goes wrong that the first one did not
/// show.
pub(crate) const DRIFT_GROWTH_FACTOR: f64 = 10.0;

/// The tolerance of `precision` for a spec with growth `g`.
pub fn tolerance(precision: Precision, g: &Growth) -> Tolerance {
    tolerance_for(precision, precision.compute_dtype(), g)
}

/// The tolerance of `precision` computed with `dtype`'s unit roundoff (to ask, e.g., whether
/// bf16-mixed would pass the fp32 tolerance).
pub fn tolerance_for(precision: Precision, dtype: Dtype, g: &Growth) -> Tolerance {
    let u = unit_roundoff(dtype);
    let k = kappa(precision);
    let (p, n, sc) = (g.gradient_chain as f64, g.reduction as f64, g.score_bound);
    let growth = (k.chain.powi(2) * p + k.reduction.powi(2) * n + (k.score * sc).powi(2)).sqrt();
    let grad = u * growth;
    Tolerance {
        precision,
        dtype,
        unit_roundoff: u,
        growth,
        grad,
        loss: u * k.loss * (g.forward_chain as f64).sqrt(),
        drift: k.drift * grad,
        reason: format!(
            "u({dtype}) · √(κ_P²·P + κ_n²·n + κ_s²·S²) = {u:.3e} · √({}²·{} + {}²·{} + ({}·{sc:.1})²) \
             (gradients; {} · u · √{} for the loss; {} × that for the drift)",
            k.chain, g.gradient_chain, k.reduction, g.reduction, k.score, k.loss, g.forward_chain, k.drift
        ),
    }
}

/// The dtype the attention's softmax and dS = P∘(dP − Σ dP·P) run in: f32 for every policy
/// but fp64 (the fused attention accumulates in f32, `ops/attention/mod.rs`; the bf16 kernel
/// keeps the softmax and dS in f32, `ops/attention/bf16.rs`), f64 for fp64.
pub(crate) fn softmax_dtype(compute: Dtype) -> Dtype {
    if compute == Dtype::F64 {
        Dtype::F64
    } else {
        Dtype::F32
    }
}

/// The underflow term enters a tensor's tolerance × this: [`SPREAD_MARGIN`], as every κ (the
/// term itself is the predicted error, see [`TensorError::underflow`]).
pub(crate) const KAPPA_UNDERFLOW: f64 = SPREAD_MARGIN;

/// The kink term enters a tensor's tolerance × this: [`SPREAD_MARGIN`], as every κ (the term
/// is the expected error of a count of flipped components, see [`kink`]).
pub(crate) const KAPPA_KINK: f64 = SPREAD_MARGIN;

impl Tolerance {
    /// The softmax cancellation `a` amplifies the rounding of [`softmax_dtype`], u_s·a; the
    /// policy's tolerance already holds rounding at u_c, so the factor is u_s·a / u_c where
    /// that is larger (fp32 and fp64: a itself; bf16/fp16 policies: 1 unless a > u_c / u_f32).
    pub(crate) fn softmax_factor(&self, a: f64) -> f64 {
        (a * unit_roundoff(softmax_dtype(self.dtype)) / self.unit_roundoff).max(1.0)
    }
}
