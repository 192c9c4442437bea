//! [`cross_attention`]: a cross-attention's k and v projections of the text context, Wan's
//! RMSNorm of k across heads, and the attention itself ([`SeparateAttention`]) as one node on
//! (q, context[, norm weight]) ([`CrossAttention`]). Budget twin:
//! `ditmem_budget::ditmem_cpu::cross::cross_attention`.
//!
//! Why one node: composed, the attention's backward hands dk and dv to candle, which folds each
//! into its store as `zeros_like + add` while the other is alive (candle-core 0.11
//! `backprop.rs`): four context-sized tensors at once beside the attention's own gradients, the
//! block's worst moment when the caption has more tokens than the image (PixArt's 300, Wan's
//! 512 text tokens). Here dk and dv never leave the node: the v projection's backward runs on
//! dv as soon as the attention's has, then the norm's and the k projection's on dk, each
//! freeing what it read; the context's gradient goes to the trainer's running sum
//! ([`InputSink`], v's part then k's, the order candle ran the composed nodes in) and the
//! weights' to their [`GradSink`](crate::ops::GradSink)s.
//!
//! Why k and v are not kept: the forward frees them (and the norm's statistics) once the
//! attention has run, and the backward projects them again from the context, which every block
//! reads anyway (a shared leaf). Kept, each block held two (b·T, D) tensors from its forward to
//! its backward: with T = 300 caption tokens over PixArt's 64-token tiny spec that was the
//! block's largest saved state, and the step's worst moment (block 1's backward) held block 0's
//! too. PyTorch's SDPA keeps them; here they cost two (b·T) × C × D products per block in the
//! backward instead (at PixArt-Σ 1024², 300 text against 4,096 image tokens, about 1 % of a
//! block's multiply-adds by count, not timed). The attention's backward writes dk and dv over
//! the recomputed k and v, and the rest is freed as the backward goes.
//!
//! Numerics: the same kernel calls as the composition (the fused linear's storage functions, the
//! RMSNorm's and the attention's own forward and backward); a projection recomputed from the same
//! inputs has the same bits, so the results are the composition's bits.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, Layout, Shape, Tensor};

use super::separate::SeparateAttention;
use super::AttnKeep;
use crate::ops::custom_op::{Cpu, CpuOp, Grads, Op};
use crate::ops::fused_mlp::MlpLinear;
use crate::ops::linear::{storage_tensor, InputSink};
use crate::ops::rms_norm_rows::RmsNormRows;
use crate::ops::storage::{err, with_cpu, with_cpus, CResult};

/// k before the norm (with a norm), k as the attention reads it, and v, all (b·T, D), with
/// their dims: made by the forward for the attention and again by the backward.
struct Projected {
    k_pre: Option<CpuStorage>,
    k: CpuStorage,
    v: CpuStorage,
    dims: (usize, usize),
}

/// The fused cross-attention (see the module docs).
#[derive(Debug)]
pub(crate) struct CrossAttention {
    k: MlpLinear,
    v: MlpLinear,
    norm: Option<RmsNormRows>,
    attn: SeparateAttention,
    /// Where the context's gradient goes; None: returned to candle.
    ctx_sink: Option<Arc<InputSink>>,
    track: bool,
    /// Whether a tracked forward has run and its backward has not (the attention's and the
    /// norm's own state is theirs).
    pending: Mutex<bool>,
}

/// Attention of q (b·s_q, D) over k = norm(ctx·Wkᵀ + bk) (the norm only with `norm_k` = (its
/// weight, eps)) and v = ctx·Wvᵀ + bv of the context ctx (b·T, C), written as (b·s_q, D). A
/// linear's weights must not track unless it has a sink; the context's gradient goes to
/// `ctx_sink` when given.
#[allow(clippy::too_many_arguments)]
pub fn cross_attention(
    q: &Tensor,
    ctx: &Tensor,
    (k, v): (MlpLinear, MlpLinear),
    norm_k: Option<(&Tensor, f64)>,
    ctx_sink: Option<Arc<InputSink>>,
    batch: usize,
    heads: usize,
    keep: AttnKeep,
) -> CResult<Tensor> {
    MlpLinear::require_sinks(
        &[&k, &v],
        "cross_attention: a projection whose weights track needs a gradient sink",
    )?;
    let track = q.track_op() || ctx.track_op() || norm_k.is_some_and(|(w, _)| w.track_op());
    let op = CrossAttention {
        k,
        v,
        norm: norm_k.map(|(_, eps)| RmsNormRows::new(eps, q.dtype())),
        attn: SeparateAttention::new(batch, heads, keep, track),
        ctx_sink,
        track,
        pending: Mutex::new(false),
    };
    match norm_k {
        Some((w, _)) => q.apply_op3(ctx, w, Op(op)),
        None => q.apply_op2(ctx, Op(op)),
    }
}

impl CrossAttention {
    /// k (normed when the op has a norm, its statistics then kept by the norm op until
    /// [`RmsNormRows::release`]) and v of the context, in the order the budget counts them: k,
    /// the norm's output, v.
    fn project_kv(
        &self,
        ctx: (&CpuStorage, &Layout),
        nw: Option<(&CpuStorage, &Layout)>,
    ) -> CResult<Projected> {
        let (k_pre, shape) = self.k.forward(ctx)?;
        let lk = Layout::contiguous(shape.clone());
        let kn = match (&self.norm, nw) {
            (Some(op), Some(w)) => Some(op.forward_on(&k_pre, &lk, Some(w))?.0),
            (None, None) => None,
            _ => return Err(err("cross_attention: a norm needs its weight")),
        };
        let (v, _) = self.v.forward(ctx)?;
        let (k_pre, k) = match kn {
            Some(kn) => (Some(k_pre), kn),
            None => (None, k_pre),
        };
        Ok(Projected {
            k_pre,
            k,
            v,
            dims: shape.dims2()?,
        })
    }

    fn forward_on(
        &self,
        (sq, lq): (&CpuStorage, &Layout),
        ctx: (&CpuStorage, &Layout),
        nw: Option<(&CpuStorage, &Layout)>,
    ) -> CResult<(CpuStorage, Shape)> {
        let p = self.project_kv(ctx, nw)?;
        let lk = Layout::contiguous(p.dims);
        let out = CpuOp::<3>::fwd(&self.attn, [(sq, lq), (&p.k, &lk), (&p.v, &lk)])?;
        // k, v (and k before the norm, with the norm's statistics) go now: the backward
        // projects them again.
        drop(p);
        if let Some(op) = &self.norm {
            op.release();
        }
        if self.track {
            *self.lock()? = true;
        }
        Ok(out)
    }

    fn lock(&self) -> CResult<std::sync::MutexGuard<'_, bool>> {
        self.pending
            .lock()
            .map_err(|_| err("cross_attention: state poisoned"))
    }

    /// One projection's backward on its output gradient `g`: the context's part to the sink
    /// (or added into `dctx`), dW and db to the projection's sink.
    fn project_bwd(
        &self,
        l: &MlpLinear,
        ctx: &Tensor,
        g: Tensor,
        dctx: &mut Option<Tensor>,
    ) -> CResult<()> {
        let (dx, dw, db) = with_cpu(&g, |sg, lg| l.grads(ctx, (sg, lg), ctx.track_op()))?;
        drop(g);
        if let Some(dx) = dx {
            let dx = storage_tensor(dx, ctx.shape())?;
            match (&self.ctx_sink, dctx.take()) {
                (Some(sink), _) => sink.add(&dx)?,
                (None, Some(sum)) => *dctx = Some((sum + dx)?),
                (None, None) => *dctx = Some(dx),
            }
        }
        l.sink_grads(dw, db)
    }

    /// The backward (see the module docs): (dq, dctx unless sunk, dnorm weight).
    fn bwd_impl(
        &self,
        q: &Tensor,
        ctx: &Tensor,
        nw: Option<&Tensor>,
        res: &Tensor,
        grad: &Tensor,
    ) -> Grads<3> {
        if !std::mem::take(&mut *self.lock()?) {
            return Err(err("cross_attention: backward without a tracked forward"));
        }
        // k and v again from the context (the norm's statistics with them), then dk and dv
        // over them: nothing reads them after the attention's backward.
        let Projected { k_pre, k, v, dims } = with_cpu(ctx, |sc, lc| match nw {
            Some(w) => with_cpu(w, |sw, lw| self.project_kv((sc, lc), Some((sw, lw)))),
            None => self.project_kv((sc, lc), None),
        })?;
        let lk = Layout::contiguous(dims);
        let grad = grad.contiguous()?;
        let (dq, dk, dv) = with_cpus([q, res, &grad], |[sq, so, sg]| {
            self.attn.grads_over(sq, (k, v, &lk), so, sg)
        })?;
        self.attn.release();
        let dq = storage_tensor(dq, q.shape())?;
        let (dk, dv) = (storage_tensor(dk, dims)?, storage_tensor(dv, dims)?);
        let mut dctx = None;
        self.project_bwd(&self.v, ctx, dv, &mut dctx)?;
        let (dk, dnw) = match (&self.norm, k_pre) {
            (Some(op), Some(k_pre)) => {
                let k_pre = storage_tensor(k_pre, dims)?;
                let want_w = nw.is_some_and(|w| w.track_op());
                let (dk_pre, dnw) = op.bwd_parts(&k_pre, nw, &dk, (true, want_w))?;
                op.release();
                drop((dk, k_pre));
                let dk_pre =
                    dk_pre.ok_or_else(|| err("cross_attention: the norm gave no gradient"))?;
                (dk_pre, dnw)
            }
            _ => (dk, None),
        };
        self.project_bwd(&self.k, ctx, dk, &mut dctx)?;
        Ok([Some(dq), dctx, dnw])
    }
}

impl CpuOp<2> for CrossAttention {
    fn name(&self) -> &'static str {
        "cross-attention"
    }

    fn fwd(&self, [(s1, l1), (s2, l2)]: [Cpu<'_>; 2]) -> CResult<(CpuStorage, Shape)> {
        self.forward_on((s1, l1), (s2, l2), None)
    }

    fn bwd(&self, [q, ctx]: [&Tensor; 2], res: &Tensor, grad: &Tensor) -> Grads<2> {
        let [dq, dctx, _] = self.bwd_impl(q, ctx, None, res, grad)?;
        Ok([dq, dctx])
    }
}

impl CpuOp<3> for CrossAttention {
    fn name(&self) -> &'static str {
        "cross-attention"
    }

    fn fwd(&self, [(s1, l1), (s2, l2), (s3, l3)]: [Cpu<'_>; 3]) -> CResult<(CpuStorage, Shape)> {
        self.forward_on((s1, l1), (s2, l2), Some((s3, l3)))
    }

    fn bwd(&self, [q, ctx, nw]: [&Tensor; 3], res: &Tensor, grad: &Tensor) -> Grads<3> {
        self.bwd_impl(q, ctx, Some(nw), res, grad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::attention::separate::attention;
    use crate::ops::test_values::*;
    use crate::ops::{linear_into, rms_norm_rows};
    use candle_core::{DType, Var};

    const EPS: f64 = 1e-6;

    /// (b, sq, t, c, d, heads).
    type CrossDims = (usize, usize, usize, usize, usize, usize);

    /// out, dq, dctx, dWk, dbk, dWv, dbv and (with the norm) dnorm of the cross-attention of q
    /// (b·sq, d) over ctx (b·t, c), fused or composed of the sunk linears, the norm and the
    /// attention.
    fn run(
        fused: bool,
        (dt, wdt): (DType, DType),
        (norm, keep, (b, sq, t_, c, d, heads)): (bool, AttnKeep, CrossDims),
    ) -> Vec<Tensor> {
        let q = Var::from_tensor(&t(b * sq * d, &[b * sq, d], 1, dt)).unwrap();
        let ctx = Var::from_tensor(&t(b * t_ * c, &[b * t_, c], 2, dt)).unwrap();
        let nw = Var::from_tensor(&t(d, &[d], 3, dt)).unwrap();
        let (sk, sv) = (new_sink(), new_sink());
        let lk = seeded_linear((d, c), 4, wdt, Some(Arc::clone(&sk)));
        let lv = seeded_linear((d, c), 6, wdt, Some(Arc::clone(&sv)));
        let r = t(b * sq * d, &[b * sq, d], 8, dt);
        let sink = Arc::new(InputSink::default());
        // The running sum in the gradient dtype (f64 under f64, else f32), as the trainer's.
        let gd = if dt == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        sink.set(Tensor::zeros((b * t_, c), gd, q.device()).unwrap())
            .unwrap();
        let norm_k = norm.then_some((nw.as_tensor(), EPS));
        let y = if fused {
            let s = Some(Arc::clone(&sink));
            cross_attention(
                q.as_tensor(),
                ctx.as_tensor(),
                (lk, lv),
                norm_k,
                s,
                b,
                heads,
                keep,
            )
            .unwrap()
        } else {
            let k = linear_into(ctx.as_tensor(), &lk.w, &lk.b, Some(&sk), &sink).unwrap();
            let v = linear_into(ctx.as_tensor(), &lv.w, &lv.b, Some(&sv), &sink).unwrap();
            let k = match norm_k {
                Some((w, eps)) => rms_norm_rows(&k, Some(w), eps, dt).unwrap(),
                None => k,
            };
            attention(q.as_tensor(), &k, &v, b, heads, keep).unwrap()
        };
        let grads = grads_against(&y, &r);
        let dq = grads.get(q.as_tensor()).unwrap().clone();
        assert!(grads.get(ctx.as_tensor()).is_none(), "dctx in the store");
        let dctx = sink.take().unwrap();
        let dnw = grads.get(nw.as_tensor()).cloned();
        assert_eq!(dnw.is_some(), norm, "the norm weight's gradient");
        [
            vec![y, dq, dctx],
            take_sunk(&[&sk, &sv]),
            dnw.into_iter().collect(),
        ]
        .concat()
    }

    /// The fused cross-attention's output and every gradient (q's, the context's, the four
    /// weight gradients it sinks, the norm weight's) are the composition's, bit for bit, on
    /// f64, f32, bf16 and f16 with weights in the compute dtype or f32 masters, with and
    /// without the norm, in both attention modes.
    #[test]
    fn cross_attention_equals_the_composition_bit_for_bit() {
        let dims = (2, 5, 7, 12, 8, 2);
        let cases: Vec<_> = [false, true]
            .into_iter()
            .flat_map(|norm| {
                [AttnKeep::LogSumExp, AttnKeep::Probabilities].map(|keep| (norm, keep, dims))
            })
            .collect();
        let names = ["y", "dq", "dctx", "dWk", "dbk", "dWv", "dbv", "dnorm"];
        assert_fused_is_composition(&names, &[2], &cases, run);
    }

    /// The op's heap bytes beside what it keeps are the budget's constant.
    #[test]
    fn op_bytes_are_the_budgets() {
        use ditmem_budget::ditmem_cpu::cross::CROSS_ATTENTION_OP_BYTES;
        assert_eq!(
            CROSS_ATTENTION_OP_BYTES,
            32 + std::mem::size_of::<CrossAttention>() as u64
        );
    }
}
