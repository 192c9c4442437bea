//! Flux's geometry beyond [`Dims`] and its parameter inventory, named and ordered as diffusers
//! registers them (the budget's table, `ditmem_budget::denoiser::param_table`).
//!
//! Initialisation (drawn in f64 from the seed and the name, as for the DiT): linears
//! xavier-uniform with zero biases; the embedders' MLPs and every adaLN `linear` normal(0, 0.02);
//! the q/k RMSNorm weights ones (torch's init).

use ditmem_budget::{FluxDims, Spec};

use crate::error::{EngineError, Result};
use crate::families::config::no_dropout;
use crate::families::lora::{adapt, LoraPlan};
use crate::shapes::{Dims, Init, Inventory, ParamShape};

/// Width of diffusers' `Timesteps(256)` sinusoid (timestep and guidance).
pub const FLUX_FREQ: usize = 256;

/// `FluxPosEmbed`'s θ.
pub const ROPE_THETA: f64 = 10000.0;

/// The guidance scale the synthetic batch feeds a guidance-distilled model (FLUX.1-dev's
/// default 3.5, times diffusers' 1000 before the sinusoid).
pub const GUIDANCE: f64 = 3500.0;

/// The linears of a double-stream block in forward order (diffusers names), without the q/k
/// norms.
pub const DOUBLE_LINEARS: [&str; 14] = [
    "norm1.linear",
    "norm1_context.linear",
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_out.0",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
];

/// The q/k RMSNorm weights of a double-stream block.
pub const DOUBLE_NORMS: [&str; 4] = [
    "attn.norm_q",
    "attn.norm_k",
    "attn.norm_added_q",
    "attn.norm_added_k",
];

/// The linears of a single-stream block in forward order.
pub const SINGLE_LINEARS: [&str; 6] = [
    "norm.linear",
    "proj_mlp",
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "proj_out",
];

/// The q/k RMSNorm weights of a single-stream block.
pub const SINGLE_NORMS: [&str; 2] = ["attn.norm_q", "attn.norm_k"];

/// What a Flux step needs beyond [`Dims`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FluxGeom {
    /// Double-stream blocks (they come first).
    pub double: usize,
    /// Single-stream blocks.
    pub single: usize,
    /// T5 tokens T in the sequence.
    pub text_tokens: usize,
    /// Width of the T5 embeddings (`joint_attention_dim`).
    pub text_width: usize,
    /// Width of the pooled CLIP embedding (`pooled_projection_dim`).
    pub pooled_width: usize,
    pub guidance: bool,
    /// RoPE axes (sum: the head width).
    pub axes: Vec<usize>,
    /// Features per packed token (`in_channels`, 64 for the real model).
    pub in_features: usize,
    /// Features per output token (`patch_size² · out_channels`).
    pub out_features: usize,
    /// LoRA's rank and the modules it adapts ([`LoraPlan`]); None trains the full model.
    pub lora: Option<LoraPlan>,
}

impl FluxGeom {
    /// Checks what the engine runs of a Flux config and reads its geometry.
    pub fn new(spec: &Spec, d: &FluxDims) -> Result<FluxGeom> {
        if d.patch_size != 1 {
            return Err(EngineError::unsupported(
                "model.diffusers.patch_size",
                format!(
                    "{}; the engine packs 2×2 latent pixels per token (patch_size 1, as FLUX.1)",
                    d.patch_size
                ),
            ));
        }
        if d.out_channels != d.in_channels {
            return Err(EngineError::unsupported(
                "model.diffusers.out_channels",
                format!(
                    "{} ≠ in_channels {}; the engine predicts the packed latent itself",
                    d.out_channels, d.in_channels
                ),
            ));
        }
        if d.num_single_layers == 0 {
            return Err(EngineError::unsupported(
                "model.diffusers.num_single_layers = 0",
                "the engine's Flux ends on the joint stream of its single-stream blocks; use at \
                 least one",
            ));
        }
        no_dropout(spec, "a Flux model", "Flux")?;
        let fm = ditmem_budget::denoiser::family(spec)?
            .ok_or_else(|| EngineError::bad_input("model.diffusers", "is missing"))?;
        let geo = fm.geometry();
        let tokens = ditmem_budget::denoiser::text_tokens(spec, &geo);
        // The CLIP encoder gives only the pooled vector; the T5 tokens enter the sequence.
        let seq: Vec<u64> = geo
            .text
            .iter()
            .zip(&tokens)
            .filter(|(e, _)| e.sequence)
            .map(|(_, &n)| n)
            .collect();
        let t = match (seq.as_slice(), tokens.len() == geo.text.len()) {
            ([t], true) if *t > 0 => *t as usize,
            _ => {
                return Err(EngineError::bad_input(
                    "workload.text_tokens",
                    format!(
                        "{tokens:?}; allowed: two positive counts (CLIP-L, pooled; T5 in the \
                         sequence)"
                    ),
                ))
            }
        };
        let u = |v: u64| v as usize;
        Ok(FluxGeom {
            double: u(d.num_layers),
            single: u(d.num_single_layers),
            text_tokens: t,
            text_width: u(d.joint_attention_dim),
            pooled_width: u(d.pooled_projection_dim),
            guidance: d.guidance_embeds,
            axes: d.axes_dims_rope.iter().map(|&a| u(a)).collect(),
            in_features: u(d.in_channels),
            out_features: u(d.patch_size * d.patch_size * d.out_channels),
            lora: LoraPlan::of(spec),
        })
    }
}

/// Every tensor of the Flux model of `spec`, in the budget's table order.
pub fn param_shapes(d: &Dims, g: &FluxGeom) -> Vec<ParamShape> {
    let h = d.hidden;
    let dh = d.head_dim;
    let small = Init::Normal(0.02);
    let mut inv = Inventory::default();
    let tte = "time_text_embed";
    let mlp = |inv: &mut Inventory, p: String, inp| {
        inv.linear(&format!("{p}.linear_1"), h, inp, small);
        inv.linear(&format!("{p}.linear_2"), h, h, small);
    };
    mlp(&mut inv, format!("{tte}.timestep_embedder"), FLUX_FREQ);
    if g.guidance {
        mlp(&mut inv, format!("{tte}.guidance_embedder"), FLUX_FREQ);
    }
    mlp(&mut inv, format!("{tte}.text_embedder"), g.pooled_width);
    let xavier = Init::XavierUniform;
    inv.linear("context_embedder", h, g.text_width, xavier);
    inv.linear("x_embedder", h, g.in_features, xavier);
    let norm = |inv: &mut Inventory, p: &str| {
        inv.tensor(format!("{p}.weight"), vec![dh], Init::Ones);
    };
    for i in 0..g.double {
        let b = format!("transformer_blocks.{i}");
        inv.linear(&format!("{b}.norm1.linear"), 6 * h, h, small);
        inv.linear(&format!("{b}.norm1_context.linear"), 6 * h, h, small);
        norm(&mut inv, &format!("{b}.attn.norm_q"));
        norm(&mut inv, &format!("{b}.attn.norm_k"));
        for p in ["to_q", "to_k", "to_v", "to_out.0"] {
            inv.linear(&format!("{b}.attn.{p}"), h, h, xavier);
        }
        norm(&mut inv, &format!("{b}.attn.norm_added_q"));
        norm(&mut inv, &format!("{b}.attn.norm_added_k"));
        for p in ["add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"] {
            inv.linear(&format!("{b}.attn.{p}"), h, h, xavier);
        }
        for ff in ["ff", "ff_context"] {
            inv.linear(&format!("{b}.{ff}.net.0.proj"), 4 * h, h, xavier);
            inv.linear(&format!("{b}.{ff}.net.2"), h, 4 * h, xavier);
        }
    }
    for i in 0..g.single {
        let b = format!("single_transformer_blocks.{i}");
        inv.linear(&format!("{b}.norm.linear"), 3 * h, h, small);
        inv.linear(&format!("{b}.proj_mlp"), 4 * h, h, xavier);
        inv.linear(&format!("{b}.proj_out"), h, 5 * h, xavier);
        norm(&mut inv, &format!("{b}.attn.norm_q"));
        norm(&mut inv, &format!("{b}.attn.norm_k"));
        for p in ["to_q", "to_k", "to_v"] {
            inv.linear(&format!("{b}.attn.{p}"), h, h, xavier);
        }
    }
    inv.linear("norm_out.linear", 2 * h, h, small);
    inv.linear("proj_out", g.out_features, h, small);
    adapt(inv.shapes, g.lora.as_ref())
}

/// `FluxPosEmbed`'s ids, three positions per token: (0, 0, 0) for each of the `text_tokens`
/// text tokens, then (0, row, column) for each image token, row-major.
pub fn rope_ids(text_tokens: usize, d: &Dims) -> Vec<f64> {
    let n = text_tokens + d.rows * d.cols;
    let mut ids = Vec::with_capacity(3 * n);
    ids.resize(3 * text_tokens, 0.0);
    for k in 0..d.rows * d.cols {
        ids.extend([0.0, (k / d.cols) as f64, (k % d.cols) as f64]);
    }
    ids
}
