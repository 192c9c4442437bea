//! Sana (diffusers `SanaTransformer2DModel`) in the engine, written as PixArt is:
//!
//! - [`params`]: the geometry beyond [`crate::model::Dims`] (caption tokens and width, the
//!   cross-attention's heads, the Mix-FFN width) and the parameter inventory with diffusers'
//!   names, in the order of the budget's table, so counts match `ditmem params`;
//! - [`block`]: the `SanaTransformerBlock` (per-block `scale_shift_table` added to the shared
//!   (b, 6D) timestep modulation, ReLU linear self-attention, softmax cross-attention to the
//!   normed caption with its own head count, the GLUMBConv Mix-FFN), the caption projection with
//!   its RMSNorm and the output side (`norm_out` + the final `scale_shift_table` + `proj_out`).
//!
//! Text embeddings enter as cached synthetic inputs (batch × T × caption_channels, from the
//! data seed), like the latents: no Gemma weights. The step uses the engine's noising and
//! target (as for the DiT and PixArt), not diffusers' flow matching: the tensors are the same.
//!
//! # Block composition (what one block allocates in forward)
//! `cd` compute dtype, `ad` accumulation dtype, E = b·s·D, C = b·T·D_c (T caption tokens,
//! D_c the cross-attention width), F = b·s·H (H the Mix-FFN width):
//! 1. `t6 + scale_shift_table` (b, 6D) ad, six `narrow` views.
//! 2. LN1 + modulate fused (E cd, keeps 2·b·s stats); a zero bias (D) when attn1's q/k/v or
//!    `conv_point` has none; `to_q`, `to_k`, `to_v` (3 × E cd); linear attention
//!    ([`crate::ops::linear_attention`]: E cd, keeps nothing); `to_out.0` (E cd);
//!    x1 = x + out·gate_msa fused (E ad).
//! 3. Cross-attention: q input x1 in cd (a cast copy under a low-precision compute dtype, else a
//!    view); `to_q` (b·s·D_c cd), `to_k`, `to_v` on the caption (2 × C cd); separate attention
//!    (b·s·D_c cd, keeps P / lse / nothing); `to_out.0` (E cd); x2 = x1 + out with a (b, D)
//!    gate of ones (E ad).
//! 4. LN2 + modulate (E cd); the Mix-FFN as one node ([`crate::ops::mix_ffn()`]: E cd, keeps
//!    `conv_inverted`'s output, 2F cd, and nothing else); without it (LoRA on `conv_inverted`
//!    or `conv_point`) `conv_inverted` (2F cd), SiLU + depthwise conv fused (2F cd, keeps
//!    nothing beyond its input), GLU gate (F cd) and `conv_point` (E cd); x3 = x2 +
//!    out·gate_mlp (E ad).

pub mod block;
pub mod params;
pub(crate) mod step;

pub(crate) use block::zero_bias;
pub use block::{
    caption_forward, final_forward, sana_block_forward, SanaBlockGeom, SanaBlockWeights,
    SanaCaptionWeights, SanaFinalWeights,
};
pub use params::{param_shapes, SanaGeom, SANA_BLOCK_LINEARS, SANA_FREQ};

use ditmem_spec::Spec;

use crate::error::Result;
use crate::families::tiny::{config_map, tiny_family_spec};
use crate::families::EngineFamily;
use crate::shapes::{Dims, ParamShape};

/// A tiny Sana `config.json` (diffusers keys): `layers` blocks of `heads` × 16-wide heads
/// (Sana's are 32 wide), cross-attention of `heads / 2` × 32-wide heads (the same width),
/// 8 latent channels (the DC-AE's 32 in Sana), patch 1, caption channels 48, mlp_ratio 2.5, no
/// attention bias.
pub fn tiny_config(layers: u32, heads: u32) -> serde_json::Map<String, serde_json::Value> {
    let hidden = 16 * heads;
    let cross_heads = (heads / 2).max(1);
    let cross_hd = hidden / cross_heads;
    let text = format!(
        r#"{{"_class_name": "SanaTransformer2DModel", "sample_size": 8, "num_layers": {layers},
            "attention_head_dim": 16, "num_attention_heads": {heads}, "in_channels": 8,
            "out_channels": 8, "patch_size": 1, "attention_bias": false,
            "num_cross_attention_heads": {cross_heads}, "cross_attention_head_dim": {cross_hd},
            "cross_attention_dim": {hidden}, "caption_channels": 48, "mlp_ratio": 2.5,
            "norm_elementwise_affine": false, "norm_eps": 1e-6, "interpolation_scale": null}}"#
    );
    config_map(&text)
}

/// A tiny Sana spec on [`Spec::small`]'s workload at 256×256 (the DC-AE's factor 32: an 8×8
/// latent, 64 tokens; batch 4) with `text_tokens` caption tokens, fp32, materialized
/// cross-attention, no EMA.
pub fn tiny_spec(layers: u32, heads: u32, text_tokens: u32) -> Result<Spec> {
    let mut s = tiny_family_spec("sana-tiny", tiny_config(layers, heads), &[text_tokens])?;
    s.workload.height = 256;
    s.workload.width = 256;
    Ok(s)
}

impl EngineFamily for SanaGeom {
    fn out_channels(&self, _spec: &Spec) -> usize {
        self.out_channels
    }

    fn text_inputs(&self) -> (usize, usize, usize) {
        (self.text_tokens, self.text_width, 0)
    }

    fn param_shapes(&self, _spec: &Spec, d: &Dims) -> Vec<ParamShape> {
        param_shapes(d, self)
    }

    fn softmax_key_biases(&self) -> &'static [&'static str] {
        &["attn2.to_k.bias"]
    }
}
