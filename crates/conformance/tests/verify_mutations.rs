//! The mutation suite: each planted precision bug (feature `mutations`, enabled for the tests by
//! the engine's dev-dependency on itself) must fail `verify`, while the correct variants pass.
//! The planted bug is process-wide: the tests of this file run one at a time. The DiT's own
//! specs show each mutation; every diffusers family's tiny spec must show each one that
//! applies to it.

use ditmem_budget::Spec;
use ditmem_conformance::verify::{
    compute_reference, parse_variants, verify, Reference, Report, VariantReport, Verdict,
    VerifyOptions, SPREAD_MARGIN, WARN_FACTOR,
};
use ditmem_engine::mutation::{self, Mutation};
use std::sync::MutexGuard;

mod common;
use common::one_at_a_time;

/// The default spec with an EMA and two microbatches, so every mutation has something to touch.
fn spec() -> Spec {
    let mut s = Spec::small();
    s.recipe.ema.enabled = true;
    s.workload.batch = 4;
    s.workload.microbatch = 2;
    s.workload.accumulation = 2;
    s.validate().unwrap();
    s
}

/// [`spec`] with MLP and attention dropout: a recomputed block must replay the same masks.
fn dropout_spec() -> Spec {
    let mut s = spec();
    s.model.mlp_dropout = 0.1;
    s.model.attn_dropout = 0.1;
    s.validate().unwrap();
    s
}

/// [`spec`] at DiT-S/2's width (384): LayerNorm statistics in bf16 err with the row width, and
/// at the default spec's 64 they stay inside the bf16 tolerance.
fn wide_spec() -> Spec {
    let mut s = spec();
    s.model.hidden = WIDE_ROWS;
    s.model.heads = 6;
    s.validate().unwrap();
    s
}

/// Attention-score gain of the softmax case: at the default spec's initial weights the scores
/// are O(1) and e^x cannot overflow, so softmax without its max subtraction equals the correct
/// one up to rounding and no check can see it (asserted below); scores grown ×32 (as trained
/// models' logits grow) pass 88.7, where e^x overflows f32. The tolerance grows with the
/// reference's attention-score bound S (×32 here), so the correct run stays well inside it.
const SOFTMAX_GAIN: f64 = 32.0;

/// The largest margin a correct variant may show on the specs made to expose a mutation (wide
/// rows, large scores): the tolerance model must follow what the error scales with there.
const COMFORT: f64 = 0.6;

/// The variants that run under mutation `m` (the correct ones run on the same spec first).
fn variants_for(m: Mutation) -> &'static str {
    match m {
        Mutation::Fp16NoLossScaling | Mutation::GradNormBeforeUnscale => {
            "fp16-mixed/none/materialized"
        }
        Mutation::SoftmaxNoMax => "fp32/none/materialized",
        Mutation::LayerNormStatsBf16 => "bf16-mixed/none/materialized",
        Mutation::RecomputeDropoutMask => "fp32/none/materialized,fp32/all/materialized",
        _ => "fp32/none/materialized,bf16-mixed/none/materialized",
    }
}

fn show(what: &str, rep: &Report) {
    for v in &rep.variants {
        eprintln!(
            "{what} on {}: {} grad {:.2e} / tol {:.2e} (margin {:.3}), norm {:.2e}, loss {:.2e} / {:.2e}, drift {:.2e} (share of travel {:.2e} / tol {:.2e}, margin {:.3}), ema drift {:?}; {:?}",
            v.name,
            v.verdict,
            v.grad_rel_err_max.unwrap_or(f64::NAN),
            v.tolerance_grad,
            v.grad_margin.unwrap_or(f64::NAN),
            v.grad_norm_rel_err.unwrap_or(f64::NAN),
            v.loss_rel_err.unwrap_or(f64::NAN),
            v.tolerance_loss,
            v.drift_final.unwrap_or(f64::NAN),
            v.drift.as_ref().map_or(f64::NAN, |d| d.vs_travel),
            v.tolerance_drift,
            v.drift_margin.unwrap_or(f64::NAN),
            v.ema_drift_final,
            v.reasons
        );
    }
}

/// The suite's lock, no mutation planted and the logit gain at 1, and the options of `steps`
/// drift steps.
fn unmutated(steps: u32) -> (MutexGuard<'static, ()>, VerifyOptions) {
    let one = one_at_a_time();
    mutation::set(None);
    mutation::set_logit_gain(1.0);
    let o = VerifyOptions {
        steps,
        ..VerifyOptions::default()
    };
    (one, o)
}

fn run(base: &Spec, variants: &str, o: &VerifyOptions, r: &Reference) -> Report {
    verify(
        base,
        &parse_variants(variants).unwrap(),
        o,
        r,
        2,
        &mut |_| {},
    )
    .unwrap()
}

fn assert_correct(what: &str, rep: &Report) {
    show(what, rep);
    for v in &rep.variants {
        assert_ne!(
            v.verdict,
            Verdict::Fail,
            "{what} {}: {:?}",
            v.name,
            v.reasons
        );
    }
}

/// Correct and comfortably inside: every margin (gradient, loss, drift) at most [`COMFORT`].
fn assert_comfortable(what: &str, rep: &Report) {
    assert_correct(what, rep);
    for v in &rep.variants {
        for (m, which) in [
            (v.grad_margin, "gradient"),
            (v.loss_margin, "loss"),
            (v.drift_margin, "drift"),
        ] {
            let m = m.unwrap_or(f64::NAN);
            assert!(m <= COMFORT, "{what} {}: {which} margin {m}", v.name);
        }
    }
}

#[test]
fn every_mutation_fails_and_correct_variants_pass() {
    let (_one, o) = unmutated(3);
    // The correct variants of each spec the suite uses, against their references.
    let base = spec();
    let r = compute_reference(&base, &o, &mut |_| {}).unwrap();
    let all = "fp32/none/*,bf16-mixed/none/*,fp16-mixed/none/*,bf16-pure/none/materialized";
    let clean = run(&base, all, &o, &r);
    assert_correct("correct", &clean);
    let fp32_drift = clean.variants[0].drift_final.unwrap();
    let drop_base = dropout_spec();
    let r_drop = compute_reference(&drop_base, &o, &mut |_| {}).unwrap();
    let drop_vs = variants_for(Mutation::RecomputeDropoutMask);
    let rep = run(&drop_base, drop_vs, &o, &r_drop);
    assert_correct("correct (dropout)", &rep);
    assert!(
        rep.variants.iter().any(|v| v.twins.iter().any(|t| t.ok)),
        "the recompute twin was not checked"
    );
    let wide = wide_spec();
    let r_wide = compute_reference(&wide, &o, &mut |_| {}).unwrap();
    let ln_vs = variants_for(Mutation::LayerNormStatsBf16);
    assert_comfortable("correct (width 384)", &run(&wide, ln_vs, &o, &r_wide));
    mutation::set_logit_gain(SOFTMAX_GAIN);
    let r_gain = compute_reference(&base, &o, &mut |_| {}).unwrap();
    let gain_vs = variants_for(Mutation::SoftmaxNoMax);
    assert!(
        r_gain.score_bound > 20.0 * r.score_bound,
        "S {} at ×32 vs {} at ×1",
        r_gain.score_bound,
        r.score_bound
    );
    assert_comfortable("correct (logits ×32)", &run(&base, gain_vs, &o, &r_gain));
    mutation::set_logit_gain(1.0);
    // At the default spec's scores the softmax without max subtraction is invisible.
    mutation::set(Some(Mutation::SoftmaxNoMax));
    let rep = run(&base, gain_vs, &o, &r);
    mutation::set(None);
    show("SoftmaxNoMax (logits ×1)", &rep);
    assert!(rep.variants.iter().all(|v| v.verdict == Verdict::Pass));

    for m in Mutation::ALL {
        let (b, r) = match m {
            Mutation::RecomputeDropoutMask => (&drop_base, &r_drop),
            Mutation::SoftmaxNoMax => (&base, &r_gain),
            Mutation::LayerNormStatsBf16 => (&wide, &r_wide),
            _ => (&base, &r),
        };
        if m == Mutation::SoftmaxNoMax {
            mutation::set_logit_gain(SOFTMAX_GAIN);
        }
        mutation::set(Some(m));
        let rep = run(b, variants_for(m), &o, r);
        mutation::set(None);
        mutation::set_logit_gain(1.0);
        show(&format!("{m:?}"), &rep);
        if m == Mutation::AdamMomentsBf16 {
            // AdamW normalises its update, so bf16 moments leave the gradients alone and move
            // the weights by ~2^-9 of an update per step: only the drift tolerance sees it.
            let v = &rep.variants[0];
            let d = v.drift_final.unwrap();
            assert!(d > 100.0 * fp32_drift, "{d:e} vs {fp32_drift:e}");
            assert_eq!(v.verdict, Verdict::Fail, "{:?}", v.reasons);
            assert!(
                v.drift_margin.unwrap() > WARN_FACTOR,
                "{:?}",
                v.drift_margin
            );
            assert!(
                v.grad_margin.unwrap() <= 1.0,
                "the gradients are not what fails"
            );
        }
        if m == Mutation::EmaBf16 {
            // The EMA rule, not the drift tolerance (the weights themselves are correct).
            for v in &rep.variants {
                assert!(v.reasons.iter().any(|r| r.starts_with("EMA divergence")));
                assert!(v.drift_margin.unwrap() <= 1.0, "{}", v.name);
            }
        }
        assert!(
            rep.variants.iter().any(|v| v.verdict == Verdict::Fail),
            "{m:?} was not caught"
        );
    }
}

/// `base` with an EMA and two microbatches of two, so the EMA and accumulation mutations have
/// something to touch.
fn with_ema_and_accumulation(base: Spec) -> Spec {
    let mut s = base;
    s.recipe.ema.enabled = true;
    s.workload.batch = 4;
    s.workload.microbatch = 2;
    s.workload.accumulation = 2;
    s.validate().unwrap();
    s
}

/// One small spec per diffusers family (the tiny specs of `tests/verify_families.rs`, one block
/// fewer where the family allows), with an EMA and two microbatches.
///
/// With `VERIFY_MUTATION_PRESETS=name,…` (one-encoder presets: PixArt, Sana, Wan), those
/// presets instead at their real width with one block (`model.keep_blocks`, `--depth 1`),
/// `VERIFY_MUTATION_RESOLUTION` (default 256) square images and 13 caption tokens: the suite
/// at real widths (issue 51), minutes each on 2 cores; there LayerNorm statistics in bf16 apply
/// (rows ≥ [`WIDE_ROWS`]), `VERIFY_MUTATION_SOFTMAX_GAIN` sets the softmax case's logit gain
/// and `VERIFY_MUTATION_ONLY` picks mutations. Runs and figures:
/// `bench/verify/runs/2026-12-06-epyc-width-mutations/`.
fn family_specs() -> Vec<(&'static str, Spec)> {
    use ditmem_engine::families::{flux, pixart, sana, sd3, wan};
    if let Ok(list) = std::env::var("VERIFY_MUTATION_PRESETS") {
        let side: u32 = std::env::var("VERIFY_MUTATION_RESOLUTION")
            .map_or(256, |v| v.parse().expect("a resolution"));
        return list
            .split(',')
            .map(|p| {
                let text = ditmem_budget::preset_config(p).expect("a diffusers preset");
                let map = serde_json::from_str(text).expect("its config");
                let mut s =
                    ditmem_budget::denoiser::with_family(Spec::small(), p, map).expect("spec");
                s.model.keep_blocks = vec![1];
                ditmem_budget::denoiser::resolve(&mut s).expect("one block");
                s.workload.height = side;
                s.workload.width = side;
                s.workload.text_tokens = Some(vec![13]);
                s.recipe.attention = ditmem_budget::AttentionMode::Materialized;
                let name: &'static str = Box::leak(p.to_string().into_boxed_str());
                (name, with_ema_and_accumulation(s))
            })
            .collect();
    }
    [
        ("pixart", pixart::tiny_spec(2, 4, 13).unwrap()),
        ("sd3", sd3::tiny_spec(2, 2, true, 5, 6).unwrap()),
        ("flux", flux::tiny_spec(1, 1, 2, 7, true).unwrap()),
        ("sana", sana::tiny_spec(2, 4, 13).unwrap()),
        ("wan", wan::tiny_spec(2, 2, 5, 7).unwrap()),
    ]
    .into_iter()
    .map(|(f, s)| (f, with_ema_and_accumulation(s)))
    .collect()
}

/// The LayerNorm row width from which bf16 statistics show: the DiT's `wide_spec` (384).
const WIDE_ROWS: u32 = 384;

/// Why mutation `m` cannot show on a family spec whose blocks are `hidden` wide, if it cannot.
fn not_applicable(m: Mutation, hidden: u32) -> Option<&'static str> {
    match m {
        // The families' blocks run without dropout (diffusers' defaults: attention and MLP
        // dropout 0), so a recomputed block has no mask to replay.
        Mutation::RecomputeDropoutMask => Some("the family's blocks have no dropout"),
        // bf16 LayerNorm statistics err with the row width: the DiT shows it at 384 (see
        // `wide_spec`), not at the default 64; the tiny family specs are 32–64 wide, the
        // presets at their real width (1,152 and more) are not.
        Mutation::LayerNormStatsBf16 if hidden < WIDE_ROWS => {
            Some("rows 32–64 wide: bf16 statistics stay inside the bf16 tolerance there")
        }
        _ => None,
    }
}

/// The logit gain of the softmax case on the families: [`SOFTMAX_GAIN`], or at real width
/// `VERIFY_MUTATION_SOFTMAX_GAIN` (scores whose bound S passes e^x's range need not reach it:
/// Sana-600M's cross-attention at ×32 has S = 124 and no score above 88.7, so the mutation
/// changes nothing there; a larger gain is the same condition, logits grown further).
fn family_softmax_gain() -> f64 {
    std::env::var("VERIFY_MUTATION_SOFTMAX_GAIN")
        .map_or(SOFTMAX_GAIN, |v| v.parse().expect("a gain"))
}

/// Whether mutation `m` runs: every one, or those named in `VERIFY_MUTATION_ONLY`
/// (comma-separated `Debug` names, e.g. `SoftmaxNoMax,LayerNormStatsBf16`) to rerun a few at
/// real width, where each costs minutes.
fn selected(m: Mutation) -> bool {
    std::env::var("VERIFY_MUTATION_ONLY")
        .map_or(true, |l| l.split(',').any(|n| n.trim() == format!("{m:?}")))
}

/// The families whose correct fp32 variant may still fail at logits ×32 with the softmax term
/// (`verify/softmax.rs`): SD3's text-query projections (`add_q_proj.weight` of block 0) err
/// 2.05× their tolerance on this spec with `gemm`'s AVX2 kernels (~15× the tolerance without
/// the term, where the term measures ~7.5×) and 0.37× with its AVX-512 kernels (same spec, same
/// seed): an error that depends on the product's summation order beyond what the model holds,
/// left open (not widened to green). Listed families may fail or pass; every other must pass.
const OUTSIDE_THE_SOFTMAX_MODEL: [&str; 1] = ["sd3"];

/// Whether a variant's step or drift produced non-finite values (an overflow).
fn overflowed(v: &VariantReport) -> bool {
    v.nonfinite_share.is_some_and(|s| s > 0.0) || v.reasons.iter().any(|r| r.contains("non-finite"))
}

#[test]
fn every_mutation_that_applies_fails_on_each_family() {
    let (_one, o) = unmutated(2);
    let (mut missed, mut false_failures) = (Vec::new(), Vec::new());
    for (fam, base) in family_specs() {
        let r = compute_reference(&base, &o, &mut |_| {}).unwrap();
        let clean = run(
            &base,
            "fp32/none/materialized,bf16-mixed/none/materialized,fp16-mixed/none/materialized",
            &o,
            &r,
        );
        assert_correct(&format!("{fam} correct"), &clean);
        let gain = family_softmax_gain();
        mutation::set_logit_gain(gain);
        let r_gain = compute_reference(&base, &o, &mut |_| {}).unwrap();
        let gain_vs = variants_for(Mutation::SoftmaxNoMax);
        let at_gain = run(&base, gain_vs, &o, &r_gain);
        mutation::set_logit_gain(1.0);
        eprintln!(
            "{fam}: score bound S {:.3} at ×1, {:.3} at ×{gain}",
            r.score_bound, r_gain.score_bound
        );
        show(&format!("{fam} correct (logits ×{gain})"), &at_gain);
        // At ×32 the rows saturate and the softmax backward cancels (dS = P·(dP − Σ P·dP) with
        // P near one-hot); the tolerance holds it (`verify/softmax.rs`), so the correct variant
        // passes and the softmax mutation fails by verdict, not by comparison with this run.
        assert!(
            at_gain.variants.iter().all(|v| !overflowed(v)),
            "{fam}: the correct variant overflows at ×32: {:?}",
            at_gain.variants[0].reasons
        );
        let correct_fails = at_gain.variants.iter().any(|v| v.verdict == Verdict::Fail);
        if correct_fails && !OUTSIDE_THE_SOFTMAX_MODEL.contains(&fam) {
            false_failures.push(format!(
                "{fam} correct at logits ×{gain}: {:?} (listed outside the model: {})",
                at_gain.variants[0].reasons,
                OUTSIDE_THE_SOFTMAX_MODEL.contains(&fam)
            ));
        }
        for m in Mutation::ALL {
            if let Some(why) = not_applicable(m, base.model.hidden) {
                eprintln!("{fam} {m:?}: does not apply ({why})");
                continue;
            }
            if !selected(m) {
                eprintln!("{fam} {m:?}: not selected (VERIFY_MUTATION_ONLY)");
                continue;
            }
            let r = if m == Mutation::SoftmaxNoMax {
                mutation::set_logit_gain(gain);
                &r_gain
            } else {
                &r
            };
            mutation::set(Some(m));
            let rep = run(&base, variants_for(m), &o, r);
            mutation::set(None);
            mutation::set_logit_gain(1.0);
            show(&format!("{fam} {m:?}"), &rep);
            let caught = if m == Mutation::SoftmaxNoMax && correct_fails {
                // Outside the model: told from the correct run's error as the tolerances were
                // calibrated, × SPREAD_MARGIN, beyond the warning band (× WARN_FACTOR).
                let correct = at_gain.variants[0]
                    .grad_rel_err_max
                    .unwrap_or(f64::INFINITY);
                rep.variants.iter().any(|v| {
                    v.verdict == Verdict::Fail
                        && v.grad_rel_err_max.is_some_and(|e| {
                            e.is_nan() || e > SPREAD_MARGIN * WARN_FACTOR * correct
                        })
                })
            } else {
                rep.variants.iter().any(|v| v.verdict == Verdict::Fail)
            };
            if !caught {
                missed.push(format!("{fam} {m:?}"));
            }
        }
    }
    assert!(
        false_failures.is_empty(),
        "correct variants' verdicts at ×32 not as listed: {false_failures:#?}"
    );
    assert!(missed.is_empty(), "not caught: {missed:?}");
}
