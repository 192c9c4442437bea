//! PixArt's block, caption projection and output side (see the module docs of
//! [`super`] for the tensor list), on the engine's fused ops. `cd` is the compute dtype of the
//! matmuls and attention, `ad` the accumulation dtype of the residual stream, norms and
//! modulation; every linear is one fused node ([`LinearW`]).

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::families::cross::SelfCrossWeights;
use crate::layers::{
    cast_then_release, feed_forward_then_release, gated_then_release, linear_then_release,
    AttnImpl, BlockConfig, LinearW, LN_EPS,
};
use crate::ops::attention::separate::attention;
use crate::ops::{gelu_tanh, ln_modulate, AttnKeep};

/// The weights of one PixArt block (the order of
/// [`PIXART_BLOCK_LINEARS`](super::PIXART_BLOCK_LINEARS)): `ffn` is the feed-forward's two
/// linears.
pub type PixartBlockWeights = SelfCrossWeights<[LinearW; 2]>;

impl PixartBlockWeights {
    /// The weights from the `scale_shift_table`, attn1's then attn2's q, k, v, out and the
    /// feed-forward's two linears.
    pub fn new(table: Tensor, attn: [LinearW; 8], ffn: [LinearW; 2]) -> Self {
        SelfCrossWeights::with_ffn(table, attn, ffn)
    }
}

/// What the attention ops keep under the block's attention setting.
pub(crate) fn attn_keep(a: AttnImpl) -> AttnKeep {
    match a {
        AttnImpl::Materialized => AttnKeep::Probabilities,
        AttnImpl::RecomputeCore => AttnKeep::Nothing,
        AttnImpl::MemoryEfficient => AttnKeep::LogSumExp,
    }
}

/// One PixArt block: x (b, s, D) and t6 (b, 6D) in `ad`, the projected caption y (b·T, D) in
/// `cd` → x (b, s, D) in `ad`. Every intermediate is a local until the block returns (the
/// budget's twin binds the same tensors).
pub fn pixart_block_forward(
    x: &Tensor,
    t6: &Tensor,
    y: &Tensor,
    w: &PixartBlockWeights,
    cfg: &BlockConfig,
) -> Result<Tensor> {
    let b = x.dim(0)?;
    let (cd, ad) = (cfg.compute, cfg.accum);
    let keep = attn_keep(cfg.attn);

    // Self-attention.
    let (m, [_h1, q, k, v]) = w.self_attn_inputs(x, t6, cd)?;
    let o = attention(&q, &k, &v, b, cfg.heads, keep)?;
    let p = w.o1.forward(&o)?;
    let x1 = gated_then_release(x, p, &m.gate_msa)?;

    // Cross-attention to the caption (PixArt's attn2 reads the stream without a norm).
    let [_xq, _q2, _o2, p2, ones] = w.unnormed_cross(&x1, y, cfg.heads, keep, (cd, ad))?;
    let x2 = gated_then_release(&x1, p2, &ones)?;

    // MLP.
    let h2 = ln_modulate(&x2, &m.shift_mlp, &m.scale_mlp, LN_EPS, cd)?;
    let [fc1, fc2] = &w.ffn;
    let f2 = feed_forward_then_release(&h2, fc1, fc2)?;
    gated_then_release(&x2, f2, &m.gate_mlp)
}

/// The output side's weights: the final `scale_shift_table` (2, D) in `ad` and `proj_out`.
#[derive(Debug, Clone)]
pub struct PixartFinalWeights {
    pub table: Tensor,
    pub proj_out: LinearW,
}

/// `norm_out` + `(table[None] + emb[:, None]).chunk(2)` modulation + `proj_out`: x (b, s, D)
/// and the embedded timestep (b, D) in `ad` → (b·s, p²·C_out) in `ad`.
pub fn final_forward(
    x: &Tensor,
    emb: &Tensor,
    w: &PixartFinalWeights,
    cd: DType,
    ad: DType,
) -> Result<Tensor> {
    let (b, _, h) = x.dims3()?;
    let e = emb.unsqueeze(1)?;
    let t = w.table.unsqueeze(0)?;
    let ss = e.broadcast_add(&t)?.reshape((b, 2 * h))?;
    let (shift, scale) = (ss.narrow(1, 0, h)?, ss.narrow(1, h, h)?);
    let hx = ln_modulate(x, &shift, &scale, LN_EPS, cd)?;
    let y = linear_then_release(&w.proj_out, &hx)?;
    cast_then_release(y, ad)
}

/// `caption_projection` (PixArtAlphaTextProjection): linear_1, GELU-tanh, linear_2.
#[derive(Debug, Clone)]
pub struct CaptionWeights {
    pub linear_1: LinearW,
    pub linear_2: LinearW,
}

/// The caption (b·T, C) in `cd` → (b·T, D) in `cd`.
pub fn caption_forward(cap: &Tensor, w: &CaptionWeights) -> Result<Tensor> {
    let c1 = w.linear_1.forward(cap)?;
    let g = gelu_tanh(&c1)?;
    w.linear_2.forward(&g)
}
