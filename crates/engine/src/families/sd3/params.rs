//! SD3's geometry beyond [`Dims`] and its parameter inventory, named and ordered as the budget's
//! table (`ditmem_budget::denoiser::param_table`, from `ditmem_budget::families::sd3`).
//!
//! Initialisation (drawn in f64 from the seed and the name, as for the DiT and PixArt): every
//! linear xavier-uniform with zero biases (diffusers' SD3 keeps PyTorch's default init, of that
//! scale, with no adaLN-Zero zeros: gates of order one, so the gradients through two gated
//! residuals do not underflow fp16 in a first step, as they did with normal(0, 0.02)
//! modulation), `proj_out` normal(0, 0.02); the q/k RMSNorm weights ones; the sin-cos table of the `pos_embed_max_size` grid
//! (frozen; diffusers' persistent `pos_embed.pos_embed` buffer, cropped to the token grid at
//! run time).

use ditmem_budget::{Sd3Dims, Spec};

use crate::error::{EngineError, Result};
use crate::families::config::{no_dropout, patch_conv};
use crate::families::lora::{adapt, LoraPlan};
use crate::shapes::{Dims, Init, Inventory, ParamShape};

/// Width of diffusers' `Timesteps(256)` sinusoid.
pub const SD3_FREQ: usize = 256;

/// What an SD3 step needs beyond [`Dims`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sd3Geom {
    /// Caption tokens T (the sequence encoders' counts summed: CLIP ⊕ T5 along the tokens).
    pub text_tokens: usize,
    /// Width of the cached caption (`joint_attention_dim`).
    pub text_width: usize,
    /// Width of the cached pooled embedding (`pooled_projection_dim`).
    pub pooled_width: usize,
    /// Side of the position table (`pos_embed_max_size`, else the token grid's side).
    pub pos_side: usize,
    /// Whether the table is the token grid itself (no `pos_embed_max_size`).
    pub pos_is_grid: bool,
    /// `out_channels` of the config.
    pub out_channels: usize,
    /// Per-head q/k RMSNorm (`qk_norm: "rms_norm"`).
    pub qk_norm: bool,
    /// The dual-attention (MMDiT-X) blocks, SD3.5's `dual_attention_layers`: each has an
    /// `SD35AdaLayerNormZeroX` `norm1` (9·D) and the image-only self-attention `attn2`.
    pub dual: Vec<usize>,
    /// LoRA's rank and the modules it adapts ([`LoraPlan`]); None trains the full model.
    pub lora: Option<LoraPlan>,
}

impl Sd3Geom {
    /// Checks what the engine runs of an SD3 config and reads its geometry.
    pub fn new(spec: &Spec, d: &Sd3Dims) -> Result<Sd3Geom> {
        no_dropout(spec, "an SD3 model", "SD3")?;
        if d.out_channels < d.in_channels {
            return Err(EngineError::bad_input(
                "model.diffusers.out_channels",
                format!(
                    "{} is below in_channels {}; allowed: at least {}",
                    d.out_channels, d.in_channels, d.in_channels
                ),
            ));
        }
        let fm = ditmem_budget::denoiser::family(spec)?
            .ok_or_else(|| EngineError::bad_input("model.diffusers", "is missing"))?;
        let tokens = ditmem_budget::denoiser::text_tokens(spec, &fm.geometry());
        if tokens.is_empty() || tokens.contains(&0) {
            return Err(EngineError::bad_input(
                "workload.text_tokens",
                format!("{tokens:?}; allowed: positive counts (CLIP ⊕ CLIP, T5)"),
            ));
        }
        let t: u64 = tokens.iter().sum();
        let grid = spec.token_grid()?;
        let (rows, cols) = (grid.rows as usize, grid.cols as usize);
        let (pos_side, pos_is_grid) = match d.pos_embed_max_size {
            Some(m) => {
                let m = m as usize;
                if rows > m || cols > m {
                    return Err(EngineError::bad_input(
                        "model.diffusers.pos_embed_max_size",
                        format!(
                            "{m} is smaller than the {rows}×{cols} token grid; allowed: at least {}",
                            rows.max(cols)
                        ),
                    ));
                }
                (m, false)
            }
            None => {
                if rows != cols {
                    return Err(EngineError::bad_input(
                        "workload.image_size",
                        format!(
                            "a {rows}×{cols} token grid without pos_embed_max_size; allowed: a \
                             square grid, or set pos_embed_max_size"
                        ),
                    ));
                }
                (rows, true)
            }
        };
        Ok(Sd3Geom {
            text_tokens: t as usize,
            text_width: d.joint_attention_dim as usize,
            pooled_width: d.pooled_projection_dim as usize,
            pos_side,
            pos_is_grid,
            out_channels: d.out_channels as usize,
            qk_norm: d.qk_norm,
            dual: d
                .dual_attention_layers
                .iter()
                .map(|&i| i as usize)
                .collect(),
            lora: LoraPlan::of(spec),
        })
    }
}

/// The linears of a joint block in the table's order (diffusers names); the last block
/// (`context_pre_only`) has no `attn.to_add_out` and no `ff_context`.
pub fn block_linears(last: bool) -> Vec<&'static str> {
    let mut v = vec![
        "norm1.linear",
        "norm1_context.linear",
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.add_q_proj",
        "attn.to_out.0",
    ];
    if !last {
        v.push("attn.to_add_out");
    }
    v.extend(["ff.net.0.proj", "ff.net.2"]);
    if !last {
        v.extend(["ff_context.net.0.proj", "ff_context.net.2"]);
    }
    v
}

impl Sd3Geom {
    /// Whether block `i` is a dual-attention (MMDiT-X) block.
    pub fn is_dual(&self, i: usize) -> bool {
        self.dual.contains(&i)
    }
}

/// The linears of a dual-attention block's `attn2` (diffusers `Attention(query_dim=dim)`, a
/// self-attention over the image tokens), in the table's order.
pub const DUAL_LINEARS: [&str; 4] = ["attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0"];

/// The q/k RMSNorm weights of `attn2` (with `qk_norm`).
pub const DUAL_QK_NORMS: [&str; 2] = ["attn2.norm_q", "attn2.norm_k"];

/// The q/k RMSNorm weights of a block's attention (with `qk_norm`).
pub const QK_NORMS: [&str; 4] = [
    "attn.norm_q",
    "attn.norm_k",
    "attn.norm_added_q",
    "attn.norm_added_k",
];

/// Every tensor of the SD3 model of `spec`, in the budget's table order, then the frozen
/// position table.
pub fn param_shapes(d: &Dims, g: &Sd3Geom) -> Vec<ParamShape> {
    let h = d.hidden;
    let small = Init::Normal(0.02);
    let mut inv = Inventory::default();
    patch_conv(&mut inv, "pos_embed.proj", d, &[d.patch, d.patch]);
    let te = "time_text_embed.timestep_embedder";
    inv.linear(&format!("{te}.linear_1"), h, SD3_FREQ, Init::XavierUniform);
    inv.linear(&format!("{te}.linear_2"), h, h, Init::XavierUniform);
    let pe = "time_text_embed.text_embedder";
    inv.linear(
        &format!("{pe}.linear_1"),
        h,
        g.pooled_width,
        Init::XavierUniform,
    );
    inv.linear(&format!("{pe}.linear_2"), h, h, Init::XavierUniform);
    inv.linear("context_embedder", h, g.text_width, Init::XavierUniform);
    let hd = d.head_dim;
    for i in 0..d.depth {
        let b = format!("transformer_blocks.{i}");
        let last = i + 1 == d.depth;
        let dual = g.is_dual(i);
        for name in block_linears(last) {
            let (out, inp, init) = match name {
                // SD35AdaLayerNormZeroX: a second shift / scale / gate for attn2.
                "norm1.linear" if dual => (9 * h, h, Init::XavierUniform),
                "norm1.linear" => (6 * h, h, Init::XavierUniform),
                "norm1_context.linear" if last => (2 * h, h, Init::XavierUniform),
                "norm1_context.linear" => (6 * h, h, Init::XavierUniform),
                "ff.net.0.proj" | "ff_context.net.0.proj" => (d.mlp_hidden, h, Init::XavierUniform),
                "ff.net.2" | "ff_context.net.2" => (h, d.mlp_hidden, Init::XavierUniform),
                _ => (h, h, Init::XavierUniform),
            };
            inv.linear(&format!("{b}.{name}"), out, inp, init);
            // The table lists the q/k norms after the attention's output projections.
            let after = if last {
                "attn.to_out.0"
            } else {
                "attn.to_add_out"
            };
            if name == after {
                if g.qk_norm {
                    for n in QK_NORMS {
                        inv.tensor(format!("{b}.{n}.weight"), vec![hd], Init::Ones);
                    }
                }
                // Then attn2's projections and its q/k norms.
                if dual {
                    for n in DUAL_LINEARS {
                        inv.linear(&format!("{b}.{n}"), h, h, Init::XavierUniform);
                    }
                    if g.qk_norm {
                        for n in DUAL_QK_NORMS {
                            inv.tensor(format!("{b}.{n}.weight"), vec![hd], Init::Ones);
                        }
                    }
                }
            }
        }
    }
    inv.linear("norm_out.linear", 2 * h, h, Init::XavierUniform);
    let out = d.patch * d.patch * g.out_channels;
    inv.linear("proj_out", out, h, small);
    inv.sincos_table("pos_embed.pos_embed", (g.pos_side, g.pos_side), h);
    adapt(inv.shapes, g.lora.as_ref())
}
