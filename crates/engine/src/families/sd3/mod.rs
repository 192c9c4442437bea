//! SD3 / SD3.5 (diffusers `SD3Transformer2DModel`) in the engine, on the generic family
//! schedule:
//!
//! - [`params`]: the geometry beyond [`crate::model::Dims`] (caption tokens and width, the
//!   pooled width, the position table's side) and the parameter inventory with diffusers' names,
//!   in the order of the budget's table (`ditmem_budget::denoiser::param_table`);
//! - [`block`]: the MMDiT `JointTransformerBlock` (AdaLayerNormZero on both streams, one
//!   softmax attention over the per-sample concatenation [image, context], gated residuals,
//!   GELU-tanh MLPs), its last `context_pre_only` variant, the optional q/k RMSNorm, and the
//!   output side (`norm_out` + `proj_out`); SD3.5's dual-attention (MMDiT-X) blocks add the
//!   image-only self-attention `attn2` ([`dual_attention`]).
//!
//! The caption (b × T × joint_attention_dim) and the pooled embedding (b ×
//! pooled_projection_dim) enter as cached synthetic inputs from the data seed, like the
//! latents: no text encoder weights.
//!
//! # Block composition (what one block allocates in forward)
//! `cd` compute dtype, `ad` accumulation dtype, E = b·s·D, C = b·T·D, N = E + C:
//! 1. `norm1.linear`, `norm1_context.linear` on SiLU(temb) (b, 6D cd each; b, 2D for the last
//!    block's context), each cast to `ad` (a copy under mixed precision), `narrow` views.
//! 2. LN + modulate on x (E cd) and on c (C cd).
//! 3. q, k, v of [image; context] (3 × N cd), each one [`crate::ops::joint_linear`] node
//!    (`to_q` ‖ `add_q_proj`, …; nothing else kept); where LoRA adapts one of the pair, or
//!    `qk_norm` puts per-head RMSNorms between (q and k: 2E + 2C cd, each keeping b·s·a / b·T·a
//!    rstd), the two linears (E + C cd) and `cat_tokens` instead, in the order q, k, v; attention
//!    (N cd, keeps P b·a·n² cd / the log-sum-exp b·a·n f32 / nothing).
//! 4. Image: `split_tokens` (E cd), `to_out.0` (E cd), x1 = x + ·gate (E ad), LN + modulate
//!    (E cd), `ff.net.0.proj` (4E cd), GELU (4E cd), `ff.net.2` (E cd), x2 (E ad). A
//!    dual-attention block adds, between x1 and norm2: LN + modulate on x with chunks 6, 7 of
//!    the 9 (E cd), `attn2.to_q/k/v` (3E cd; under `qk_norm` the normed q, k: 2E cd, each
//!    keeping b·s·a rstd), attention over the s image tokens (E cd, kept: its backward reads
//!    it), `attn2.to_out.0` (E cd), x1' = x1 + ·gate_msa2 (E ad).
//! 5. Context (not the last block): `split_tokens` (C cd), `to_add_out` (C cd), c1 (C ad), LN +
//!    modulate (C cd), `ff_context` (4C, 4C, C cd), c2 (C ad).

pub mod block;
pub mod params;
pub(crate) mod step;

pub use block::{
    dual_attention, dual_qk, final_forward, joint_qk, sd3_block_forward, silu_mlp, ContextOut,
    DualAttn, Sd3BlockWeights,
};
pub use params::{
    block_linears, param_shapes, Sd3Geom, DUAL_LINEARS, DUAL_QK_NORMS, QK_NORMS, SD3_FREQ,
};

use ditmem_spec::Spec;

use crate::error::Result;
use crate::families::tiny::{config_map, tiny_family_spec};
use crate::families::EngineFamily;
use crate::shapes::{Dims, ParamShape};

/// A tiny SD3 `config.json` (diffusers keys): `layers` joint blocks of `heads` × 16-wide heads,
/// 16 latent channels, patch 2, caption width 32, pooled width 24, a 12-wide position table,
/// no dual attention; `qk_norm` as SD3.5's.
pub(crate) fn tiny_config(
    layers: u32,
    heads: u32,
    qk_norm: bool,
) -> serde_json::Map<String, serde_json::Value> {
    tiny_config_dual(layers, heads, qk_norm, &[])
}

/// [`tiny_config`] with SD3.5's dual-attention blocks `dual` (`dual_attention_layers`).
pub(crate) fn tiny_config_dual(
    layers: u32,
    heads: u32,
    qk_norm: bool,
    dual: &[u32],
) -> serde_json::Map<String, serde_json::Value> {
    let hidden = 16 * heads;
    let qk = if qk_norm { r#""rms_norm""# } else { "null" };
    let dual = serde_json::to_string(dual).unwrap_or_else(|_| "[]".into());
    let text = format!(
        r#"{{"_class_name": "SD3Transformer2DModel", "sample_size": 16, "num_layers": {layers},
            "attention_head_dim": 16, "num_attention_heads": {heads}, "in_channels": 16,
            "out_channels": 16, "patch_size": 2, "joint_attention_dim": 32,
            "caption_projection_dim": {hidden}, "pooled_projection_dim": 24,
            "pos_embed_max_size": 12, "dual_attention_layers": {dual}, "qk_norm": {qk}}}"#
    );
    config_map(&text)
}

/// A tiny SD3 spec on [`Spec::small`]'s workload (128×128 images: 64 tokens, batch 4) with
/// `clip` + `t5` caption tokens, fp32, materialized attention, no EMA.
pub fn tiny_spec(layers: u32, heads: u32, qk_norm: bool, clip: u32, t5: u32) -> Result<Spec> {
    tiny_family_spec("sd3-tiny", tiny_config(layers, heads, qk_norm), &[clip, t5])
}

/// A tiny SD3.5 spec ([`tiny_spec`] with q/k RMSNorm) whose blocks `dual` are dual-attention
/// (MMDiT-X) blocks, as SD3.5-medium's `dual_attention_layers`.
pub fn tiny_dual_spec(layers: u32, heads: u32, dual: &[u32], clip: u32, t5: u32) -> Result<Spec> {
    tiny_family_spec(
        "sd3.5-tiny-dual",
        tiny_config_dual(layers, heads, true, dual),
        &[clip, t5],
    )
}

impl EngineFamily for Sd3Geom {
    fn out_channels(&self, _spec: &Spec) -> usize {
        self.out_channels
    }

    fn text_inputs(&self) -> (usize, usize, usize) {
        (self.text_tokens, self.text_width, self.pooled_width)
    }

    fn param_shapes(&self, _spec: &Spec, d: &Dims) -> Vec<ParamShape> {
        param_shapes(d, self)
    }
}
