//! DiT, twice: the original facebookresearch/DiT (`models.py`, counted by `params.rs`) and
//! diffusers' `DiTTransformer2DModel` (`models/transformers/dit_transformer_2d.py`), whose
//! `BasicTransformerBlock` with `norm_type="ada_norm_zero"` holds an `AdaLayerNormZero` with its
//! own `CombinedTimestepLabelEmbeddings` in every block — 749,826,464 parameters for XL/2 against
//! the original's 675,129,632.

pub(crate) mod ditmem_cpu;
pub(crate) mod pytorch;

use serde::Serialize;

use super::config::{Cfg, MAX_DIM, MAX_LAYERS, MAX_PATCH, MAX_ROWS, MAX_SIDE};
use super::facts::FamilyFacts;
use super::family::{diffusers_f8, FamilyDims, Geometry};
use super::modules::Attn;
use super::table::{Group, Table, TensorKind};
use crate::error::SpecError;
use crate::params::{param_table, Module};
use crate::spec::{ModelSpec, Spec};

/// The original DiT's training facts: FSDP wraps `DiTBlock` (facebookresearch/DiT `models.py`);
/// diffusers has no script for it.
pub(crate) const DIT_FACTS: FamilyFacts = FamilyFacts::without_script("DiTBlock");

/// diffusers' DiT's training facts: FSDP wraps `BasicTransformerBlock`; no diffusers script.
pub(crate) const DIT_DIFFUSERS_FACTS: FamilyFacts =
    FamilyFacts::without_script("BasicTransformerBlock");

/// The original DiT: a `ModelSpec` at a square image side in pixels (VAE factor 8).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DitDims {
    pub model: ModelSpec,
    pub image_size: u32,
}

/// `DiTTransformer2DModel`'s config (defaults: the class's `__init__`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DitDiffusersDims {
    pub num_layers: u64,
    pub num_attention_heads: u64,
    pub attention_head_dim: u64,
    pub in_channels: u64,
    pub out_channels: u64,
    /// Latent side; the fixed sin-cos table has (sample_size / patch_size)² rows.
    pub sample_size: u64,
    pub patch_size: u64,
    /// Classes of the label table (one more row for the null class: dropout 0.1 is hard-coded).
    pub num_embeds_ada_norm: u64,
    pub attention_bias: bool,
}

impl DitDiffusersDims {
    pub fn inner(&self) -> u64 {
        self.num_attention_heads * self.attention_head_dim
    }
}

/// Keys of a legacy `Transformer2DModel` config that the remapped class does not take: accepted at
/// the value that changes nothing (diffusers drops them when it remaps), refused otherwise.
fn legacy_keys(cfg: &mut Cfg, cross_attention: bool) -> Result<(), SpecError> {
    let why = " (diffusers drops it when it remaps Transformer2DModel)";
    cfg.choice("num_vector_embeds", None, &[None], why)?;
    if cfg.bool("only_cross_attention", false)? {
        return Err(SpecError::invalid(
            "only_cross_attention",
            "true is not modelled; allowed: false",
        ));
    }
    if cfg.bool("double_self_attention", false)? {
        return Err(SpecError::invalid(
            "double_self_attention",
            "true is not modelled; allowed: false",
        ));
    }
    // Used only by Transformer2DModel's continuous (non-patch) input path.
    cfg.bool("use_linear_projection", false)?;
    if !cross_attention {
        cfg.choice(
            "cross_attention_dim",
            None,
            &[None],
            " for DiT (no cross-attention)",
        )?;
        cfg.choice(
            "caption_channels",
            None,
            &[None],
            " for DiT (no caption projection)",
        )?;
        cfg.choice("attention_type", None, &[Some("default")], "")?;
        cfg.ignore_numbers(&["interpolation_scale"])?;
        if cfg.opt_bool("use_additional_conditions", None)? == Some(true) {
            return Err(SpecError::invalid(
                "use_additional_conditions",
                "true is not modelled for DiT (PixArt's size embedders); allowed: false, null",
            ));
        }
    }
    Ok(())
}

/// Read a `DiTTransformer2DModel` config (or a `Transformer2DModel` one remapped to it).
pub(crate) fn from_config(cfg: &mut Cfg, legacy: bool) -> Result<DitDiffusersDims, SpecError> {
    let k = block_keys(cfg, "ada_norm_zero", None, 32)?;
    let num_embeds = num_embeds_ada_norm(cfg, "ada_norm_zero")?;
    let attention_bias = cfg.bool("attention_bias", true)?;
    common_keys(cfg, legacy.then_some(false))?;
    let d = DitDiffusersDims {
        num_layers: k.num_layers,
        num_attention_heads: k.heads,
        attention_head_dim: k.head_dim,
        in_channels: k.in_channels,
        out_channels: k.out_channels,
        sample_size: k.sample_size,
        patch_size: k.patch_size,
        num_embeds_ada_norm: num_embeds,
        attention_bias,
    };
    check_inner(d.inner())?;
    check_patch(k.sample_size, k.patch_size)?;
    Ok(d)
}

/// The keys the `BasicTransformerBlock` families (DiT, PixArt) read first, in this order.
pub(crate) struct BlockKeys {
    pub heads: u64,
    pub head_dim: u64,
    pub in_channels: u64,
    pub out_channels: u64,
    pub num_layers: u64,
    pub sample_size: u64,
    pub patch_size: u64,
}

/// Reads [`BlockKeys`] after `norm_type` (only `norm_type` allowed); `out_channels` null is
/// `in_channels`; the defaults that differ are the classes' (`out_channels`, `sample_size`).
pub(crate) fn block_keys(
    cfg: &mut Cfg,
    norm_type: &'static str,
    out_channels: Option<u64>,
    sample_size: u64,
) -> Result<BlockKeys, SpecError> {
    cfg.choice("norm_type", Some(norm_type), &[Some(norm_type)], "")?;
    let heads = cfg.int("num_attention_heads", 16, 1, MAX_DIM)?;
    let head_dim = cfg.int("attention_head_dim", 72, 1, MAX_DIM)?;
    let in_channels = cfg.int("in_channels", 4, 1, MAX_DIM)?;
    let out_channels = cfg.out_channels(out_channels, in_channels)?;
    Ok(BlockKeys {
        heads,
        head_dim,
        in_channels,
        out_channels,
        num_layers: cfg.int("num_layers", 28, 1, MAX_LAYERS)?,
        sample_size: cfg.int("sample_size", sample_size, 1, MAX_SIDE)?,
        patch_size: cfg.int("patch_size", 2, 1, MAX_PATCH)?,
    })
}

/// `num_embeds_ada_norm` (default 1000), which the adaLN norm `norm_type` needs.
pub(crate) fn num_embeds_ada_norm(cfg: &mut Cfg, norm_type: &str) -> Result<u64, SpecError> {
    cfg.opt_int("num_embeds_ada_norm", Some(1000), 1, MAX_ROWS)?
        .ok_or_else(|| {
            SpecError::invalid(
                "num_embeds_ada_norm",
                format!(
                    "null is not allowed with {norm_type}; allowed: an integer from 1 to 1048576"
                ),
            )
        })
}

/// Keys shared by the BasicTransformerBlock families (DiT, PixArt); then, for a legacy
/// `Transformer2DModel` config (`legacy`: whether the family has cross-attention), its
/// [`legacy_keys`].
pub(crate) fn common_keys(cfg: &mut Cfg, legacy: Option<bool>) -> Result<(), SpecError> {
    cfg.choice(
        "activation_fn",
        Some("gelu-approximate"),
        &[Some("gelu-approximate"), Some("gelu")],
        " (a GEGLU doubles the first FFN projection)",
    )?;
    if cfg.bool("norm_elementwise_affine", false)? {
        return Err(SpecError::invalid(
            "norm_elementwise_affine",
            "true is not modelled (the published checkpoints have no affine LayerNorms); allowed: false",
        ));
    }
    cfg.zero_dropout("dropout")?;
    // Numbers that change no shape: the norms' epsilon and GroupNorm groups of the unused
    // continuous-input path; upcasting changes the attention's dtype, not the parameters.
    cfg.ignore_numbers(&["norm_eps", "norm_num_groups"])?;
    cfg.bool("upcast_attention", false)?;
    if let Some(cross_attention) = legacy {
        legacy_keys(cfg, cross_attention)?;
    }
    Ok(())
}

pub(crate) fn check_inner(inner: u64) -> Result<(), SpecError> {
    if inner > super::config::MAX_HIDDEN {
        return Err(SpecError::invalid(
            "num_attention_heads",
            format!(
                "num_attention_heads × attention_head_dim = {inner}; allowed: at most {}",
                super::config::MAX_HIDDEN
            ),
        ));
    }
    Ok(())
}

/// A width the model needs equal to the hidden size `inner` (num_attention_heads ×
/// attention_head_dim): the config's `key` at `value`; `why` says what makes or reads it.
pub(crate) fn check_hidden(key: &str, value: u64, inner: u64, why: &str) -> Result<(), SpecError> {
    if value != inner {
        return Err(SpecError::invalid(
            key,
            format!(
                "{value} differs from the hidden size num_attention_heads × attention_head_dim = \
                 {inner} {why}; allowed: {inner}"
            ),
        ));
    }
    Ok(())
}

pub(crate) fn check_patch(sample_size: u64, patch: u64) -> Result<(), SpecError> {
    if !sample_size.is_multiple_of(patch) {
        return Err(SpecError::invalid(
            "sample_size",
            format!("{sample_size} is not a multiple of patch_size {patch}; allowed: a multiple of {patch}"),
        ));
    }
    Ok(())
}

/// diffusers `DiTTransformer2DModel.__init__`: `pos_embed` (PatchEmbed: conv + a non-persistent
/// sin-cos buffer), `transformer_blocks` (BasicTransformerBlock, ada_norm_zero), `proj_out_1`,
/// `proj_out_2`.
pub(crate) fn diffusers_table(d: &DitDiffusersDims, t: &mut Table) {
    let dim = d.inner();
    let p = d.patch_size;
    t.patch_embed("pos_embed", d.in_channels, dim, p);
    for i in 0..d.num_layers as u32 {
        let b = format!("transformer_blocks.{i}");
        let (g, blk) = (Group::Blocks, Some(i));
        // AdaLayerNormZero(dim, num_embeds): its own CombinedTimestepLabelEmbeddings in every block.
        t.ada_layer_norm_zero(
            &format!("{b}.norm1"),
            dim,
            Some(d.num_embeds_ada_norm),
            g,
            blk,
        );
        let attn = Attn::self_attn(dim, d.attention_bias);
        t.attention(&format!("{b}.attn1"), attn, g, blk);
        t.feed_forward(&format!("{b}.ff"), dim, 4 * dim, g, blk);
    }
    t.top_linear("proj_out_1", 2 * dim, dim, Group::FinalLayer);
    t.top_linear("proj_out_2", p * p * d.out_channels, dim, Group::FinalLayer);
    let side = d.sample_size / p;
    t.patch_embed_pos_embed("pos_embed", side, dim, TensorKind::BufferNonPersistent);
}

/// The original DiT, from `params.rs` (the engine's twin): its `pos_embed` is an `nn.Parameter`
/// with `requires_grad=False`, counted by `model.parameters()`.
pub(crate) fn original_table(d: &DitDims, t: &mut Table) {
    let mut spec = Spec::default_xl();
    spec.model = d.model.clone();
    spec.workload.height = d.image_size;
    spec.workload.width = d.image_size;
    spec.recipe.lora = None;
    for p in param_table(&spec) {
        let group = match p.module {
            Module::PatchEmbed => Group::PatchEmbed,
            Module::PosEmbed => Group::PosEmbed,
            Module::TimestepEmbed => Group::TimeEmbed,
            Module::LabelEmbed => Group::ClassEmbed,
            Module::Blocks | Module::Lora | Module::TransformerBlocks => Group::Blocks,
            Module::SingleBlocks => Group::SingleBlocks,
            Module::TextEmbed => Group::TextEmbed,
            Module::FinalLayer => Group::FinalLayer,
        };
        let fixed = p.module == Module::PosEmbed;
        t.push(p.name, p.shape, group, p.block);
        if let Some(last) = t.0.last_mut() {
            last.fixed = fixed;
        }
    }
}

impl FamilyDims for DitDims {
    fn table(&self, t: &mut Table) {
        original_table(self, t);
    }

    /// SD VAE f8c4, class-conditional.
    fn geometry(&self, _name: &str) -> Geometry {
        let m = &self.model;
        Geometry {
            mlp: u64::from(m.mlp_hidden()),
            ..diffusers_f8(
                [m.depth, m.hidden, m.heads, m.patch, m.in_channels].map(u64::from),
                Vec::new(),
            )
        }
    }

    fn layers(&self) -> u64 {
        u64::from(self.model.depth)
    }

    fn keep_blocks(&mut self, counts: &[u64]) {
        self.model.depth = counts[0] as u32;
    }
}

impl FamilyDims for DitDiffusersDims {
    fn table(&self, t: &mut Table) {
        diffusers_table(self, t);
    }

    /// SD VAE f8c4, class-conditional.
    fn geometry(&self, _name: &str) -> Geometry {
        let d = self;
        let dims = [
            d.num_layers,
            d.inner(),
            d.num_attention_heads,
            d.patch_size,
            d.in_channels,
        ];
        diffusers_f8(dims, Vec::new())
    }

    fn layers(&self) -> u64 {
        self.num_layers
    }

    fn keep_blocks(&mut self, counts: &[u64]) {
        self.num_layers = counts[0];
    }
}
