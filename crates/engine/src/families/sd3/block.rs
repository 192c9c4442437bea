//! SD3's joint block, embedders and output side (see the module docs of [`super`] for the
//! tensor list), on the engine's fused ops. `cd` is the compute dtype of the matmuls and
//! attention, `ad` the accumulation dtype of both residual streams, norms and modulation; every
//! linear is one fused node ([`LinearW`]).

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::families::adaln::{linear_modulated_out, ShiftScale};
use crate::families::pixart::block::attn_keep;
use crate::layers::{
    cast, feed_forward_then_release, gated_then_release, linear_then_release, mlp_linear,
    BlockConfig, LinearW, LN_EPS,
};
use crate::ops::attention::separate::attention;
use crate::ops::{cat_tokens, joint_linear, ln_modulate, release, rms_norm, split_tokens};

/// diffusers' `RMSNorm` eps of the q/k norms.
pub use crate::ops::RMS_EPS;

/// The weights of one joint block; `ctx` is None for the last (`context_pre_only`) block's
/// context-side output weights, `qk` the four q/k RMSNorm weights (`norm_q`, `norm_k`,
/// `norm_added_q`, `norm_added_k`, in the compute dtype) with `qk_norm`.
#[derive(Debug, Clone)]
pub struct Sd3BlockWeights {
    pub norm1: LinearW,
    pub norm1_context: LinearW,
    pub to_q: LinearW,
    pub to_k: LinearW,
    pub to_v: LinearW,
    pub add_k: LinearW,
    pub add_v: LinearW,
    pub add_q: LinearW,
    pub to_out: LinearW,
    pub ff1: LinearW,
    pub ff2: LinearW,
    pub ctx: Option<ContextOut>,
    pub qk: Option<[Tensor; 4]>,
    /// A dual-attention (MMDiT-X) block's `attn2`; `norm1` then yields 9 chunks.
    pub dual: Option<DualAttn>,
}

/// The image-only self-attention `attn2` of an SD3.5 dual-attention block (diffusers
/// `JointTransformerBlock(use_dual_attention=True)`), with its q/k RMSNorm weights (`norm_q`,
/// `norm_k`, in the compute dtype) under `qk_norm`.
#[derive(Debug, Clone)]
pub struct DualAttn {
    pub to_q: LinearW,
    pub to_k: LinearW,
    pub to_v: LinearW,
    pub to_out: LinearW,
    pub qk: Option<[Tensor; 2]>,
}

/// The context stream's output side of a block that is not `context_pre_only`.
#[derive(Debug, Clone)]
pub struct ContextOut {
    pub to_add_out: LinearW,
    pub ff1: LinearW,
    pub ff2: LinearW,
}

/// `norm1` (AdaLayerNormZero: shift, scale, gate (msa), shift, scale, gate (mlp)) and
/// `norm1_context` (the same, or AdaLayerNormContinuous (scale, shift) in the last block) on
/// SiLU(temb) `se`: [their modulations m, mc (b, k·D) in `ad`, the modulated image hx and
/// context hc in `cd`]. The caller holds m and mc until the block returns.
fn norm1(
    c: &Tensor,
    x: &Tensor,
    se: &Tensor,
    w: &Sd3BlockWeights,
    cfg: &BlockConfig,
) -> Result<[Tensor; 4]> {
    let h = x.dim(2)?;
    let (cd, ad) = (cfg.compute, cfg.accum);
    let m = cast(w.norm1.forward(se)?, ad)?;
    let mc = cast(w.norm1_context.forward(se)?, ad)?;
    let chunk = |t: &Tensor, i: usize| t.narrow(1, i * h, h);
    let hx = ln_modulate(x, &chunk(&m, 0)?, &chunk(&m, 1)?, LN_EPS, cd)?;
    let hc = match &w.ctx {
        Some(_) => ln_modulate(c, &chunk(&mc, 0)?, &chunk(&mc, 1)?, LN_EPS, cd)?,
        None => ln_modulate(c, &chunk(&mc, 1)?, &chunk(&mc, 0)?, LN_EPS, cd)?,
    };
    Ok([m, mc, hx, hc])
}

/// One `JointTransformerBlock`: the context c (b, T, D) and image x (b, s, D) streams in `ad`,
/// SiLU(temb) `se` (b, D) in `cd` → [c', x'] (the last block returns [x'] only). Every
/// intermediate is a local until the block returns (the budget's twin binds the same tensors).
pub fn sd3_block_forward(
    c: &Tensor,
    x: &Tensor,
    se: &Tensor,
    w: &Sd3BlockWeights,
    cfg: &BlockConfig,
) -> Result<Vec<Tensor>> {
    let (b, s, h) = x.dims3()?;
    let t = c.dim(1)?;
    let cd = cfg.compute;
    let keep = attn_keep(cfg.attn);
    let [m, mc, hx, hc] = norm1(c, x, se, w, cfg)?;
    let chunk = |t: &Tensor, i: usize| t.narrow(1, i * h, h);

    // Joint attention over [image, context] per sample.
    // q, k, v of [image; text] per sample: one joint linear each where neither linear
    // carries LoRA and no q/k norm sits between (nothing but the joint tensor is kept); else
    // the two linears, the norms and the concatenation, whose locals live until the block
    // returns (`hold`; the budget binds them).
    let tracks = hx.track_op() || hc.track_op();
    let mut hold: Vec<Tensor> = Vec::new();
    let mut joint = |la: &LinearW, lc: &LinearW, norms: Option<(&Tensor, &Tensor)>| {
        if norms.is_none() {
            if let (Some(a), Some(c)) = (mlp_linear(la, tracks), mlp_linear(lc, tracks)) {
                return Ok::<Tensor, crate::error::EngineError>(joint_linear(&hx, &hc, a, c, b)?);
            }
        }
        let (y, ey) = (la.forward(&hx)?, lc.forward(&hc)?);
        let (y, ey) = match norms {
            Some((na, nc)) => {
                hold.extend([y.clone(), ey.clone()]);
                (rms_norm(&y, na, RMS_EPS)?, rms_norm(&ey, nc, RMS_EPS)?)
            }
            None => (y, ey),
        };
        let cat = cat_tokens(&y, &ey, b)?;
        // The parts: no backward reads them (a linear's rule reads its input, a q/k norm's
        // its input, kept above, the concatenation's none), so their buffers go now.
        release(&y)?;
        release(&ey)?;
        hold.extend([y, ey]);
        Ok(cat)
    };
    let qc = joint(&w.to_q, &w.add_q, w.qk.as_ref().map(|n| (&n[0], &n[2])))?;
    let kc = joint(&w.to_k, &w.add_k, w.qk.as_ref().map(|n| (&n[1], &n[3])))?;
    let vc = joint(&w.to_v, &w.add_v, None)?;
    // The normalised context: read by no backward once its three linears are frozen (LoRA on
    // the image side only, as the scripts' default).
    if ![&w.add_q, &w.add_k, &w.add_v]
        .iter()
        .any(|l| l.reads_input())
    {
        release(&hc)?;
    }
    let o = attention(&qc, &kc, &vc, b, cfg.heads, keep)?;

    // Image stream: to_out.0, gated residual, norm2 + ff.
    let oi = split_tokens(&o, b, 0, s)?;
    let ao = linear_then_release(&w.to_out, &oi)?;
    let x1 = gated_then_release(x, ao, &chunk(&m, 2)?)?;
    // SD3.5's dual attention: x1 + gate_msa2 · attn2(LN(x)·(1 + scale_msa2) + shift_msa2).
    let x1 = match &w.dual {
        Some(d2) => dual_attention(x, &x1, &m, d2, cfg)?,
        None => x1,
    };
    let h2 = ln_modulate(&x1, &chunk(&m, 3)?, &chunk(&m, 4)?, LN_EPS, cd)?;
    let f = feed_forward_then_release(&h2, &w.ff1, &w.ff2)?;
    let x2 = gated_then_release(&x1, f, &chunk(&m, 5)?)?;
    let Some(cw) = &w.ctx else {
        return Ok(vec![x2]);
    };

    // Context stream: to_add_out, gated residual, norm2_context + ff_context.
    let oc = split_tokens(&o, b, s, t)?;
    let co = linear_then_release(&cw.to_add_out, &oc)?;
    let c1 = gated_then_release(c, co, &chunk(&mc, 2)?)?;
    let h2c = ln_modulate(&c1, &chunk(&mc, 3)?, &chunk(&mc, 4)?, LN_EPS, cd)?;
    let fc = feed_forward_then_release(&h2c, &cw.ff1, &cw.ff2)?;
    let c2 = gated_then_release(&c1, fc, &chunk(&mc, 5)?)?;
    Ok(vec![c2, x2])
}

/// `attn2` of a dual-attention block and its gated residual (a function: its locals live until
/// it returns): `norm_hidden_states2` = LN(x) modulated by chunks 6 and 7 of `norm1`'s nine
/// (diffusers' `SD35AdaLayerNormZeroX` normalises the block input x, not x1), q, k, v of the
/// image tokens (q/k RMSNorm under `qk_norm`), attention, `to_out.0`, and x1 + ·gate_msa2
/// (chunk 8). Returns the new image stream (b, s, D) in `ad`.
pub fn dual_attention(
    x: &Tensor,
    x1: &Tensor,
    m: &Tensor,
    w: &DualAttn,
    cfg: &BlockConfig,
) -> Result<Tensor> {
    let (b, _, h) = x.dims3()?;
    let chunk = |i: usize| m.narrow(1, i * h, h);
    let hx2 = ln_modulate(x, &chunk(6)?, &chunk(7)?, LN_EPS, cfg.compute)?;
    let (q, k, v) = (
        w.to_q.forward(&hx2)?,
        w.to_k.forward(&hx2)?,
        w.to_v.forward(&hx2)?,
    );
    // Read by no backward once its three linears are frozen (LoRA's default leaves attn2).
    if ![&w.to_q, &w.to_k, &w.to_v].iter().any(|l| l.reads_input()) {
        release(&hx2)?;
    }
    let (qn, kn) = match &w.qk {
        Some([nq, nk]) => (rms_norm(&q, nq, RMS_EPS)?, rms_norm(&k, nk, RMS_EPS)?),
        None => (q.clone(), k.clone()),
    };
    let o = attention(&qn, &kn, &v, b, cfg.heads, attn_keep(cfg.attn))?;
    // The attention's backward reads its output: `o` stays (the joint attention's `to_out`
    // reads a split copy, which it may release).
    let a = w.to_out.forward(&o)?;
    gated_then_release(x1, a, &chunk(8)?)
}

/// The queries and keys of a dual-attention block's `attn2` (after its q/k norms), as
/// [`dual_attention`] computes them: (b·s, D) each. The score probe of `verify` reads them.
pub fn dual_qk(
    x: &Tensor,
    se: &Tensor,
    w: &Sd3BlockWeights,
    cfg: &BlockConfig,
) -> Result<Option<(Tensor, Tensor)>> {
    let Some(d2) = &w.dual else {
        return Ok(None);
    };
    let h = x.dim(2)?;
    let m = cast(w.norm1.forward(se)?, cfg.accum)?;
    let chunk = |i: usize| m.narrow(1, i * h, h);
    let hx2 = ln_modulate(x, &chunk(6)?, &chunk(7)?, LN_EPS, cfg.compute)?;
    let (mut q, mut k) = (d2.to_q.forward(&hx2)?, d2.to_k.forward(&hx2)?);
    if let Some([nq, nk]) = &d2.qk {
        q = rms_norm(&q, nq, RMS_EPS)?;
        k = rms_norm(&k, nk, RMS_EPS)?;
    }
    Ok(Some((q, k)))
}

/// The joint attention's concatenated queries and keys of a block, [image, context] per sample
/// after the q/k norms, as [`sd3_block_forward`] computes them: (b·(s+T), D) each. The score
/// probe of `verify` reads them; the block itself does not call this.
pub fn joint_qk(
    c: &Tensor,
    x: &Tensor,
    se: &Tensor,
    w: &Sd3BlockWeights,
    cfg: &BlockConfig,
) -> Result<(Tensor, Tensor)> {
    let b = x.dim(0)?;
    let [_m, _mc, hx, hc] = norm1(c, x, se, w, cfg)?;
    let (mut q, mut k) = (w.to_q.forward(&hx)?, w.to_k.forward(&hx)?);
    let (mut eq, mut ek) = (w.add_q.forward(&hc)?, w.add_k.forward(&hc)?);
    if let Some([nq, nk, naq, nak]) = &w.qk {
        q = rms_norm(&q, nq, RMS_EPS)?;
        k = rms_norm(&k, nk, RMS_EPS)?;
        eq = rms_norm(&eq, naq, RMS_EPS)?;
        ek = rms_norm(&ek, nak, RMS_EPS)?;
    }
    Ok((cat_tokens(&q, &eq, b)?, cat_tokens(&k, &ek, b)?))
}

/// `norm_out` (AdaLayerNormContinuous: scale, shift = linear(SiLU(temb)).chunk(2)) +
/// `proj_out`: x (b, s, D) in `ad`, `se` (b, D) in `cd` → (b·s, p²·C_out) in `ad`.
pub fn final_forward(
    x: &Tensor,
    se: &Tensor,
    norm_out: &LinearW,
    proj_out: &LinearW,
    cd: DType,
    ad: DType,
) -> Result<Tensor> {
    let lins = (norm_out, proj_out);
    linear_modulated_out(x, se, lins, ShiftScale::ScaleFirst, cd, ad)
}

/// A two-linear MLP with SiLU between (`TimestepEmbedding`, and the pooled text's
/// `PixArtAlphaTextProjection(act_fn="silu")`): (b, in) in `cd` → (b, D) in `cd`.
pub fn silu_mlp(x: &Tensor, l1: &LinearW, l2: &LinearW) -> Result<Tensor> {
    let h = l1.forward(x)?.silu()?;
    l2.forward(&h)
}
