//! The shapes and modes of the fused attention, shared by its op ([`super`]) and its kernels
//! (`super::generic`, [`super::bf16`]): what the op keeps ([`AttnKeep`]), the geometry of one
//! call ([`AttnGeom`]) with its per-head scratch sizes (the budget's one function,
//! `ditmem_budget::ditmem_cpu::ops::attention_head_elems`, by which the `ditmem-cpu` runtime also
//! predicts), and the head loop's thread count.

use candle_core::{Layout, WithDType};
use rayon::prelude::*;

use crate::kernels::scalar::Acc;
use crate::ops::storage::{err, CResult};

/// What the fused attention keeps for its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnKeep {
    /// The probabilities P (b, a, s, s) in the compute dtype: the materialized mode. Its softmax
    /// is fused, so nothing else of size s² is kept (no scores, no exp, no casts).
    Probabilities,
    /// Nothing: backward recomputes P head by head (the attention-only recompute policy).
    Nothing,
    /// The log-sum-exp per query row (b, a, s) in the accumulation type; forward and backward
    /// stream over key blocks and never hold more than s × [`ATTN_KEY_BLOCK`] scores per head
    /// in forward, [`ATTN_QUERY_BLOCK`] × [`ATTN_KEY_BLOCK`] (P and dP) in backward (the
    /// memory-efficient mode).
    LogSumExp,
}

/// Keys per block of the streaming kernels (the budget's size, `ditmem_budget::ditmem_cpu::ops::sizes`).
pub const ATTN_KEY_BLOCK: usize = ditmem_budget::ditmem_cpu::ops::ATTN_KEY_BLOCK as usize;

/// Queries per block of the streaming kernels' backward (generic kernels): P and dP of a block
/// are [`ATTN_QUERY_BLOCK`] × [`ATTN_KEY_BLOCK`], not s × [`ATTN_KEY_BLOCK`] — at Flux's tiny
/// family spec (192 joint tokens, 16-wide heads) 64 KiB per thread instead of 192 KiB, the
/// single-stream block's worst moment; at 4,608 tokens 64 KiB instead of 4.5 MiB. dk and dv
/// sum the query blocks in order (one more rounding per block than one product over all
/// queries). The size is the budget's (`ditmem_budget::ditmem_cpu::ops::sizes`), which predicts by it.
pub const ATTN_QUERY_BLOCK: usize = ditmem_budget::ditmem_cpu::ops::ATTN_QUERY_BLOCK as usize;

/// Shapes of one fused attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnGeom {
    pub b: usize,
    pub a: usize,
    pub s: usize,
    pub dh: usize,
}

impl AttnGeom {
    pub(crate) fn d(&self) -> usize {
        self.a * self.dh
    }
    pub(crate) fn heads(&self) -> usize {
        self.b * self.a
    }
    pub(crate) fn kb(&self) -> usize {
        ATTN_KEY_BLOCK.min(self.s)
    }
    pub(crate) fn qb(&self) -> usize {
        ATTN_QUERY_BLOCK.min(self.s)
    }
    /// Scratch elements (accumulation type) per head of the forward ([`head_scratch`]).
    pub fn fwd_scratch(&self, keep: AttnKeep) -> usize {
        head_scratch((self.s, self.s, self.dh), keep).0
    }
    /// Scratch elements (accumulation type) per head of the backward ([`head_scratch`]).
    pub fn bwd_scratch(&self, keep: AttnKeep) -> usize {
        head_scratch((self.s, self.s, self.dh), keep).1
    }
}

/// Scratch elements (accumulation type, forward and backward) per head of the generic kernels,
/// `sq` queries over `sk` keys of width `dh` (the fused qkv attention's `sq = sk`; the separate
/// one's `separate::sep_{fwd,bwd}_scratch`): the budget's `attention_head_elems`
/// (`ditmem_budget::ditmem_cpu::ops`), which lists the buffers and by which the `ditmem-cpu`
/// runtime predicts, so the two cannot drift apart.
pub(crate) fn head_scratch((sq, sk, dh): (usize, usize, usize), keep: AttnKeep) -> (usize, usize) {
    let streaming = keep == AttnKeep::LogSumExp;
    let (fwd, bwd) = ditmem_budget::ditmem_cpu::ops::attention_head_elems(
        sq as u64, sk as u64, dh as u64, streaming,
    );
    (fwd as usize, bwd as usize)
}

/// Threads the head loop uses: rayon's pool size, at most one per head. The scratch of all of
/// them is allocated up front, so the transient bytes are deterministic.
pub(crate) fn attn_threads(heads: usize) -> usize {
    rayon::current_num_threads().clamp(1, heads.max(1))
}

/// Runs `f(head, scratch)` for heads 0..nh on [`attn_threads`] tasks (the attention kernels and `crate::ops::linear_attention`), heads dealt to tasks by
/// residue (head ≡ t mod nt, so a head is one task's alone), each task with its own `per`
/// elements of scratch: allocated (zeroed) up front for all tasks, dropped when all are done.
pub(crate) fn for_each_head<A: Acc + WithDType>(
    nh: usize,
    per: usize,
    f: impl Fn(usize, &mut [A]) + Sync,
) {
    let nt = attn_threads(nh);
    let mut scratch: Vec<A> = vec![A::ZERO; nt * per];
    scratch.par_chunks_mut(per).enumerate().for_each(|(t, sc)| {
        let mut head = t;
        while head < nh {
            f(head, sc);
            head += nt;
        }
    });
}

/// Cuts a task's scratch into buffers of the given lengths, in order, and what is left.
pub(crate) fn carve<A, const N: usize>(
    sc: &mut [A],
    lens: [usize; N],
) -> ([&mut [A]; N], &mut [A]) {
    let mut rest = sc;
    let bufs = lens.map(|n| {
        let (a, r) = std::mem::take(&mut rest).split_at_mut(n);
        rest = r;
        a
    });
    (bufs, rest)
}

pub(super) fn attn_geom(l: &Layout, batch: usize, heads: usize) -> CResult<AttnGeom> {
    let (rows, d3) = match l.dims() {
        &[r, c] => (r, c),
        dims => {
            return Err(err(format!(
                "attention expects qkv (b·s, 3D), got {dims:?}"
            )))
        }
    };
    if batch == 0 || heads == 0 || rows % batch != 0 || d3 % (3 * heads) != 0 {
        return Err(err(format!(
            "attention: qkv ({rows}, {d3}) does not split into batch {batch} × 3 × {heads} heads"
        )));
    }
    Ok(AttnGeom {
        b: batch,
        a: heads,
        s: rows / batch,
        dh: d3 / (3 * heads),
    })
}
