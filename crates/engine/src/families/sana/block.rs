//! Sana's block, caption side and output side (see the module docs of [`super`] for the tensor
//! list), on the engine's fused ops. `cd` is the compute dtype of the matmuls and attention, `ad`
//! the accumulation dtype of the residual stream, norms and modulation; every linear (and every
//! 1×1 conv, as its (out, in) view) is one fused node ([`LinearW`]).

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::families::cross::SelfCrossWeights;
use crate::families::pixart::block::attn_keep;
use crate::layers::{mlp_linear, BlockConfig, LinearW, LN_EPS};
use crate::ops::dwconv::silu_dwconv3x3;
use crate::ops::glu::glu_silu;
use crate::ops::linear_attention::linear_attention;
use crate::ops::mix_ffn::mix_ffn;
use crate::ops::rms_norm;
use crate::ops::{gated_residual, gelu_tanh, ln_modulate};

use super::params::CAPTION_NORM_EPS;

/// The weights of one Sana block: `ffn` is its Mix-FFN. A linear without a bias in diffusers
/// (attn1's q/k/v when `attention_bias` is false, `conv_point`) carries a zero bias made by the
/// block ([`zero_bias`]).
pub type SanaBlockWeights = SelfCrossWeights<MixFfnWeights>;

/// The Mix-FFN's (GLUMBConv's) weights.
#[derive(Debug, Clone)]
pub struct MixFfnWeights {
    pub conv_inverted: LinearW,
    /// `conv_depth` weight (2H, 1, 3, 3) and bias (2H), as the fused linears read weights.
    pub conv_depth: (Tensor, Tensor),
    pub conv_point: LinearW,
}

impl SanaBlockWeights {
    /// The weights from the `scale_shift_table`, attn1's then attn2's q, k, v, out and the
    /// Mix-FFN's `conv_inverted`, `conv_depth` (weight, bias) and `conv_point`.
    pub fn new(
        table: Tensor,
        attn: [LinearW; 8],
        conv_inverted: LinearW,
        conv_depth: (Tensor, Tensor),
        conv_point: LinearW,
    ) -> Self {
        let ffn = MixFfnWeights {
            conv_inverted,
            conv_depth,
            conv_point,
        };
        SelfCrossWeights::with_ffn(table, attn, ffn)
    }
}

/// The geometry a block reads beyond [`BlockConfig`].
#[derive(Debug, Clone, Copy)]
pub struct SanaBlockGeom {
    /// The token grid (rows, cols) the depthwise conv runs on.
    pub rows: usize,
    pub cols: usize,
    /// Cross-attention heads.
    pub cross_heads: usize,
}

/// The zero bias (`n`) a bias-less linear of weight dtype `dt` reads: a constant of the block,
/// freed when it returns.
pub(crate) fn zero_bias(n: usize, dt: DType) -> Result<Tensor> {
    Ok(Tensor::zeros(n, dt, &candle_core::Device::Cpu)?)
}

/// One Sana block: x (b, s, D) and t6 (b, 6D) in `ad`, the normed caption y (b·T, D) in `cd` →
/// x (b, s, D) in `ad`. Every intermediate is a local until the block returns (the budget's
/// twin binds the same tensors).
pub fn sana_block_forward(
    x: &Tensor,
    t6: &Tensor,
    y: &Tensor,
    w: &SanaBlockWeights,
    cfg: &BlockConfig,
    geo: &SanaBlockGeom,
) -> Result<Tensor> {
    let b = x.dim(0)?;
    let (cd, ad) = (cfg.compute, cfg.accum);
    let keep = attn_keep(cfg.attn);

    // Linear self-attention.
    let (m, [_h1, q, k, v]) = w.self_attn_inputs(x, t6, cd)?;
    let o = linear_attention(&q, &k, &v, b, cfg.heads)?;
    let p = w.o1.forward(&o)?;
    let x1 = gated_residual(x, &p, &m.gate_msa)?;

    // Cross-attention to the caption (softmax; attn2 reads the stream without a norm).
    let [_xq, _q2, _o2, p2, ones] = w.unnormed_cross(&x1, y, geo.cross_heads, keep, (cd, ad))?;
    let x2 = gated_residual(&x1, &p2, &ones)?;

    // Mix-FFN (GLUMBConv) on the channels-last token rows.
    let h2 = ln_modulate(&x2, &m.shift_mlp, &m.scale_mlp, LN_EPS, cd)?;
    let f2 = mix_ffn_forward(&h2, &w.ffn, geo)?;
    Ok(gated_residual(&x2, &f2, &m.gate_mlp)?)
}

/// The Mix-FFN on h2 (b·s, D): one fused node ([`mix_ffn`]: keeps `conv_inverted`'s output
/// only, no wide gradient in candle's store) where both linears allow it (no LoRA on either,
/// see [`mlp_linear`]), else composed of the linears, [`silu_dwconv3x3`] and [`glu_silu`] (each
/// a local until `conv_point`'s output exists). The same values either way, bit for bit.
fn mix_ffn_forward(h2: &Tensor, w: &MixFfnWeights, geo: &SanaBlockGeom) -> Result<Tensor> {
    let t = h2.track_op();
    let (wd, bd) = &w.conv_depth;
    match (
        mlp_linear(&w.conv_inverted, t),
        mlp_linear(&w.conv_point, t),
    ) {
        (Some(inv), Some(point)) => Ok(mix_ffn(h2, inv, (wd, bd), point, (geo.rows, geo.cols))?),
        _ => {
            let f1 = w.conv_inverted.forward(h2)?;
            let c2 = silu_dwconv3x3(&f1, wd, bd, geo.rows, geo.cols)?;
            let gl = glu_silu(&c2)?;
            w.conv_point.forward(&gl)
        }
    }
}

/// The output side's weights: the final `scale_shift_table` (2, D) in `ad` and `proj_out`
/// (PixArt's).
pub type SanaFinalWeights = crate::families::pixart::PixartFinalWeights;

/// `norm_out` (SanaModulatedNorm: LayerNorm, `(table[None] + emb[:, None]).chunk(2)`
/// modulation) + `proj_out`: PixArt's output side.
pub use crate::families::pixart::final_forward;

/// `caption_projection` (PixArtAlphaTextProjection: linear_1, GELU-tanh, linear_2) and
/// `caption_norm` (RMSNorm with a weight, eps 1e-5).
#[derive(Debug, Clone)]
pub struct SanaCaptionWeights {
    pub linear_1: LinearW,
    pub linear_2: LinearW,
    pub norm: Tensor,
}

/// The Gemma states (b·T, C) in `cd` → the normed caption (b·T, D) in `cd`.
pub fn caption_forward(cap: &Tensor, w: &SanaCaptionWeights) -> Result<Tensor> {
    let c1 = w.linear_1.forward(cap)?;
    let g = gelu_tanh(&c1)?;
    let c2 = w.linear_2.forward(&g)?;
    Ok(rms_norm(&c2, &w.norm, CAPTION_NORM_EPS)?)
}
