//! Wan's geometry beyond [`Dims`] and its parameter inventory, named and ordered as diffusers
//! registers them (the budget's table, `ditmem_budget::denoiser::param_table`).
//!
//! Initialisation (drawn in f64 from the seed and the name, as for the DiT and PixArt):
//! linears and the Conv3d patch embedding xavier-uniform with zero biases; the timestep MLP,
//! `time_proj` and `proj_out` normal(0, 0.02); every `scale_shift_table` randn / √D
//! (diffusers' init); the RMSNorm and `norm2` weights ones and `norm2`'s bias zeros (torch's
//! defaults); the 3-D RoPE buffers `rope.freqs_cos` / `rope.freqs_sin` (frozen, diffusers'
//! non-persistent buffers, counted as the budget counts them).

use ditmem_budget::{Spec, WanDims};

use crate::error::{EngineError, Result};
use crate::families::config::{caption_tokens, no_dropout, patch_conv};
use crate::families::cross::self_cross_block_linears;
use crate::families::lora::{adapt, LoraPlan};
use crate::shapes::{Dims, Init, Inventory, ParamShape};

/// RoPE's base θ (`WanRotaryPosEmbed`'s default).
pub(crate) const WAN_ROPE_THETA: f64 = 10000.0;
/// The norms' eps (the config's `eps`, 1e-6 in every released Wan config).
pub(crate) const WAN_EPS: f64 = 1e-6;

/// The linears of a Wan block in forward order (diffusers names).
pub const WAN_BLOCK_LINEARS: [&str; 10] = self_cross_block_linears(["ffn.net.0.proj", "ffn.net.2"]);

/// The RMSNorm weights of a Wan block (q/k norms of both attentions).
pub const WAN_BLOCK_NORMS: [&str; 4] = [
    "attn1.norm_q",
    "attn1.norm_k",
    "attn2.norm_q",
    "attn2.norm_k",
];

/// What a Wan step needs beyond [`Dims`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WanGeom {
    /// umT5 tokens T (`workload.text_tokens`, else 512).
    pub text_tokens: usize,
    /// `text_dim`: width of the cached text embeddings.
    pub text_dim: usize,
    /// `ffn_dim`.
    pub ffn: usize,
    /// `freq_dim`: width of the timestep sinusoid.
    pub freq: usize,
    /// Latent frames F' ((frames − 1)/4 + 1).
    pub frames: usize,
    /// `out_channels`.
    pub out_channels: usize,
    /// `cross_attn_norm`: an affine LayerNorm before the cross-attention.
    pub cross_attn_norm: bool,
    /// `rope_max_seq_len`: rows of the RoPE buffers.
    pub rope_max: usize,
    /// `attention_head_dim`.
    pub head_dim: usize,
    /// LoRA's rank and the modules it adapts ([`LoraPlan`]); None trains the full model.
    pub lora: Option<LoraPlan>,
}

impl WanGeom {
    /// Checks what the engine runs of a Wan config and reads its geometry.
    pub fn new(spec: &Spec, d: &WanDims) -> Result<WanGeom> {
        let [pt, ph, pw] = d.patch_size;
        if pt != 1 || ph != pw {
            return Err(EngineError::unsupported(
                format!("model.diffusers.patch_size = {:?}", d.patch_size),
                "the engine's Wan patchifies one latent frame at a time with a square patch; \
                 use [1, p, p]",
            ));
        }
        no_dropout(spec, "a Wan model", "Wan")?;
        let t = caption_tokens(spec, "umT5")?;
        let frames = spec.latent_frames()? as usize;
        let u = |v: u64| v as usize;
        let g = WanGeom {
            text_tokens: t,
            text_dim: u(d.text_dim),
            ffn: u(d.ffn_dim),
            freq: u(d.freq_dim),
            frames,
            out_channels: u(d.out_channels),
            cross_attn_norm: d.cross_attn_norm,
            rope_max: u(d.rope_max_seq_len),
            head_dim: u(d.attention_head_dim),
            lora: LoraPlan::of(spec),
        };
        if !g.freq.is_multiple_of(2) {
            return Err(EngineError::unsupported(
                format!("model.diffusers.freq_dim = {}", g.freq),
                "the timestep sinusoid is cos and sin halves; use an even freq_dim",
            ));
        }
        let grid = spec.token_grid()?;
        let longest = (grid.rows.max(grid.cols) as usize).max(frames);
        if longest > g.rope_max {
            return Err(EngineError::bad_input(
                "model.diffusers.rope_max_seq_len",
                format!(
                    "{} is shorter than the token grid's longest axis {longest}; allowed: ≥ {longest}",
                    g.rope_max
                ),
            ));
        }
        Ok(g)
    }

    /// Channel pairs per axis (frames, rows, columns) of the 3-D RoPE: diffusers gives the
    /// height and the width 2·(d_h // 6) channels each and the frames the rest.
    pub(crate) fn rope_pairs(&self) -> [usize; 3] {
        let hw = 2 * (self.head_dim / 6);
        let t = self.head_dim - 2 * hw;
        [t / 2, hw / 2, hw / 2]
    }
}

/// The angle of channel pair `k` of an axis of `pairs` pairs at position `pos`:
/// pos·θ^(−2k/dim), dim = 2·pairs (`get_1d_rotary_pos_embed` in float64).
fn angle(pos: usize, k: usize, pairs: usize) -> f64 {
    let dim = (2 * pairs) as f64;
    pos as f64 * WAN_ROPE_THETA.powf(-((2 * k) as f64) / dim)
}

/// The per-step RoPE tables of a (frames, rows, cols) token grid: (s, d_h/2) cos and sin in
/// f64, row = token (f, r, c) row-major as the patch embedding lays them out, one angle per
/// channel pair (frames' pairs, then rows', then columns').
pub fn rope_tables(g: &WanGeom, rows: usize, cols: usize) -> (Vec<f64>, Vec<f64>) {
    let [pf, pr, pc] = g.rope_pairs();
    let half = pf + pr + pc;
    let s = g.frames * rows * cols;
    let (mut cos, mut sin) = (Vec::with_capacity(s * half), Vec::with_capacity(s * half));
    for f in 0..g.frames {
        for r in 0..rows {
            for c in 0..cols {
                for (pos, pairs) in [(f, pf), (r, pr), (c, pc)] {
                    for k in 0..pairs {
                        let a = angle(pos, k, pairs);
                        cos.push(a.cos());
                        sin.push(a.sin());
                    }
                }
            }
        }
    }
    (cos, sin)
}

/// diffusers' `rope.freqs_cos` / `rope.freqs_sin` buffers (`rope_max_seq_len`, d_h): for each
/// position the frames', rows' and columns' angles of that position, each repeated for both
/// channels of its pair.
pub(crate) fn rope_buffer(head_dim: usize, max_len: usize, cos: bool) -> Vec<f64> {
    let hw = 2 * (head_dim / 6);
    let pairs = [(head_dim - 2 * hw) / 2, hw / 2, hw / 2];
    let mut v = Vec::with_capacity(max_len * head_dim);
    for pos in 0..max_len {
        for p in pairs {
            for k in 0..p {
                let a = angle(pos, k, p);
                let x = if cos { a.cos() } else { a.sin() };
                v.extend([x, x]);
            }
        }
    }
    v
}

/// Every tensor of the Wan model of `spec`, in the budget's table order (the RoPE buffers,
/// frozen, last).
pub fn param_shapes(d: &Dims, g: &WanGeom) -> Vec<ParamShape> {
    let h = d.hidden;
    let table_init = Init::Normal(1.0 / (h as f64).sqrt());
    let small = Init::Normal(0.02);
    let mut inv = Inventory::default();
    inv.tensor("scale_shift_table".into(), vec![1, 2, h], table_init);
    patch_conv(&mut inv, "patch_embedding", d, &[1, d.patch, d.patch]);
    let ce = "condition_embedder";
    inv.linear(&format!("{ce}.time_embedder.linear_1"), h, g.freq, small);
    inv.linear(&format!("{ce}.time_embedder.linear_2"), h, h, small);
    inv.linear(&format!("{ce}.time_proj"), 6 * h, h, small);
    let te = format!("{ce}.text_embedder");
    let xu = Init::XavierUniform;
    inv.linear(&format!("{te}.linear_1"), h, g.text_dim, xu);
    inv.linear(&format!("{te}.linear_2"), h, h, xu);
    for i in 0..d.depth {
        let b = format!("blocks.{i}");
        inv.tensor(format!("{b}.scale_shift_table"), vec![1, 6, h], table_init);
        for attn in ["attn1", "attn2"] {
            for proj in ["to_q", "to_k", "to_v", "to_out.0"] {
                inv.linear(&format!("{b}.{attn}.{proj}"), h, h, xu);
            }
            for norm in ["norm_q", "norm_k"] {
                inv.tensor(format!("{b}.{attn}.{norm}.weight"), vec![h], Init::Ones);
            }
        }
        if g.cross_attn_norm {
            inv.tensor(format!("{b}.norm2.weight"), vec![h], Init::Ones);
            inv.tensor(format!("{b}.norm2.bias"), vec![h], Init::Zeros);
        }
        inv.linear(&format!("{b}.ffn.net.0.proj"), g.ffn, h, xu);
        inv.linear(&format!("{b}.ffn.net.2"), h, g.ffn, xu);
    }
    let out = d.patch * d.patch * g.out_channels;
    inv.linear("proj_out", out, h, small);
    for (name, cos) in [("rope.freqs_cos", true), ("rope.freqs_sin", false)] {
        inv.shapes.push(ParamShape {
            name: name.into(),
            shape: vec![g.rope_max, g.head_dim],
            init: Init::Rope3d { cos },
            trainable: false,
        });
    }
    adapt(inv.shapes, g.lora.as_ref())
}
