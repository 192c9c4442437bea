//! FLUX.1: diffusers `FluxTransformer2DModel` (`models/transformers/transformer_flux.py`):
//! `num_layers` double-stream blocks (AdaLayerNormZero for image and context, joint attention with
//! per-head q/k RMSNorm, two GELU-tanh FFNs) and `num_single_layers` single-stream blocks (one
//! `Linear(D, 3D)` modulation, q/k/v without an output projection, `proj_mlp` D → 4D and the fused
//! `proj_out` 5D → D). RoPE over `axes_dims_rope` is computed per step: no buffer, no parameter.
//! `x_embedder` reads the 2×2-packed latent (64 features).

pub mod ditmem_cpu;
pub(crate) mod pytorch;

use serde::Serialize;

use super::config::{mismatch, Cfg, MAX_DIM, MAX_LAYERS, MAX_PATCH};
use super::defaults::TrainingDefaults;
use super::dit::check_inner;
use super::facts::{FamilyFacts, VaeOnDevice};
use super::family::{diffusers_f8, FamilyDims, Geometry, TextEncoder};
use super::table::{Group, Table};
use crate::error::SpecError;

/// `train_dreambooth_lora_flux.py` with `--lora_layers` unset (diffusers 58eb52c; :1257-1270):
/// the double blocks' attention projections and feed-forwards, and (by suffix) the single
/// blocks' `attn.to_q/k/v`; not their `proj_mlp` or `proj_out`.
pub(crate) const LORA_MODULES: [&str; 12] = [
    "attn.to_k",
    "attn.to_q",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
];

/// FLUX.1's training facts: FSDP wraps both kinds of block; the LoRA script's default modules
/// ([`LORA_MODULES`], the budget counts the same list); the VAE follows the precision.
pub(crate) const FACTS: FamilyFacts = FamilyFacts {
    fsdp_block_classes: "FluxTransformerBlock,FluxSingleTransformerBlock",
    lora_modules: &LORA_MODULES,
    script_lora_layers: Some(&LORA_MODULES),
    fp32_vae: false,
    vae_on_device: VaeOnDevice::WholeAutoencoderKl,
};

/// `FluxTransformer2DModel`'s config (defaults: the class's `__init__`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FluxDims {
    pub num_layers: u64,
    pub num_single_layers: u64,
    pub num_attention_heads: u64,
    pub attention_head_dim: u64,
    /// Features per packed token (16 latent channels × 2 × 2 = 64).
    pub in_channels: u64,
    pub out_channels: u64,
    pub patch_size: u64,
    /// T5-XXL width fed to `context_embedder` (4096).
    pub joint_attention_dim: u64,
    /// CLIP-L pooled width (768).
    pub pooled_projection_dim: u64,
    /// FLUX.1-dev's guidance embedder (schnell has none).
    pub guidance_embeds: bool,
    /// RoPE axes (sum = attention_head_dim).
    pub axes_dims_rope: Vec<u64>,
}

impl FluxDims {
    pub fn inner(&self) -> u64 {
        self.num_attention_heads * self.attention_head_dim
    }
}

pub(crate) fn from_config(cfg: &mut Cfg) -> Result<FluxDims, SpecError> {
    let patch_size = cfg.int("patch_size", 1, 1, MAX_PATCH)?;
    let in_channels = cfg.int("in_channels", 64, 1, MAX_DIM)?;
    let out_channels = cfg.out_channels(None, in_channels)?;
    let num_layers = cfg.int("num_layers", 19, 0, MAX_LAYERS)?;
    let num_single_layers = cfg.int("num_single_layers", 38, 0, MAX_LAYERS)?;
    let head_dim = cfg.int("attention_head_dim", 128, 1, MAX_DIM)?;
    let heads = cfg.int("num_attention_heads", 24, 1, MAX_DIM)?;
    let joint = cfg.int("joint_attention_dim", 4096, 1, MAX_DIM)?;
    let pooled = cfg.int("pooled_projection_dim", 768, 1, MAX_DIM)?;
    let guidance_embeds = cfg.bool("guidance_embeds", false)?;
    let axes = cfg.int_list("axes_dims_rope", &[16, 56, 56], 3, 0, MAX_DIM)?;
    let d = FluxDims {
        num_layers,
        num_single_layers,
        num_attention_heads: heads,
        attention_head_dim: head_dim,
        in_channels,
        out_channels,
        patch_size,
        joint_attention_dim: joint,
        pooled_projection_dim: pooled,
        guidance_embeds,
        axes_dims_rope: axes,
    };
    check_inner(d.inner())?;
    let sum: u64 = d.axes_dims_rope.iter().sum();
    if d.axes_dims_rope.len() != 3 || sum != head_dim || d.axes_dims_rope.iter().any(|a| a % 2 != 0)
    {
        return Err(mismatch(
            "axes_dims_rope",
            format!(
                "{:?} must be three even sizes adding up to attention_head_dim {head_dim} (RoPE rotates \
                 every channel of a head)",
                d.axes_dims_rope
            ),
        ));
    }
    Ok(d)
}

impl FamilyDims for FluxDims {
    fn table(&self, t: &mut Table) {
        let d = self;
        let dim = d.inner();
        let hd = d.attention_head_dim;
        // CombinedTimestep(Guidance)TextProjEmbeddings.
        let pooled = d.pooled_projection_dim;
        t.combined_timestep_text_proj_embeddings("time_text_embed", dim, pooled, d.guidance_embeds);
        t.top_linear(
            "context_embedder",
            dim,
            d.joint_attention_dim,
            Group::TextEmbed,
        );
        t.top_linear("x_embedder", dim, d.in_channels, Group::PatchEmbed);
        for i in 0..d.num_layers as u32 {
            let b = format!("transformer_blocks.{i}");
            let (g, blk) = (Group::Blocks, Some(i));
            t.ada_layer_norm_zero(&format!("{b}.norm1"), dim, None, g, blk);
            t.ada_layer_norm_zero(&format!("{b}.norm1_context"), dim, None, g, blk);
            t.flux_attention(&format!("{b}.attn"), dim, hd, true, g, blk);
            t.feed_forward(&format!("{b}.ff"), dim, 4 * dim, g, blk);
            t.feed_forward(&format!("{b}.ff_context"), dim, 4 * dim, g, blk);
        }
        for i in 0..d.num_single_layers as u32 {
            let b = format!("single_transformer_blocks.{i}");
            let (g, blk) = (Group::SingleBlocks, Some(i));
            // mlp_ratio 4.0 is fixed in FluxSingleTransformerBlock.
            let mlp = 4 * dim;
            t.ada_layer_norm_zero_single(&format!("{b}.norm"), dim, g, blk);
            t.linear(&format!("{b}.proj_mlp"), mlp, dim, true, g, blk);
            t.linear(&format!("{b}.proj_out"), dim, dim + mlp, true, g, blk);
            t.flux_attention(&format!("{b}.attn"), dim, hd, false, g, blk);
        }
        t.ada_layer_norm_continuous("norm_out", dim, Group::FinalLayer, None);
        let p = d.patch_size;
        t.top_linear("proj_out", p * p * d.out_channels, dim, Group::FinalLayer);
    }

    /// SD3/Flux VAE f8c16, 2×2 latent pixels of 16 channels packed into one 64-wide token;
    /// CLIP-L pooled + T5-XXL at 512 tokens (dev; schnell 256).
    fn geometry(&self, _name: &str) -> Geometry {
        let d = self;
        let clip = TextEncoder {
            name: "CLIP-L (pooled)",
            default_tokens: 77,
            width: d.pooled_projection_dim,
            sequence: false,
        };
        let t5_tokens = if d.guidance_embeds { 512 } else { 256 };
        let t5 = TextEncoder::t5(t5_tokens, d.joint_attention_dim);
        let dims = [d.num_layers, d.inner(), d.num_attention_heads, d.patch_size];
        Geometry {
            blocks: d.num_layers + d.num_single_layers,
            patch: 2 * d.patch_size,
            latent_channels: d.in_channels / 4,
            ..diffusers_f8(
                [dims[0], dims[1], dims[2], dims[3], d.in_channels],
                vec![clip, t5],
            )
        }
    }

    /// FluxPipeline's default: `default_sample_size = 128` latent pixels × the VAE's 8 = 1024².
    fn training_defaults(&self) -> Option<TrainingDefaults> {
        Some(TrainingDefaults::square(1024))
    }

    fn layers(&self) -> u64 {
        self.num_layers + self.num_single_layers
    }

    /// Double- and single-stream blocks.
    fn block_kinds(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("double-stream block", self.num_layers),
            ("single-stream block", self.num_single_layers),
        ]
    }

    fn keep_blocks(&mut self, counts: &[u64]) {
        self.num_layers = counts[0];
        self.num_single_layers = counts[1];
    }
}
