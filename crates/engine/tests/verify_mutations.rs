//! The mutation suite: each planted precision bug (feature `mutations`, enabled for the tests by
//! the engine's dev-dependency on itself) must fail `verify`, while the correct variants pass.
//! One test function: the planted bug is process-wide.

use ditmem_budget::{Precision, Spec};
use ditmem_engine::mutation::{self, Mutation};
use ditmem_engine::verify::{compute_reference, parse_variants, verify, Verdict, VerifyOptions};

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

fn variants_for(m: Mutation) -> &'static str {
    match m {
        Mutation::Fp16NoLossScaling => "fp16-mixed/none/materialized",
        _ => "fp32/none/materialized,bf16-mixed/none/materialized",
    }
}

#[test]
fn every_mutation_fails_and_correct_variants_pass() {
    let base = spec();
    let o = VerifyOptions {
        steps: 3,
        ..VerifyOptions::default()
    };
    mutation::set(None);
    let r = compute_reference(&base, &o, &mut |_| {}).unwrap();
    let all = parse_variants(
        "fp32/none/*,bf16-mixed/none/*,fp16-mixed/none/*,bf16-pure/none/materialized",
    )
    .unwrap();
    let clean = verify(&base, &all, &o, &r, 2, &mut |_| {}).unwrap();
    for v in &clean.variants {
        eprintln!(
            "correct {}: {} grad {:.2e} / tol {:.2e} (margin {:.3}), ema drift {:?}",
            v.name,
            v.verdict,
            v.grad_rel_err_max.unwrap_or(f64::NAN),
            v.tolerance_grad,
            v.grad_margin.unwrap_or(f64::NAN),
            v.ema_drift_final
        );
        assert_ne!(v.verdict, Verdict::Fail, "{}: {:?}", v.name, v.reasons);
    }
    for m in Mutation::ALL {
        mutation::set(Some(m));
        let vs = parse_variants(variants_for(m)).unwrap();
        let rep = verify(&base, &vs, &o, &r, 2, &mut |_| {}).unwrap();
        mutation::set(None);
        for v in &rep.variants {
            eprintln!(
                "{m:?} on {}: {} grad {:.2e} / tol {:.2e}, loss {:.2e} / {:.2e}, ema drift {:?}; {:?}",
                v.name,
                v.verdict,
                v.grad_rel_err_max.unwrap_or(f64::NAN),
                v.tolerance_grad,
                v.loss_rel_err.unwrap_or(f64::NAN),
                v.tolerance_loss,
                v.ema_drift_final,
                v.reasons
            );
        }
        assert!(
            rep.variants.iter().any(|v| v.verdict == Verdict::Fail),
            "{m:?} was not caught"
        );
        let _ = Precision::Fp32;
    }
}
