//! Sana's geometry beyond [`Dims`] and its parameter inventory, named and ordered as the
//! budget's table (`ditmem_budget::denoiser::param_table`, `families/sana.rs`).
//!
//! Initialisation (drawn in f64 from the seed and the name, as for PixArt): linears and convs
//! xavier-uniform over their (out, rest) view with zero biases; the timestep MLP,
//! `time_embed.linear` and `proj_out` normal(0, 0.02); every `scale_shift_table` randn / √D
//! (diffusers' init); `caption_norm` ones.

use ditmem_budget::{SanaDims, Spec};

use crate::error::{EngineError, Result};
use crate::families::config::{caption_tokens, no_dropout};
use crate::families::cross::self_cross_block_linears;
use crate::families::lora::{adapt, LoraPlan};
use crate::shapes::{Dims, Init, Inventory, ParamShape};

/// Width of diffusers' `Timesteps(256)` sinusoid.
pub const SANA_FREQ: usize = 256;

/// The linears of a Sana block in forward order (diffusers names): its linear self-attention
/// `attn1`, its cross-attention `attn2`, the Mix-FFN's pointwise convs.
pub const SANA_BLOCK_LINEARS: [&str; 10] =
    self_cross_block_linears(["ff.conv_inverted", "ff.conv_point"]);

/// `caption_norm`'s epsilon (`RMSNorm(inner_dim, eps=1e-5, elementwise_affine=True)`).
pub(crate) const CAPTION_NORM_EPS: f64 = 1e-5;

/// What a Sana step needs beyond [`Dims`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SanaGeom {
    /// Caption tokens T (`workload.text_tokens`, else the family's default).
    pub text_tokens: usize,
    /// Width of the cached Gemma states (`caption_channels`).
    pub text_width: usize,
    /// `out_channels` of the config.
    pub out_channels: usize,
    /// Cross-attention heads and their inner width (heads × head size).
    pub cross_heads: usize,
    pub cross_width: usize,
    /// GLUMBConv hidden channels H (`int(mlp_ratio · D)`; the inverted conv makes 2H).
    pub mlp_hidden: usize,
    /// Whether attn1's to_q / to_k / to_v have biases (`attention_bias`).
    pub qkv_bias: bool,
    /// LoRA's rank and the modules it adapts ([`LoraPlan`]); None trains the full model.
    pub lora: Option<LoraPlan>,
}

impl SanaGeom {
    /// Checks what the engine runs of a Sana config and reads its geometry.
    pub fn new(spec: &Spec, d: &SanaDims) -> Result<SanaGeom> {
        if d.qk_norm {
            return Err(EngineError::unsupported(
                "model.diffusers.qk_norm",
                "the q/k RMSNorms of Sana 1.5 are not in the engine yet; use qk_norm = null",
            ));
        }
        if d.pos_embed {
            return Err(EngineError::unsupported(
                "model.diffusers.interpolation_scale",
                "Sana's sin-cos position table is not in the engine yet; use \
                 interpolation_scale = null",
            ));
        }
        no_dropout(spec, "a Sana model", "Sana")?;
        let t = caption_tokens(spec, "Gemma")?;
        Ok(SanaGeom {
            text_tokens: t,
            text_width: d.caption_channels as usize,
            out_channels: d.out_channels as usize,
            cross_heads: d.num_cross_attention_heads as usize,
            cross_width: (d.num_cross_attention_heads * d.cross_attention_head_dim) as usize,
            mlp_hidden: d.mlp_hidden() as usize,
            qkv_bias: d.attention_bias,
            lora: LoraPlan::of(spec),
        })
    }
}

/// Every tensor of the Sana model of `spec`, in the budget's table order, with LoRA's adapters
/// when the recipe has them ([`adapt`]).
pub fn param_shapes(d: &Dims, g: &SanaGeom) -> Vec<ParamShape> {
    let h = d.hidden;
    let table_init = Init::Normal(1.0 / (h as f64).sqrt());
    let small = Init::Normal(0.02);
    let xav = Init::XavierUniform;
    let mut inv = Inventory::default();
    inv.tensor("scale_shift_table".into(), vec![2, h], table_init);
    let p = d.patch;
    inv.layer("patch_embed.proj", vec![h, d.in_channels, p, p], xav, true);
    let te = "time_embed.emb.timestep_embedder";
    inv.layer(&format!("{te}.linear_1"), vec![h, SANA_FREQ], small, true);
    inv.layer(&format!("{te}.linear_2"), vec![h, h], small, true);
    inv.layer("time_embed.linear", vec![6 * h, h], small, true);
    let c = g.text_width;
    inv.layer("caption_projection.linear_1", vec![h, c], xav, true);
    inv.layer("caption_projection.linear_2", vec![h, h], xav, true);
    inv.tensor("caption_norm.weight".into(), vec![h], Init::Ones);
    let (dc, hid) = (g.cross_width, g.mlp_hidden);
    for i in 0..d.depth {
        let b = format!("transformer_blocks.{i}");
        inv.tensor(format!("{b}.scale_shift_table"), vec![6, h], table_init);
        for n in ["to_q", "to_k", "to_v"] {
            inv.layer(&format!("{b}.attn1.{n}"), vec![h, h], xav, g.qkv_bias);
        }
        inv.layer(&format!("{b}.attn1.to_out.0"), vec![h, h], xav, true);
        inv.layer(&format!("{b}.attn2.to_q"), vec![dc, h], xav, true);
        inv.layer(&format!("{b}.attn2.to_k"), vec![dc, h], xav, true);
        inv.layer(&format!("{b}.attn2.to_v"), vec![dc, h], xav, true);
        inv.layer(&format!("{b}.attn2.to_out.0"), vec![h, dc], xav, true);
        let ff = format!("{b}.ff");
        inv.layer(
            &format!("{ff}.conv_inverted"),
            vec![2 * hid, h, 1, 1],
            xav,
            true,
        );
        inv.layer(
            &format!("{ff}.conv_depth"),
            vec![2 * hid, 1, 3, 3],
            xav,
            true,
        );
        inv.layer(&format!("{ff}.conv_point"), vec![h, hid, 1, 1], xav, false);
    }
    let out = d.patch * d.patch * g.out_channels;
    inv.layer("proj_out", vec![out, h], small, true);
    adapt(inv.shapes, g.lora.as_ref())
}
