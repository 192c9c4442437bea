//! The measurement behind verify's κ factors (ignored: minutes; run it to re-derive them):
//!
//! ```text
//! CAL_CASES=base,gain,width,mutspec CAL_SEEDS=5 CAL_STEPS=3 cargo test --release \
//!     -p ditmem-conformance --test verify_calibrate -- --ignored --nocapture
//! CAL_CASES=base CAL_SEEDS=5 CAL_STEPS=50 cargo test ... (the drift over the default K)
//! ```
//!
//! For each case (spec × attention-score gain) and seed pair (weights i, data 10 + i) it runs
//! every precision × {materialized, memory-efficient} (recompute twins are bitwise identical to
//! these) against its fp64 reference, and prints one `CAL` line per variant: the errors and
//! their normalised forms err / (u·√P), err / (u·S), the drift as a share of the reference's
//! travel over (u·√P), and each margin under the current κ. κ is fitted from these lines as the
//! doc of `verify::Tolerance` says (per policy: 2 × the largest normalised value over correct
//! runs, the reduction and score terms as excesses over the chain term). It asserts only that
//! every correct variant passes verify.

use ditmem_budget::Spec;
use ditmem_conformance::verify::{
    compute_reference, parse_variants, unit_roundoff, verify, Verdict, VerifyOptions,
};
use ditmem_engine::mutation;

fn case(name: &str) -> Vec<(String, Spec, f64)> {
    let base = Spec::small();
    let mut out = Vec::new();
    match name {
        "base" => {
            for b in [2u32, 4, 8] {
                let mut s = base.clone();
                s.workload.batch = b;
                s.workload.microbatch = b;
                out.push((format!("batch{b}"), s, 1.0));
            }
        }
        "gain" => {
            for g in [4.0, 8.0, 16.0, 32.0] {
                out.push((format!("gain{g}"), base.clone(), g));
            }
        }
        "width" => {
            for w in [128u32, 256, 384] {
                let mut s = base.clone();
                s.model.hidden = w;
                s.model.heads = w / 16;
                out.push((format!("width{w}"), s, 1.0));
            }
        }
        "mutspec" => {
            // The mutation suite's spec: EMA, two microbatches.
            let mut s = base.clone();
            s.recipe.ema.enabled = true;
            s.workload.batch = 4;
            s.workload.microbatch = 2;
            s.workload.accumulation = 2;
            out.push(("mutspec".into(), s.clone(), 1.0));
            out.push(("mutspec-gain32".into(), s.clone(), 32.0));
            s.model.hidden = 384;
            s.model.heads = 6;
            out.push(("mutspec-width384".into(), s, 1.0));
        }
        other => panic!("unknown case {other}"),
    }
    for (_, s, _) in &mut out {
        s.validate().unwrap();
    }
    out
}

#[test]
#[ignore]
fn calibrate() {
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
    let seeds: u64 = env("CAL_SEEDS", "5").parse().unwrap();
    let first: u64 = env("CAL_FIRST_SEED", "0").parse().unwrap();
    let steps: u32 = env("CAL_STEPS", "3").parse().unwrap();
    let variants = parse_variants(&env(
        "CAL_VARIANTS",
        "fp64/none/*,fp32/none/*,bf16-mixed/none/*,fp16-mixed/none/*,bf16-pure/none/*",
    ))
    .unwrap();
    let mut failed = Vec::new();
    for c in env("CAL_CASES", "base").split(',') {
        for (name, spec, gain) in case(c) {
            for i in first..first + seeds {
                mutation::set_logit_gain(gain);
                let o = VerifyOptions {
                    seed: i,
                    data_seed: 10 + i,
                    steps,
                    ..VerifyOptions::default()
                };
                let r = compute_reference(&spec, &o, &mut |_| {}).unwrap();
                let rep = verify(&spec, &variants, &o, &r, 2, &mut |_| {}).unwrap();
                let g = &rep.growth;
                for v in &rep.variants {
                    let u = unit_roundoff(v.precision.compute_dtype());
                    let ge = v.grad_rel_err_max.unwrap_or(f64::NAN);
                    let le = v.loss_rel_err.unwrap_or(f64::NAN);
                    let dt = v.drift.as_ref().map_or(f64::NAN, |d| d.vs_travel);
                    let pg = (g.gradient_chain as f64).sqrt();
                    let pl = (g.forward_chain as f64).sqrt();
                    eprintln!(
                        "CAL\t{name}\t{i}\t{}\t{}\tS={:.3}\tgrad={ge:.3e}\tg/uP={:.3}\tg/uS={:.4}\tloss={le:.3e}\tl/uP={:.4}\tl/uS={:.5}\tdrift={dt:.3e}\td/uP={:.3}\tfinal={:.3e}\tmg={:.3}\tml={:.3}\tmd={:.3}\t{}",
                        v.precision,
                        v.attention.name(),
                        g.score_bound,
                        ge / (u * pg),
                        ge / (u * g.score_bound),
                        le / (u * pl),
                        le / (u * g.score_bound),
                        dt / (u * pg),
                        v.drift_final.unwrap_or(f64::NAN),
                        v.grad_margin.unwrap_or(f64::NAN),
                        v.loss_margin.unwrap_or(f64::NAN),
                        v.drift_margin.unwrap_or(f64::NAN),
                        v.verdict
                    );
                    if v.verdict == Verdict::Fail {
                        failed.push(format!("{name} seed {i} {}: {:?}", v.name, v.reasons));
                    }
                }
            }
        }
    }
    mutation::set_logit_gain(1.0);
    assert!(failed.is_empty(), "{failed:#?}");
}
