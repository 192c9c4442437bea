//! SD3 in the engine: `verify` passes with and without q/k RMSNorm, and the backward is the
//! forward's derivative (finite differences). What every family shares (the parameter table,
//! the levers, equal gradients across recompute and attention modes, the agreement grid) is in
//! `families.rs`.

use ditmem_budget::{AttentionMode, Precision, Recompute, Spec};
use ditmem_engine::families::sd3::tiny_spec;
use ditmem_engine::{CountingAlloc, SyntheticData, TrainOptions, Trainer};

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

/// The counting allocator is the whole process's: the tests of this file run one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

fn spec(qk_norm: bool) -> Spec {
    ditmem_engine::host::resolve(&tiny_spec(3, 2, qk_norm, 5, 6).unwrap())
}

/// `verify` on a tiny SD3: every precision passes against the f64 reference, recompute twins are
/// bitwise, and a dropped context-projection gradient fails; with q/k RMSNorm (SD3.5) too, where
/// bf16-mixed may warn (below).
#[test]
fn sd3_verifies_against_its_f64_reference() {
    let _one = one_at_a_time();
    use ditmem_engine::verify::{
        compute_reference, verify, Fault, Variant, Verdict, VerifyOptions,
    };
    let o = VerifyOptions {
        steps: 2,
        ..VerifyOptions::default()
    };
    for qk in [false, true] {
        let base = spec(qk);
        let r = compute_reference(&base, &o, &mut |_| {}).unwrap();
        let mut variants = Vec::new();
        for (p, rc, a) in [
            (
                Precision::Fp32,
                Recompute::None,
                AttentionMode::Materialized,
            ),
            (Precision::Fp32, Recompute::All, AttentionMode::Materialized),
            (
                Precision::Fp16Mixed,
                Recompute::AttentionOnly,
                AttentionMode::Materialized,
            ),
            (
                Precision::Bf16Mixed,
                Recompute::None,
                AttentionMode::MemoryEfficient,
            ),
        ] {
            variants.push(Variant::new(p, rc, a));
        }
        let mut bad = Variant::new(
            Precision::Fp32,
            Recompute::None,
            AttentionMode::Materialized,
        );
        bad.fault = Some(Fault::ZeroGradient(
            "transformer_blocks.1.attn.add_v_proj.weight".into(),
        ));
        variants.push(bad);
        let rep = verify(&base, &variants, &o, &r, 1, &mut |_| {}).unwrap();
        let (clean, faulty) = rep.variants.split_at(4);
        for v in clean {
            eprintln!(
                "qk {qk} {}: {:?} margin {:?} worst {:?}",
                v.name, v.verdict, v.grad_margin, v.worst_tensor
            );
            // Under bf16/fp16 the gradients of the context queries' projection and of the q/k
            // norm weights (summed over every token and head) carry more rounding than the
            // DiT-calibrated tolerance allows: they land in the warning band (at most 1.4× at
            // these specs), not in failure. fp32 and the recompute twins pass.
            let allowed = match v.precision {
                Precision::Bf16Mixed | Precision::Fp16Mixed => Verdict::Warn,
                _ => Verdict::Pass,
            };
            if let Some(m) = v.grad_margin {
                assert!(m <= 1.5, "qk {qk} {}: margin {m}", v.name);
            }
            assert!(v.verdict <= allowed, "qk {qk} {}: {:?}", v.name, v.reasons);
        }
        assert_eq!(faulty[0].verdict, Verdict::Fail, "{:?}", faulty[0].reasons);
    }
}

/// The backward is the forward's derivative: central differences of the f64 loss along a few
/// weights' gradients (joint-attention projections of both streams, a q/k norm weight, the
/// last block's modulation) agree with the step's gradients.
#[test]
fn sd3_gradients_match_finite_differences() {
    let _one = one_at_a_time();
    let mut s = spec(true);
    s.recipe.precision = Precision::Fp64;
    let batch = SyntheticData::new(&s, 5).unwrap().step_batch(0);
    let new = || {
        Trainer::new(
            &s,
            TrainOptions {
                seed: 9,
                keep_gradients: true,
                ..TrainOptions::default()
            },
        )
        .unwrap()
    };
    let mut t = new();
    t.compute_gradients(&batch).unwrap();
    for name in [
        "transformer_blocks.1.attn.add_q_proj.weight",
        "transformer_blocks.0.attn.to_k.weight",
        "transformer_blocks.1.attn.norm_added_k.weight",
        "transformer_blocks.2.norm1_context.linear.weight",
        "transformer_blocks.0.ff_context.net.2.weight",
    ] {
        let g = t.gradient(name).unwrap().unwrap();
        let w = t.parameter(name).unwrap();
        // Along the gradient direction: dL/dε at ε = 0 is ‖g‖².
        let gn: f64 = g.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
        let eps = 1e-4 / gn.sqrt();
        let loss_at = |e: f64| {
            let mut u = new();
            let v = (&w + (&g * e).unwrap()).unwrap();
            u.load_parameters(&[(name.to_string(), v)]).unwrap();
            u.compute_gradients(&batch).unwrap()
        };
        let fd = (loss_at(eps) - loss_at(-eps)) / (2.0 * eps);
        let rel = (fd - gn).abs() / gn;
        assert!(
            rel < 1e-5,
            "{name}: finite difference {fd} vs ‖g‖² {gn} ({rel:.2e})"
        );
    }
}
