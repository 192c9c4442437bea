//! diffusers' DiT (`DiTTransformer2DModel`, `models/transformers/dit_transformer_2d.py`) in the
//! engine, written as the other families are:
//!
//! - [`params`]: the geometry beyond [`crate::model::Dims`] (learned-sigma output channels, the
//!   classes) and the parameter inventory with diffusers' names, in the order of the budget's
//!   table (`ditmem_budget::denoiser::param_table`), so counts match `ditmem params`;
//! - [`block`]: the `BasicTransformerBlock` with `norm_type="ada_norm_zero"` (`attention.py`):
//!   an `AdaLayerNormZero` holding its own `CombinedTimestepLabelEmbeddings` (timestep MLP +
//!   label table) in every block, self-attention over separate q, k, v, the GELU-tanh
//!   feed-forward; and the output side (`proj_out_1` on SiLU of block 0's embedding,
//!   `norm_out` + modulate, `proj_out_2`).
//!
//! What sets it apart from the original DiT ([`crate::model`], [`crate::layers`]): no shared
//! `t_embedder` / `y_embedder` — every block embeds the timestep and the label itself (749.8 M
//! parameters for XL/2 against 675.1 M), q, k, v are three linears, and the output side reads
//! block 0's embedder again (`self.transformer_blocks[0].norm1.emb(...)`).
//!
//! The step (`families/dit_diffusers/step.rs`): the embed segment runs the patch embedding, makes the
//! timestep features (`Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=1)`) and the
//! label rows, and evaluates block 0's embedder once more for the output side (its SiLU in the
//! compute dtype is the one conditioning leaf); the features and the label rows reach every
//! block as fixed tables. Block 0's embedder parameters get their gradient from block 0 and,
//! summed into it, from the embed's backward — diffusers' two uses of the same module.
//! The class labels are the batch's (label dropout: the batch's flag for every block, where
//! diffusers' `LabelEmbedding.token_drop` draws once per block; a family spec has one class and
//! no dropout, so every row read is row 0).
//!
//! # Block composition (what one block allocates in forward)
//! `cd` compute dtype, `ad` accumulation dtype, E = b·s·D:
//! 1. Embedder: `linear_1` (b·D cd), SiLU (b·D cd), `linear_2` (b·D cd) cast to `ad`; the label
//!    rows (b·D in the table's dtype) cast to `ad`; their sum (b·D ad).
//! 2. SiLU(emb) (b·D ad) cast to `cd`; `norm1.linear` (6·b·D cd) cast to `ad`; six views.
//! 3. LN1 + modulate fused (E cd, keeps 2·b·s stats); `to_q`, `to_k`, `to_v` (3 × E cd);
//!    attention over separate q, k, v (E cd; keeps P / the log-sum-exp / nothing);
//!    `to_out.0` (E cd); x1 = x + out·gate_msa fused (E ad).
//! 4. LN2 + modulate (E cd); `ff.net.0.proj` (4E cd); GELU-tanh (4E cd); `ff.net.2` (E cd);
//!    x2 = x1 + out·gate_mlp (E ad).

pub mod block;
pub mod params;
pub(crate) mod step;

pub use block::{
    combined_embedding, ditd_block_forward, final_forward, label_timestep_features,
    DitdBlockWeights, EmbWeights,
};
pub use params::{
    param_shapes, DitdGeom, DITD_BLOCK_LINEARS, DITD_EMB_LINEARS, DITD_FREQ, DITD_LABEL_TABLE,
};

use ditmem_spec::Spec;

use crate::error::Result;
use crate::families::tiny::{config_map, tiny_family_spec};
use crate::families::EngineFamily;
use crate::shapes::{Dims, ParamShape};

/// A tiny `DiTTransformer2DModel` `config.json` (diffusers keys): `layers` blocks of `heads` ×
/// 16-wide heads, 4 latent channels, a learned variance (8 out), patch 2, 1000 classes.
pub fn tiny_config(layers: u32, heads: u32) -> serde_json::Map<String, serde_json::Value> {
    let text = format!(
        r#"{{"_class_name": "DiTTransformer2DModel", "sample_size": 16, "num_layers": {layers},
            "attention_head_dim": 16, "num_attention_heads": {heads}, "in_channels": 4,
            "out_channels": 8, "patch_size": 2, "attention_bias": true,
            "activation_fn": "gelu-approximate", "num_embeds_ada_norm": 1000,
            "norm_type": "ada_norm_zero", "norm_elementwise_affine": false, "norm_eps": 1e-5}}"#
    );
    config_map(&text)
}

/// A tiny diffusers DiT spec on [`Spec::small`]'s workload (128×128 images: 64 tokens, batch
/// 4), fp32, materialized attention, no EMA.
pub fn tiny_spec(layers: u32, heads: u32) -> Result<Spec> {
    tiny_family_spec("dit-diffusers-tiny", tiny_config(layers, heads), &[])
}

impl EngineFamily for DitdGeom {
    fn out_channels(&self, _spec: &Spec) -> usize {
        self.out_channels
    }

    fn param_shapes(&self, _spec: &Spec, d: &Dims) -> Vec<ParamShape> {
        param_shapes(d, self)
    }

    fn softmax_key_biases(&self) -> &'static [&'static str] {
        &["attn1.to_k.bias"]
    }
}
