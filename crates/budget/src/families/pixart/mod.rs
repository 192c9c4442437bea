//! PixArt-α / Σ: diffusers `PixArtTransformer2DModel` (`models/transformers/pixart_transformer_2d.py`):
//! adaLN-single (one shared timestep MLP and `Linear(D, 6D)` in `adaln_single`, a 6×D
//! `scale_shift_table` per block), self-attention, cross-attention to the projected T5 caption,
//! a GELU-tanh MLP, and a non-persistent sin-cos position table.

pub(crate) mod ditmem_cpu;
pub(crate) mod pytorch;

use serde::Serialize;

use super::config::{Cfg, MAX_DIM};
use super::defaults::TrainingDefaults;
use super::dit::{
    block_keys, check_hidden, check_inner, check_patch, common_keys, num_embeds_ada_norm,
};
use super::facts::FamilyFacts;
use super::family::{diffusers_f8, FamilyDims, Geometry, TextEncoder};
use super::modules::Attn;
use super::table::{Group, Table, TensorKind};
use crate::error::SpecError;

/// PixArt's training facts: FSDP wraps `BasicTransformerBlock`; diffusers has no fine-tune
/// script for the transformer.
pub(crate) const FACTS: FamilyFacts = FamilyFacts::without_script("BasicTransformerBlock");

/// `PixArtTransformer2DModel`'s config (defaults: the class's `__init__`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PixartDims {
    pub num_layers: u64,
    pub num_attention_heads: u64,
    pub attention_head_dim: u64,
    pub in_channels: u64,
    pub out_channels: u64,
    pub sample_size: u64,
    pub patch_size: u64,
    /// Width of the keys/values of cross-attention (the projected caption: the hidden size).
    pub cross_attention_dim: u64,
    /// Text-encoder width the caption projection reads (T5-XXL: 4096); None: no projection.
    pub caption_channels: Option<u64>,
    /// The resolution and aspect-ratio embedders of PixArt-α's multi-scale models (null in the
    /// config: on when sample_size is 128).
    pub use_additional_conditions: bool,
    pub attention_bias: bool,
}

impl PixartDims {
    pub fn inner(&self) -> u64 {
        self.num_attention_heads * self.attention_head_dim
    }
}

/// Read a `PixArtTransformer2DModel` config (or a `Transformer2DModel` one remapped to it).
pub(crate) fn from_config(cfg: &mut Cfg, legacy: bool) -> Result<PixartDims, SpecError> {
    let k = block_keys(cfg, "ada_norm_single", Some(8), 128)?;
    let cross = cfg.opt_int("cross_attention_dim", Some(1152), 1, MAX_DIM)?;
    let caption_channels = cfg.opt_int("caption_channels", None, 1, MAX_DIM)?;
    num_embeds_ada_norm(cfg, "ada_norm_single")?;
    let attention_bias = cfg.bool("attention_bias", true)?;
    let extra = cfg.opt_bool("use_additional_conditions", None)?;
    // pixart_transformer_2d.py: `if use_additional_conditions is None: = sample_size == 128`.
    let use_additional_conditions = extra.unwrap_or(k.sample_size == 128);
    cfg.choice("attention_type", Some("default"), &[Some("default")], "")?;
    // Scales the sin-cos table's positions, not its shape.
    cfg.number("interpolation_scale", None, 1e-6, 1e6, true)?;
    common_keys(cfg, legacy.then_some(true))?;
    let d = PixartDims {
        num_layers: k.num_layers,
        num_attention_heads: k.heads,
        attention_head_dim: k.head_dim,
        in_channels: k.in_channels,
        out_channels: k.out_channels,
        sample_size: k.sample_size,
        patch_size: k.patch_size,
        cross_attention_dim: cross.ok_or_else(|| {
            SpecError::invalid(
                "cross_attention_dim",
                "null (PixArt without cross-attention) is not modelled; allowed: the hidden size",
            )
        })?,
        caption_channels,
        use_additional_conditions,
        attention_bias,
    };
    check_inner(d.inner())?;
    check_patch(k.sample_size, k.patch_size)?;
    if caption_channels.is_some() {
        let why = "that the caption projection gives";
        check_hidden("cross_attention_dim", d.cross_attention_dim, d.inner(), why)?;
    }
    if use_additional_conditions && d.inner() < 3 {
        return Err(SpecError::invalid(
            "use_additional_conditions",
            "needs a hidden size of at least 3 (the size embedders are hidden / 3 wide)",
        ));
    }
    Ok(d)
}

impl FamilyDims for PixartDims {
    /// diffusers `PixArtTransformer2DModel.__init__`, in registration order.
    fn table(&self, t: &mut Table) {
        let d = self;
        let dim = d.inner();
        let p = d.patch_size;
        t.push(
            "scale_shift_table".into(),
            vec![2, dim],
            Group::FinalLayer,
            None,
        );
        t.patch_embed("pos_embed", d.in_channels, dim, p);
        for i in 0..d.num_layers as u32 {
            let b = format!("transformer_blocks.{i}");
            let (g, blk) = (Group::Blocks, Some(i));
            t.push(format!("{b}.scale_shift_table"), vec![6, dim], g, blk);
            let attn1 = Attn::self_attn(dim, d.attention_bias);
            t.attention(&format!("{b}.attn1"), attn1, g, blk);
            let attn2 = Attn {
                kv_dim: d.cross_attention_dim,
                ..attn1
            };
            t.attention(&format!("{b}.attn2"), attn2, g, blk);
            t.feed_forward(&format!("{b}.ff"), dim, 4 * dim, g, blk);
        }
        t.top_linear("proj_out", p * p * d.out_channels, dim, Group::FinalLayer);
        // AdaLayerNormSingle: PixArtAlphaCombinedTimestepSizeEmbeddings (size embedders dim / 3 wide).
        t.ada_layer_norm_single("adaln_single", dim, d.use_additional_conditions);
        if let Some(c) = d.caption_channels {
            // PixArtAlphaTextProjection(caption_channels, dim): linear_1, GELU-tanh, linear_2.
            t.pixart_alpha_text_projection("caption_projection", c, dim);
        }
        let side = d.sample_size / p;
        t.patch_embed_pos_embed("pos_embed", side, dim, TensorKind::BufferNonPersistent);
    }

    /// SD VAE f8c4; T5-XXL at 120 tokens (α; Σ: 300), told by name: a preset's, or the path of
    /// a --model config.json (a Hub snapshot's path names the checkpoint,
    /// "PixArt-Sigma-XL-2-1024-MS").
    fn geometry(&self, name: &str) -> Geometry {
        let d = self;
        let sigma = name.to_ascii_lowercase().contains("sigma");
        let t5 = TextEncoder::t5(
            if sigma { 300 } else { 120 },
            d.caption_channels.unwrap_or(d.cross_attention_dim),
        );
        let dims = [
            d.num_layers,
            d.inner(),
            d.num_attention_heads,
            d.patch_size,
            d.in_channels,
        ];
        diffusers_f8(dims, vec![t5])
    }

    /// PixArtAlphaPipeline / PixArtSigmaPipeline's default: `sample_size` × the VAE's 8, per
    /// checkpoint (the 1024 checkpoints: 128 → 1024²; the 512 ones: 64 → 512²).
    fn training_defaults(&self) -> Option<TrainingDefaults> {
        Some(TrainingDefaults::from_sample_size(
            self.sample_size,
            self.patch_size,
            8,
        ))
    }

    fn layers(&self) -> u64 {
        self.num_layers
    }

    fn keep_blocks(&mut self, counts: &[u64]) {
        self.num_layers = counts[0];
    }
}
