//! The engine's attention over separate q, k, v as one candle node (twin: the engine's
//! `ops/attention/separate.rs`): what it keeps (P, or the log-sum-exp, or nothing under
//! attention-only recompute) and its per-thread scratch. PixArt's, SD3's, Flux's, Sana's and Wan's
//! attentions and the fused cross-attention ([`super::cross`]) all run on it.

use crate::runtime::ditmem_cpu::graph::{Graph, Kind, Nid};
use crate::runtime::ditmem_cpu::ops::{
    attention_head_elems, attention_head_packing, ATTN_KEY_BLOCK,
};
use crate::runtime::shape::Shape;
use crate::spec::{AttentionMode, Precision};

/// Scratch elements (accumulation type) per head of the separate attention, (forward,
/// backward): [`attention_head_elems`], by which the engine's `ops/attention/separate.rs`
/// allocates.
pub(crate) fn separate_attention_scratch(sh: &Shape, sq: u64, sk: u64) -> (u64, u64) {
    let streaming = sh.attention == AttentionMode::MemoryEfficient;
    attention_head_elems(sq, sk, sh.d / sh.heads, streaming)
}

/// `ops::attention::separate::attention` of the engine: q (b·s_q, D) over k, v (b·s_kv, D),
/// one fresh (b·s_q, D) output in the compute dtype. It keeps P (b·a·s_q·s_kv, compute dtype)
/// when materialized, the log-sum-exp (b·a·s_q, accumulation type) when memory-efficient,
/// nothing under attention-only recompute. Forward and backward run on one scratch of
/// accumulation-type buffers per thread (at most one per head, every dtype on the generic
/// kernels); the backward returns three fresh gradients.
pub(crate) fn separate_attention(
    g: &mut Graph,
    sh: &Shape,
    name: &str,
    qkv: [Nid; 3],
    sq: u64,
) -> Nid {
    let sk = g.elems(qkv[1]) / (sh.b * sh.d);
    let (extra, fwd, bwd) = separate_attention_bytes(sh, sq, sk);
    let o = g.op(
        name,
        Kind::Custom { bwd_scratch: bwd },
        &qkv,
        sh.b * sq * sh.d,
        sh.cd(),
    );
    g.nodes[o].extra = extra;
    g.nodes[o].fwd_scratch = fwd;
    o
}

/// [`separate_attention`]'s bytes for s_q queries over s_kv keys (the shape's batch, heads and
/// width): what it keeps (P or the log-sum-exp) and the workspace of its forward and backward
/// (every thread's scratch with its `gemm` packing).
pub(crate) fn separate_attention_bytes(sh: &Shape, sq: u64, sk: u64) -> (u64, u64, u64) {
    let cd = sh.cd();
    let acc = if sh.precision == Precision::Fp64 {
        8
    } else {
        4
    };
    let nh = sh.b * sh.heads;
    let nt = u64::from(sh.cpu.threads).clamp(1, nh.max(1));
    let extra = if sh.attention == AttentionMode::MemoryEfficient {
        nh * sq * acc
    } else if sh.attention_only {
        0
    } else {
        nh * sq * sk * cd.size()
    };
    let (fwd, bwd) = separate_attention_scratch(sh, sq, sk);
    let kb = (sh.attention == AttentionMode::MemoryEfficient).then_some(ATTN_KEY_BLOCK);
    let (pf, pb) = attention_head_packing(&sh.cpu, (sq, sk, sh.d / sh.heads), kb, acc);
    (extra, nt * (fwd * acc + pf), nt * (bwd * acc + pb))
}
