//! Flux in the engine: what it does not run is refused by name, and `verify` passes. What
//! every family shares (the parameter table, the levers, equal gradients across recompute and
//! attention modes, the agreement grid) is in `families.rs`.

use ditmem_budget::{AttentionMode, Precision, Recompute, Spec};
use ditmem_engine::families::flux::tiny_spec;
use ditmem_engine::{CountingAlloc, TrainOptions, Trainer};

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

/// The counting allocator is the whole process's: the tests of this file run one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// One double-stream and two single-stream blocks of 2 heads, 7 T5 tokens, guidance on.
fn spec() -> Spec {
    ditmem_engine::host::resolve(&tiny_spec(1, 2, 2, 7, true).unwrap())
}

/// What the engine does not run is refused by name: a Flux without single-stream blocks.
#[test]
fn flux_refuses_a_model_without_single_stream_blocks() {
    let _one = one_at_a_time();
    let mut s = tiny_spec(1, 1, 2, 5, false).unwrap();
    s.model
        .diffusers
        .as_mut()
        .unwrap()
        .insert("num_single_layers".into(), 0.into());
    let s = ditmem_budget::denoiser::with_family(
        s.clone(),
        "flux-tiny",
        s.model.diffusers.clone().unwrap(),
    )
    .unwrap();
    let e = Trainer::new(&s, TrainOptions::default())
        .err()
        .expect("refused");
    assert!(e.to_string().contains("num_single_layers"), "{e}");
}

/// `verify` on a tiny Flux: fp32 and bf16 pass against the f64 reference, recompute twins are
/// bitwise, and a dropped single-stream gradient fails. (fp16-mixed does not pass on this
/// model at initialisation: the gradients of the double block's text-query and text-output
/// projections are ~1e-10 in norm — the text stream reaches the loss only through the later
/// joint attention — and underflow f16 even under the 2^16 loss scale, 30 % off in relative
/// terms; bf16's exponent range keeps them.)
#[test]
fn flux_verifies_against_its_f64_reference() {
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
            Precision::Bf16Mixed,
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
        "single_transformer_blocks.1.attn.to_v.weight".into(),
    ));
    variants.push(bad);
    let rep = verify(&base, &variants, &o, &r, 1, &mut |_| {}).unwrap();
    let (clean, faulty) = rep.variants.split_at(4);
    for v in clean {
        assert_eq!(v.verdict, Verdict::Pass, "{}: {:?}", v.name, v.reasons);
    }
    assert_eq!(faulty[0].verdict, Verdict::Fail, "{:?}", faulty[0].reasons);
}
