//! The geometry of diffusers' `DiTTransformer2DModel` beyond [`Dims`] and its parameter
//! inventory, named and ordered as diffusers registers them (the budget's table,
//! `ditmem_budget::denoiser::param_table`): `pos_embed.proj`, then per block `norm1.emb`
//! (`timestep_embedder.linear_1`, `linear_2`, `class_embedder.embedding_table`), `norm1.linear`,
//! `attn1.to_q`, `to_k`, `to_v`, `to_out.0`, `ff.net.0.proj`, `ff.net.2`, then `proj_out_1`,
//! `proj_out_2` and the frozen position table.
//!
//! Initialisation (drawn in f64 from the seed and the name, as for the DiT): attention and
//! feed-forward linears and the patch embedding xavier-uniform with zero biases; the timestep
//! MLPs, the label tables, `norm1.linear` and the output side normal(0, 0.02) (diffusers
//! zero-initialises nothing here, the original DiT zero-initialises adaLN: normal(0, 0.02)
//! keeps every gradient non-zero for `verify`); the sin-cos table of the token grid (frozen;
//! diffusers' non-persistent `pos_embed.pos_embed` buffer, which the parameter count leaves out).

use ditmem_budget::{DitDiffusersDims, Spec};

use crate::error::{EngineError, Result};
use crate::families::config::{biased_qkv, no_dropout, patch_conv};
use crate::families::lora::{adapt, LoraPlan};
use crate::shapes::{Dims, Init, Inventory, ParamShape};

/// Width of `CombinedTimestepLabelEmbeddings.time_proj` (`Timesteps(256)`).
pub const DITD_FREQ: usize = 256;

/// The linears of a block after its embedder, in forward order (diffusers names).
pub const DITD_BLOCK_LINEARS: [&str; 7] = [
    "norm1.linear",
    "attn1.to_q",
    "attn1.to_k",
    "attn1.to_v",
    "attn1.to_out.0",
    "ff.net.0.proj",
    "ff.net.2",
];

/// The two linears of a block's `CombinedTimestepLabelEmbeddings` (`norm1.emb`).
pub const DITD_EMB_LINEARS: [&str; 2] = [
    "norm1.emb.timestep_embedder.linear_1",
    "norm1.emb.timestep_embedder.linear_2",
];

/// The label table of a block's embedder.
pub const DITD_LABEL_TABLE: &str = "norm1.emb.class_embedder.embedding_table.weight";

/// What a `DiTTransformer2DModel` step needs beyond [`Dims`].
#[derive(Debug, Clone, PartialEq)]
pub struct DitdGeom {
    /// `out_channels` of the config (8 with the learned variance; the loss reads the first
    /// `in_channels`).
    pub out_channels: usize,
    /// `num_embeds_ada_norm`: the classes; every label table has one more row (the null class
    /// of `LabelEmbedding`'s dropout, `class_dropout_prob=0.1` hard-coded).
    pub classes: usize,
    /// LoRA's rank and the modules it adapts ([`LoraPlan`]); None trains the full model.
    pub lora: Option<LoraPlan>,
    /// Epsilon of the feed-forward's LayerNorm (`norm3 = nn.LayerNorm(dim, norm_eps)`, the
    /// config's `norm_eps`, class default 1e-5); `AdaLayerNormZero.norm` and `norm_out` use
    /// 1e-6 (diffusers `normalization.py`, `dit_transformer_2d.py`).
    pub norm_eps: f64,
}

impl DitdGeom {
    /// Checks what the engine runs of a `DiTTransformer2DModel` config and reads its geometry.
    pub fn new(spec: &Spec, d: &DitDiffusersDims) -> Result<DitdGeom> {
        biased_qkv(d.attention_bias, "diffusers DiT")?;
        no_dropout(spec, "a DiTTransformer2DModel", "the diffusers DiT")?;
        let lora = LoraPlan::of(spec);
        if let Some(plan) = &lora {
            // Block 0's embedder also feeds the output side, so the engine runs it in the
            // embed segment too; an adapter there would train the embed (the budget's replay
            // keeps a LoRA'd model's embed frozen).
            if let Some(m) = DITD_EMB_LINEARS
                .iter()
                .find(|m| plan.adapts(&format!("transformer_blocks.0.{m}")))
            {
                return Err(EngineError::unsupported(
                    format!("recipe.lora.modules adapting {m}"),
                    "the engine adapts the diffusers DiT's attention, feed-forward and norm1.linear; \
                     leave the timestep embedders out",
                ));
            }
        }
        Ok(DitdGeom {
            out_channels: d.out_channels as usize,
            classes: d.num_embeds_ada_norm as usize,
            lora,
            norm_eps: spec
                .model
                .diffusers
                .as_ref()
                .and_then(|m| m.get("norm_eps"))
                .and_then(serde_json::Value::as_f64)
                .unwrap_or(1e-5),
        })
    }
}

/// Every tensor of the `DiTTransformer2DModel` of `spec`, in the budget's table order, then the
/// frozen position table.
pub fn param_shapes(d: &Dims, g: &DitdGeom) -> Vec<ParamShape> {
    let h = d.hidden;
    let small = Init::Normal(0.02);
    let mut inv = Inventory::default();
    patch_conv(&mut inv, "pos_embed.proj", d, &[d.patch, d.patch]);
    for i in 0..d.depth {
        let b = format!("transformer_blocks.{i}");
        let [l1, l2] = DITD_EMB_LINEARS;
        inv.linear(&format!("{b}.{l1}"), h, DITD_FREQ, small);
        inv.linear(&format!("{b}.{l2}"), h, h, small);
        inv.tensor(
            format!("{b}.{DITD_LABEL_TABLE}"),
            vec![g.classes + 1, h],
            small,
        );
        for name in DITD_BLOCK_LINEARS {
            let (out, inp, init) = match name {
                "norm1.linear" => (6 * h, h, small),
                "ff.net.0.proj" => (d.mlp_hidden, h, Init::XavierUniform),
                "ff.net.2" => (h, d.mlp_hidden, Init::XavierUniform),
                _ => (h, h, Init::XavierUniform),
            };
            inv.linear(&format!("{b}.{name}"), out, inp, init);
        }
    }
    inv.linear("proj_out_1", 2 * h, h, small);
    let out = d.patch * d.patch * g.out_channels;
    inv.linear("proj_out_2", out, h, small);
    inv.sincos_table("pos_embed.pos_embed", (d.rows, d.cols), h);
    adapt(inv.shapes, g.lora.as_ref())
}
