//! SD3 in the engine: the backward is the
//! forward's derivative (finite differences). What every family shares (the parameter table,
//! the levers, equal gradients across recompute and attention modes, the agreement grid) is in
//! `families.rs`.

use ditmem_budget::{Precision, Spec};
use ditmem_engine::families::sd3::{tiny_dual_spec, tiny_spec};
use ditmem_engine::{trainable_count, CountingAlloc, SyntheticData, TrainOptions, Trainer};

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

/// Central differences of the f64 loss along each named weight's gradient agree with the
/// step's gradient (dL/dε at ε = 0 along g is ‖g‖²) to 1e-5 relative.
fn gradients_match_finite_differences(mut s: Spec, names: &[&str]) {
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
    for &name in names {
        let g = t.gradient(name).unwrap().unwrap();
        let w = t.parameter(name).unwrap();
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

/// The backward is the forward's derivative: central differences of the f64 loss along a few
/// weights' gradients (joint-attention projections of both streams, a q/k norm weight, the
/// last block's modulation) agree with the step's gradients.
#[test]
fn sd3_gradients_match_finite_differences() {
    let _one = one_at_a_time();
    gradients_match_finite_differences(
        spec(true),
        &[
            "transformer_blocks.1.attn.add_q_proj.weight",
            "transformer_blocks.0.attn.to_k.weight",
            "transformer_blocks.1.attn.norm_added_k.weight",
            "transformer_blocks.2.norm1_context.linear.weight",
            "transformer_blocks.0.ff_context.net.2.weight",
        ],
    );
}

/// SD3.5's dual-attention blocks (0 and 2 of 3: a stored one and the `context_pre_only` last):
/// the backward of attn2 (its projections, its q/k RMSNorm weights) and of the 9-chunk `norm1`
/// (its shift / scale / gate for attn2 included) is the forward's derivative.
#[test]
fn sd35_dual_attention_gradients_match_finite_differences() {
    let _one = one_at_a_time();
    let s = ditmem_engine::host::resolve(&tiny_dual_spec(3, 2, &[0, 2], 5, 6).unwrap());
    gradients_match_finite_differences(
        s,
        &[
            "transformer_blocks.0.attn2.to_q.weight",
            "transformer_blocks.0.attn2.norm_k.weight",
            "transformer_blocks.0.attn2.to_v.bias",
            "transformer_blocks.0.attn2.to_out.0.weight",
            "transformer_blocks.0.norm1.linear.weight",
            "transformer_blocks.2.attn2.to_k.weight",
            "transformer_blocks.2.norm1.linear.bias",
        ],
    );
}

/// The tiny dual-attention config has the real class's parameters: diffusers 0.42.1 builds
/// `SD3Transformer2DModel(sample_size=16, num_layers=3, attention_head_dim=16,
/// num_attention_heads=2, in_channels=16, out_channels=16, patch_size=2, joint_attention_dim=32,
/// caption_projection_dim=32, pooled_projection_dim=24, pos_embed_max_size=12,
/// dual_attention_layers=[0, 2], qk_norm="rms_norm")` on the meta device with 133,376
/// parameters (`sum(p.numel() for p in m.parameters())`, torch 2.15, measured 2026-12-06 with
/// bench/torch_peer/.venv).
#[test]
fn sd35_tiny_dual_parameters_are_the_diffusers_count() {
    let _one = one_at_a_time();
    let s = ditmem_engine::host::resolve(&tiny_dual_spec(3, 2, &[0, 2], 5, 6).unwrap());
    assert_eq!(trainable_count(&s).unwrap(), 133_376);
    // The engine builds it (a trainer's tensors are the same inventory).
    let t = Trainer::new(&s, TrainOptions::default()).unwrap();
    assert!(t
        .parameter("transformer_blocks.2.attn2.norm_k.weight")
        .is_ok());
}
