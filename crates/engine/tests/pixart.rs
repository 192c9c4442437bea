//! PixArt in the engine: `verify` passes. What every family shares (the parameter table,
//! the levers, equal gradients across recompute and attention modes, the agreement grid) is
//! in `families.rs`.

use ditmem_budget::{AttentionMode, Precision, Recompute, Spec};
use ditmem_engine::families::pixart::tiny_spec;
use ditmem_engine::CountingAlloc;

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

/// The counting allocator is the whole process's: the tests of this file run one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

fn spec() -> Spec {
    ditmem_engine::host::resolve(&tiny_spec(2, 4, 13).unwrap())
}

/// `verify` on a tiny PixArt: every precision passes against the f64 reference (the key
/// biases' zero gradients judged against the whole gradient), recompute twins are bitwise, and
/// a dropped cross-attention gradient fails.
#[test]
fn pixart_verifies_against_its_f64_reference() {
    let _one = one_at_a_time();
    use ditmem_engine::verify::{
        compute_reference, verify, Fault, Variant, Verdict, VerifyOptions,
    };
    let base = spec();
    let o = VerifyOptions {
        steps: 2,
        ..VerifyOptions::default()
    };
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
            Precision::Bf16Mixed,
            Recompute::None,
            AttentionMode::MemoryEfficient,
        ),
        (
            Precision::Fp16Mixed,
            Recompute::AttentionOnly,
            AttentionMode::Materialized,
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
        "transformer_blocks.1.attn2.to_v.weight".into(),
    ));
    variants.push(bad);
    let rep = verify(&base, &variants, &o, &r, 1, &mut |_| {}).unwrap();
    let (clean, faulty) = rep.variants.split_at(4);
    for v in clean {
        assert_eq!(v.verdict, Verdict::Pass, "{}: {:?}", v.name, v.reasons);
    }
    assert_eq!(faulty[0].verdict, Verdict::Fail, "{:?}", faulty[0].reasons);
}
