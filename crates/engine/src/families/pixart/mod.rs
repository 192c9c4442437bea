//! PixArt-α / Σ (diffusers `PixArtTransformer2DModel`) in the engine, written as the DiT is:
//!
//! - [`params`]: the geometry beyond [`crate::model::Dims`] (caption tokens and width) and the
//!   parameter inventory with diffusers' names, in the order of the budget's table
//!   (`ditmem_budget::denoiser::param_table`), so counts match `ditmem params`;
//! - [`block`]: the `BasicTransformerBlock` with `norm_type="ada_norm_single"` (per-block
//!   `scale_shift_table` added to the shared (b, 6D) timestep modulation, self-attention,
//!   cross-attention to the projected caption, GELU-tanh MLP), the caption projection and the
//!   output side (`norm_out` + the final `scale_shift_table` + `proj_out`).
//!
//! The step itself (embed, blocks stored or recomputed, final layer, backward) is the trainer's
//! (`families/pixart/step.rs`). Text embeddings enter as cached synthetic inputs (batch × T ×
//! caption_channels, from the data seed), like the latents: no text encoder weights.
//!
//! # Block composition (what one block allocates in forward)
//! `cd` compute dtype, `ad` accumulation dtype, E = b·s·D, C = b·T·D (T caption tokens):
//! 1. `t6 + scale_shift_table` (b, 6D) ad (the table's (1, 6D) view broadcast), six `narrow`
//!    views.
//! 2. LN1 + modulate fused (E cd, keeps 2·b·s stats); `to_q`, `to_k`, `to_v` fused linears
//!    (3 × E cd); attention over separate q, k, v ([`crate::ops::attention::separate`]): output
//!    E cd, keeps P (b·a·s² cd) / the log-sum-exp (b·a·s f32) / nothing; `to_out.0` (E cd);
//!    x1 = x + out·gate_msa fused (E ad).
//! 3. Cross-attention: q input x1 in cd (a cast copy E cd under a low-precision compute dtype,
//!    else a reshape view); `to_q` (E cd), `to_k`, `to_v` on the caption (2 × C cd); attention
//!    (E cd, keeps P (b·a·s·T cd) / lse (b·a·s f32) / nothing); `to_out.0` (E cd);
//!    x2 = x1 + out fused with a (b, D) gate of ones (E ad; the ones are a constant).
//! 4. LN2 + modulate (E cd); `ff.net.0.proj` (4E cd); GELU-tanh (4E cd); `ff.net.2` (E cd);
//!    x3 = x2 + out·gate_mlp (E ad).

pub mod block;
pub mod params;
pub(crate) mod step;

pub use block::{
    caption_forward, final_forward, pixart_block_forward, CaptionWeights, PixartBlockWeights,
    PixartFinalWeights,
};
pub use params::{param_shapes, PixartGeom, PIXART_BLOCK_LINEARS};

use ditmem_spec::Spec;

use crate::error::Result;
use crate::families::tiny::{config_map, tiny_family_spec};
use crate::families::EngineFamily;
use crate::shapes::{Dims, ParamShape};

/// A tiny PixArt `config.json` (diffusers keys): `layers` blocks of `heads` × 16-wide heads,
/// 4 latent channels, a learned variance (8 out), patch 2, caption channels 32, no size
/// embedders.
pub fn tiny_config(layers: u32, heads: u32) -> serde_json::Map<String, serde_json::Value> {
    let hidden = 16 * heads;
    let text = format!(
        r#"{{"_class_name": "PixArtTransformer2DModel", "sample_size": 16, "num_layers": {layers},
            "attention_head_dim": 16, "num_attention_heads": {heads}, "in_channels": 4,
            "out_channels": 8, "patch_size": 2, "attention_bias": true,
            "cross_attention_dim": {hidden}, "activation_fn": "gelu-approximate",
            "num_embeds_ada_norm": 1000, "norm_type": "ada_norm_single",
            "norm_elementwise_affine": false, "norm_eps": 1e-6, "caption_channels": 32,
            "use_additional_conditions": false}}"#
    );
    config_map(&text)
}

/// A tiny PixArt spec on [`Spec::small`]'s workload (128×128 images: 64 tokens, batch 4) with
/// `text_tokens` caption tokens, fp32, materialized attention, no EMA.
pub fn tiny_spec(layers: u32, heads: u32, text_tokens: u32) -> Result<Spec> {
    tiny_family_spec("pixart-tiny", tiny_config(layers, heads), &[text_tokens])
}

impl EngineFamily for PixartGeom {
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
        &["attn1.to_k.bias", "attn2.to_k.bias"]
    }
}
