//! The engine's fused cross-attention (`ditmem_engine::ops::cross_attention`, called by
//! `families::cross::cross_attend`) as one candle node: the k and v projections of the text
//! context, Wan's RMSNorm of k, and the attention over separate q, k, v. What the op keeps and
//! frees, phase by phase, is restated here from its forward and backward.

use crate::runtime::ditmem_cpu::graph::{Graph, Kind, Nid};
use crate::runtime::ditmem_cpu::ops::linear_workspace;
use crate::runtime::ditmem_cpu::separate::separate_attention_bytes;
use crate::runtime::shape::Shape;
use crate::spec::{Dtype, Precision};

/// Heap bytes of a tracked cross-attention node's op beside what it keeps: candle's
/// `Arc<Box<dyn CustomOp>>` (32) and the op (`size_of::<CrossAttention>()`: two projections'
/// weight and sink handles, the norm's and the attention's own state, the context's sink, the
/// flag of a pending backward; held equal by the engine's test).
pub const CROSS_ATTENTION_OP_BYTES: u64 = 32 + 192;

/// The fused cross-attention: q (b·s_q, D) over the context `ctx` (b·T, C) through the
/// projections `k` and `v` ([weight, bias] as `block::linear_weights` makes them: sunk when
/// trained and the context tracks), k normed by the weight `norm` when given; `sh` is the
/// attention's shape (its width D and heads). `(sq, t, c)`: queries and text tokens per sample
/// and the context's width.
///
/// Forward, in order: k (and, normed, its copy and one rstd per row), v, then the attention's
/// output and its saved state; k, v and the rstd are then freed (tracked, the attention's saved
/// state stays). Backward: k, v (and the norm's) again, in the forward's order, beside the
/// saved state; the attention's (dq beside its workspace, dk and dv written over k and v),
/// which frees its saved state; v's projection on dv (the context's part, dW, db and the
/// linear's workspace), freeing dv; the norm's on dk (dk before the norm and the weight's
/// gradient), freeing dk, k before the norm and the rstd; k's projection (the context's part,
/// dW, db). The context's parts go to the trainer's sum
/// ([`Node::sunk_input`](super::graph::Node::sunk_input)).
#[allow(clippy::too_many_arguments)]
pub fn cross_attention(
    g: &mut Graph,
    sh: &Shape,
    name: &str,
    q: Nid,
    ctx: Nid,
    (kw, vw): ([Nid; 2], [Nid; 2]),
    norm: Option<Nid>,
    (sq, t, c): (u64, u64, u64),
) -> Nid {
    let cd = sh.cd();
    let e = cd.size();
    let acc = if sh.precision == Precision::Fp64 {
        8
    } else {
        4
    };
    let (d, trows) = (sh.d, sh.b * t);
    let (nq, nk, nc) = (sh.b * sq * d * e, trows * d * e, trows * c * e);
    let rstd = if norm.is_some() { trows * acc } else { 0 };
    let (saved, att_f, att_b) = separate_attention_bytes(sh, sq, t);
    let ctx_tracks = g.nodes[ctx].tracks;
    let grad = |g: &Graph, n: Nid| {
        if g.nodes[n].sunk {
            g.nodes[n].bytes()
        } else {
            0
        }
    };
    let lin = |g: &Graph, w: [Nid; 2]| {
        let master = g.dtype(w[0]) == Dtype::F32 && matches!(cd, Dtype::Bf16 | Dtype::F16);
        let tracks = (ctx_tracks, g.nodes[w[0]].sunk, g.nodes[w[1]].sunk);
        linear_workspace(&sh.cpu, cd, (trows, c, d), tracks, master)
    };
    let ((lk_f, lk_b), (lv_f, lv_b)) = (lin(g, kw), lin(g, vw));
    let (dwk, dwv) = (
        grad(g, kw[0]) + grad(g, kw[1]),
        grad(g, vw[0]) + grad(g, vw[1]),
    );
    let dnw = norm.map_or(0, |n| if g.nodes[n].tracks { d * e } else { 0 });
    let dc = if ctx_tracks { nc } else { 0 };

    let mut ins = vec![q, ctx, kw[0], kw[1], vw[0], vw[1]];
    ins.extend(norm);
    let y = g.op(
        name,
        Kind::Custom { bwd_scratch: 0 },
        &ins,
        sh.b * sq * d,
        cd,
    );
    let tracks = g.nodes[y].tracks;
    // k before the norm (made only with a norm), k as the attention reads it, v.
    let k_pre = if norm.is_some() { nk } else { 0 };
    let kept = if tracks { saved } else { 0 };
    // The projections' moments, in the forward and again at the start of the backward.
    let project = [nk + lk_f, k_pre + nk + rstd, k_pre + 2 * nk + rstd + lv_f];
    let kv = k_pre + 2 * nk + rstd;
    let fwd = project
        .into_iter()
        .chain([kv + kept + nq + att_f])
        .max()
        .unwrap_or(0)
        .saturating_sub(kept + nq);
    let bwd = if tracks {
        let again = project.into_iter().max().unwrap_or(0) + kept;
        // dk and dv are written over the recomputed k and v.
        let a = kv + kept + att_b + nq;
        let held = k_pre + rstd;
        let b = held + 2 * nk + nq + dc + dwv + lv_b;
        let c_ = if norm.is_some() {
            held + nq + nk + dwv + nk + dnw
        } else {
            0
        };
        let dd = nq + nk + dwv + dnw + dc + dwk + lk_b;
        let q_grad = if g.nodes[q].tracks { nq } else { 0 };
        [again, a, b, c_, dd]
            .into_iter()
            .max()
            .unwrap_or(0)
            .saturating_sub(q_grad + dc + dwk + dwv + dnw)
    } else {
        0
    };
    g.nodes[y].kind = Kind::Custom { bwd_scratch: bwd };
    g.nodes[y].fwd_scratch = fwd;
    if tracks {
        g.nodes[y].extra = kept + CROSS_ATTENTION_OP_BYTES;
        g.nodes[y].released_by_bwd = kept;
        if ctx_tracks {
            g.nodes[y].sunk_input = Some(1);
        }
    }
    y
}
