//! Wan 2.1 text-to-video: diffusers `WanTransformer3DModel` (`models/transformers/transformer_wan.py`):
//! a Conv3d patch embedding over (frames, height, width), a time embedding with a shared
//! `time_proj` to 6·D and a per-block 1×6×D `scale_shift_table`, a GELU-tanh text projection of
//! umT5 (4096), blocks with self-attention and cross-attention (q/k RMSNorm across heads, biases
//! everywhere, an affine LayerNorm before cross-attention when `cross_attn_norm`), and two
//! non-persistent 3-D RoPE tables of `rope_max_seq_len` × head-dim. Image conditioning (I2V:
//! `image_dim`, `added_kv_proj_dim`) is not modelled.

pub(crate) mod ditmem_cpu;
pub(crate) mod pytorch;

use serde::Serialize;

use super::config::{Cfg, MAX_DIM, MAX_FFN, MAX_LAYERS, MAX_PATCH, MAX_ROWS};
use super::defaults::TrainingDefaults;
use super::dit::check_inner;
use super::facts::FamilyFacts;
use super::family::{FamilyDims, Geometry, TextEncoder};
use super::table::{Group, Table, TensorKind};
use crate::error::SpecError;

/// Wan's training facts: FSDP wraps `WanTransformerBlock`; diffusers has no fine-tune script.
pub(crate) const FACTS: FamilyFacts = FamilyFacts::without_script("WanTransformerBlock");

/// `WanTransformer3DModel`'s config (defaults: the class's `__init__`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WanDims {
    /// (frames, height, width) of a patch: (1, 2, 2).
    pub patch_size: [u64; 3],
    pub num_attention_heads: u64,
    pub attention_head_dim: u64,
    pub in_channels: u64,
    pub out_channels: u64,
    /// umT5-XXL width (4096).
    pub text_dim: u64,
    /// Sinusoid width of the timestep (256).
    pub freq_dim: u64,
    pub ffn_dim: u64,
    pub num_layers: u64,
    pub cross_attn_norm: bool,
    pub rope_max_seq_len: u64,
}

impl WanDims {
    pub fn inner(&self) -> u64 {
        self.num_attention_heads * self.attention_head_dim
    }
}

pub(crate) fn from_config(cfg: &mut Cfg) -> Result<WanDims, SpecError> {
    let patch = cfg.int_list("patch_size", &[1, 2, 2], 3, 1, MAX_PATCH)?;
    let [pt, ph, pw] = patch[..] else {
        return Err(SpecError::invalid(
            "patch_size",
            format!(
                "{patch:?} has {} entries; allowed: [frames, height, width]",
                patch.len()
            ),
        ));
    };
    let heads = cfg.int("num_attention_heads", 40, 1, MAX_DIM)?;
    let head_dim = cfg.int("attention_head_dim", 128, 2, MAX_DIM)?;
    let in_channels = cfg.int("in_channels", 16, 1, MAX_DIM)?;
    let out_channels = cfg.out_channels(Some(16), in_channels)?;
    let text_dim = cfg.int("text_dim", 4096, 1, MAX_DIM)?;
    let freq_dim = cfg.int("freq_dim", 256, 1, MAX_DIM)?;
    let ffn_dim = cfg.int("ffn_dim", 13824, 1, MAX_FFN)?;
    let num_layers = cfg.int("num_layers", 40, 1, MAX_LAYERS)?;
    let cross_attn_norm = cfg.bool("cross_attn_norm", true)?;
    // WanAttention always builds its q/k RMSNorm across heads; the block takes qk_norm and
    // ignores it. Only the value diffusers writes is accepted.
    cfg.choice(
        "qk_norm",
        Some("rms_norm_across_heads"),
        &[Some("rms_norm_across_heads")],
        "",
    )?;
    cfg.ignore_numbers(&["eps"])?;
    // The image-to-video conditioning's keys: refused unless null.
    for (key, max) in [
        ("image_dim", MAX_DIM),
        ("added_kv_proj_dim", MAX_DIM),
        ("pos_embed_seq_len", MAX_ROWS),
    ] {
        if cfg.opt_int(key, None, 0, max)?.is_some() {
            return Err(SpecError::invalid(
                key,
                "a value is not modelled (image-to-video conditioning); allowed: null",
            ));
        }
    }
    let rope = cfg.int("rope_max_seq_len", 1024, 1, MAX_ROWS)?;
    let d = WanDims {
        patch_size: [pt, ph, pw],
        num_attention_heads: heads,
        attention_head_dim: head_dim,
        in_channels,
        out_channels,
        text_dim,
        freq_dim,
        ffn_dim,
        num_layers,
        cross_attn_norm,
        rope_max_seq_len: rope,
    };
    check_inner(d.inner())?;
    if head_dim % 2 != 0 {
        return Err(SpecError::invalid(
            "attention_head_dim",
            format!("{head_dim} is odd; allowed: an even size (3-D RoPE rotates channel pairs)"),
        ));
    }
    Ok(d)
}

impl FamilyDims for WanDims {
    fn table(&self, t: &mut Table) {
        let d = self;
        let dim = d.inner();
        let [pt, ph, pw] = d.patch_size;
        t.push(
            "scale_shift_table".into(),
            vec![1, 2, dim],
            Group::FinalLayer,
            None,
        );
        let patch = vec![dim, d.in_channels, pt, ph, pw];
        t.conv("patch_embedding", patch, true, Group::PatchEmbed, None);
        // WanTimeTextImageEmbedding: TimestepEmbedding(freq_dim, dim), time_proj Linear(dim, 6dim),
        // text_embedder PixArtAlphaTextProjection(text_dim, dim, gelu_tanh).
        let ce = "condition_embedder";
        let g = Group::TimeEmbed;
        t.timestep_embedding(&format!("{ce}.time_embedder"), d.freq_dim, dim, g, None);
        t.top_linear(&format!("{ce}.time_proj"), 6 * dim, dim, g);
        t.pixart_alpha_text_projection(&format!("{ce}.text_embedder"), d.text_dim, dim);
        for i in 0..d.num_layers as u32 {
            let b = format!("blocks.{i}");
            let (g, blk) = (Group::Blocks, Some(i));
            t.push(format!("{b}.scale_shift_table"), vec![1, 6, dim], g, blk);
            for attn in ["attn1", "attn2"] {
                t.wan_attention(&format!("{b}.{attn}"), dim, g, blk);
            }
            if d.cross_attn_norm {
                t.norm(&format!("{b}.norm2"), dim, true, g, blk);
            }
            t.feed_forward(&format!("{b}.ffn"), dim, d.ffn_dim, g, blk);
        }
        let out = d.out_channels * pt * ph * pw;
        t.top_linear("proj_out", out, dim, Group::FinalLayer);
        for name in ["rope.freqs_cos", "rope.freqs_sin"] {
            t.buffer(
                name,
                vec![d.rope_max_seq_len, d.attention_head_dim],
                TensorKind::BufferNonPersistent,
                Group::Rope,
            );
        }
    }

    /// Wan-VAE f8 × t4, c16; umT5-XXL at 512 tokens.
    fn geometry(&self, _name: &str) -> Geometry {
        let d = self;
        Geometry {
            blocks: d.num_layers,
            hidden: d.inner(),
            heads: d.num_attention_heads,
            patch: d.patch_size[1],
            latent_channels: d.in_channels,
            vae_factor: 8,
            vae_temporal_factor: 4,
            mlp: d.ffn_dim,
            text: vec![TextEncoder {
                name: "umT5-XXL",
                default_tokens: 512,
                width: d.text_dim,
                sequence: true,
            }],
        }
    }

    /// WanPipeline's default: 81 frames of 480 × 832 (`height=480, width=832, num_frames=81`).
    fn training_defaults(&self) -> Option<TrainingDefaults> {
        Some(TrainingDefaults {
            height: 480,
            width: 832,
            frames: 81,
            microbatch: 1,
            accumulation: 1,
        })
    }

    fn layers(&self) -> u64 {
        self.num_layers
    }

    fn keep_blocks(&mut self, counts: &[u64]) {
        self.num_layers = counts[0];
    }
}
