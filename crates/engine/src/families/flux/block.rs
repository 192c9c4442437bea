//! Flux's blocks, embedders and output side (see the module docs of [`super`] for the tensor
//! lists), on the engine's fused ops. `cd` is the compute dtype of the matmuls, norms' outputs
//! and attention, `ad` the accumulation dtype of the residual streams and the modulation; every
//! linear is one fused node ([`LinearW`]). `st` is `silu(temb)` (b, D) in `cd`, which every
//! AdaLayerNorm's linear reads.

use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::error::{EngineError, Result};
use crate::families::pixart::block::attn_keep;
use crate::layers::{
    cast, cast_then_release, feed_forward_then_release, gated_then_release, linear_then_release,
    mlp_linear, BlockConfig, LinearW, LN_EPS,
};
use crate::ops::attention::separate::attention;
use crate::ops::tokens::{concat, slice};
use crate::ops::{
    fused_mlp_side, gelu_tanh, joint_linear, joint_norm_rope, ln_modulate, norm_rope, release,
    RopeTable, RMS_EPS,
};

/// The weights of one double-stream block (`FluxTransformerBlock`): the linears in
/// [`super::params::DOUBLE_LINEARS`] order and the four q/k RMSNorm weights (d_h).
#[derive(Debug, Clone)]
pub struct DoubleWeights {
    pub lin: Vec<LinearW>,
    /// norm_q, norm_k, norm_added_q, norm_added_k.
    pub norms: [Tensor; 4],
}

/// The weights of one single-stream block (`FluxSingleTransformerBlock`): the linears in
/// [`super::params::SINGLE_LINEARS`] order and norm_q, norm_k.
#[derive(Debug, Clone)]
pub struct SingleWeights {
    pub lin: Vec<LinearW>,
    pub norms: [Tensor; 2],
}

/// `linear(st)` of an AdaLayerNorm in `ad`, chunked into `k` (b, D) views.
fn modulation(l: &LinearW, st: &Tensor, k: usize, h: usize, ad: DType) -> Result<Vec<Tensor>> {
    let m = cast(l.forward(st)?, ad)?;
    (0..k).map(|i| Ok(m.narrow(1, i * h, h)?)).collect()
}

/// One double-stream block: image x (b, s, D) and text c (b, t, D) in `ad`, `st` (b, D) in
/// `cd`, the RoPE table over the t + s tokens → (x, c) in `ad`. Every intermediate is a local
/// until the block returns (the budget's twin binds the same tensors).
pub fn double_forward(
    x: &Tensor,
    c: &Tensor,
    st: &Tensor,
    table: &Arc<RopeTable>,
    w: &DoubleWeights,
    cfg: &BlockConfig,
) -> Result<(Tensor, Tensor)> {
    let (b, s, h) = x.dims3()?;
    let t = c.dim(1)?;
    let n = s + t;
    let (cd, ad) = (cfg.compute, cfg.accum);
    let l = &w.lin;
    let m = modulation(&l[0], st, 6, h, ad)?;
    let mc = modulation(&l[1], st, 6, h, ad)?;
    let hx = ln_modulate(x, &m[0], &m[1], LN_EPS, cd)?;
    let hc = ln_modulate(c, &mc[0], &mc[1], LN_EPS, cd)?;
    // The joint v [text; image] as one joint linear (`add_v_proj` ‖ `to_v`) where neither
    // carries LoRA, made after the joint q and k (nothing but the joint tensor kept); else the
    // two linears here and their concatenation.
    let t_in = hx.track_op() || hc.track_op();
    let joint_v = match (mlp_linear(&l[7], t_in), mlp_linear(&l[4], t_in)) {
        (Some(lc), Some(lx)) => Some((lc, lx)),
        _ => None,
    };
    // The joint q (and k) [text; image] before its norms: one joint linear (`add_q_proj` ‖
    // `to_q`) where neither carries LoRA, else the two linears and their concatenation (the
    // linears' outputs locals until the block returns; the budget binds them). The norms and
    // the RoPE then run as one node on it.
    let mut hold: Vec<Tensor> = Vec::new();
    let mut joint_pre = |li: usize, lt: usize| -> Result<Tensor> {
        if let (Some(lc), Some(lx)) = (mlp_linear(&l[lt], t_in), mlp_linear(&l[li], t_in)) {
            return Ok(joint_linear(&hc, &hx, lc, lx, b)?);
        }
        let y = l[li].forward(&hx)?;
        let ey = l[lt].forward(&hc)?;
        let cat = concat(&ey, &y, b, (b * n, h))?;
        // No backward reads the parts (a linear's rule reads its input; the concatenation's
        // none).
        release(&y)?;
        release(&ey)?;
        hold.extend([y, ey]);
        Ok(cat)
    };
    let qc = joint_pre(2, 5)?;
    let kc = joint_pre(3, 6)?;
    let v = match joint_v {
        None => Some(l[4].forward(&hx)?),
        Some(_) => None,
    };
    let ev = match joint_v {
        None => Some(l[7].forward(&hc)?),
        Some(_) => None,
    };
    let vc = match (joint_v, &ev, &v) {
        (Some((lc, lx)), _, _) => joint_linear(&hc, &hx, lc, lx, b)?,
        (None, Some(ev), Some(v)) => {
            let vc = concat(ev, v, b, (b * n, h))?;
            release(ev)?;
            release(v)?;
            vc
        }
        _ => {
            return Err(EngineError::bad_input(
                "flux double block",
                "no v projection",
            ))
        }
    };
    let [nq, nk, naq, nak] = &w.norms;
    let qr = joint_norm_rope(&qc, naq, nq, t, RMS_EPS, table)?;
    let kr = joint_norm_rope(&kc, nak, nk, t, RMS_EPS, table)?;
    let o = attention(&qr, &kr, &vc, b, cfg.heads, attn_keep(cfg.attn))?;
    let oc = slice(&o, b, (0, t * h), (b * t, h))?;
    let oi = slice(&o, b, (t * h, n * h), (b * s, h))?;
    let ao = l[8].forward(&oi)?;
    let co = l[9].forward(&oc)?;
    // Image stream; the branch outputs go under frozen gates, the feed-forwards' inputs when
    // fc1 is frozen (`ops::release`).
    let x1 = gated_then_release(x, ao, &m[2])?;
    let h2 = ln_modulate(&x1, &m[3], &m[4], LN_EPS, cd)?;
    let f = feed_forward_then_release(&h2, &l[10], &l[11])?;
    let x2 = gated_then_release(&x1, f, &m[5])?;
    // Text stream.
    let c1 = gated_then_release(c, co, &mc[2])?;
    let h2c = ln_modulate(&c1, &mc[3], &mc[4], LN_EPS, cd)?;
    let fc = feed_forward_then_release(&h2c, &l[12], &l[13])?;
    let c2 = gated_then_release(&c1, fc, &mc[5])?;
    Ok((x2, c2))
}

/// The [text; image] stream (b, t + s, D) in `ad` the first single-stream block starts from.
pub fn join_streams(x: &Tensor, c: &Tensor) -> Result<Tensor> {
    let (b, s, h) = x.dims3()?;
    let t = c.dim(1)?;
    Ok(concat(c, x, b, (b, t + s, h))?)
}

/// One single-stream block: the joint stream (b, n, D) in `ad` → (b, n, D) in `ad`.
pub fn single_forward(
    x: &Tensor,
    st: &Tensor,
    table: &Arc<RopeTable>,
    w: &SingleWeights,
    cfg: &BlockConfig,
) -> Result<Tensor> {
    let (b, n, h) = x.dims3()?;
    let (cd, ad) = (cfg.compute, cfg.accum);
    let l = &w.lin;
    let m = modulation(&l[0], st, 3, h, ad)?;
    let hx = ln_modulate(x, &m[0], &m[1], LN_EPS, cd)?;
    let rows = b * n;
    let t = hx.track_op();
    // proj_out reads [attention; MLP] per row: one fused node with proj_mlp and the GELU where
    // both linears allow it (no LoRA), made after the attention; else composed, the MLP first.
    let fused = match (mlp_linear(&l[1], t), mlp_linear(&l[5], t)) {
        (Some(l1), Some(l5)) => Some((l1, l5)),
        _ => None,
    };
    // Locals until the function returns (the budget binds them).
    let (_pm, am) = match fused {
        Some(_) => (None, None),
        None => {
            let pm = l[1].forward(&hx)?;
            let am = gelu_tanh(&pm)?;
            (Some(pm), Some(am))
        }
    };
    let q = l[2].forward(&hx)?;
    let k = l[3].forward(&hx)?;
    let v = l[4].forward(&hx)?;
    let qr = norm_rope(&q, &w.norms[0], RMS_EPS, table)?;
    let kr = norm_rope(&k, &w.norms[1], RMS_EPS, table)?;
    let o = attention(&qr, &kr, &v, b, cfg.heads, attn_keep(cfg.attn))?;
    let p = match (fused, am) {
        (Some((l1, l5)), _) => fused_mlp_side(&hx, &o, l1, l5)?,
        (None, Some(am)) => {
            let cat = concat(&o, &am, rows, (rows, 5 * h))?;
            // The GELU's output is read by the concatenation alone (whose rule reads nothing);
            // the concatenation by proj_out, whose rule reads it for a trained weight or LoRA.
            release(&am)?;
            let p = l[5].forward(&cat)?;
            if !l[5].reads_input() {
                release(&cat)?;
            }
            p
        }
        (None, None) => {
            return Err(EngineError::bad_input(
                "flux single block",
                "no MLP activation",
            ))
        }
    };
    gated_then_release(x, p, &m[2])
}

/// The output side's weights: `norm_out.linear` and `proj_out`.
#[derive(Debug, Clone)]
pub struct FinalWeights {
    pub norm_out: LinearW,
    pub proj_out: LinearW,
}

/// The image tokens (b, s, D) of the last stream: the image stream itself after double blocks
/// only, else a copy of the joint stream's last s tokens.
pub fn image_tokens(x: &Tensor, s: usize) -> Result<Tensor> {
    let (b, n, h) = x.dims3()?;
    if n == s {
        return Ok(x.clone());
    }
    Ok(slice(x, b, ((n - s) * h, n * h), (b, s, h))?)
}

/// `norm_out` (AdaLayerNormContinuous: scale, shift = linear(st).chunk(2)) + `proj_out`: image
/// tokens (b, s, D) in `ad` → (b·s, features) in `ad`.
pub fn final_forward(
    x: &Tensor,
    st: &Tensor,
    w: &FinalWeights,
    cd: DType,
    ad: DType,
) -> Result<Tensor> {
    let h = x.dim(2)?;
    let m = modulation(&w.norm_out, st, 2, h, ad)?;
    let hx = ln_modulate(x, &m[1], &m[0], LN_EPS, cd)?;
    let y = linear_then_release(&w.proj_out, &hx)?;
    cast_then_release(y, ad)
}

/// A two-layer MLP with SiLU between (`TimestepEmbedding`, `PixArtAlphaTextProjection` with
/// `act_fn="silu"`): (b, in) cd → (b, D) cd.
pub fn mlp_silu(x: &Tensor, l1: &LinearW, l2: &LinearW) -> Result<Tensor> {
    let a = l1.forward(x)?.silu()?;
    l2.forward(&a)
}

/// diffusers' `_unpack_latents`: (b·s, C·2·2) with features ordered (c, py, px) → (b, C, H, W);
/// one contiguous copy.
pub fn unpack(x: &Tensor, b: usize, d: &crate::shapes::Dims) -> Result<Tensor> {
    let p = d.patch;
    let x = x.reshape(vec![b, d.rows, d.cols, d.out_channels, p, p])?;
    let x = x.permute(vec![0, 3, 1, 4, 2, 5])?.contiguous()?;
    Ok(x.reshape((b, d.out_channels, d.latent_h, d.latent_w))?)
}
