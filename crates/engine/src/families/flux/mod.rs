//! FLUX.1 (diffusers `FluxTransformer2DModel`) in the engine, written as the DiT is:
//!
//! - [`params`]: the geometry beyond [`crate::model::Dims`] (T5 tokens and width, the pooled
//!   width, the RoPE axes, the two stacks) and the parameter inventory with diffusers' names, in
//!   the order of the budget's table (`ditmem_budget::denoiser::param_table`);
//! - [`block`]: the double-stream `FluxTransformerBlock`, the single-stream
//!   `FluxSingleTransformerBlock`, the join of the two streams, the output side (`norm_out` +
//!   `proj_out` on the image tokens) and the embedders' MLPs.
//!
//! Text embeddings (T5, (b·T, joint_attention_dim)) and the pooled CLIP embedding
//! (b, pooled_projection_dim) enter as cached synthetic inputs, like the latents; the latents are
//! packed 2×2 per token (the engine's patchify with patch 2: 4·C features, `x_embedder`'s
//! in_channels). The RoPE tables (`FluxPosEmbed` over text ids (0, 0, 0) and image ids
//! (0, row, column)) are made once per microbatch, untrained.
//!
//! # Block composition (what one block allocates in forward)
//! `cd` compute dtype, `ad` accumulation dtype, E = b·s·D (image), C = b·t·D (text), N = E + C:
//! - double: `norm1.linear`, `norm1_context.linear` on st (2 × b·6D cd, cast to ad under a
//!   low-precision compute dtype), LN + modulate of both streams (E + C cd, keeping their
//!   stats), the joint q and k before their norms (2N cd, each one [`crate::ops::joint_linear`];
//!   with LoRA on a q or k linear, that pair's two projections (N cd) and their
//!   [`crate::ops::tokens::concat`]), the joint v (N cd, a joint linear; with LoRA on a v linear
//!   both projections (N cd) and their concatenation), the q/k RMSNorms with RoPE on q and k
//!   (2N cd, one [`crate::ops::joint_norm_rope`] each), attention (N cd, keeps P
//!   (b·a·n²) / the lse / nothing), the text and image slices of its output (N cd), `to_out.0`
//!   and `to_add_out` (N cd), then per stream the gated residual, LN + modulate, the GELU-tanh
//!   FFN (4×, 4× and 1× the stream) and the second gated residual.
//! - single: `norm.linear` (b·3D), LN + modulate (N cd), q/k/v (3N), the RMSNorm and RoPE of
//!   q and of k (2N, one [`crate::ops::norm_rope`] each), attention (N), then `proj_mlp`, its GELU, [attention; MLP] and `proj_out` as
//!   one [`crate::ops::fused_mlp_side`] node (N cd, keeping `proj_mlp`'s output, 4N cd), the
//!   gated residual (N ad). With LoRA on `proj_mlp` or `proj_out`: `proj_mlp` and its GELU
//!   (2 × 4N cd) before q, [attention; MLP] (5N) and `proj_out` (N) composed.

pub mod block;
pub mod params;
pub(crate) mod step;

pub use block::{
    double_forward, final_forward, image_tokens, join_streams, mlp_silu, single_forward, unpack,
    DoubleWeights, FinalWeights, SingleWeights,
};
pub use params::{
    param_shapes, rope_ids, FluxGeom, DOUBLE_LINEARS, DOUBLE_NORMS, SINGLE_LINEARS, SINGLE_NORMS,
};

use ditmem_spec::Spec;

use crate::error::Result;
use crate::families::tiny::{config_map, tiny_family_spec};
use crate::families::EngineFamily;
use crate::shapes::{Dims, ParamShape};

/// A tiny Flux `config.json` (diffusers keys): `double` + `single` blocks of `heads` × 16-wide
/// heads (RoPE axes 4 + 6 + 6), 16 latent channels packed to 64, T5 width 32, pooled width 24,
/// guidance embedder on or off.
pub(crate) fn tiny_config(
    double: u32,
    single: u32,
    heads: u32,
    guidance: bool,
) -> serde_json::Map<String, serde_json::Value> {
    let text = format!(
        r#"{{"_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 64,
            "num_layers": {double}, "num_single_layers": {single}, "attention_head_dim": 16,
            "num_attention_heads": {heads}, "joint_attention_dim": 32,
            "pooled_projection_dim": 24, "guidance_embeds": {guidance},
            "axes_dims_rope": [4, 6, 6]}}"#
    );
    config_map(&text)
}

/// A tiny Flux spec on [`Spec::small`]'s workload (128×128 images: 16×16 latents packed to 64
/// tokens, batch 4) with `text_tokens` T5 tokens, fp32, materialized attention.
pub fn tiny_spec(
    double: u32,
    single: u32,
    heads: u32,
    text_tokens: u32,
    guidance: bool,
) -> Result<Spec> {
    tiny_family_spec(
        "flux-tiny",
        tiny_config(double, single, heads, guidance),
        &[77, text_tokens],
    )
}

impl EngineFamily for FluxGeom {
    /// Flux predicts the packed latent (out_channels = in_channels, checked).
    fn out_channels(&self, spec: &Spec) -> usize {
        spec.model.in_channels as usize
    }

    fn text_inputs(&self) -> (usize, usize, usize) {
        (self.text_tokens, self.text_width, self.pooled_width)
    }

    fn param_shapes(&self, _spec: &Spec, d: &Dims) -> Vec<ParamShape> {
        param_shapes(d, self)
    }
}
