//! What `verify` reports: per variant ([`VariantReport`], [`TwinCheck`]), for the run
//! ([`Report`]), and the progress events ([`Event`]).

use super::drift::Drift;
use super::one_step::TensorError;
use super::reference::VerifyOptions;
use super::tolerance::{Growth, Tolerance};
use super::verdict::Verdict;
use ditmem_budget::{AttentionMode, Precision, Spec};
use serde::Serialize;

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
