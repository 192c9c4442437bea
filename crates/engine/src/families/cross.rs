//! [`cross_attend`]: the cross-attention of PixArt, Sana and Wan to the projected text, from
//! its query: one fused node ([`crate::ops::cross_attention`]: the k and v projections, Wan's
//! k norm and the attention) where both projections allow it, composed otherwise (LoRA on
//! `to_k` / `to_v`, or tracking weights without a sink). Budget twin:
//! `ditmem_budget::ditmem_cpu::ops::cross_attention` and the composed nodes.
//! [`SelfCrossWeights`]: the weights of PixArt's and Sana's blocks, which read their
//! self-attention's inputs and their cross-attention (no norm on its query) alike.

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::families::adaln::AdaLnZero;
use crate::layers::{cast, mlp_linear, LinearW, LN_EPS};
use crate::ops::attention::separate::attention;
use crate::ops::{cross_attention, rms_norm_rows, AttnKeep};

/// The linears of a block with a self-attention (`attn1`), a cross-attention (`attn2`) and a
/// feed-forward of two linears `ffn` (PixArt's, Sana's, Wan's), in forward order (diffusers
/// names).
pub(crate) const fn self_cross_block_linears(ffn: [&'static str; 2]) -> [&'static str; 10] {
    [
        "attn1.to_q",
        "attn1.to_k",
        "attn1.to_v",
        "attn1.to_out.0",
        "attn2.to_q",
        "attn2.to_k",
        "attn2.to_v",
        "attn2.to_out.0",
        ffn[0],
        ffn[1],
    ]
}

/// The weights of a PixArt or Sana block: `table`, its `scale_shift_table` (6, D) in `ad`;
/// attn1's then attn2's q, k, v, out; the feed-forward's weights `ffn` (PixArt's two linears,
/// Sana's Mix-FFN).
#[derive(Debug, Clone)]
pub struct SelfCrossWeights<F> {
    pub table: Tensor,
    pub q1: LinearW,
    pub k1: LinearW,
    pub v1: LinearW,
    pub o1: LinearW,
    pub q2: LinearW,
    pub k2: LinearW,
    pub v2: LinearW,
    pub o2: LinearW,
    pub ffn: F,
}

impl<F> SelfCrossWeights<F> {
    /// The weights from the `scale_shift_table`, attn1's then attn2's q, k, v, out (the order
    /// of [`self_cross_block_linears`]) and the feed-forward's.
    pub(crate) fn with_ffn(table: Tensor, attn: [LinearW; 8], ffn: F) -> Self {
        let [q1, k1, v1, o1, q2, k2, v2, o2] = attn;
        SelfCrossWeights {
            table,
            q1,
            k1,
            v1,
            o1,
            q2,
            k2,
            v2,
            o2,
            ffn,
        }
    }

    /// The block's six modulation rows (the (b, 6D) timestep modulation `t6` plus the table,
    /// [`AdaLnZero::of_table`]) and the self-attention's inputs on x (b, s, D) in `ad`
    /// ([`AdaLnZero::attn_inputs`], eps [`LN_EPS`]): [h1, q, k, v], each held by the block until
    /// it returns, as the rows are.
    pub(crate) fn self_attn_inputs(
        &self,
        x: &Tensor,
        t6: &Tensor,
        cd: DType,
    ) -> Result<(AdaLnZero, [Tensor; 4])> {
        let (_, _, h) = x.dims3()?;
        let m = AdaLnZero::of_table(t6, &self.table, h)?;
        let qkv = m.attn_inputs(x, [&self.q1, &self.k1, &self.v1], LN_EPS, cd)?;
        Ok((m, qkv))
    }

    /// attn2, which reads the stream without a norm: the query input x1 (b, s, D) in `ad` as
    /// (b·s, D) in `cd` (a cast copy under a low-precision compute dtype, else a view), `to_q`,
    /// the attention over the context `y` ([`cross_attend`]), `to_out.0`, and the (b, D) gate
    /// of ones of its residual: [xq, q2, o2, p2, ones], each held by the block until it
    /// returns.
    pub(crate) fn unnormed_cross(
        &self,
        x1: &Tensor,
        y: &Tensor,
        heads: usize,
        keep: AttnKeep,
        (cd, ad): (DType, DType),
    ) -> Result<[Tensor; 5]> {
        let (b, s, h) = x1.dims3()?;
        let xq = cast(x1.clone(), cd)?.reshape((b * s, h))?;
        let q2 = self.q2.forward(&xq)?;
        let o2 = cross_attend(&q2, y, (&self.k2, &self.v2), None, b, heads, keep)?;
        let p2 = self.o2.forward(&o2)?;
        let ones = Tensor::ones((b, h), ad, x1.device())?;
        Ok([xq, q2, o2, p2, ones])
    }
}

/// Attention of `q` (b·s_q, D) over the context `ctx` (b·T, C) through the projections `k`, `v`
/// (k normed by `norm_k` = (weight, eps) when given): (b·s_q, D). The context's gradient goes
/// to `k`'s input sink when it has one (the trainer's running sum), else to candle.
#[allow(clippy::too_many_arguments)]
pub fn cross_attend(
    q: &Tensor,
    ctx: &Tensor,
    (k, v): (&LinearW, &LinearW),
    norm_k: Option<(&Tensor, f64)>,
    batch: usize,
    heads: usize,
    keep: AttnKeep,
) -> Result<Tensor> {
    let tracks = ctx.track_op();
    if let (Some(kl), Some(vl)) = (mlp_linear(k, tracks), mlp_linear(v, tracks)) {
        let sink = k.dx_sink.clone().filter(|_| tracks);
        let o = cross_attention(q, ctx, (kl, vl), norm_k, sink, batch, heads, keep)?;
        return Ok(o);
    }
    let kp = k.forward(ctx)?;
    let vp = v.forward(ctx)?;
    let kn = match norm_k {
        Some((w, eps)) => rms_norm_rows(&kp, Some(w), eps, q.dtype())?,
        None => kp,
    };
    Ok(attention(q, &kn, &vp, batch, heads, keep)?)
}
