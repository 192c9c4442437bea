//! Sana: diffusers `SanaTransformer2DModel` (`models/transformers/sana_transformer.py`): linear
//! self-attention (q/k/v without bias when `attention_bias` is false), cross-attention to the
//! projected Gemma-2 caption (its own head count and size), Mix-FFN `GLUMBConv` (1×1 conv D → 2H,
//! depthwise 3×3 on 2H, GLU, 1×1 conv H → D without bias; H = int(mlp_ratio · D)), adaLN-single as
//! in PixArt, an RMSNorm on the caption, and no position table unless `interpolation_scale` is set.

pub mod ditmem_cpu;
pub(crate) mod pytorch;

use serde::Serialize;

use super::config::{Cfg, MAX_DIM, MAX_LAYERS, MAX_PATCH, MAX_SIDE};
use super::defaults::TrainingDefaults;
use super::dit::{check_hidden, check_inner, check_patch};
use super::facts::{FamilyFacts, VaeOnDevice};
use super::family::{diffusers_f8, FamilyDims, Geometry, TextEncoder};
use super::modules::Attn;
use super::table::{Group, Table, TensorKind};
use crate::error::SpecError;

/// Sana's training facts (`train_dreambooth_lora_sana.py`): FSDP wraps `SanaTransformerBlock`;
/// the script's LoRA default is `to_k, to_q, to_v` (:1045) while the budget counts
/// [`super::DEFAULT_LORA_MODULES`] (see there); the VAE stays fp32 (:1017).
pub(crate) const FACTS: FamilyFacts = FamilyFacts {
    fsdp_block_classes: "SanaTransformerBlock",
    lora_modules: &super::DEFAULT_LORA_MODULES,
    script_lora_layers: Some(&["to_k", "to_q", "to_v"]),
    fp32_vae: true,
    vae_on_device: VaeOnDevice::WholeAutoencoderDc,
};

/// `SanaTransformer2DModel`'s config (defaults: the class's `__init__`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SanaDims {
    pub num_layers: u64,
    pub num_attention_heads: u64,
    pub attention_head_dim: u64,
    pub num_cross_attention_heads: u64,
    pub cross_attention_head_dim: u64,
    pub cross_attention_dim: u64,
    /// Gemma-2-2B width (2304).
    pub caption_channels: u64,
    pub in_channels: u64,
    pub out_channels: u64,
    pub sample_size: u64,
    pub patch_size: u64,
    pub mlp_ratio: f64,
    pub attention_bias: bool,
    /// `rms_norm_across_heads` q/k norms (Sana 1.5); None in Sana 1.0.
    pub qk_norm: bool,
    /// A sin-cos position table (non-persistent) only when `interpolation_scale` is set.
    pub pos_embed: bool,
}

impl SanaDims {
    pub fn inner(&self) -> u64 {
        self.num_attention_heads * self.attention_head_dim
    }

    /// GLUMBConv hidden channels: `int(expand_ratio * in_channels)`.
    pub fn mlp_hidden(&self) -> u64 {
        // mlp_ratio ≤ 16 and inner ≤ 65,536: exact in f64 as in Python's float product.
        (self.mlp_ratio * self.inner() as f64).floor() as u64
    }
}

pub(crate) fn from_config(cfg: &mut Cfg) -> Result<SanaDims, SpecError> {
    let in_channels = cfg.int("in_channels", 32, 1, MAX_DIM)?;
    let out_channels = cfg.out_channels(Some(32), in_channels)?;
    let heads = cfg.int("num_attention_heads", 70, 1, MAX_DIM)?;
    let head_dim = cfg.int("attention_head_dim", 32, 1, MAX_DIM)?;
    let num_layers = cfg.int("num_layers", 20, 1, MAX_LAYERS)?;
    let cross_heads = cfg.opt_int("num_cross_attention_heads", Some(20), 1, MAX_DIM)?;
    let cross_hd = cfg.opt_int("cross_attention_head_dim", Some(112), 1, MAX_DIM)?;
    let cross_dim = cfg.opt_int("cross_attention_dim", Some(2240), 1, MAX_DIM)?;
    let caption_channels = cfg.int("caption_channels", 2304, 1, MAX_DIM)?;
    let mlp_ratio = cfg
        .number("mlp_ratio", Some(2.5), 0.0, 16.0, false)?
        .unwrap_or(2.5);
    cfg.zero_dropout("dropout")?;
    let attention_bias = cfg.bool("attention_bias", false)?;
    let sample_size = cfg.int("sample_size", 32, 1, MAX_SIDE)?;
    let patch_size = cfg.int("patch_size", 1, 1, MAX_PATCH)?;
    if cfg.bool("norm_elementwise_affine", false)? {
        return Err(SpecError::invalid(
            "norm_elementwise_affine",
            "true is not modelled (the published checkpoints have no affine LayerNorms); allowed: false",
        ));
    }
    let interpolation = cfg.number("interpolation_scale", None, 1e-6, 1e6, true)?;
    if cfg.bool("guidance_embeds", false)? {
        return Err(SpecError::invalid(
            "guidance_embeds",
            "true (Sana-Sprint) is not modelled; allowed: false",
        ));
    }
    let qk_norm = cfg.choice(
        "qk_norm",
        None,
        &[None, Some("rms_norm_across_heads")],
        " (Sana uses null or rms_norm_across_heads)",
    )?;
    // Scalars of the forward pass, no shape.
    cfg.ignore_numbers(&["norm_eps", "guidance_embeds_scale", "timestep_scale"])?;
    let none = |key: &str| {
        SpecError::invalid(
            key,
            "null (Sana without cross-attention) is not modelled; allowed: a positive integer",
        )
    };
    let d = SanaDims {
        num_layers,
        num_attention_heads: heads,
        attention_head_dim: head_dim,
        num_cross_attention_heads: cross_heads.ok_or_else(|| none("num_cross_attention_heads"))?,
        cross_attention_head_dim: cross_hd.ok_or_else(|| none("cross_attention_head_dim"))?,
        cross_attention_dim: cross_dim.ok_or_else(|| none("cross_attention_dim"))?,
        caption_channels,
        in_channels,
        out_channels,
        sample_size,
        patch_size,
        mlp_ratio,
        attention_bias,
        qk_norm: qk_norm.is_some(),
        pos_embed: interpolation.is_some(),
    };
    check_inner(d.inner())?;
    check_inner(d.num_cross_attention_heads * d.cross_attention_head_dim)?;
    check_patch(sample_size, patch_size)?;
    let why = "that the caption projection gives";
    check_hidden("cross_attention_dim", d.cross_attention_dim, d.inner(), why)?;
    if d.mlp_hidden() == 0 {
        return Err(SpecError::invalid(
            "mlp_ratio",
            format!(
                "{mlp_ratio} gives no FFN channels; allowed: a ratio with mlp_ratio × hidden ≥ 1"
            ),
        ));
    }
    Ok(d)
}

impl FamilyDims for SanaDims {
    fn table(&self, t: &mut Table) {
        let d = self;
        let dim = d.inner();
        let p = d.patch_size;
        let cross = d.num_cross_attention_heads * d.cross_attention_head_dim;
        t.push(
            "scale_shift_table".into(),
            vec![2, dim],
            Group::FinalLayer,
            None,
        );
        t.patch_embed("patch_embed", d.in_channels, dim, p);
        // AdaLayerNormSingle(dim) without the size embedders.
        t.ada_layer_norm_single("time_embed", dim, false);
        t.pixart_alpha_text_projection("caption_projection", d.caption_channels, dim);
        t.norm("caption_norm", dim, false, Group::TextEmbed, None);
        for i in 0..d.num_layers as u32 {
            let b = format!("transformer_blocks.{i}");
            let (g, blk) = (Group::Blocks, Some(i));
            t.push(format!("{b}.scale_shift_table"), vec![6, dim], g, blk);
            // Attention(qk_norm="rms_norm_across_heads"): RMSNorm over all heads, weight only.
            let attn1 = Attn {
                qk_norm: d.qk_norm.then_some(dim),
                ..Attn::self_attn(dim, d.attention_bias)
            };
            t.attention(&format!("{b}.attn1"), attn1, g, blk);
            let attn2 = Attn {
                query_dim: dim,
                kv_dim: d.cross_attention_dim,
                inner: cross,
                bias: true,
                qk_norm: d.qk_norm.then_some(cross),
            };
            t.attention(&format!("{b}.attn2"), attn2, g, blk);
            t.glumb_conv(&format!("{b}.ff"), dim, d.mlp_hidden(), g, blk);
        }
        t.top_linear("proj_out", p * p * d.out_channels, dim, Group::FinalLayer);
        if d.pos_embed {
            let side = d.sample_size / p;
            t.patch_embed_pos_embed("patch_embed", side, dim, TensorKind::BufferNonPersistent);
        }
    }

    /// DC-AE f32c32, Sana's own MLP width; Gemma-2-2B at 300 tokens.
    fn geometry(&self, _name: &str) -> Geometry {
        let d = self;
        let gemma = TextEncoder {
            name: "Gemma-2-2B",
            default_tokens: 300,
            width: d.caption_channels,
            sequence: true,
        };
        let dims = [d.num_layers, d.inner(), d.num_attention_heads, d.patch_size];
        Geometry {
            vae_factor: 32,
            mlp: d.mlp_hidden(),
            ..diffusers_f8(
                [dims[0], dims[1], dims[2], dims[3], d.in_channels],
                vec![gemma],
            )
        }
    }

    /// SanaPipeline's default: `sample_size` × DC-AE's 32 (the 1024px checkpoints: 32 → 1024²).
    fn training_defaults(&self) -> Option<TrainingDefaults> {
        Some(TrainingDefaults::from_sample_size(
            self.sample_size,
            self.patch_size,
            32,
        ))
    }

    fn layers(&self) -> u64 {
        self.num_layers
    }

    fn keep_blocks(&mut self, counts: &[u64]) {
        self.num_layers = counts[0];
    }
}
