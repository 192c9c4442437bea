//! PixArt's geometry beyond [`Dims`] and its parameter inventory, named and ordered as diffusers
//! registers them (the budget's table, `ditmem_budget::denoiser::param_table`).
//!
//! Initialisation (drawn in f64 from the seed and the name, as for the DiT): linears
//! xavier-uniform with zero biases; the timestep MLP and `adaln_single.linear` normal(0, 0.02);
//! every `scale_shift_table` randn / √D (diffusers' init); the sin-cos table of the token grid
//! (frozen; diffusers' non-persistent `pos_embed.pos_embed` buffer, which the parameter count
//! leaves out).

use ditmem_budget::{PixartDims, Spec};

use crate::error::Result;
use crate::families::config::{biased_qkv, caption_tokens, no_dropout, patch_conv};
use crate::families::cross::self_cross_block_linears;
use crate::families::lora::{adapt, LoraPlan};
use crate::shapes::{Dims, Init, Inventory, ParamShape};

/// Width of diffusers' `Timesteps(256)` sinusoid.
pub const PIXART_FREQ: usize = 256;

/// The linears of a PixArt block in forward order (diffusers names).
pub const PIXART_BLOCK_LINEARS: [&str; 10] =
    self_cross_block_linears(["ff.net.0.proj", "ff.net.2"]);

/// What a PixArt step needs beyond [`Dims`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PixartGeom {
    /// Caption tokens T (`workload.text_tokens`, else the family's default).
    pub text_tokens: usize,
    /// Width of the cached text embeddings (`caption_channels`, or the hidden size when the
    /// model has no caption projection).
    pub text_width: usize,
    /// Whether the model projects the caption (`caption_channels` set).
    pub caption_projection: bool,
    /// `out_channels` of the config (8 with a learned variance).
    pub out_channels: usize,
    /// LoRA's rank and the modules it adapts ([`LoraPlan`]); None trains the full model.
    pub lora: Option<LoraPlan>,
    /// PixArt-α's additional conditions (`use_additional_conditions`, on with sample_size 128):
    /// the image's (height, width) in pixels, whose sinusoids the resolution embedder reads,
    /// and height / width for the aspect-ratio embedder (diffusers
    /// `PixArtAlphaCombinedTimestepSizeEmbeddings`; the training scripts pass the batch's
    /// resolution). None without them.
    pub sizes: Option<(u32, u32)>,
}

impl PixartGeom {
    /// Checks what the engine runs of a PixArt config and reads its geometry.
    pub fn new(spec: &Spec, d: &PixartDims) -> Result<PixartGeom> {
        biased_qkv(d.attention_bias, "PixArt")?;
        no_dropout(spec, "a PixArt model", "PixArt")?;
        let t = caption_tokens(spec, "T5")?;
        let hidden = d.inner() as usize;
        Ok(PixartGeom {
            text_tokens: t,
            text_width: d.caption_channels.map_or(hidden, |c| c as usize),
            caption_projection: d.caption_channels.is_some(),
            out_channels: d.out_channels as usize,
            lora: LoraPlan::of(spec),
            sizes: d
                .use_additional_conditions
                .then_some((spec.workload.height, spec.workload.width)),
        })
    }
}

/// PixArt-α's additional-condition embedders, in the table's order.
pub const SIZE_EMBEDDERS: [&str; 2] = ["resolution_embedder", "aspect_ratio_embedder"];

/// Every tensor of the PixArt model of `spec`, in the budget's table order, then the frozen
/// position table.
pub fn param_shapes(d: &Dims, g: &PixartGeom) -> Vec<ParamShape> {
    let h = d.hidden;
    let table_init = Init::Normal(1.0 / (h as f64).sqrt());
    let small = Init::Normal(0.02);
    let mut inv = Inventory::default();
    inv.tensor("scale_shift_table".into(), vec![2, h], table_init);
    patch_conv(&mut inv, "pos_embed.proj", d, &[d.patch, d.patch]);
    for i in 0..d.depth {
        let b = format!("transformer_blocks.{i}");
        inv.tensor(format!("{b}.scale_shift_table"), vec![6, h], table_init);
        for name in PIXART_BLOCK_LINEARS {
            let (out, inp) = match name {
                "ff.net.0.proj" => (d.mlp_hidden, h),
                "ff.net.2" => (h, d.mlp_hidden),
                _ => (h, h),
            };
            inv.linear(&format!("{b}.{name}"), out, inp, Init::XavierUniform);
        }
    }
    let out = d.patch * d.patch * g.out_channels;
    inv.linear("proj_out", out, h, small);
    let te = "adaln_single.emb.timestep_embedder";
    inv.linear(&format!("{te}.linear_1"), h, PIXART_FREQ, small);
    inv.linear(&format!("{te}.linear_2"), h, h, small);
    if g.sizes.is_some() {
        // `size_emb_dim = embedding_dim // 3` each, as the timestep embedder.
        for e in SIZE_EMBEDDERS {
            let p = format!("adaln_single.emb.{e}");
            inv.linear(&format!("{p}.linear_1"), h / 3, PIXART_FREQ, small);
            inv.linear(&format!("{p}.linear_2"), h / 3, h / 3, small);
        }
    }
    inv.linear("adaln_single.linear", 6 * h, h, small);
    if g.caption_projection {
        let c = g.text_width;
        inv.linear("caption_projection.linear_1", h, c, Init::XavierUniform);
        inv.linear("caption_projection.linear_2", h, h, Init::XavierUniform);
    }
    inv.sincos_table("pos_embed.pos_embed", (d.rows, d.cols), h);
    adapt(inv.shapes, g.lora.as_ref())
}
