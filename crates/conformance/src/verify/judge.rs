//! Verdicts from the measured errors (module docs, 5.): one step ([`judge_one_step`]), drift
//! and terms ([`judge`]), recompute twins ([`check_twins`]).

use super::drift::{ema_bound, Drift};
use super::one_step::{OneStep, TensorError};
use super::report::{TwinCheck, VariantReport};
use super::run::Run;
use super::tolerance::{Tolerance, DRIFT_GROWTH_FACTOR, KAPPA_KINK, KAPPA_UNDERFLOW};
use super::variant::Variant;
use super::verdict::Verdict;

pub(super) fn raise(rep: &mut VariantReport, v: Verdict, why: String) {
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
pub(super) fn note_terms(rep: &mut VariantReport, one: &OneStep, tol: &Tolerance) {
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

pub(super) fn judge(rep: &mut VariantReport, run: &Run, tol: &Tolerance) {
    one_step_rules(rep, &run.one, tol);
    if let Some(d) = &run.drift {
        drift_rules(rep, d, &run.one, tol);
    }
}

/// The one-step rules: the gradients' and the loss's errors against their tolerances, the
/// non-finite share.
fn one_step_rules(rep: &mut VariantReport, one: &OneStep, tol: &Tolerance) {
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
}

/// The drift rules: the EMA's divergence, a diverged run, the weight drift against its
/// tolerance, a drift growing faster than its first step predicts, skipped steps.
fn drift_rules(rep: &mut VariantReport, d: &Drift, one: &OneStep, tol: &Tolerance) {
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

/// Recompute twins: variants that differ only by recompute (same precision and attention) must
/// be bitwise identical — same digest of every loss, gradient and weight. Variants that differ by
/// the attention mode are each held to the reference directly (within one tolerance each, so
/// within two of each other: no separate check).
pub(super) fn check_twins(
    variants: &[Variant],
    runs: &[Option<Run>],
    reports: &mut [VariantReport],
) {
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
