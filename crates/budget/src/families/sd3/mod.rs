//! SD3 / SD3.5: diffusers `SD3Transformer2DModel` (`models/transformers/transformer_sd3.py`,
//! `JointTransformerBlock` in `models/attention.py`): MMDiT joint blocks with an image and a
//! context stream, the last block `context_pre_only` (AdaLayerNormContinuous for the context, no
//! `to_add_out`, no `ff_context`), a pooled-text projection, optional per-head q/k RMSNorm,
//! SD3.5-medium's dual-attention layers (MMDiT-X: `SD35AdaLayerNormZeroX` with 9·D modulation and a
//! second self-attention `attn2`), and a persistent sin-cos table of pos_embed_max_size² rows
//! cropped at run time.

pub(crate) mod ditmem_cpu;
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

/// `train_dreambooth_lora_sd3.py` with `--lora_layers` unset (diffusers 58eb52c; :1251-1260):
/// both streams' attention projections.
pub(crate) const LORA_MODULES: [&str; 8] = [
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_k",
    "attn.to_out.0",
    "attn.to_q",
    "attn.to_v",
];

/// SD3's training facts: FSDP wraps `JointTransformerBlock`; the LoRA script's default modules
/// ([`LORA_MODULES`], the budget counts the same list); the VAE stays fp32 in both scripts
/// (train_dreambooth_sd3.py:1167, train_dreambooth_lora_sd3.py:1237:
/// `vae.to(accelerator.device, dtype=torch.float32)`).
pub(crate) const FACTS: FamilyFacts = FamilyFacts {
    fsdp_block_classes: "JointTransformerBlock",
    lora_modules: &LORA_MODULES,
    script_lora_layers: Some(&LORA_MODULES),
    fp32_vae: true,
    vae_on_device: VaeOnDevice::WholeAutoencoderKl,
};

/// `SD3Transformer2DModel`'s config (defaults: the class's `__init__`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Sd3Dims {
    pub num_layers: u64,
    pub num_attention_heads: u64,
    pub attention_head_dim: u64,
    pub in_channels: u64,
    pub out_channels: u64,
    pub sample_size: u64,
    pub patch_size: u64,
    /// Width of the T5/CLIP token embeddings fed to `context_embedder` (4096).
    pub joint_attention_dim: u64,
    /// Width of the context stream (must equal the hidden size).
    pub caption_projection_dim: u64,
    /// Width of the pooled CLIP-L ⊕ CLIP-G embedding (2048).
    pub pooled_projection_dim: u64,
    /// Side of the fixed position table (None: sample_size / patch_size, non-persistent).
    pub pos_embed_max_size: Option<u64>,
    /// Blocks with the second self-attention (sorted, unique).
    pub dual_attention_layers: Vec<u64>,
    /// Per-head q/k RMSNorm (`"rms_norm"`).
    pub qk_norm: bool,
}

impl Sd3Dims {
    pub fn inner(&self) -> u64 {
        self.num_attention_heads * self.attention_head_dim
    }
}

pub(crate) fn from_config(cfg: &mut Cfg) -> Result<Sd3Dims, SpecError> {
    let sample_size = cfg.int("sample_size", 128, 1, MAX_SIDE)?;
    let patch_size = cfg.int("patch_size", 2, 1, MAX_PATCH)?;
    let in_channels = cfg.int("in_channels", 16, 1, MAX_DIM)?;
    let num_layers = cfg.int("num_layers", 18, 1, MAX_LAYERS)?;
    let head_dim = cfg.int("attention_head_dim", 64, 1, MAX_DIM)?;
    let heads = cfg.int("num_attention_heads", 18, 1, MAX_DIM)?;
    let joint = cfg.int("joint_attention_dim", 4096, 1, MAX_DIM)?;
    let caption = cfg.int("caption_projection_dim", 1152, 1, MAX_DIM)?;
    let pooled = cfg.int("pooled_projection_dim", 2048, 1, MAX_DIM)?;
    let out_channels = cfg.out_channels(Some(16), in_channels)?;
    let pos_max = cfg.opt_int("pos_embed_max_size", Some(96), 1, MAX_SIDE)?;
    let mut dual = cfg.int_list(
        "dual_attention_layers",
        &[],
        MAX_LAYERS as usize,
        0,
        MAX_LAYERS - 1,
    )?;
    dual.sort_unstable();
    dual.dedup();
    let qk_norm = cfg.choice(
        "qk_norm",
        None,
        &[None, Some("rms_norm")],
        " (SD3 and SD3.5 use null or rms_norm)",
    )?;
    let d = Sd3Dims {
        num_layers,
        num_attention_heads: heads,
        attention_head_dim: head_dim,
        in_channels,
        out_channels,
        sample_size,
        patch_size,
        joint_attention_dim: joint,
        caption_projection_dim: caption,
        pooled_projection_dim: pooled,
        pos_embed_max_size: pos_max,
        dual_attention_layers: dual,
        qk_norm: qk_norm.is_some(),
    };
    check_inner(d.inner())?;
    if pos_max.is_none() {
        check_patch(sample_size, patch_size)?;
    }
    let why = "that the joint blocks' context stream has";
    check_hidden("caption_projection_dim", caption, d.inner(), why)?;
    if let Some(&i) = d.dual_attention_layers.iter().find(|&&i| i >= num_layers) {
        return Err(SpecError::invalid(
            "dual_attention_layers",
            format!(
                "names block {i}; allowed: block indices from 0 to {}",
                num_layers - 1
            ),
        ));
    }
    Ok(d)
}

impl FamilyDims for Sd3Dims {
    /// `pos_embed` (PatchEmbed), `time_text_embed`, `context_embedder`, the joint blocks, `norm_out`,
    /// `proj_out`, then the position buffer.
    fn table(&self, t: &mut Table) {
        let d = self;
        let dim = d.inner();
        let p = d.patch_size;
        let hd = d.attention_head_dim;
        t.patch_embed("pos_embed", d.in_channels, dim, p);
        // CombinedTimestepTextProjEmbeddings: TimestepEmbedding(256, dim) + PixArtAlphaTextProjection.
        t.combined_timestep_text_proj_embeddings(
            "time_text_embed",
            dim,
            d.pooled_projection_dim,
            false,
        );
        let (c, joint) = (d.caption_projection_dim, d.joint_attention_dim);
        t.top_linear("context_embedder", c, joint, Group::TextEmbed);
        for i in 0..d.num_layers {
            let b = format!("transformer_blocks.{i}");
            let (g, blk) = (Group::Blocks, Some(i as u32));
            let last = i + 1 == d.num_layers;
            let dual = d.dual_attention_layers.binary_search(&i).is_ok();
            // AdaLayerNormZero: Linear(dim, 6dim); SD35AdaLayerNormZeroX: Linear(dim, 9dim).
            if dual {
                t.sd35_ada_layer_norm_zero_x(&format!("{b}.norm1"), dim, g, blk);
            } else {
                t.ada_layer_norm_zero(&format!("{b}.norm1"), dim, None, g, blk);
            }
            // context_pre_only: AdaLayerNormContinuous(dim, dim) = Linear(dim, 2dim).
            if last {
                t.ada_layer_norm_continuous(&format!("{b}.norm1_context"), dim, g, blk);
            } else {
                t.ada_layer_norm_zero(&format!("{b}.norm1_context"), dim, None, g, blk);
            }
            // Attention(added_kv_proj_dim=dim, context_pre_only=last). The table lists the q/k
            // RMSNorms after the projections (diffusers registers norm_q and norm_k first).
            let attn = format!("{b}.attn");
            for proj in [
                "to_q",
                "to_k",
                "to_v",
                "add_k_proj",
                "add_v_proj",
                "add_q_proj",
            ] {
                t.linear(&format!("{attn}.{proj}"), dim, dim, true, g, blk);
            }
            t.linear(&format!("{attn}.to_out.0"), dim, dim, true, g, blk);
            if !last {
                t.linear(&format!("{attn}.to_add_out"), dim, dim, true, g, blk);
            }
            if d.qk_norm {
                let norms = ["norm_q", "norm_k", "norm_added_q", "norm_added_k"];
                t.rms_norms(&attn, &norms, hd, g, blk);
            }
            if dual {
                let attn2 = format!("{b}.attn2");
                t.attention(&attn2, Attn::self_attn(dim, true), g, blk);
                if d.qk_norm {
                    t.rms_norms(&attn2, &["norm_q", "norm_k"], hd, g, blk);
                }
            }
            t.feed_forward(&format!("{b}.ff"), dim, 4 * dim, g, blk);
            if !last {
                t.feed_forward(&format!("{b}.ff_context"), dim, 4 * dim, g, blk);
            }
        }
        t.ada_layer_norm_continuous("norm_out", dim, Group::FinalLayer, None);
        t.top_linear("proj_out", p * p * d.out_channels, dim, Group::FinalLayer);
        let (side, kind) = match d.pos_embed_max_size {
            Some(m) => (m, TensorKind::Buffer),
            None => (d.sample_size / p, TensorKind::BufferNonPersistent),
        };
        t.patch_embed_pos_embed("pos_embed", side, dim, kind);
    }

    /// SD3 VAE f8c16; CLIP-L ⊕ CLIP-G 77 + T5-XXL 77 (`train_dreambooth_sd3.py`
    /// `--max_sequence_length 77`).
    fn geometry(&self, _name: &str) -> Geometry {
        let d = self;
        let clip = TextEncoder {
            name: "CLIP-L ⊕ CLIP-G",
            default_tokens: 77,
            width: d.joint_attention_dim,
            sequence: true,
        };
        let t5 = TextEncoder::t5(77, d.joint_attention_dim);
        let dims = [
            d.num_layers,
            d.inner(),
            d.num_attention_heads,
            d.patch_size,
            d.in_channels,
        ];
        diffusers_f8(dims, vec![clip, t5])
    }

    /// StableDiffusion3Pipeline's default: `sample_size` × the VAE's 8 (SD3, SD3.5: 128 → 1024²).
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

    /// SD3.5's dual-attention (MMDiT-X) and plain joint blocks; one kind without them.
    fn block_kinds(&self) -> Vec<(&'static str, u64)> {
        let dual = self.dual_attention_layers.len() as u64;
        if dual == 0 {
            vec![("block", self.num_layers)]
        } else {
            vec![
                ("dual-attention block", dual),
                ("joint block", self.num_layers.saturating_sub(dual)),
            ]
        }
    }

    /// Without dual-attention blocks, the first N; with them, the first N dual-attention
    /// blocks and the first N joint blocks, in their order.
    fn keep_blocks(&mut self, counts: &[u64]) {
        if self.dual_attention_layers.is_empty() {
            self.num_layers = counts[0];
            return;
        }
        // Walk the blocks in order, keeping each while its kind's count lasts.
        let (mut dual_left, mut joint_left) = (counts[0], counts[1]);
        let mut dual = Vec::new();
        let mut kept = 0u64;
        for i in 0..self.num_layers {
            if self.dual_attention_layers.contains(&i) {
                if dual_left > 0 {
                    dual_left -= 1;
                    dual.push(kept);
                    kept += 1;
                }
            } else if joint_left > 0 {
                joint_left -= 1;
                kept += 1;
            }
        }
        self.num_layers = kept;
        self.dual_attention_layers = dual;
    }
}
