//! Wan 2.1 text-to-video (diffusers `WanTransformer3DModel`) in the engine, written as PixArt
//! is:
//!
//! - [`params`]: the geometry beyond [`crate::model::Dims`] (latent frames, umT5 tokens and
//!   width, FFN width, RoPE) and the parameter inventory with diffusers' names, in the order of
//!   the budget's table, so counts match `ditmem params`;
//! - [`block`]: the `WanTransformerBlock` (per-block `scale_shift_table` added to the shared
//!   (b, 6D) `time_proj`, self-attention with q/k RMSNorm across heads and 3-D RoPE,
//!   cross-attention to the projected text after an affine LayerNorm, GELU-tanh FFN), the text
//!   projection, the output side and the 3-D patchify.
//!
//! The step (embed, blocks stored or recomputed, final layer, backward) is the family schedule
//! (`trainer/family.rs`, `families/wan/step.rs`). Latents are video, (b, C, F', H, W) with F' =
//! (frames − 1)/4 + 1; the umT5 states enter as cached synthetic inputs (b × T × text_dim).
//! The objective is the engine's (DDPM ε or v), not Wan's flow matching: the step's memory is
//! the same.
//!
//! Differences from diffusers kept on purpose: the residual stream and modulation run in the
//! accumulation dtype and every norm is a fused op with its own backward (as for PixArt);
//! diffusers' float32 residual casts are what `ad` already is under mixed precision. The RoPE
//! tables are made per step from the angles (what diffusers slices out of its
//! `rope.freqs_cos` / `freqs_sin` buffers, which the engine holds too, for the count).
//!
//! # Block composition (what one block allocates in forward)
//! E = b·s·D, C = b·T·D (T text tokens):
//! 1. `t6 + scale_shift_table` (b, 6D) ad, six `narrow` views.
//! 2. norm1 + modulate fused (E cd); `to_q`, `to_k`, `to_v` (3 × E cd); RMSNorm of q and k
//!    (2 × E cd, each keeping b·s rstd); RoPE of both (2 × E cd); attention over separate q, k,
//!    v (E cd, keeps P / lse / nothing); `to_out.0` (E cd); x1 = x + out·gate_msa (E ad).
//! 3. norm2: `weight − 1` (D ad), then LN + affine fused (E cd, keeps 2·b·s stats) — or a cast
//!    copy of x1 without `cross_attn_norm`; `to_q` (E cd), `to_k`, `to_v` on the text (2 × C
//!    cd); RMSNorm of q and k (E + C cd); attention (E cd); `to_out.0` (E cd);
//!    x2 = x1 + out (E ad, gate of ones).
//! 4. norm3 + modulate (E cd); `ffn.net.0.proj` (b·s·ffn cd); GELU-tanh (same); `ffn.net.2`
//!    (E cd); x3 = x2 + out·c_gate (E ad).

pub mod block;
pub mod params;
pub(crate) mod step;

pub use block::{
    final_forward, patchify3d, text_forward, unpatchify3d, wan_block_forward, wan_block_qk,
    WanBlockWeights, WanConds, WanFinalWeights,
};
pub use params::{param_shapes, rope_tables, WanGeom, WAN_BLOCK_LINEARS, WAN_BLOCK_NORMS};

use ditmem_spec::Spec;

use crate::error::Result;
use crate::families::tiny::{config_map, tiny_family_spec};
use crate::families::EngineFamily;
use crate::shapes::{Dims, ParamShape};

/// A tiny Wan `config.json` (diffusers keys): `layers` blocks of `heads` × 16-wide heads,
/// 16 latent channels, patch (1, 2, 2), umT5 width 32, FFN 2·D, `cross_attn_norm`.
pub(crate) fn tiny_config(layers: u32, heads: u32) -> serde_json::Map<String, serde_json::Value> {
    let ffn = 32 * heads;
    let text = format!(
        r#"{{"_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2],
            "num_attention_heads": {heads}, "attention_head_dim": 16, "in_channels": 16,
            "out_channels": 16, "text_dim": 32, "freq_dim": 64, "ffn_dim": {ffn},
            "num_layers": {layers}, "cross_attn_norm": true,
            "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": null,
            "added_kv_proj_dim": null, "rope_max_seq_len": 64}}"#
    );
    config_map(&text)
}

/// A tiny Wan spec on [`Spec::small`]'s workload at 32×48 pixels (4×6 latents, 2×3 tokens a
/// frame) with `frames` video frames (5: 2 latent frames, 9: 3) and `text_tokens` umT5
/// tokens, fp32, materialized attention, no EMA.
pub fn tiny_spec(layers: u32, heads: u32, frames: u32, text_tokens: u32) -> Result<Spec> {
    let mut s = tiny_family_spec("wan-tiny", tiny_config(layers, heads), &[text_tokens])?;
    s.workload.height = 32;
    s.workload.width = 48;
    s.workload.frames = frames;
    Ok(s)
}

impl EngineFamily for WanGeom {
    fn out_channels(&self, _spec: &Spec) -> usize {
        self.out_channels
    }

    fn frames(&self) -> usize {
        self.frames
    }

    fn mlp_hidden(&self) -> Option<usize> {
        Some(self.ffn)
    }

    fn text_inputs(&self) -> (usize, usize, usize) {
        (self.text_tokens, self.text_dim, 0)
    }

    fn param_shapes(&self, _spec: &Spec, d: &Dims) -> Vec<ParamShape> {
        param_shapes(d, self)
    }
}
