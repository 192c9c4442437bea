//! The composed attention core as candle ops (twin: the engine's `ops/attention/reference.rs`,
//! `attention_materialized`): the explicit `softmax(q·kᵀ)·v`, and its rebuild in backward under
//! attention-only recompute.

use crate::runtime::ditmem_cpu::backward::backward;
use crate::runtime::ditmem_cpu::graph::{owned_bytes, untracked_peak, Graph, Kind, Nid};
use crate::runtime::ditmem_cpu::ops::surrogate;
use crate::runtime::shape::Shape;
use crate::spec::{AttentionMode, Dtype, Precision};

/// Bytes of the materialized attention core for one block (its rebuild in backward).
fn materialized_core(sh: &Shape) -> Graph {
    let mut g = Graph::default();
    let cd = sh.cd();
    let e = sh.e();
    let q = g.var("q", e, cd, true);
    let k = g.var("k", e, cd, true);
    let v = g.var("v", e, cd, true);
    let plain = Shape {
        attention: AttentionMode::Materialized,
        attention_only: false,
        ..sh.clone()
    };
    attention(&mut g, &plain, q, k, v);
    g
}

/// The attention core on q, k, v of shape (b, a, s, dh).
pub fn attention(g: &mut Graph, sh: &Shape, q: Nid, k: Nid, v: Nid) -> Nid {
    let (cd, ad) = (sh.cd(), sh.ad());
    let e = sh.e();
    let a_el = sh.b * sh.heads * sh.s * sh.s;
    let rows = sh.b * sh.heads * sh.s;
    if sh.attention_only && sh.attention == AttentionMode::Materialized {
        // Forward runs the materialized core without tracking on q, k, v themselves, then
        // copies its result into the op's output.
        let mut core = materialized_core(sh);
        for i in 0..3 {
            core.nodes[i].alloc = false;
        }
        let last = core.nodes.len() - 1;
        let fwd = untracked_peak(&core, &[last]);
        let o = g.op(
            "attn core (recomputed in backward)",
            Kind::Attention { bwd_scratch: 0 },
            &[q, k, v],
            e,
            cd,
        );
        g.nodes[o].fwd_scratch = fwd;
        // Backward rebuilds the core on leaf copies of q, k, v, roots it at sum(o · grad_o)
        // and backprops through it; the gradients come back detached.
        let mut core = materialized_core(sh);
        let out = core.nodes.len() - 1;
        let root = surrogate(&mut core, out);
        let (act, _) = owned_bytes(&core);
        let bwd = backward(&core, root);
        if let Kind::Attention { bwd_scratch } = &mut g.nodes[o].kind {
            *bwd_scratch = act + bwd.peak;
        }
        return o;
    }
    if sh.attention == AttentionMode::MemoryEfficient {
        let acc = if sh.precision == Precision::Fp64 {
            Dtype::F64
        } else {
            Dtype::F32
        };
        let dh = sh.d / sh.heads;
        // Per (batch, head): f32 copies of k and v; backward adds dk, dv accumulators.
        let per_head = sh.s * dh * acc.size();
        let o = g.op(
            "attn core (memory-efficient)",
            Kind::Attention {
                bwd_scratch: 4 * per_head,
            },
            &[q, k, v],
            e,
            cd,
        );
        g.nodes[o].extra = rows * acc.size();
        g.nodes[o].fwd_scratch = 2 * per_head;
        return o;
    }
    let kt = g.view("kᵀ", Kind::Transpose, k, e);
    let scores = g.op("scores q·kᵀ", Kind::Matmul, &[q, kt], a_el, cd);
    let s32 = g.cast(&format!("scores→{ad}"), scores, ad);
    // The row max is detached: a constant the subtraction keeps alive.
    let max = g.constant("softmax row max (detached)", rows, ad, true);
    let sub = g.broadcast_binary("softmax x−max", Kind::Sub, s32, max, false);
    let exp = g.op("softmax exp", Kind::Exp, &[sub], a_el, ad);
    let sum = g.op("softmax row sum", Kind::Sum, &[exp], rows, ad);
    let p = g.broadcast_binary("softmax P", Kind::Div, exp, sum, false);
    let mut pc = g.cast(&format!("P→{cd}"), p, cd);
    if sh.attn_dropout {
        let mask = g.constant("attn dropout mask", a_el, cd, true);
        pc = g.op("P·mask", Kind::Mul, &[pc, mask], a_el, cd);
    }
    let o = g.op("P·v", Kind::Matmul, &[pc, v], e, cd);
    // `attention_materialized` binds scores, max, exp, the row sum and P to locals: without
    // tracking they all live until it returns.
    g.hold_until(&[s32, max, exp, sum, pc], o);
    o
}
