//! `verify` on every diffusers family's tiny spec: which gradients are zero in exact arithmetic
//! (`families::zero_gradient`, checked against the f64 reference's own gradients), each
//! family's correct variants against its f64 reference with a planted fault that must fail,
//! and (ignored: minutes) the margins of every correct variant over five weight seeds.

use ditmem_budget::{AttentionMode, Precision, Recompute, Spec};
use ditmem_conformance::verify::{
    compute_reference, parse_variants, verify, Fault, Report, Variant, Verdict, VerifyOptions,
};
use ditmem_engine::families::{self, zero_gradient, Arch};

fn resolve(s: Spec) -> Spec {
    ditmem_engine::host::resolve(&s)
}

/// The tiny specs of the family tests (`tests/<family>.rs`): PixArt 2 blocks × 4 heads and 13
/// caption tokens; SD3 3 joint blocks × 2 heads (without and with q/k RMSNorm); Flux one
/// double- and two single-stream blocks × 2 heads, guidance on; Sana 2 blocks × 4 heads; Wan
/// 2 blocks × 2 heads, 5 frames.
fn family_specs() -> Vec<(&'static str, Spec)> {
    vec![
        (
            "pixart",
            resolve(families::pixart::tiny_spec(2, 4, 13).unwrap()),
        ),
        (
            "sd3",
            resolve(families::sd3::tiny_spec(3, 2, false, 5, 6).unwrap()),
        ),
        (
            "sd3-qk",
            resolve(families::sd3::tiny_spec(3, 2, true, 5, 6).unwrap()),
        ),
        (
            "flux",
            resolve(families::flux::tiny_spec(1, 2, 2, 7, true).unwrap()),
        ),
        (
            "sana",
            resolve(families::sana::tiny_spec(2, 4, 13).unwrap()),
        ),
        (
            "wan",
            resolve(families::wan::tiny_spec(2, 2, 5, 7).unwrap()),
        ),
        (
            "dit-diffusers",
            resolve(families::dit_diffusers::tiny_spec(2, 4).unwrap()),
        ),
    ]
}

fn norm(v: &[f64]) -> f64 {
    v.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// A key projection's bias (softmax or linear attention, either stream).
fn is_key_bias(name: &str) -> bool {
    name.ends_with("to_k.bias") || name.ends_with("add_k_proj.bias")
}

/// Every bias `zero_gradient` names has an f64 gradient at rounding level (≤ 1e-11 of its own
/// linear's weight gradient), and every other key bias a real one (≥ 1e-6 of it): the rule
/// is neither too wide (it would hide a dropped gradient) nor too narrow (a zero gradient
/// judged by its own norm is all noise).
#[test]
fn zero_gradients_are_the_softmax_key_biases_of_each_family() {
    let o = VerifyOptions {
        steps: 0,
        ..VerifyOptions::default()
    };
    for (fam, spec) in family_specs() {
        let arch = Arch::of(&spec).unwrap();
        let r = compute_reference(&spec, &o, &mut |_| {}).unwrap();
        let mut zeros = 0;
        for (name, _) in &r.tensors {
            let predicted = zero_gradient(&arch, name);
            if !predicted && !is_key_bias(name) {
                continue;
            }
            let weight = name.strip_suffix(".bias").unwrap().to_string() + ".weight";
            let g = norm(&r.gradient(name).unwrap());
            let gw = norm(&r.gradient(&weight).unwrap());
            eprintln!(
                "{fam} {name}: ‖g‖ {g:.3e}, its weight's {gw:.3e}, predicted zero {predicted}"
            );
            assert!(gw > 0.0, "{fam} {weight}");
            if predicted {
                zeros += 1;
                assert!(g <= 1e-11 * gw, "{fam} {name}: {g:e} vs {gw:e}");
            } else {
                assert!(g >= 1e-6 * gw, "{fam} {name}: {g:e} vs {gw:e}");
            }
        }
        let want = match fam {
            "pixart" => 4,
            "sana" => 2,
            // attn1.to_k.bias of each of the 2 blocks.
            "dit-diffusers" => 2,
            _ => 0,
        };
        assert_eq!(zeros, want, "{fam}");
    }
}

/// The correct variants a family test runs (each must pass, or warn where `may_warn` says so)
/// and the fault planted in one more (fp32), which must fail.
fn verify_family(
    spec: &Spec,
    variants: &str,
    fault: &str,
    may_warn: &dyn Fn(&Variant) -> bool,
) -> Report {
    let o = VerifyOptions {
        steps: 2,
        ..VerifyOptions::default()
    };
    let r = compute_reference(spec, &o, &mut |_| {}).unwrap();
    let vs0 = parse_variants(variants).unwrap();
    let mut vs = vs0.clone();
    let mut bad = Variant::new(
        Precision::Fp32,
        Recompute::None,
        AttentionMode::Materialized,
    );
    bad.fault = Some(Fault::ZeroGradient(fault.into()));
    vs.push(bad);
    let rep = verify(spec, &vs, &o, &r, 1, &mut |_| {}).unwrap();
    for v in &rep.variants {
        eprintln!(
            "{}: {:?} margin {:?} worst {:?} {:?}",
            v.name, v.verdict, v.grad_margin, v.worst_tensor, v.reasons
        );
    }
    let (clean, faulty) = rep.variants.split_at(rep.variants.len() - 1);
    for (v, var) in clean.iter().zip(&vs0) {
        let allowed = if may_warn(var) {
            Verdict::Warn
        } else {
            Verdict::Pass
        };
        assert!(v.verdict <= allowed, "{}: {:?}", v.name, v.reasons);
    }
    assert_eq!(faulty[0].verdict, Verdict::Fail, "{:?}", faulty[0].reasons);
    assert!(
        faulty[0].reasons.iter().any(|r| r.contains(fault)),
        "{:?}",
        faulty[0].reasons
    );
    rep
}

/// Every policy once, recompute (all, attention-only) and memory-efficient attention on some.
const VARIANTS: &str = "fp32/none/materialized,fp32/all/materialized,\
    bf16-mixed/none/memory-efficient,fp16-mixed/attention-only/materialized,\
    bf16-pure/none/materialized";

#[test]
fn pixart_verifies_against_its_f64_reference() {
    verify_family(
        &family_specs()[0].1,
        VARIANTS,
        "transformer_blocks.1.attn2.to_v.weight",
        &|_| false,
    );
}

/// diffusers' DiT (`DiTTransformer2DModel`, an embedder in every block, block 0's read again
/// for the output side): every policy passes; a zeroed value projection of block 1 fails.
#[test]
fn dit_diffusers_verifies_against_its_f64_reference() {
    verify_family(
        &family_specs()[6].1,
        VARIANTS,
        "transformer_blocks.1.attn1.to_v.weight",
        &|_| false,
    );
}

/// SD3's fp16-mixed variant may warn (1.37× without q/k norm): its text-stream projections
/// (`add_q_proj`) err ~1.8× what bf16-mixed's error scaled by u(f16)/u(bf16) predicts, and the
/// excess does not move with the loss scale (2^10 to 2^24): not underflow, no term of the
/// tolerance model yet (an open finding).
#[test]
fn sd3_verifies_against_its_f64_reference() {
    for spec in [&family_specs()[1].1, &family_specs()[2].1] {
        let rep = verify_family(
            spec,
            VARIANTS,
            "transformer_blocks.1.attn.add_v_proj.weight",
            &|v| v.precision == Precision::Fp16Mixed,
        );
        // A key bias's gradient is a remainder of the joint attention's zero sum (key_bias.rs):
        // amplified beside its query sibling's, which is not.
        let amp = |suffix: &str| {
            rep.variants[0]
                .per_tensor
                .iter()
                .filter(|t| t.name.ends_with(suffix))
                .map(|t| t.amplification)
                .fold(0.0, f64::max)
        };
        assert!(amp("attn.to_k.bias") > 1.0);
        assert_eq!(amp("attn.to_q.bias"), 1.0);
    }
}

/// Flux's fp16-mixed variants pass because their tolerance holds the underflow of the double
/// block's text-stream gradients (~1e-10 in norm at initialisation: the text stream reaches the
/// loss only through the later joint attention), which the report names.
#[test]
fn flux_verifies_against_its_f64_reference() {
    let rep = verify_family(
        &family_specs()[3].1,
        VARIANTS,
        "single_transformer_blocks.1.attn.to_v.weight",
        &|_| false,
    );
    let fp16 = rep
        .variants
        .iter()
        .find(|v| v.precision == Precision::Fp16Mixed)
        .unwrap();
    assert!(
        fp16.reasons
            .iter()
            .any(|r| r.contains("underflow") && r.contains("loss scale")),
        "{:?}",
        fp16.reasons
    );
}

/// Sana's fp16-mixed variant passes because its linear attention's q and k gradients hold the
/// components that cross the ReLU kink (kink.rs: 2.37× its tolerance on seeds 1 and 4 without
/// the term).
///
/// Its fp32 variants may warn on the weight drift alone (an open finding): with `gemm`'s AVX-512
/// kernels the 2-step drift is 1.25× its tolerance (1.74e-4 vs 1.39e-4) while every gradient
/// passes (margin ≤ 0.35); 1.55× on seed 2 before them. κ_d was calibrated on the DiT only, and
/// AdamW's first update, g/(|g| + ε), turns an error in a gradient component near zero into a
/// whole step of that weight, which Sana's gradients (ReLU-gated linear attention) may hold more
/// of: no term for it yet. The gradients must still pass.
#[test]
fn sana_verifies_against_its_f64_reference() {
    let rep = verify_family(
        &family_specs()[4].1,
        VARIANTS,
        "transformer_blocks.1.ff.conv_depth.weight",
        &|v| v.precision == Precision::Fp32,
    );
    for v in rep
        .variants
        .iter()
        .filter(|v| v.precision == Precision::Fp32)
    {
        if !v.name.contains("+fault") {
            let m = v.grad_margin.unwrap_or(f64::INFINITY);
            assert!(m <= 1.0, "{}: gradient margin {m}", v.name);
        }
    }
    assert!(rep.variants[0]
        .per_tensor
        .iter()
        .any(|t| t.name.contains("attn1.to_q") && t.amplification > 1.0));
    // The ReLU kink: flips expected under fp16 on the linear attention's q and k, their term
    // carried to every tensor upstream of them (the embedders, earlier blocks, the block's
    // modulation) and to none after them (the last block's v, cross-attention and
    // feed-forward, the final layer); too rare under fp32 to be a term (kink.rs).
    let kinked = |i: usize| -> Vec<&str> {
        rep.variants[i]
            .per_tensor
            .iter()
            .filter(|t| t.kink > 0.0)
            .map(|t| t.name.as_str())
            .collect()
    };
    let fp16 = kinked(3);
    assert!(fp16.iter().any(|n| n.contains("attn1.to_k")), "{fp16:?}");
    let after = |n: &&str| {
        n.starts_with("proj_out")
            || *n == "scale_shift_table"
            || ["attn1.to_v", "attn1.to_out", "attn2.", "ff."]
                .iter()
                .any(|p| n.starts_with(&format!("transformer_blocks.1.{p}")))
    };
    assert!(!fp16.iter().any(after), "{fp16:?}");
    if fp16
        .iter()
        .any(|n| n.starts_with("transformer_blocks.1.attn1.to_"))
    {
        for n in [
            "patch_embed.proj.weight",
            "transformer_blocks.0.ff.conv_inverted.weight",
            "transformer_blocks.1.scale_shift_table",
        ] {
            assert!(
                fp16.contains(&n),
                "{n} is upstream of block 1's kink: {fp16:?}"
            );
        }
    }
    assert!(kinked(0).is_empty(), "{:?}", kinked(0));
}

#[test]
fn wan_verifies_against_its_f64_reference() {
    verify_family(
        &family_specs()[5].1,
        VARIANTS,
        "blocks.1.attn2.to_v.weight",
        &|_| false,
    );
}

/// Weight seeds 0–4 × every family × every policy and both attention modes (no recompute: its
/// twins are bitwise): the largest gradient / loss / drift margin per family and policy, none
/// failing. Minutes on 2 cores: `cargo test --release -p ditmem-conformance --test verify_families
/// -- --ignored --nocapture`.
#[test]
#[ignore]
fn correct_variants_pass_over_five_weight_seeds() {
    let mut failures = Vec::new();
    eprintln!("family  policy       seed  grad   loss   drift  verdict  worst");
    for (fam, spec) in family_specs() {
        for seed in 0..5 {
            let o = VerifyOptions {
                seed,
                steps: 2,
                ..VerifyOptions::default()
            };
            let r = compute_reference(&spec, &o, &mut |_| {}).unwrap();
            let vs = parse_variants("*/none/*").unwrap();
            let rep = verify(&spec, &vs, &o, &r, 1, &mut |_| {}).unwrap();
            for v in &rep.variants {
                let f = |m: Option<f64>| m.map_or("-".to_string(), |m| format!("{m:.3}"));
                eprintln!(
                    "{fam:7} {:24} {seed} {} {} {} {} {:?} {:?}",
                    v.name,
                    f(v.grad_margin),
                    f(v.loss_margin),
                    f(v.drift_margin),
                    v.verdict,
                    v.worst_tensor,
                    v.reasons
                );
                if v.verdict == Verdict::Fail {
                    failures.push(format!("{fam} seed {seed} {}: {:?}", v.name, v.reasons));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Diagnosis: every tensor's error, tolerance and margin of the variants `VERIFY_VARIANTS`
/// (default `*/none/materialized`) of family `VERIFY_FAMILY` at weight seed `VERIFY_SEED`
/// with the attention scores × `VERIFY_GAIN` (default 1; the softmax mutation's probe uses 32),
/// largest margin first. `cargo test --release -p ditmem-conformance --test verify_families
/// per_tensor_margins -- --ignored --nocapture`.
#[test]
#[ignore]
fn per_tensor_margins() {
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
    let fam = env("VERIFY_FAMILY", "sana");
    let seed: u64 = env("VERIFY_SEED", "1").parse().unwrap();
    let gain: f64 = env("VERIFY_GAIN", "1").parse().unwrap();
    let (_, spec) = family_specs().into_iter().find(|(f, _)| *f == fam).unwrap();
    let o = VerifyOptions {
        seed,
        steps: 2,
        ..VerifyOptions::default()
    };
    ditmem_engine::mutation::set_logit_gain(gain);
    let r = compute_reference(&spec, &o, &mut |_| {}).unwrap();
    let vs = parse_variants(&env("VERIFY_VARIANTS", "*/none/materialized")).unwrap();
    let rep = verify(&spec, &vs, &o, &r, 1, &mut |_| {}).unwrap();
    ditmem_engine::mutation::set_logit_gain(1.0);
    eprintln!("growth {:?}", rep.growth);
    // ‖g_ref(bias)‖ / ‖g_ref(its weight)‖ of the attention projections: a bias whose gradient
    // is a small part of its terms (a cancellation) sits far below the others.
    for (name, _) in &r.tensors {
        if let Some(stem) = name.strip_suffix(".bias").filter(|n| n.contains("attn")) {
            let (g, gw) = (
                norm(&r.gradient(name).unwrap()),
                norm(&r.gradient(&format!("{stem}.weight")).unwrap()),
            );
            eprintln!("  bias/weight {:.3e} {name}", g / gw);
        }
    }
    for v in &rep.variants {
        let tol = rep
            .tolerances
            .iter()
            .find(|t| t.precision == v.precision)
            .unwrap();
        eprintln!(
            "== {} {:?} tol {:.3e} {:?}",
            v.name, v.verdict, tol.grad, v.reasons
        );
        let mut rows: Vec<_> = v
            .per_tensor
            .iter()
            .map(|te| (te.rel_err / tol.grad_of(te), te))
            .collect();
        rows.sort_by(|a, b| b.0.total_cmp(&a.0));
        let shown = rows
            .iter()
            .enumerate()
            .filter(|(i, (_, te))| *i < 12 || te.kink > 0.0)
            .map(|(_, r)| r);
        for (m, te) in shown {
            eprintln!(
                "  {m:.3} {:50} err {:.3e} tol {:.3e} under {:.2e} amp {:.2} kink {:.2e}",
                te.name,
                te.rel_err,
                tol.grad_of(te),
                te.underflow,
                te.amplification,
                te.kink
            );
        }
    }
}
