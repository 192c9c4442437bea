//! The engine's fused attention (`ops/attention/`: `qkv.rs`, `projected.rs`, the bf16 kernels'
//! scratch of `bf16.rs`): the scratch formulas, `gemm`'s per-call packing of a head and the
//! nodes [`fused_attention`] and [`fused_qkv_attention`].

use super::linear::{gemm_call_bytes, linear_workspace};
use super::sizes::{attention_head_elems, packed_a_bytes, packed_b_bytes};
use crate::runtime::ditmem_cpu::graph::{Graph, Kind, Nid, STORAGE_META, TENSOR_META};
use crate::runtime::shape::Shape;
use crate::spec::{AttentionMode, CpuSpec, Dtype, Precision};

use super::sizes::{ATTN_KEY_BLOCK, ATTN_QUERY_BLOCK};

/// Bytes of one thread's scratch (forward, backward) of the engine's streaming bf16 attention on
/// the AVX512-BF16 kernel with key blocks of `kb` (`ops::attention::bf16::streaming_scratch_bytes`).
/// Forward: f32 output accumulator, a block of scores, row max and sum; packed q, a packed block
/// of P, a packed B (a block of kᵀ or v). Backward, by blocks of [`NATIVE_ATTN_BWD_ROWS`]
/// queries: f32 dq, dk, dv, blocks of P and dP, the row deltas; the query block's packed q and
/// dO, a packed A of a block (Pᵀ, dS or dSᵀ), a packed B (a block of kᵀ, vᵀ or k, or the query
/// block's dO or q).
pub(crate) fn streaming_attention_scratch(s: u64, dh: u64, kb: u64) -> (u64, u64) {
    let b_fwd = packed_b_bytes(dh, kb).max(packed_b_bytes(kb, dh));
    let qb = NATIVE_ATTN_BWD_ROWS.min(s);
    let a_qd = packed_a_bytes(qb, dh);
    let a_blk = packed_a_bytes(qb, kb).max(packed_a_bytes(kb, qb));
    let b_bwd = b_fwd.max(packed_b_bytes(qb, dh));
    (
        4 * (s * dh + s * kb + 2 * s) + packed_a_bytes(s, dh) + packed_a_bytes(s, kb) + b_fwd,
        4 * (3 * s * dh + 2 * qb * kb + s) + 2 * a_qd + a_blk + b_bwd,
    )
}

/// Query rows per block of the backward of the engine's bf16 attention on the AVX512-BF16
/// kernel (`ops::attention::bf16::NATIVE_BWD_ROWS`): P and dP of a block are this × s.
pub(crate) const NATIVE_ATTN_BWD_ROWS: u64 = 128;

/// Bytes of one thread's scratch (forward, backward) of the engine's bf16 attention on the
/// AVX512-BF16 kernel (`ops::attention::bf16::native_scratch_bytes`): f32 buffers (forward the
/// head's output and S; backward dq, dk, dv, and P and dP of a block of
/// [`NATIVE_ATTN_BWD_ROWS`] query rows) and the packed operands of every product (forward: A
/// up to s × max(s, d_h), B d_h × s or s × d_h; backward, of a block of m rows: A m × d_h,
/// m × s or s × m, B d_h × s, s × d_h or m × d_h).
pub(crate) fn native_attention_scratch(s: u64, dh: u64) -> (u64, u64) {
    let packed = packed_a_bytes(s, s.max(dh)) + packed_b_bytes(dh, s).max(packed_b_bytes(s, dh));
    let m = NATIVE_ATTN_BWD_ROWS.min(s);
    let packed_bwd = packed_a_bytes(m, dh)
        .max(packed_a_bytes(m, s))
        .max(packed_a_bytes(s, m))
        + packed_b_bytes(dh, s)
            .max(packed_b_bytes(s, dh))
            .max(packed_b_bytes(m, dh));
    (
        4 * (s * dh + s * s) + packed,
        4 * (3 * s * dh + 2 * m * s) + packed_bwd,
    )
}

/// `gemm`'s per-call packing bytes (forward, backward) of one head of the engine's generic
/// attention kernels (`ops/attention/{generic,separate}.rs`, `sq` queries over `sk` keys, head
/// width `dh`, accumulation elements of `elem` bytes, single-threaded calls), the most of any of
/// its products: per key block of `n` keys (all `sk` at once when `kb` is None, else blocks of
/// `kb` and the rest) the scores `S = q·kᵀ` (and `dP = dO·vᵀ`), `O = P·v` (and `dq = dS·k`), and
/// in backward `dv = Pᵀ·dO` (and `dk = dSᵀ·q`), the streaming backward's by blocks of
/// [`ATTN_QUERY_BLOCK`] queries. q·kᵀ reads k transposed, so `gemm` pre-packs it on every
/// ISA.
pub(crate) fn attention_head_packing(
    cpu: &CpuSpec,
    (sq, sk, dh): (u64, u64, u64),
    kb: Option<u64>,
    elem: u64,
) -> (u64, u64) {
    let mm = |m: u64, n: u64, k: u64, dst, lhs, rhs| {
        gemm_call_bytes(cpu, (elem, 1), (m, n, k), [dst, lhs, rhs])
    };
    let split = |s: u64, b: u64| {
        if b > 0 && b < s {
            vec![b, s % b]
        } else {
            vec![s]
        }
    };
    let blocks = split(sk, kb.unwrap_or(sk));
    // The streaming backward also blocks the queries (`ops::ATTN_QUERY_BLOCK`).
    let q_blocks = match kb {
        Some(_) => split(sq, ATTN_QUERY_BLOCK),
        None => vec![sq],
    };
    let (mut fwd, mut bwd) = (0, 0);
    for n in blocks.into_iter().filter(|&n| n > 0) {
        let scores = mm(sq, n, dh, (n, 1), (dh, 1), (1, dh));
        let out = mm(sq, dh, n, (dh, 1), (n, 1), (dh, 1));
        fwd = fwd.max(scores).max(out);
        for &m in q_blocks.iter().filter(|&&m| m > 0) {
            let scores = mm(m, n, dh, (n, 1), (dh, 1), (1, dh));
            let dq = mm(m, dh, n, (dh, 1), (n, 1), (dh, 1));
            let grad_kv = mm(n, dh, m, (dh, 1), (1, n), (dh, 1));
            bwd = bwd.max(scores).max(dq).max(grad_kv);
        }
    }
    (fwd, bwd)
}

/// `ops::qkv_attention` of the engine: attention read in place from the (b·s, 3D) qkv
/// projection, written as (b·s, D). One fresh output. What it keeps (the node's `extra`): P
/// (b·a·s², compute dtype) when materialized, the log-sum-exp (b·a·s, accumulation type) when
/// memory-efficient, nothing under attention-only recompute. Forward and backward work on one
/// scratch of accumulation-type buffers per thread (at most one thread per head), allocated up
/// front; the backward returns one fresh (b·s, 3D) gradient.
pub(crate) fn fused_attention(g: &mut Graph, sh: &Shape, qkv: Nid) -> Nid {
    let (name, extra, fwd, bwd) = attention_workspace(sh);
    let o = g.op(
        name,
        Kind::Custom { bwd_scratch: bwd },
        &[qkv],
        sh.e(),
        sh.cd(),
    );
    g.nodes[o].extra = extra;
    g.nodes[o].fwd_scratch = fwd;
    o
}

/// The fused attention's name, what it keeps (P or the log-sum-exp, bytes) and its forward and
/// backward workspace (all threads' scratch, with `gemm`'s per-call packing), as
/// [`fused_attention`] and [`fused_qkv_attention`] count them.
fn attention_workspace(sh: &Shape) -> (&'static str, u64, u64, u64) {
    let cd = sh.cd();
    let acc = if sh.precision == Precision::Fp64 {
        8
    } else {
        4
    };
    let (s, dh) = (sh.s, sh.d / sh.heads);
    let nh = sh.b * sh.heads;
    let kb = ATTN_KEY_BLOCK.min(s);
    let nt = u64::from(sh.cpu.threads).clamp(1, nh.max(1));
    let streaming = sh.attention == AttentionMode::MemoryEfficient;
    // bf16 runs on the AVX512-BF16 kernel where the CPU has it (`ops::attention::bf16::applies`),
    // in every mode: its own scratch, in bytes.
    let native = cd == Dtype::Bf16 && sh.cpu.bf16_kernel();
    let (name, extra) = if streaming {
        ("attention (fused, streaming; keeps lse)", nh * s * acc)
    } else if sh.attention_only {
        ("attention (fused; P recomputed in backward)", 0)
    } else {
        ("attention (fused; keeps P)", nh * s * s * cd.size())
    };
    let (fwd_bytes, bwd_bytes) = if native && streaming {
        streaming_attention_scratch(s, dh, kb)
    } else if native {
        native_attention_scratch(s, dh)
    } else {
        let (fwd, bwd) = attention_head_elems(s, s, dh, streaming);
        let (pf, pb) = attention_head_packing(&sh.cpu, (s, s, dh), streaming.then_some(kb), acc);
        (fwd * acc + pf, bwd * acc + pb)
    };
    (name, extra, nt * fwd_bytes, nt * bwd_bytes)
}

/// Heap bytes of an `ops::ProjectedAttention` node's op beside the buffers it keeps: candle's
/// `Arc<Box<dyn CustomOp1>>` (32) and the op (the attention's settings and saved state, the
/// projection's weight, bias and sink handles, the mutex over qkv: `size_of`, held equal by the
/// engine's test).
pub const PROJECTED_ATTENTION_OP_BYTES: u64 = 32 + 152;

/// `ops::projected_attention` of the engine: the qkv projection `x·Wᵀ + b` and the fused
/// attention as one node on x (rows, D), written as (rows, D), used where x tracks and the
/// projection has no LoRA. The op keeps qkv (rows, 3D, compute dtype, a bare buffer) beside
/// what the attention keeps; its backward makes dqkv (bare: over qkv's own buffer on the
/// generic kernels, fresh with qkv freed once it is made on the AVX512-BF16 ones; the node's
/// `released_by_bwd` is qkv), makes dx, dW, db from dqkv (the weights sunk or frozen), frees dqkv
/// and returns dx only: dqkv never enters candle's store, where
/// its `zeros_like` + `add` held three qkv-sized buffers at once, and the projection's own
/// node (dqkv handed in, dx made beside it) is gone. Workspace, beyond the output and what is
/// kept: forward, the projection's less what the node's output and kept state already count,
/// or the attention's; backward, beyond the gradients it hands out, dqkv (and on the bf16
/// kernels qkv) with the attention's scratch, or dqkv with the projection's.
pub(crate) fn fused_qkv_attention(g: &mut Graph, sh: &Shape, x: Nid, wb: [Nid; 2]) -> Nid {
    let cd = sh.cd();
    let (rows, d) = (sh.b * sh.s, sh.d);
    let (name, attn_extra, attn_fwd, attn_bwd) = attention_workspace(sh);
    let wants = |i: Nid| g.nodes[i].tracks || g.nodes[i].sunk;
    let tracks = (true, wants(wb[0]), wants(wb[1]));
    let master = g.dtype(wb[0]) == Dtype::F32 && matches!(cd, Dtype::Bf16 | Dtype::F16);
    let (lin_fwd, lin_bwd) = linear_workspace(&sh.cpu, cd, (rows, d, 3 * d), tracks, master);
    let qkv = rows * 3 * d * cd.size();
    let meta = TENSOR_META + STORAGE_META;
    let grads = rows * d * cd.size()
        + meta
        + if tracks.1 {
            3 * d * d * g.dtype(wb[0]).size() + meta
        } else {
            0
        }
        + if tracks.2 {
            3 * d * g.dtype(wb[1]).size() + meta
        } else {
            0
        };
    // The node releases the kept qkv as its backward starts (`Node::released_by_bwd`), so it
    // is counted here. On the generic kernels the op writes dqkv over qkv's own buffer: one
    // qkv-sized buffer beside the attention's scratch, then beside the projection's products.
    // On the AVX512-BF16 kernels (which read q, k, v in place) dqkv is fresh: qkv and dqkv
    // beside the attention's scratch, then dqkv alone, qkv freed once it is made.
    let native = cd == Dtype::Bf16 && sh.cpu.bf16_kernel();
    let during = if native { 2 * qkv } else { qkv };
    // The output gradient (rows × D, alive beside the whole backward in `custom_backward`) is
    // freed once dqkv is made: the projection's products no longer read it.
    let bwd = (during + attn_bwd)
        .saturating_sub(grads)
        .max((qkv + lin_bwd).saturating_sub(sh.e() * cd.size()));
    let o = g.op(
        &format!("attn.qkv + {name}"),
        Kind::Custom { bwd_scratch: bwd },
        &[x, wb[0], wb[1]],
        sh.e(),
        cd,
    );
    g.nodes[o].extra = attn_extra + qkv + PROJECTED_ATTENTION_OP_BYTES;
    if g.nodes[o].tracks {
        g.nodes[o].released_by_bwd = qkv;
    }
    let out = g.nodes[o].footprint();
    let kept = attn_extra + PROJECTED_ATTENTION_OP_BYTES;
    g.nodes[o].fwd_scratch = attn_fwd.max(lin_fwd.saturating_sub(out + kept));
    o
}
