//! Wan's block, condition embedder and output side (see the module docs of [`super`] for the
//! tensor list), on the engine's fused ops. `cd` is the compute dtype of the matmuls, norms'
//! outputs and attention, `ad` the accumulation dtype of the residual stream and the
//! modulation; every linear is one fused node ([`LinearW`]).

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::families::adaln::AdaLnZero;
use crate::families::cross::cross_attend;
use crate::families::pixart::block::attn_keep;
use crate::layers::{cast, BlockConfig, LinearW};
use crate::ops::attention::separate::attention;
use crate::ops::{
    gated_residual, gelu_tanh, ln_modulate, rms_norm_rows as rms_norm, rope_cos_sin as rope,
};

use super::params::WAN_EPS;

/// The weights of one Wan block: `table` is its `scale_shift_table` (1, 6, D) and `norm2`'s
/// (weight, bias) in `ad`; the RMSNorm weights in `cd`.
#[derive(Debug, Clone)]
pub struct WanBlockWeights {
    pub table: Tensor,
    pub q1: LinearW,
    pub k1: LinearW,
    pub v1: LinearW,
    pub o1: LinearW,
    pub norm_q1: Tensor,
    pub norm_k1: Tensor,
    pub q2: LinearW,
    pub k2: LinearW,
    pub v2: LinearW,
    pub o2: LinearW,
    pub norm_q2: Tensor,
    pub norm_k2: Tensor,
    /// `norm2` (weight, bias) when `cross_attn_norm`.
    pub norm2: Option<(Tensor, Tensor)>,
    pub fc1: LinearW,
    pub fc2: LinearW,
}

/// The shared inputs of every block: the (b, 6D) `time_proj` output in `ad`, the projected
/// text (b·T, D) in `cd`, and the RoPE tables (s, d_h/2) (f32, f64 under fp64).
#[derive(Debug, Clone, Copy)]
pub struct WanConds<'a> {
    pub t6: &'a Tensor,
    pub ctx: &'a Tensor,
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
}

/// One `WanTransformerBlock`: x (b, s, D) in `ad` → (b, s, D) in `ad`. Every intermediate is
/// a local until the block returns (the budget's twin binds the same tensors).
pub fn wan_block_forward(
    x: &Tensor,
    c: WanConds<'_>,
    w: &WanBlockWeights,
    cfg: &BlockConfig,
) -> Result<Tensor> {
    let (b, _, h) = x.dims3()?;
    let cd = cfg.compute;
    let keep = attn_keep(cfg.attn);
    let m = AdaLnZero::of_table(c.t6, &w.table, h)?;

    // Self-attention: norm1 + modulate, q/k RMSNorm across heads, RoPE on q and k.
    let [_h1, q, k, v] = m.attn_inputs(x, [&w.q1, &w.k1, &w.v1], WAN_EPS, cd)?;
    let qn = rms_norm(&q, Some(&w.norm_q1), WAN_EPS, cd)?;
    let kn = rms_norm(&k, Some(&w.norm_k1), WAN_EPS, cd)?;
    let qr = rope(&qn, c.cos, c.sin)?;
    let kr = rope(&kn, c.cos, c.sin)?;
    let o = attention(&qr, &kr, &v, b, cfg.heads, keep)?;
    let p = w.o1.forward(&o)?;
    let x1 = gated_residual(x, &p, &m.gate_msa)?;

    // Cross-attention to the text.
    let h2 = cross_input(&x1, w.norm2.as_ref(), cd)?;
    let q2 = w.q2.forward(&h2)?;
    let q2n = rms_norm(&q2, Some(&w.norm_q2), WAN_EPS, cd)?;
    let norm_k = Some((&w.norm_k2, WAN_EPS));
    let o2 = cross_attend(&q2n, c.ctx, (&w.k2, &w.v2), norm_k, b, cfg.heads, keep)?;
    let p2 = w.o2.forward(&o2)?;
    let ones = Tensor::ones((b, h), x.dtype(), x.device())?;
    let x2 = gated_residual(&x1, &p2, &ones)?;

    // Feed-forward on norm3 + modulate.
    let h3 = ln_modulate(&x2, &m.shift_mlp, &m.scale_mlp, WAN_EPS, cd)?;
    let f2 = crate::layers::feed_forward(&h3, &w.fc1, &w.fc2)?;
    Ok(gated_residual(&x2, &f2, &m.gate_mlp)?)
}

/// The cross-attention's query input from x1 (b, s, D) in `ad`, (b·s, D) in `cd`: `norm2` (an
/// affine LayerNorm: ln_modulate with the bias as the shift and weight − 1 as the scale, one
/// row each for the whole batch) when `cross_attn_norm`, else the stream itself.
fn cross_input(x1: &Tensor, norm2: Option<&(Tensor, Tensor)>, cd: DType) -> Result<Tensor> {
    let (b, s, h) = x1.dims3()?;
    Ok(match norm2 {
        Some((nw, nb)) => {
            let shift = nb.reshape((1, h))?.broadcast_as((b, h))?;
            let scale = nw
                .affine(1.0, -1.0)?
                .reshape((1, h))?
                .broadcast_as((b, h))?;
            ln_modulate(x1, &shift, &scale, WAN_EPS, cd)?
        }
        None => cast(x1.clone(), cd)?.reshape((b * s, h))?,
    })
}

/// The output side's weights: the final `scale_shift_table` (1, 2, D) in `ad` and `proj_out`.
#[derive(Debug, Clone)]
pub struct WanFinalWeights {
    pub table: Tensor,
    pub proj_out: LinearW,
}

/// `norm_out` + `(table + temb[:, None]).chunk(2, dim=1)` modulation + `proj_out`: x (b, s, D)
/// and temb (b, D) in `ad` → (b·s, p²·C_out) in `ad`.
pub fn final_forward(
    x: &Tensor,
    temb: &Tensor,
    w: &WanFinalWeights,
    cd: DType,
    ad: DType,
) -> Result<Tensor> {
    let (b, _, h) = x.dims3()?;
    let e = temb.unsqueeze(1)?;
    let ss = e.broadcast_add(&w.table)?.reshape((b, 2 * h))?;
    let (shift, scale) = (ss.narrow(1, 0, h)?, ss.narrow(1, h, h)?);
    let hx = ln_modulate(x, &shift, &scale, WAN_EPS, cd)?;
    cast(w.proj_out.forward(&hx)?, ad)
}

/// `condition_embedder.text_embedder` (PixArtAlphaTextProjection, GELU-tanh): the umT5 states
/// (b·T, text_dim) in `cd` → (b·T, D) in `cd`.
pub fn text_forward(cap: &Tensor, l1: &LinearW, l2: &LinearW) -> Result<Tensor> {
    let c1 = l1.forward(cap)?;
    let g = gelu_tanh(&c1)?;
    l2.forward(&g)
}

/// (b, C, F, H, W) (or (b, C, H, W) for one frame) → (b·s, C·p·p) with tokens ordered
/// (frame, row, column) and features (c, py, px) like the flattened Conv3d weight
/// (D, C, 1, p, p). One contiguous copy.
pub fn patchify3d(
    x: &Tensor,
    c: usize,
    frames: usize,
    rows: usize,
    cols: usize,
    p: usize,
) -> Result<Tensor> {
    let b = x.dim(0)?;
    let x = x.reshape(vec![b, c, frames, rows, p, cols, p])?;
    // → (b, F, rows, cols, C, py, px)
    let x = x.permute(vec![0, 2, 3, 5, 1, 4, 6])?.contiguous()?;
    Ok(x.reshape((b * frames * rows * cols, c * p * p))?)
}

/// (b·s, p·p·C) with features ordered (py, px, c) (diffusers' `proj_out` layout) →
/// `shape` (b, C, F, H, W) or (b, C, H, W). One contiguous copy.
pub fn unpatchify3d(
    x: &Tensor,
    b: usize,
    (c, frames, rows, cols, p): (usize, usize, usize, usize, usize),
    shape: &[usize],
) -> Result<Tensor> {
    let x = x.reshape(vec![b, frames, rows, cols, p, p, c])?;
    // → (b, C, F, rows, py, cols, px)
    let x = x.permute(vec![0, 6, 1, 2, 4, 3, 5])?.contiguous()?;
    Ok(x.reshape(shape)?)
}

/// The q and k of both attentions of a block as [`wan_block_forward`] computes them (self:
/// after the RMSNorm and RoPE; cross: after the RMSNorm), for `verify`'s score bound; x1, the
/// stream after the self-attention, comes with them.
pub fn wan_block_qk(
    x: &Tensor,
    c: WanConds<'_>,
    w: &WanBlockWeights,
    cfg: &BlockConfig,
) -> Result<[(Tensor, Tensor); 2]> {
    let (b, _, h) = x.dims3()?;
    let cd = cfg.compute;
    let m = AdaLnZero::of_table(c.t6, &w.table, h)?;
    let h1 = ln_modulate(x, &m.shift_msa, &m.scale_msa, WAN_EPS, cd)?;
    let q = rope(
        &rms_norm(&w.q1.forward(&h1)?, Some(&w.norm_q1), WAN_EPS, cd)?,
        c.cos,
        c.sin,
    )?;
    let k = rope(
        &rms_norm(&w.k1.forward(&h1)?, Some(&w.norm_k1), WAN_EPS, cd)?,
        c.cos,
        c.sin,
    )?;
    let v = w.v1.forward(&h1)?;
    let o = attention(&q, &k, &v, b, cfg.heads, crate::ops::AttnKeep::Nothing)?;
    let x1 = gated_residual(x, &w.o1.forward(&o)?, &m.gate_msa)?;
    let h2 = cross_input(&x1, w.norm2.as_ref(), cd)?;
    let q2 = rms_norm(&w.q2.forward(&h2)?, Some(&w.norm_q2), WAN_EPS, cd)?;
    let k2 = rms_norm(&w.k2.forward(c.ctx)?, Some(&w.norm_k2), WAN_EPS, cd)?;
    Ok([(q, k), (q2, k2)])
}
