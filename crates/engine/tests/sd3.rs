//! SD3 in the engine: the backward is the
//! forward's derivative (finite differences). What every family shares (the parameter table,
//! the levers, equal gradients across recompute and attention modes, the agreement grid) is in
//! `families.rs`.

use ditmem_budget::Spec;
use ditmem_engine::families::sd3::{tiny_dual_spec, tiny_spec};
use ditmem_engine::{trainable_count, CountingAlloc, TrainOptions, Trainer};

#[global_allocator]
static A: CountingAlloc = CountingAlloc::new();

mod common;
use common::{gradients_match_finite_differences, one_at_a_time};

fn spec(qk_norm: bool) -> Spec {
    ditmem_engine::host::resolve(&tiny_spec(3, 2, qk_norm, 5, 6).unwrap())
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
