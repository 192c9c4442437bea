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

mod cancellation;
mod chain;
mod error;
mod key_bias;
mod kink;
mod probe;
mod roundoff;
mod softmax;
mod store;
mod terms;

use error::{bad, reference_error};
pub use error::{Result, VerifyError};
pub use roundoff::unit_roundoff;

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::fmt;
use std::hash::Hasher;
use std::path::{Path, PathBuf};

use candle_core::DType;
use ditmem_budget::{AttentionMode, Dtype, Precision, Recompute, Spec};
use serde::{Deserialize, Serialize};

use crate::diffusion::SyntheticData;
use crate::error::EngineError;
use crate::model::Dims;
use crate::trainer::{TrainOptions, Trainer};

// ---------------------------------------------------------------------------------------------
// Errors.

// ---------------------------------------------------------------------------------------------
// Variants.

/// One way of computing the step: precision policy × recompute policy × attention mode.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Variant {
    pub precision: Precision,
    pub recompute: Recompute,
    pub attention: AttentionMode,
    /// A planted bug applied to the one-step gradients (tests of the verifier only).
    #[doc(hidden)]
    pub fault: Option<Fault>,
}

/// Recompute policies of the default variant set.
pub(crate) const DEFAULT_RECOMPUTE: [Recompute; 3] =
    [Recompute::None, Recompute::All, Recompute::AttentionOnly];

/// Attention modes of the default variant set.
pub(crate) const DEFAULT_ATTENTION: [AttentionMode; 2] =
    [AttentionMode::Materialized, AttentionMode::MemoryEfficient];

impl Variant {
    pub fn new(precision: Precision, recompute: Recompute, attention: AttentionMode) -> Variant {
        Variant {
            precision,
            recompute,
            attention,
            fault: None,
        }
    }

    /// The reference: fp64, every block stored, materialized attention.
    pub fn reference() -> Variant {
        Variant::new(
            Precision::Fp64,
            Recompute::None,
            AttentionMode::Materialized,
        )
    }

    /// `precision/recompute/attention` (block lists written with `+`: `blocks:0+2`), with the
    /// planted fault appended when there is one.
    pub fn name(&self) -> String {
        let r = self.recompute.to_string().replace(',', "+");
        let mut n = format!("{}/{}/{}", self.precision, r, self.attention.name());
        if let Some(f) = &self.fault {
            n.push_str(&format!("+{f}"));
        }
        n
    }

    /// `base` with this variant's precision, recompute and attention.
    pub fn apply(&self, base: &Spec) -> Spec {
        let mut s = base.clone();
        s.recipe.precision = self.precision;
        s.recipe.recompute = self.recompute.clone();
        s.recipe.attention = self.attention;
        s
    }

    /// Variants with the same key differ only by recompute and must be bitwise identical: a
    /// recomputed block replays exactly the ops of storing it, and attention-only recompute
    /// rebuilds the same materialized attention graph in its backward.
    fn twin_key(&self) -> (Precision, AttentionMode) {
        (self.precision, self.attention)
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// The default variant set: every precision × {none, all, attention-only} × both attention modes.
pub fn default_variants() -> Vec<Variant> {
    let mut v = Vec::new();
    for p in Precision::ALL {
        for r in DEFAULT_RECOMPUTE.iter() {
            for a in DEFAULT_ATTENTION {
                v.push(Variant::new(p, r.clone(), a));
            }
        }
    }
    v
}

/// Parse `precision/recompute/attention` items separated by commas. `*` (or a missing trailing
/// part) stands for every value of the default set; block lists are written `blocks:0+2`.
/// Example: `bf16-mixed/all/materialized,fp32/none/memory-efficient,fp16-mixed/*/*`.
pub fn parse_variants(text: &str) -> Result<Vec<Variant>> {
    let mut out: Vec<Variant> = Vec::new();
    let items: Vec<&str> = text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if items.is_empty() {
        return Err(VerifyError::Variant {
            text: text.into(),
            why: "no variant given; allowed: precision/recompute/attention, e.g. bf16-mixed/all/materialized".into(),
        });
    }
    for item in items {
        let verr = |why: String| VerifyError::Variant {
            text: item.into(),
            why,
        };
        let parts: Vec<&str> = item.split('/').map(str::trim).collect();
        if parts.len() > 3 {
            return Err(verr(
                "has more than three parts; allowed: precision/recompute/attention".into(),
            ));
        }
        let part = |i: usize| parts.get(i).copied().unwrap_or("*");
        let precisions: Vec<Precision> = match part(0) {
            "*" | "" => Precision::ALL.to_vec(),
            p => vec![p.parse::<Precision>().map_err(|e| verr(e.to_string()))?],
        };
        let recomputes: Vec<Recompute> = match part(1) {
            "*" | "" => DEFAULT_RECOMPUTE.to_vec(),
            r => vec![r
                .replace('+', ",")
                .parse::<Recompute>()
                .map_err(|e| verr(e.to_string()))?],
        };
        let attentions: Vec<AttentionMode> = match part(2) {
            "*" | "" => DEFAULT_ATTENTION.to_vec(),
            a => vec![a
                .parse::<AttentionMode>()
                .map_err(|e| verr(e.to_string()))?],
        };
        for &p in &precisions {
            for r in &recomputes {
                for &a in &attentions {
                    let v = Variant::new(p, r.clone(), a);
                    if !out.contains(&v) {
                        out.push(v);
                    }
                }
            }
        }
    }
    Ok(out)
}

/// A planted bug, applied to a variant's one-step gradients, so tests can show that the verifier
/// catches real mistakes. Not part of the CLI.
#[doc(hidden)]
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Fault {
    /// Drop one gradient contribution: the named tensor's gradient becomes zero.
    ZeroGradient(String),
    /// Scale the named tensor's gradient by num/den (e.g. a forgotten loss-scale division).
    ScaleGradient(String, i64, i64),
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::ZeroGradient(n) => write!(f, "fault:zero-grad({n})"),
            Fault::ScaleGradient(n, a, b) => write!(f, "fault:scale-grad({n},{a}/{b})"),
        }
    }
}

impl Fault {
    /// The tensor the fault is planted in.
    pub fn target(&self) -> &str {
        match self {
            Fault::ZeroGradient(n) | Fault::ScaleGradient(n, _, _) => n,
        }
    }

    fn apply(&self, name: &str, values: &mut [f64]) {
        if name != self.target() {
            return;
        }
        let factor = match self {
            Fault::ZeroGradient(_) => 0.0,
            Fault::ScaleGradient(_, a, b) => *a as f64 / *b as f64,
        };
        for x in values {
            *x *= factor;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Tolerances.

/// The error-growth factors of a spec's step, from its shapes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Growth {
    /// K: the longest reduction of the step — max of the linear fan-ins (D, 4·D, the timestep
    /// features F, the patch C·p²), the attention sums over the s tokens, and the sums over
    /// microbatch × tokens that form the weight and bias gradients.
    pub reduction: u64,
    /// Rounding stages chained from the first weights to the loss on the longest path: the patch
    /// embedding, the blocks' stages from their structure ([`chain::block_stages`]: the DiT's 6
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
        let arch = crate::families::Arch::of(spec)?;
        let forward_chain = chain::block_stages(&arch, d.depth as u64) + chain::OUTSIDE_BLOCKS;
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

/// The verdict of a variant (ordered: worse is greater).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Pass,
    Warn,
    Fail,
    /// The engine does not execute this combination (e.g. attention dropout with
    /// memory-efficient attention); not counted as a failure.
    Skip,
}

impl Verdict {
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Warn => "warn",
            Verdict::Fail => "fail",
            Verdict::Skip => "skip",
        }
    }

    /// Judge an error against a tolerance (NaN fails).
    pub fn of(err: f64, tol: f64) -> Verdict {
        if err <= tol {
            Verdict::Pass
        } else if err <= WARN_FACTOR * tol {
            Verdict::Warn
        } else {
            Verdict::Fail
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

// ---------------------------------------------------------------------------------------------
// Settings, reference.

/// Learning rate of the drift run: large enough that 50 AdamW steps move every weight by
/// ~50·lr (≈ 5 % of a 64-wide Xavier weight), so the trajectories actually separate.
pub(crate) const DEFAULT_LR: f64 = 1e-3;

/// Settings of a verification that are not part of the spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VerifyOptions {
    /// Seed of the initial weights (and dropout masks).
    pub seed: u64,
    /// Seed of the synthetic data (latents, noise, timesteps, labels, label dropout).
    pub data_seed: u64,
    /// Learning rate of the drift run.
    pub lr: f64,
    pub weight_decay: f64,
    /// Optimizer steps of the drift run (0: one-step comparison only).
    pub steps: u32,
}

impl Default for VerifyOptions {
    fn default() -> Self {
        VerifyOptions {
            seed: 0,
            data_seed: 1,
            lr: DEFAULT_LR,
            weight_decay: 0.0,
            steps: 50,
        }
    }
}

impl VerifyOptions {
    fn train(&self) -> TrainOptions {
        TrainOptions {
            seed: self.seed,
            lr: self.lr,
            weight_decay: self.weight_decay,
            loss_scale_growth_interval: 2000,
            keep_gradients: false,
        }
    }

    fn check(&self) -> Result<()> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(bad("lr", format!("{} is not a positive number", self.lr)));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(bad(
                "weight decay",
                format!("{} is not a number ≥ 0", self.weight_decay),
            ));
        }
        Ok(())
    }
}

/// The fp64 reference: what comparison needs and nothing more. The loss and the drift losses are
/// held here; the gradients and the trajectory (parameters, and EMA weights when the recipe keeps
/// one, after 0..=K steps) lie in a file (`store`) read one tensor at a time.
#[derive(Debug)]
pub struct Reference {
    /// The reference spec: the base spec under fp64 / no recompute / materialized attention.
    pub spec: Spec,
    pub options: VerifyOptions,
    /// Version of ditmem that computed it.
    pub version: String,
    pub loss: f64,
    /// Loss of each drift step (before its update), `steps` values.
    pub losses: Vec<f64>,
    /// Trained tensors (name, shape) in the order they are compared.
    pub tensors: Vec<(String, Vec<usize>)>,
    /// Whether the trajectory holds EMA weights.
    pub ema: bool,
    /// S, the attention-score bound of the first step (see [`Growth::score_bound`]).
    pub score_bound: f64,
    /// (tensor prefix, ‖terms‖ / ‖result‖): the cancellations the tensors' gradients come out
    /// of, measured on the first step's replay (Sana's linear attention; empty elsewhere).
    pub amplification: Vec<(String, f64)>,
    /// ‖terms‖ / ‖result‖ of the softmax attentions' backward on the first step's replay
    /// ([`softmax`]: saturated rows cancel), applied to every tensor's gradient (≥ 1).
    pub softmax_amplification: f64,
    /// (tensor prefix, expected relative error per dtype of [`kink::KINK_DTYPES`]): the
    /// gradients behind a ReLU kink, measured on the first step's replay (Sana's linear
    /// attention; empty elsewhere).
    pub kink: Vec<(String, [f64; 3])>,
    /// The file's name; None for a reference computed into a file without one.
    path: Option<PathBuf>,
    file: std::sync::Mutex<std::fs::File>,
    layout: store::Layout,
    /// The named file is deleted when dropped (computed to be persisted, and not yet).
    temporary: bool,
}

impl Drop for Reference {
    fn drop(&mut self) {
        if let (true, Some(p)) = (self.temporary, &self.path) {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The reference spec of a base spec.
pub(crate) fn reference_spec(base: &Spec) -> Spec {
    Variant::reference().apply(base)
}

fn to_f64(t: &candle_core::Tensor) -> Result<Vec<f64>> {
    let v = t
        .to_dtype(DType::F64)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f64>())
        .map_err(EngineError::from)?;
    Ok(v)
}

/// Bytes of the stored reference of `base` with `opts` (header excluded): 8 B per trained
/// parameter for the gradients and for each of the K + 1 trajectory points (twice with an EMA),
/// plus the K + 1 losses.
pub fn reference_file_bytes(base: &Spec, opts: &VerifyOptions) -> Result<u64> {
    let n = crate::trainable_count(base)?;
    Ok(store::data_bytes(n, opts.steps, base.recipe.ema.enabled))
}

const FORMAT: &str = "ditmem-verify-reference/6";

/// The metadata of a reference file.
fn reference_meta(
    spec: &Spec,
    opts: &VerifyOptions,
    names: &[String],
    score_bound: f64,
    softmax_amplification: f64,
    amplification: &[(String, f64)],
    kink: &[(String, [f64; 3])],
) -> Result<HashMap<String, String>> {
    let mut meta = HashMap::new();
    meta.insert("format".to_string(), FORMAT.to_string());
    meta.insert("spec".to_string(), json(spec)?);
    meta.insert("options".to_string(), json(opts)?);
    meta.insert("names".to_string(), json(&names)?);
    meta.insert("ema".to_string(), spec.recipe.ema.enabled.to_string());
    meta.insert("score_bound".to_string(), json(&score_bound)?);
    meta.insert(
        "softmax_amplification".to_string(),
        json(&softmax_amplification)?,
    );
    meta.insert("amplification".to_string(), json(&amplification)?);
    meta.insert("kink".to_string(), json(&kink)?);
    meta.insert("version".to_string(), env!("CARGO_PKG_VERSION").to_string());
    Ok(meta)
}

/// The size in bytes of the file [`compute_reference`] writes for `base` and `opts`, header
/// included, predicted before it runs: the data ([`reference_file_bytes`]) and the header of the
/// same tensors and metadata, with the one figure not known before the run (S) at its longest
/// JSON form — an upper bound by at most a few bytes.
pub fn reference_file_size(base: &Spec, opts: &VerifyOptions) -> Result<u64> {
    let spec = reference_spec(base);
    let tensors: Vec<(String, Vec<usize>)> = crate::model::param_shapes(&spec)?
        .into_iter()
        .filter(|p| p.trainable)
        .map(|p| (p.name, p.shape))
        .collect();
    let names: Vec<String> = tensors.iter().map(|t| t.0.clone()).collect();
    let amplification: Vec<(String, f64)> = probe::amplified_tensors(&spec)?
        .into_iter()
        .map(|n| (n, -f64::MAX))
        .collect();
    let kink: Vec<(String, [f64; 3])> = amplification
        .iter()
        .map(|(n, _)| (n.clone(), [-f64::MAX; 3]))
        .collect();
    // The same tensors as the probe's lists: each source and what it reaches upstream.
    let amplification = probe::with_upstream(&spec, amplification, f64::max)?;
    let kink = probe::with_upstream(&spec, kink, |a, _| a)?;
    let meta = reference_meta(
        &spec,
        opts,
        &names,
        -f64::MAX,
        -f64::MAX,
        &amplification,
        &kink,
    )?;
    let ema = spec.recipe.ema.enabled;
    store::file_len(&meta, &store::keys(&tensors, opts.steps, ema))
}

static TEMP_COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Compute the reference for `base` (its recipe's precision, recompute and attention are replaced
/// by fp64 / none / materialized) into a file without a name in the system's temporary folder:
/// its blocks are freed when the reference is dropped or the process ends, however it ends.
/// `progress(step)` is called after each drift step.
pub fn compute_reference(
    base: &Spec,
    opts: &VerifyOptions,
    progress: &mut dyn FnMut(u32),
) -> Result<Reference> {
    compute_reference_into(
        Target::Anonymous(&std::env::temp_dir()),
        base,
        opts,
        progress,
    )
}

/// [`compute_reference`] into a named temporary file in `dir`, to be [`Reference::persist`]ed
/// there (a rename, not a copy); deleted when dropped before that.
pub fn compute_reference_in(
    dir: &Path,
    base: &Spec,
    opts: &VerifyOptions,
    progress: &mut dyn FnMut(u32),
) -> Result<Reference> {
    compute_reference_into(Target::Named(dir), base, opts, progress)
}

/// Where a reference is computed to.
enum Target<'a> {
    Anonymous(&'a Path),
    Named(&'a Path),
}

fn compute_reference_into(
    target: Target<'_>,
    base: &Spec,
    opts: &VerifyOptions,
    progress: &mut dyn FnMut(u32),
) -> Result<Reference> {
    opts.check()?;
    let spec = reference_spec(base);
    let path = match target {
        Target::Named(dir) => Some(dir.join(format!(
            ".ditmem-verify-reference-{}-{}.tmp",
            std::process::id(),
            TEMP_COUNTER.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        ))),
        Target::Anonymous(_) => None,
    };
    // From here on the file is ours: removed on every error path by the guard's drop.
    struct Cleanup(Option<PathBuf>);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            if let Some(p) = &self.0 {
                let _ = std::fs::remove_file(p);
            }
        }
    }
    let mut cleanup = Cleanup(None);
    let data = SyntheticData::new(&spec, opts.data_seed)?;
    // One-step gradients.
    let mut t = Trainer::new(&spec, opts.train())?;
    let names = t.trained_names();
    let mut tensors = Vec::with_capacity(names.len());
    for n in &names {
        tensors.push((n.clone(), t.parameter(n)?.dims().to_vec()));
    }
    let ema = spec.recipe.ema.enabled;
    let batch = data.step_batch(0);
    // The probe first, while the trainer holds only its weights (its forward stays below the
    // step's peak), then checked against the step's loss.
    let probe::Probe {
        score_bound,
        softmax: softmax_amplification,
        loss: probe_loss,
        amplification,
        kink,
    } = probe::probe(&spec, &t, opts.seed, &batch)?;
    let loss = t.compute_gradients(&batch)?;
    probe::check_loss(probe_loss, loss)?;
    drop(batch);
    let meta = reference_meta(
        &spec,
        opts,
        &names,
        score_bound,
        softmax_amplification,
        &amplification,
        &kink,
    )?;
    let keys = store::keys(&tensors, opts.steps, ema);
    let mut w = match (&path, target) {
        (Some(p), _) => {
            let w = store::Writer::create(p, meta, keys)?;
            cleanup.0 = Some(p.clone());
            w
        }
        (None, Target::Anonymous(dir) | Target::Named(dir)) => {
            store::Writer::anonymous(dir, meta, keys)?
        }
    };
    for (n, shape) in &tensors {
        let g = match t.gradient(n)? {
            Some(g) => to_f64(&g)?,
            None => vec![0.0; shape.iter().product()],
        };
        w.put(&format!("grad/{n}"), &g)?;
    }
    // The trajectory, on the same trainer: its first step is the update from the gradients just
    // stored (`step(batch 0)` is `compute_gradients(batch 0)` + `apply_gradients()`, bit for bit;
    // the probe only reads the trainer), so the reference runs one forward/backward fewer and
    // never holds two models. AdamW's moments are needed only by a later step: the last step
    // frees each tensor's right after its update, so with one drift step the reference holds
    // weights and gradients, and one tensor's moments at a time (`plan_memory`).
    let mut losses = Vec::with_capacity(opts.steps as usize);
    let put_state = |w: &mut store::Writer, t: &Trainer, step: u32| -> Result<()> {
        for (n, _) in &tensors {
            w.put(&format!("param/{step}/{n}"), &to_f64(&t.parameter(n)?)?)?;
        }
        if let Some(e) = t.ema_parameters() {
            for (n, v) in e {
                w.put(&format!("ema/{step}/{n}"), &to_f64(&v)?)?;
            }
        }
        Ok(())
    };
    put_state(&mut w, &t, 0)?;
    for i in 0..opts.steps {
        if i + 1 == opts.steps {
            t.release_optimizer_state_after_next_step();
        }
        if i == 0 {
            // fp64 has no loss scaler: the step is never skipped.
            t.apply_gradients()?;
            losses.push(loss);
        } else {
            let r = t.step(&data.step_batch(u64::from(i)), None)?;
            losses.push(r.loss);
        }
        put_state(&mut w, &t, i + 1)?;
        progress(i + 1);
    }
    drop(t);
    w.put("drift/losses", &losses)?;
    w.put("loss", &[loss])?;
    let file = w.finish()?;
    let layout = store::read_layout(&file)?;
    let temporary = cleanup.0.take().is_some();
    Ok(Reference {
        spec,
        options: opts.clone(),
        version: env!("CARGO_PKG_VERSION").into(),
        loss,
        losses,
        tensors,
        ema,
        score_bound,
        softmax_amplification,
        amplification,
        kink,
        path,
        file: std::sync::Mutex::new(file),
        layout,
        temporary,
    })
}

impl Reference {
    /// The file the reference lies in; None when it has no name ([`compute_reference`]).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Size of the reference file in bytes.
    pub fn file_bytes(&self) -> u64 {
        self.file
            .lock()
            .ok()
            .and_then(|f| f.metadata().ok())
            .map_or(0, |m| m.len())
    }

    /// Keep the reference at `to` (a rename: `to` must be on the file system of the temporary
    /// file, see [`compute_reference_in`]); it is no longer deleted when dropped. A reference
    /// without a name ([`compute_reference`]) cannot be kept.
    pub fn persist(&mut self, to: &Path) -> Result<()> {
        let from = self.path.as_ref().ok_or_else(|| {
            reference_error("this reference was computed into a file without a name; compute it with a folder to keep it")
        })?;
        std::fs::rename(from, to).map_err(|e| {
            reference_error(format!(
                "cannot move the reference to '{}': {e}",
                to.display()
            ))
        })?;
        self.path = Some(to.to_path_buf());
        self.temporary = false;
        Ok(())
    }

    /// Open a reference file written by [`compute_reference`] and [`Reference::persist`]: its
    /// header is read and checked (every tensor the layout needs, f64, of the right shape, the
    /// data exactly as long as the file); the loss and the drift losses are read.
    pub fn open(path: &Path) -> Result<Reference> {
        let file = std::fs::File::open(path)
            .map_err(|e| reference_error(format!("cannot open '{}': {e}", path.display())))?;
        let layout = store::read_layout(&file)?;
        let field = |k: &str| {
            layout.meta.get(k).ok_or_else(|| {
                reference_error(format!(
                    "metadata has no '{k}'; not a ditmem verify reference"
                ))
            })
        };
        if field("format")? != FORMAT {
            return Err(reference_error(format!(
                "format '{}' is not {FORMAT}",
                field("format")?
            )));
        }
        let spec: Spec = serde_json::from_str(field("spec")?)
            .map_err(|e| reference_error(format!("metadata 'spec': {e}")))?;
        spec.validate()
            .map_err(|e| reference_error(format!("metadata 'spec': {e}")))?;
        let options: VerifyOptions = serde_json::from_str(field("options")?)
            .map_err(|e| reference_error(format!("metadata 'options': {e}")))?;
        let names: Vec<String> = serde_json::from_str(field("names")?)
            .map_err(|e| reference_error(format!("metadata 'names': {e}")))?;
        let ema = field("ema")? == "true";
        let score_bound: f64 = serde_json::from_str(field("score_bound")?)
            .ok()
            .filter(|s: &f64| s.is_finite() && *s >= 0.0)
            .ok_or_else(|| reference_error("metadata 'score_bound' is not a number ≥ 0"))?;
        let softmax_amplification: f64 = serde_json::from_str(field("softmax_amplification")?)
            .ok()
            .filter(|s: &f64| s.is_finite() && *s >= 1.0)
            .ok_or_else(|| {
                reference_error("metadata 'softmax_amplification' is not a number ≥ 1")
            })?;
        let amplification: Vec<(String, f64)> = serde_json::from_str(field("amplification")?)
            .ok()
            .filter(|a: &Vec<(String, f64)>| a.iter().all(|x| x.1.is_finite() && x.1 >= 1.0))
            .ok_or_else(|| {
                reference_error("metadata 'amplification' is not a list of [tensor, number ≥ 1]")
            })?;
        let kink: Vec<(String, [f64; 3])> = serde_json::from_str(field("kink")?)
            .ok()
            .filter(|a: &Vec<(String, [f64; 3])>| {
                a.iter()
                    .all(|x| x.1.iter().all(|e| e.is_finite() && *e >= 0.0))
            })
            .ok_or_else(|| {
                reference_error("metadata 'kink' is not a list of [tensor, [3 numbers ≥ 0]]")
            })?;
        let version = field("version")?.clone();
        let mut tensors = Vec::with_capacity(names.len());
        for n in &names {
            let e = layout
                .entries
                .get(&format!("grad/{n}"))
                .ok_or_else(|| reference_error(format!("tensor 'grad/{n}' is missing")))?;
            tensors.push((n.clone(), e.shape.clone()));
        }
        let want = store::keys(&tensors, options.steps, ema);
        if want.len() != layout.entries.len() {
            return Err(reference_error(format!(
                "{} tensors; {} steps of {} trained tensors need {}",
                layout.entries.len(),
                options.steps,
                names.len(),
                want.len()
            )));
        }
        for (k, shape) in &want {
            match layout.entries.get(k) {
                Some(e) if &e.shape == shape => {}
                Some(e) => {
                    return Err(reference_error(format!(
                        "tensor '{k}' has shape {:?}; expected {shape:?}",
                        e.shape
                    )))
                }
                None => return Err(reference_error(format!("tensor '{k}' is missing"))),
            }
        }
        let mut r = Reference {
            spec,
            options,
            version,
            loss: 0.0,
            losses: Vec::new(),
            tensors,
            ema,
            score_bound,
            softmax_amplification,
            amplification,
            kink,
            path: Some(path.to_path_buf()),
            file: std::sync::Mutex::new(file),
            layout,
            temporary: false,
        };
        let mut rd = r.reader()?;
        let loss = rd.read("loss")?[0];
        let losses = rd.read("drift/losses")?;
        drop(rd);
        r.loss = loss;
        r.losses = losses;
        Ok(r)
    }

    /// The amplification of the cancellation `tensor`'s gradient comes out of (1: none).
    pub(crate) fn amplification_of(&self, tensor: &str) -> f64 {
        self.amplification
            .iter()
            .filter(|(prefix, _)| is_under(tensor, prefix))
            .map(|x| x.1)
            .fold(1.0, f64::max)
    }

    /// The expected relative error of `tensor`'s gradient from components crossing a ReLU
    /// kink when computed in `dtype` ([`kink`]; 0 when none, and for dtypes not measured).
    pub(crate) fn kink_of(&self, tensor: &str, dtype: Dtype) -> f64 {
        let Some(i) = kink::KINK_DTYPES.iter().position(|d| *d == dtype) else {
            return 0.0;
        };
        self.kink
            .iter()
            .filter(|(prefix, _)| is_under(tensor, prefix))
            .map(|x| x.1[i])
            .fold(0.0, f64::max)
    }

    fn reader(&self) -> Result<store::Reader<'_>> {
        Ok(store::Reader::new(&self.file, &self.layout))
    }

    /// The reference gradient of one trained tensor (f64, flattened).
    pub fn gradient(&self, name: &str) -> Result<Vec<f64>> {
        self.reader()?.read(&format!("grad/{name}"))
    }

    /// Refuse a reference computed for another spec or other settings than `base` and `opts`.
    pub fn check_matches(&self, base: &Spec, opts: &VerifyOptions) -> Result<()> {
        let want = serde_json::to_value(reference_spec(base))
            .map_err(|e| reference_error(e.to_string()))?;
        let have = serde_json::to_value(&self.spec).map_err(|e| reference_error(e.to_string()))?;
        if let Some((path, stored, current)) = first_difference("", &have, &want) {
            return Err(VerifyError::Mismatch {
                what: format!("spec field {path}"),
                stored,
                current,
            });
        }
        let o = &self.options;
        let checks: [(&str, String, String); 5] = [
            ("seed", o.seed.to_string(), opts.seed.to_string()),
            (
                "data seed",
                o.data_seed.to_string(),
                opts.data_seed.to_string(),
            ),
            ("lr", o.lr.to_string(), opts.lr.to_string()),
            (
                "weight decay",
                o.weight_decay.to_string(),
                opts.weight_decay.to_string(),
            ),
            ("steps", o.steps.to_string(), opts.steps.to_string()),
        ];
        for (what, stored, current) in checks {
            if stored != current {
                return Err(VerifyError::Mismatch {
                    what: what.into(),
                    stored,
                    current,
                });
            }
        }
        Ok(())
    }
}

/// The first leaf where two JSON values differ: (dotted path, a, b).
/// Whether `tensor` is one of the module `prefix`'s (`prefix.` starts its name).
fn is_under(tensor: &str, prefix: &str) -> bool {
    tensor == prefix
        || tensor
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('.'))
}

fn first_difference(
    path: &str,
    a: &serde_json::Value,
    b: &serde_json::Value,
) -> Option<(String, String, String)> {
    use serde_json::Value;
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                let (va, vb) = (
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                );
                if let Some(d) = first_difference(&p, va, vb) {
                    return Some(d);
                }
            }
            None
        }
        _ if a == b => None,
        _ => Some((path.to_string(), a.to_string(), b.to_string())),
    }
}

fn json<T: Serialize>(v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| reference_error(e.to_string()))
}

// ---------------------------------------------------------------------------------------------
// Comparisons.

fn norm(v: &[f64]) -> f64 {
    v.iter().map(|x| x * x).sum::<f64>().sqrt()
}

fn diff_norm(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y) * (x - y))
        .sum::<f64>()
        .sqrt()
}

/// ‖a − b‖ / ‖b‖; 0 when both are zero, ∞ when only `b` is; NaN propagates as ∞.
pub fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    ratio(diff_norm(a, b), norm(b))
}

fn scalar_rel(a: f64, b: f64) -> f64 {
    let r = if b != 0.0 {
        (a - b).abs() / b.abs()
    } else if a == b {
        0.0
    } else {
        f64::INFINITY
    };
    if r.is_nan() {
        f64::INFINITY
    } else {
        r
    }
}

/// Gradient error of one tensor.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorError {
    pub name: String,
    pub rel_err: f64,
    /// The tensor's underflow term measured on the reference: the relative error its
    /// loss-scaled gradient loses to the compute dtype's subnormals, in its own storage and in
    /// its activation gradients' ([`terms::underflow_with_upstream`]); 0 when it
    /// is normal, and for a gradient zero in exact arithmetic (judged against the whole
    /// gradient, whose scale is normal).
    pub underflow: f64,
    /// The cancellation its gradient comes out of: ‖terms‖ / ‖result‖ in the f64 replay
    /// ([`Reference::amplification`]), or a key bias's remainder of a zero sum measured on the
    /// reference's gradients (`key_bias.rs`); 1 when none.
    pub amplification: f64,
    /// The expected relative error from components crossing a ReLU kink in the compute dtype
    /// ([`Reference::kink_of`]; 0 when none).
    pub kink: f64,
    /// The cancellation of the softmax backward behind it: ‖terms‖ / ‖result‖ in the f64
    /// replay ([`Reference::softmax_amplification`], `softmax.rs`; 1 when none). It amplifies
    /// the rounding of the dtype the softmax backward runs in ([`softmax_dtype`]).
    pub softmax: f64,
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
    /// The gradient tolerance of one tensor: the policy's, multiplied by the cancellation its
    /// gradient comes out of and by the softmax's ([`Tolerance::softmax_factor`]), with its
    /// underflow and kink terms added in quadrature.
    pub fn grad_of(&self, te: &TensorError) -> f64 {
        (self.grad * te.amplification.max(1.0) * self.softmax_factor(te.softmax))
            .hypot(KAPPA_UNDERFLOW * te.underflow)
            .hypot(KAPPA_KINK * te.kink)
    }
}

impl Tolerance {
    /// The softmax cancellation `a` amplifies the rounding of [`softmax_dtype`], u_s·a; the
    /// policy's tolerance already holds rounding at u_c, so the factor is u_s·a / u_c where
    /// that is larger (fp32 and fp64: a itself; bf16/fp16 policies: 1 unless a > u_c / u_f32).
    pub(crate) fn softmax_factor(&self, a: f64) -> f64 {
        (a * unit_roundoff(softmax_dtype(self.dtype)) / self.unit_roundoff).max(1.0)
    }
}

impl Tolerance {
    /// The drift tolerance of a variant whose tensors' gradient tolerances are `one`'s: each
    /// tensor's divergence is held to κ_d × its own gradient tolerance in units of its own
    /// travel, so the whole divergence as a share of the whole travel to κ_d × the
    /// travel-weighted RMS of those tolerances, √(Σₜ shareₜ · (grad_of(t))²). The policy's
    /// [`Tolerance::drift`] where no tensor has a term of its own (or the shares are unknown).
    pub(crate) fn drift_of(&self, one: &OneStep, travel_shares: &[f64]) -> f64 {
        if travel_shares.len() != one.per_tensor.len() || self.grad <= 0.0 {
            return self.drift;
        }
        let mean_sq: f64 = one
            .per_tensor
            .iter()
            .zip(travel_shares)
            .map(|(te, s)| s * (self.grad_of(te) / self.grad).powi(2))
            .sum();
        self.drift * mean_sq.sqrt().max(1.0)
    }
}

impl OneStep {
    /// The tensor with the largest error / its own tolerance, that margin and that tolerance
    /// (None without tensors).
    pub(crate) fn worst_margin(&self, tol: &Tolerance) -> Option<(&TensorError, f64, f64)> {
        self.per_tensor
            .iter()
            .map(|te| {
                let t = tol.grad_of(te);
                let m = if te.rel_err.is_nan() {
                    f64::INFINITY
                } else {
                    te.rel_err / t
                };
                (te, m, t)
            })
            .max_by(|a, b| a.1.total_cmp(&b.1))
    }

    /// The gradient's margin under `tol` (0 without tensors) and the largest per-tensor
    /// tolerance, which bounds the whole gradient's relative error (and so its norm's).
    fn grad_margin(&self, tol: &Tolerance) -> (f64, f64) {
        let m = self.worst_margin(tol).map_or(0.0, |w| w.1);
        let widest = self
            .per_tensor
            .iter()
            .map(|te| tol.grad_of(te))
            .fold(tol.grad, f64::max);
        (m, widest)
    }
}

/// The one-step comparison of a variant with the reference.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OneStep {
    pub loss: f64,
    pub loss_rel_err: f64,
    pub grad_rel_err_max: f64,
    pub grad_rel_err_median: f64,
    pub worst_tensor: String,
    /// Cosine similarity of the whole (concatenated) gradient with the reference's.
    pub cosine: f64,
    /// Share of non-finite gradient values (first attempt under fp16-mixed).
    pub nonfinite_share: f64,
    /// Loss scale the gradients were computed at (1 unless fp16-mixed).
    pub loss_scale: f64,
    /// |‖g‖ − ‖g_ref‖| / ‖g_ref‖ with ‖g‖ the norm the trainer reports (the one a clipping rule
    /// would use), unscaled by the trainer itself: at most ‖g − g_ref‖ / ‖g_ref‖, itself at most
    /// the largest per-tensor error, so it is held to the gradient tolerance plus
    /// [`OneStep::grad_norm_rounding`].
    pub grad_norm_rel_err: f64,
    /// N · 2^−53 (N: gradient values): the f64 summation error of the two norms themselves,
    /// summed in different orders (it matters only to fp64 variants, whose tolerance is ~1e-15).
    pub grad_norm_rounding: f64,
    pub per_tensor: Vec<TensorError>,
}

/// Bits of every value, for the bitwise twin check without keeping the values.
fn hash_values(h: &mut DefaultHasher, v: &[f64]) {
    for x in v {
        h.write_u64(x.to_bits());
    }
}

fn summarize(
    loss: f64,
    reference_loss: f64,
    per_tensor: Vec<TensorError>,
    (dot, na, nb): (f64, f64, f64),
    nonfinite_share: f64,
    loss_scale: f64,
    (grad_norm, values): (f64, usize),
) -> OneStep {
    let mut sorted: Vec<f64> = per_tensor.iter().map(|t| t.rel_err).collect();
    sorted.sort_by(f64::total_cmp);
    let median = match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]),
    };
    let worst = per_tensor
        .iter()
        .max_by(|a, b| a.rel_err.total_cmp(&b.rel_err))
        .map(|t| (t.name.clone(), t.rel_err))
        .filter(|t| t.1 != 0.0)
        .unwrap_or_else(|| ("-".into(), 0.0));
    let cosine = if na > 0.0 && nb > 0.0 {
        dot / (na.sqrt() * nb.sqrt())
    } else {
        f64::NAN
    };
    OneStep {
        loss,
        loss_rel_err: scalar_rel(loss, reference_loss),
        grad_rel_err_max: worst.1,
        grad_rel_err_median: median,
        worst_tensor: worst.0,
        cosine,
        nonfinite_share,
        loss_scale,
        grad_norm_rel_err: scalar_rel(grad_norm, nb.sqrt()),
        grad_norm_rounding: values as f64 * f64::EPSILON / 2.0,
        per_tensor,
    }
}

/// One forward/backward of a variant on `step_batch(0)`, compared tensor by tensor with the
/// reference's gradients. Under fp16-mixed a non-finite gradient halves the loss scale and
/// retries, as the dynamic loss scaler would (the overflowing step is skipped in training); the
/// non-finite share reported is the first attempt's.
fn one_step(
    spec: &Spec,
    fault: Option<&Fault>,
    opts: &VerifyOptions,
    reference: &Reference,
    rd: &mut store::Reader<'_>,
    h: &mut DefaultHasher,
) -> Result<OneStep> {
    let arch = crate::families::Arch::of(spec)?;
    let mut t = Trainer::new(spec, opts.train())?;
    let names = t.trained_names();
    if names.len() != reference.tensors.len()
        || names
            .iter()
            .zip(&reference.tensors)
            .any(|(a, (b, _))| a != b)
    {
        return Err(bad(
            "gradients",
            format!(
                "the variant trains {} tensors; the reference {}",
                names.len(),
                reference.tensors.len()
            ),
        ));
    }
    if let Some(f) = fault {
        let target = f.target();
        if !names.iter().any(|n| n == target) {
            return Err(bad("fault", format!("'{target}' is not a trained tensor")));
        }
    }
    let batch = SyntheticData::new(spec, opts.data_seed)?.step_batch(0);
    let mut first_share = None;
    let mut attempts = 0;
    let loss = loop {
        attempts += 1;
        let loss = t.compute_gradients(&batch)?;
        let (mut nonfinite, mut total) = (0usize, 0usize);
        for n in &names {
            if let Some(g) = t.gradient(n)? {
                let v = to_f64(&g)?;
                total += v.len();
                nonfinite += v.iter().filter(|x| !x.is_finite()).count();
            }
        }
        first_share.get_or_insert(nonfinite as f64 / total.max(1) as f64);
        let scale = t.loss_scale().unwrap_or(1.0);
        if nonfinite == 0 || t.loss_scale().is_none() || scale <= 1.0 {
            break loss;
        }
        if attempts >= 40 {
            return Err(bad(
                "fp16 loss scale",
                "gradients stay non-finite down to a scale of 1",
            ));
        }
        t.set_loss_scale(scale / 2.0)?;
    };
    let scale = t.loss_scale().unwrap_or(1.0);
    let compute = spec.recipe.precision.compute_dtype();
    // The underflow term is the policy's, at the scale its loss scaler holds (or starts from,
    // should the run have none: a missing scaler is a bug the term must not absorb).
    let policy_scale = match spec.recipe.precision {
        Precision::Fp16Mixed => t.loss_scale().unwrap_or(crate::optim::LossScaler::INITIAL),
        _ => 1.0,
    };
    // The rows a gradient sums over, at most (see terms::underflow_with_upstream).
    let d = Dims::new(spec)?;
    let rows = (spec.workload.microbatch as usize * (d.tokens + batch.text_tokens)) as u64;
    let grad_norm = t.gradient_norm()?;
    h.write_u64(loss.to_bits());
    let mut per_tensor = Vec::with_capacity(names.len());
    let (mut dot, mut na, mut nb) = (0.0, 0.0, 0.0);
    let mut r = Vec::new();
    let mut sibling = Vec::new();
    let mut values = 0usize;
    for (name, shape) in &reference.tensors {
        let mut g = match t.gradient(name)? {
            Some(g) => to_f64(&g)?,
            None => vec![0.0; shape.iter().product()],
        };
        if let Some(f) = fault {
            f.apply(name, &mut g);
        }
        rd.read_into(&format!("grad/{name}"), &mut r)?;
        if g.len() != r.len() {
            return Err(bad(
                "gradients",
                format!(
                    "'{name}' has {} values; the reference has {}",
                    g.len(),
                    r.len()
                ),
            ));
        }
        hash_values(h, &g);
        values += g.len();
        let zero = crate::families::zero_gradient(&arch, name);
        per_tensor.push(TensorError {
            name: name.clone(),
            // Made relative to the whole gradient below when zero in exact arithmetic.
            rel_err: if crate::families::zero_gradient(&arch, name) {
                diff_norm(&g, &r)
            } else {
                rel_err(&g, &r)
            },
            underflow: if crate::families::zero_gradient(&arch, name) {
                0.0
            } else {
                let per_head = shape.len() == 1 && shape[0] == d.head_dim;
                let n = rows * if per_head { d.heads as u64 } else { 1 };
                terms::underflow_with_upstream(&r, policy_scale, n, compute)
            },
            amplification: reference.amplification_of(name).max(if zero {
                1.0
            } else {
                key_bias::of(&arch, name, |n| {
                    rd.read_into(&format!("grad/{n}"), &mut sibling)?;
                    Ok(norm(&sibling))
                })?
            }),
            kink: reference.kink_of(name, compute),
            softmax: reference.softmax_amplification,
        });
        for (x, y) in g.iter().zip(&r) {
            dot += x * y;
            na += x * x;
            nb += y * y;
        }
    }
    // A gradient that is zero in exact arithmetic (a key bias: softmax ignores a shift of a
    // row's scores) holds only rounding noise, in the reference too: its error is judged as a
    // share of the whole reference gradient, ‖g − g_ref‖ / ‖g_ref,all‖.
    for te in per_tensor.iter_mut() {
        if crate::families::zero_gradient(&arch, &te.name) {
            te.rel_err = ratio(te.rel_err, nb.sqrt());
        }
    }
    Ok(summarize(
        loss,
        reference.loss,
        per_tensor,
        (dot, na, nb),
        first_share.unwrap_or(0.0),
        scale,
        (grad_norm, values),
    ))
}

/// The one-step comparison of `variant` of `base` with the reference (fault applied), without
/// the drift run.
pub fn check_one_step(
    base: &Spec,
    variant: &Variant,
    opts: &VerifyOptions,
    reference: &Reference,
) -> Result<OneStep> {
    let mut rd = reference.reader()?;
    one_step(
        &variant.apply(base),
        variant.fault.as_ref(),
        opts,
        reference,
        &mut rd,
        &mut DefaultHasher::new(),
    )
}

/// Divergence of a variant's trajectory from the reference's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Drift {
    /// |ℓ_t − ℓ_ref,t| / |ℓ_ref,t| for t = 1..=K.
    pub loss_rel: Vec<f64>,
    /// ‖θ_t − θ_ref,t‖ / ‖θ_ref,t‖ for t = 0..=K.
    pub param_rel: Vec<f64>,
    /// ‖ema_t − ema_ref,t‖ / ‖ema_ref,t‖ for t = 0..=K (empty without an EMA).
    pub ema_rel: Vec<f64>,
    /// param_rel after the last step.
    pub final_rel: f64,
    /// ‖θ_ref,K − θ_ref,0‖ / ‖θ_ref,K‖: how far the reference moved in K steps.
    pub travel_rel: f64,
    /// final_rel / travel_rel = ‖θ_K − θ_ref,K‖ / ‖θ_ref,K − θ_ref,0‖: the divergence as a share
    /// of the distance trained, held to the drift tolerance ([`Tolerance::drift`]).
    pub vs_travel: f64,
    /// param_rel after the first step.
    pub one_step_rel: f64,
    /// DRIFT_GROWTH_FACTOR × K × one_step_rel.
    pub predicted_max: f64,
    /// The final divergence exceeds the prediction.
    pub grows_too_fast: bool,
    /// The first step t whose EMA divergence exceeds [`ema_bound`] (`None`: within it at every
    /// step, or no EMA).
    pub ema_exceeds_at: Option<usize>,
    /// Steps the fp16 loss scaler skipped.
    pub skipped_steps: u32,
    /// Each trained tensor's share of the reference's squared travel ‖θ_ref,K − θ_ref,0‖², in
    /// the reference's tensor order (empty: unknown, every tensor held to the policy's drift
    /// tolerance; see [`Tolerance::drift_of`]).
    #[serde(skip)]
    pub travel_shares: Vec<f64>,
}

/// The EMA rule: an EMA is a convex combination of the weights it has seen, so its divergence
/// from the reference's EMA cannot exceed the largest weight divergence so far (both EMAs
/// weight the same steps), plus the rounding of the shadow itself (f32: u(f32) per update,
/// counted 4× per step as a margin): `ema_rel[t] ≤ max_{s≤t} param_rel[s] + 4·(t+1)·u(f32)`.
pub(crate) fn ema_bound(param_rel: &[f64], t: usize) -> f64 {
    let max_so_far = param_rel[..=t.min(param_rel.len().saturating_sub(1))]
        .iter()
        .copied()
        .fold(0.0, f64::max);
    max_so_far + 4.0 * (t as f64 + 1.0) * unit_roundoff(Dtype::F32)
}

impl Drift {
    /// The drift of a trajectory from the per-step norms (`param_rel`, `ema_rel`: K + 1 values
    /// each, or `ema_rel` empty), the reference's travel ‖θ_ref,K − θ_ref,0‖ / ‖θ_ref,K‖ and the
    /// losses.
    pub fn from_norms(
        losses: &[f64],
        reference_losses: &[f64],
        param_rel: Vec<f64>,
        ema_rel: Vec<f64>,
        travel_rel: f64,
        skipped_steps: u32,
    ) -> Drift {
        let loss_rel: Vec<f64> = losses
            .iter()
            .zip(reference_losses)
            .map(|(&a, &b)| scalar_rel(a, b))
            .collect();
        let k = losses.len();
        let final_rel = param_rel.last().copied().unwrap_or(0.0);
        let one_step_rel = param_rel.get(1).copied().unwrap_or(final_rel);
        let predicted_max = DRIFT_GROWTH_FACTOR * k as f64 * one_step_rel;
        let ema_exceeds_at = ema_rel
            .iter()
            .enumerate()
            .find(|&(t, &e)| e.is_nan() || e > ema_bound(&param_rel, t))
            .map(|(t, _)| t);
        Drift {
            // NaN counts as too fast.
            grows_too_fast: k > 1
                && !matches!(
                    final_rel.partial_cmp(&predicted_max),
                    Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
                ),
            loss_rel,
            param_rel,
            ema_rel,
            final_rel,
            travel_rel,
            vs_travel: ratio(final_rel, travel_rel),
            one_step_rel,
            predicted_max,
            ema_exceeds_at,
            skipped_steps,
            travel_shares: Vec::new(),
        }
    }
}

/// ‖a − r‖² and ‖r‖² of the weights (or the EMA weights) of `t` after `step` steps against the
/// reference's, tensor by tensor.
///
/// With `travel`, also ‖θ_ref,step − θ_ref,0‖ / ‖θ_ref,step‖, how far the reference moved (its
/// initial weights read into the variant's buffer once it has been compared: no extra copy).
fn state_norms(
    t: &Trainer,
    step: u32,
    reference: &Reference,
    rd: &mut store::Reader<'_>,
    h: &mut DefaultHasher,
    travel: bool,
) -> Result<(f64, Option<f64>, f64, Vec<f64>)> {
    let mut r = Vec::new();
    let (mut d2, mut n2, mut t2) = (0.0, 0.0, 0.0);
    let mut travel_sq = Vec::new();
    for (name, _) in &reference.tensors {
        let mut p = to_f64(&t.parameter(name)?)?;
        rd.read_into(&format!("param/{step}/{name}"), &mut r)?;
        if p.len() != r.len() {
            return Err(bad(
                "drift",
                format!("'{name}' has {} values; the reference {}", p.len(), r.len()),
            ));
        }
        hash_values(h, &p);
        d2 += p
            .iter()
            .zip(&r)
            .map(|(x, y)| (x - y) * (x - y))
            .sum::<f64>();
        n2 += r.iter().map(|y| y * y).sum::<f64>();
        if travel {
            rd.read_into(&format!("param/0/{name}"), &mut p)?;
            let moved = p
                .iter()
                .zip(&r)
                .map(|(x, y)| (x - y) * (x - y))
                .sum::<f64>();
            t2 += moved;
            travel_sq.push(moved);
        }
    }
    let param = ratio(d2.sqrt(), n2.sqrt());
    let moved = ratio(t2.sqrt(), n2.sqrt());
    let ema = match (t.ema_parameters(), reference.ema) {
        (Some(e), true) => {
            let (mut d2, mut n2) = (0.0, 0.0);
            for (name, v) in e {
                let p = to_f64(&v)?;
                rd.read_into(&format!("ema/{step}/{name}"), &mut r)?;
                d2 += p
                    .iter()
                    .zip(&r)
                    .map(|(x, y)| (x - y) * (x - y))
                    .sum::<f64>();
                n2 += r.iter().map(|y| y * y).sum::<f64>();
            }
            Some(ratio(d2.sqrt(), n2.sqrt()))
        }
        _ => None,
    };
    for x in travel_sq.iter_mut() {
        *x = ratio(*x, t2);
    }
    Ok((param, ema, moved, travel_sq))
}

/// d / n for a difference norm d and a reference norm n: 0 when both are zero, ∞ when only n
/// is; NaN propagates as ∞.
fn ratio(d: f64, n: f64) -> f64 {
    let r = if n > 0.0 {
        d / n
    } else if d == 0.0 {
        0.0
    } else {
        f64::INFINITY
    };
    if r.is_nan() {
        f64::INFINITY
    } else {
        r
    }
}

/// K optimizer steps of a variant from the initial weights, each compared with the reference's
/// trajectory as it is taken.
fn drift(
    spec: &Spec,
    opts: &VerifyOptions,
    reference: &Reference,
    rd: &mut store::Reader<'_>,
    h: &mut DefaultHasher,
    progress: &mut dyn FnMut(u32),
) -> Result<Drift> {
    let mut t = Trainer::new(spec, opts.train())?;
    let data = SyntheticData::new(spec, opts.data_seed)?;
    let mut param_rel = Vec::with_capacity(opts.steps as usize + 1);
    let mut ema_rel = Vec::new();
    let mut losses = Vec::with_capacity(opts.steps as usize);
    let mut skipped = 0;
    let (p, e, _, _) = state_norms(&t, 0, reference, rd, h, false)?;
    param_rel.push(p);
    ema_rel.extend(e);
    let (mut travel, mut shares) = (0.0, Vec::new());
    for i in 0..opts.steps {
        if i + 1 == opts.steps {
            // No step follows: the optimizer's state need not outlive this one (the update is
            // the same; see `plan_memory`).
            t.release_optimizer_state_after_next_step();
        }
        let r = t.step(&data.step_batch(u64::from(i)), None)?;
        skipped += u32::from(r.skipped);
        losses.push(r.loss);
        h.write_u64(r.loss.to_bits());
        let last = i + 1 == opts.steps;
        let (p, e, moved, s) = state_norms(&t, i + 1, reference, rd, h, last)?;
        param_rel.push(p);
        ema_rel.extend(e);
        if last {
            (travel, shares) = (moved, s);
        }
        progress(i + 1);
    }
    let mut d = Drift::from_norms(
        &losses,
        &reference.losses,
        param_rel,
        ema_rel,
        travel,
        skipped,
    );
    d.travel_shares = shares;
    Ok(d)
}

// ---------------------------------------------------------------------------------------------
// The verification.

/// The twin a variant was checked against.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TwinCheck {
    pub twin: String,
    /// `bitwise` (recompute twin) or `order` (attention-mode twin, bounded).
    pub kind: &'static str,
    /// Max per-tensor relative gradient difference (and for bitwise twins also the loss and the
    /// drift trajectory must be identical).
    pub max_diff: f64,
    pub bound: f64,
    pub ok: bool,
}

/// Everything verify says about one variant.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VariantReport {
    pub name: String,
    pub precision: Precision,
    pub recompute: String,
    pub attention: AttentionMode,
    pub verdict: Verdict,
    /// Why the verdict is not pass; and notes (`note: …`) on what the tolerance allowed beyond
    /// rounding (underflow of a loss-scaled gradient, a cancellation), whatever the verdict.
    pub reasons: Vec<String>,
    pub loss: Option<f64>,
    pub loss_rel_err: Option<f64>,
    pub grad_rel_err_max: Option<f64>,
    pub grad_rel_err_median: Option<f64>,
    /// Error of the gradient norm the trainer reports (see [`OneStep::grad_norm_rel_err`]).
    pub grad_norm_rel_err: Option<f64>,
    pub worst_tensor: Option<String>,
    pub cosine: Option<f64>,
    pub nonfinite_share: Option<f64>,
    pub loss_scale: Option<f64>,
    pub tolerance_grad: f64,
    pub tolerance_loss: f64,
    /// grad_rel_err_max / tolerance_grad: pass ≤ 1 < warn ≤ WARN_FACTOR < fail.
    pub grad_margin: Option<f64>,
    /// loss_rel_err / tolerance_loss.
    pub loss_margin: Option<f64>,
    /// The drift tolerance ([`Tolerance::drift`]).
    pub tolerance_drift: f64,
    /// Drift as a share of the reference's travel / tolerance_drift (None without a drift run,
    /// or when the fp16 loss scaler skipped a step: the trajectories then differ by a step).
    pub drift_margin: Option<f64>,
    pub twins: Vec<TwinCheck>,
    pub drift_final: Option<f64>,
    pub drift_one_step: Option<f64>,
    pub drift_predicted_max: Option<f64>,
    pub loss_drift_final: Option<f64>,
    /// EMA divergence after the last step (recipes with an EMA).
    pub ema_drift_final: Option<f64>,
    pub skipped_steps: Option<u32>,
    pub drift: Option<Drift>,
    pub per_tensor: Vec<TensorError>,
}

/// The result of a verification.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub reference_spec: Spec,
    pub reference_variant: String,
    pub reference_loss: f64,
    pub options: VerifyOptions,
    pub growth: Growth,
    pub tolerances: Vec<Tolerance>,
    pub warn_factor: f64,
    pub drift_growth_factor: f64,
    pub variants: Vec<VariantReport>,
    pub passed: usize,
    pub warned: usize,
    pub failed: usize,
    pub skipped: usize,
}

impl Report {
    /// No variant failed.
    pub fn ok(&self) -> bool {
        self.failed == 0
    }
}

/// What verify reports while it works (from the calling thread).
#[derive(Debug, Clone, PartialEq)]
pub enum Event<'a> {
    /// Variant `index` (0-based) of `total` starts.
    Start {
        index: usize,
        total: usize,
        name: &'a str,
    },
    /// Variant `index` finished its drift step `step` of `steps`.
    Step { index: usize, step: u32, steps: u32 },
    /// Variant `index` is done.
    Done { index: usize },
}

/// What verification keeps of one variant: its comparison (a few numbers per tensor and per
/// step) and one 64-bit digest of every value it computed, for the bitwise twin check.
struct Run {
    one: OneStep,
    drift: Option<Drift>,
    /// SipHash of the bits of the loss, every gradient value, every drift loss and every weight
    /// after every step: two runs with equal digests are bitwise identical (a collision needs
    /// 2^32 distinct runs to become likely).
    digest: u64,
}

fn run_variant(
    base: &Spec,
    v: &Variant,
    opts: &VerifyOptions,
    reference: &Reference,
    step_done: &mut dyn FnMut(u32),
) -> Result<Run> {
    let mut spec = v.apply(base);
    if let Some(cpu) = &mut spec.cpu {
        // A variant steps on the pool it runs in: a worker's own one-thread pool when several
        // run at once (`run_all`), else the global one. verify holds numerics, not memory, so
        // the spec follows the pool (with RAYON_NUM_THREADS=2 and two jobs the spec said 2 and
        // every variant was refused after the whole reference had run).
        cpu.threads = crate::host::threads();
    }
    let mut rd = reference.reader()?;
    let mut h = DefaultHasher::new();
    let one = one_step(&spec, v.fault.as_ref(), opts, reference, &mut rd, &mut h)?;
    let drift = if opts.steps > 0 {
        Some(drift(&spec, opts, reference, &mut rd, &mut h, step_done)?)
    } else {
        None
    };
    Ok(Run {
        one,
        drift,
        digest: h.finish(),
    })
}

/// Messages from the workers to the calling thread.
enum Msg {
    Start(usize),
    Step(usize, u32),
    Done(usize, Box<Result<Run>>),
    /// A worker could not start; the variants it would have run are taken by the others.
    Failed(String),
}

/// Run every variant on `jobs` worker threads (each variant is independent and deterministic:
/// its own trainer, weights, data and optimizer, compared with the reference file as it steps),
/// reporting progress on the calling thread.
fn run_all(
    base: &Spec,
    variants: &[Variant],
    opts: &VerifyOptions,
    reference: &Reference,
    jobs: usize,
    progress: &mut dyn FnMut(Event<'_>),
) -> Vec<Result<Run>> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;
    let n = variants.len();
    let next = AtomicUsize::new(0);
    let names: Vec<String> = variants.iter().map(Variant::name).collect();
    let mut results: Vec<Option<Result<Run>>> = (0..n).map(|_| None).collect();
    let mut failure: Option<String> = None;
    let steps = opts.steps;
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::channel::<Msg>();
        let workers = jobs.clamp(1, n.max(1));
        for _ in 0..workers {
            let tx = tx.clone();
            let next = &next;
            scope.spawn(move || {
                // A trainer's step runs on a rayon pool (`trainer::on_pool`). Several workers
                // sharing the global pool would queue their steps on it — with the one thread
                // the CLI gives it under --jobs > 1, one variant computed at a time however
                // many jobs were asked for (measured: one busy thread of three). Each worker
                // therefore steps on a pool of its own thread; one worker keeps the global pool
                // and all its threads.
                let pool = if workers > 1 {
                    match rayon::ThreadPoolBuilder::new().num_threads(1).build() {
                        Ok(p) => Some(p),
                        Err(e) => {
                            let _ = tx.send(Msg::Failed(format!("cannot start a worker: {e}")));
                            return;
                        }
                    }
                } else {
                    None
                };
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= n {
                        break;
                    }
                    let _ = tx.send(Msg::Start(i));
                    let run = || {
                        run_variant(base, &variants[i], opts, reference, &mut |s| {
                            let _ = tx.send(Msg::Step(i, s));
                        })
                    };
                    let r = match &pool {
                        Some(p) => p.install(run),
                        None => run(),
                    };
                    let _ = tx.send(Msg::Done(i, Box::new(r)));
                }
            });
        }
        drop(tx);
        for msg in rx {
            match msg {
                Msg::Start(i) => progress(Event::Start {
                    index: i,
                    total: n,
                    name: &names[i],
                }),
                Msg::Step(i, s) => progress(Event::Step {
                    index: i,
                    step: s,
                    steps,
                }),
                Msg::Done(i, r) => {
                    progress(Event::Done { index: i });
                    results[i] = Some(*r);
                }
                Msg::Failed(why) => failure = Some(why),
            }
        }
    });
    results
        .into_iter()
        .map(|r| {
            r.unwrap_or_else(|| {
                Err(bad(
                    "verify",
                    failure
                        .clone()
                        .unwrap_or_else(|| "a worker thread stopped early".into()),
                ))
            })
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Memory.

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
                + store::WRITE_BUFFER;
            step.max(writing)
        } else {
            step + keep + store::WRITE_BUFFER
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
fn state_of_one(b: &ditmem_budget::Budget, largest: u64, trained: u64) -> u64 {
    if trained == 0 {
        return 0;
    }
    let state = u128::from(b.static_bytes.optimizer_state);
    (state * u128::from(largest)).div_ceil(u128::from(trained)) as u64
}

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

fn raise(rep: &mut VariantReport, v: Verdict, why: String) {
    if v > Verdict::Pass {
        rep.verdict = rep.verdict.max(v);
        rep.reasons.push(why);
    }
}

/// The one-step verdict of a variant under a tolerance: the worse of the loss and the gradient
/// verdicts; any non-finite gradient value fails.
pub fn judge_one_step(one: &OneStep, tol: &Tolerance) -> Verdict {
    let nonfinite = if one.nonfinite_share > 0.0 && one.loss_scale <= 1.0 {
        Verdict::Fail
    } else {
        Verdict::Pass
    };
    let (margin, widest) = one.grad_margin(tol);
    Verdict::of(margin, 1.0)
        .max(Verdict::of(
            one.grad_norm_rel_err,
            widest + one.grad_norm_rounding,
        ))
        .max(Verdict::of(one.loss_rel_err, tol.loss))
        .max(nonfinite)
}

/// Say what a variant's tolerance allowed beyond rounding, in its reasons (whatever its
/// verdict): the tensors whose loss-scaled gradients underflow the compute dtype (the loss scale
/// is too small for them) and those behind a cancellation, each with the largest term.
fn note_terms(rep: &mut VariantReport, one: &OneStep, tol: &Tolerance) {
    let largest = |key: &dyn Fn(&TensorError) -> f64| {
        one.per_tensor
            .iter()
            .max_by(|a, b| key(a).total_cmp(&key(b)))
            .map(|te| (te.name.clone(), key(te), te.rel_err))
    };
    let under = |te: &TensorError| KAPPA_UNDERFLOW * te.underflow;
    let n_under = one
        .per_tensor
        .iter()
        .filter(|te| under(te) > tol.grad)
        .count();
    if let Some((name, term, err)) = largest(&under).filter(|_| n_under > 0) {
        rep.reasons.push(format!(
            "note: {n_under} tensors' gradients underflow {} at loss scale {} (the loss scale is too small for them): worst {name}, up to {:.2e} of its gradient lost to subnormals, tolerance term {term:.2e}; its error {err:.2e}",
            tol.dtype,
            one.loss_scale,
            term / KAPPA_UNDERFLOW,
        ));
    }
    let kink = |te: &TensorError| KAPPA_KINK * te.kink;
    if let Some((name, term, err)) = largest(&kink).filter(|w| w.1 > tol.grad) {
        rep.reasons.push(format!(
            "note: gradients behind the linear attention's ReLU err by components crossing its kink, up to {:.2e} expected ({name}: tolerance term {term:.2e}); its error {err:.2e}",
            term / KAPPA_KINK
        ));
    }
    let amp = |te: &TensorError| te.amplification;
    if let Some((name, a, err)) = largest(&amp).filter(|w| w.1 > 1.0) {
        rep.reasons.push(format!(
            "note: gradients out of a cancellation (the linear attention's q and k, a key bias) amplify rounding up to {a:.1}× ({name}: tolerance {:.2e}); its error {err:.2e}",
            tol.grad * a
        ));
    }
}

fn judge(rep: &mut VariantReport, run: &Run, tol: &Tolerance) {
    let one = &run.one;
    rep.loss = Some(one.loss);
    rep.loss_rel_err = Some(one.loss_rel_err);
    rep.grad_rel_err_max = Some(one.grad_rel_err_max);
    rep.grad_rel_err_median = Some(one.grad_rel_err_median);
    rep.grad_norm_rel_err = Some(one.grad_norm_rel_err);
    rep.worst_tensor = Some(one.worst_tensor.clone());
    rep.cosine = Some(one.cosine);
    rep.nonfinite_share = Some(one.nonfinite_share);
    rep.loss_scale = Some(one.loss_scale);
    rep.per_tensor = one.per_tensor.clone();
    let (margin, widest) = one.grad_margin(tol);
    rep.grad_margin = Some(margin);
    rep.loss_margin = Some(one.loss_rel_err / tol.loss);
    if let Some((te, m, t)) = one.worst_margin(tol) {
        rep.worst_tensor = Some(te.name.clone());
        raise(
            rep,
            Verdict::of(m, 1.0),
            format!(
                "gradient error {:.2e} ({}) vs its tolerance {t:.2e}",
                te.rel_err, te.name
            ),
        );
    }
    note_terms(rep, one, tol);
    raise(
        rep,
        Verdict::of(one.grad_norm_rel_err, widest + one.grad_norm_rounding),
        format!(
            "reported gradient norm error {:.2e} vs tolerance {:.2e}",
            one.grad_norm_rel_err,
            widest + one.grad_norm_rounding
        ),
    );
    raise(
        rep,
        Verdict::of(one.loss_rel_err, tol.loss),
        format!(
            "loss error {:.2e} vs tolerance {:.2e}",
            one.loss_rel_err, tol.loss
        ),
    );
    if one.nonfinite_share > 0.0 {
        // Under fp16-mixed the scaler skips the step and halves the scale: a warning when a
        // lower scale gave finite gradients, a failure otherwise.
        let v = if one.loss_scale > 1.0 && one.grad_rel_err_max.is_finite() {
            Verdict::Warn
        } else {
            Verdict::Fail
        };
        raise(
            rep,
            v,
            format!(
                "{:.2e} of the gradient values are not finite at the first loss scale{}",
                one.nonfinite_share,
                if v == Verdict::Warn {
                    format!("; finite at scale {}", one.loss_scale)
                } else {
                    String::new()
                }
            ),
        );
    }
    if let Some(d) = &run.drift {
        rep.drift_final = Some(d.final_rel);
        rep.drift_one_step = Some(d.one_step_rel);
        rep.drift_predicted_max = Some(d.predicted_max);
        rep.loss_drift_final = d.loss_rel.last().copied();
        rep.skipped_steps = Some(d.skipped_steps);
        rep.ema_drift_final = d.ema_rel.last().copied();
        if let Some(t) = d.ema_exceeds_at {
            raise(
                rep,
                Verdict::Fail,
                format!(
                    "EMA divergence {:.2e} after {t} steps exceeds what its weights allow ({:.2e}: the largest weight divergence so far + f32 rounding)",
                    d.ema_rel[t],
                    ema_bound(&d.param_rel, t)
                ),
            );
        }
        let nonfinite = !d.final_rel.is_finite() || d.loss_rel.iter().any(|x| !x.is_finite());
        if nonfinite {
            raise(
                rep,
                Verdict::Fail,
                "the drift run diverged (non-finite loss or weights)".into(),
            );
        } else if d.skipped_steps == 0 {
            let drift_tol = tol.drift_of(one, &d.travel_shares);
            rep.tolerance_drift = drift_tol;
            rep.drift_margin = Some(d.vs_travel / drift_tol);
            raise(
                rep,
                Verdict::of(d.vs_travel, drift_tol),
                format!(
                    "weight drift {:.2e} of the distance trained in {} steps vs tolerance {drift_tol:.2e}",
                    d.vs_travel,
                    d.loss_rel.len(),
                ),
            );
        }
        if !nonfinite && d.grows_too_fast {
            raise(
                rep,
                Verdict::Warn,
                format!(
                    "drift grows faster than its first step predicts: {:.2e} after {} steps > {} × {} × {:.2e}",
                    d.final_rel,
                    d.loss_rel.len(),
                    DRIFT_GROWTH_FACTOR,
                    d.loss_rel.len(),
                    d.one_step_rel
                ),
            );
        }
        if d.skipped_steps > 0 {
            raise(
                rep,
                Verdict::Warn,
                format!(
                    "{} of {} drift steps skipped by the fp16 loss scaler",
                    d.skipped_steps,
                    d.loss_rel.len()
                ),
            );
        }
        rep.drift = Some(d.clone());
    }
}

/// Recompute twins: variants that differ only by recompute (same precision and attention) must
/// be bitwise identical — same digest of every loss, gradient and weight. Variants that differ by
/// the attention mode are each held to the reference directly (within one tolerance each, so
/// within two of each other: no separate check).
fn check_twins(variants: &[Variant], runs: &[Option<Run>], reports: &mut [VariantReport]) {
    for i in 0..variants.len() {
        let (v, Some(run)) = (&variants[i], &runs[i]) else {
            continue;
        };
        // The first earlier variant with the same precision and attention; a faulted variant
        // is only a twin of an unfaulted one (it is the one under test).
        let twin = (0..i).find(|&j| {
            variants[j].twin_key() == v.twin_key()
                && runs[j].is_some()
                && variants[j].fault.is_none()
        });
        if let (Some(j), Some(other)) = (twin, twin.and_then(|j| runs[j].as_ref())) {
            let ok = run.digest == other.digest;
            // The values are not kept: the largest difference of their errors against the
            // reference is what can be said (a lower bound of their difference).
            let max_diff = run
                .one
                .per_tensor
                .iter()
                .zip(&other.one.per_tensor)
                .map(|(a, b)| (a.rel_err - b.rel_err).abs())
                .fold(0.0, f64::max);
            let check = TwinCheck {
                twin: variants[j].name(),
                kind: "bitwise",
                max_diff,
                bound: 0.0,
                ok,
            };
            if !ok {
                raise(
                    &mut reports[i],
                    Verdict::Fail,
                    format!(
                        "not bitwise identical to its recompute twin {} (per-tensor error differs by up to {:.2e})",
                        check.twin, check.max_diff
                    ),
                );
            }
            reports[i].twins.push(check);
        }
    }
}
