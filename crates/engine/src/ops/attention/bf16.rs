//! The fused attention of [`super::qkv_attention`] on the AVX512-BF16 kernel, for bf16
//! activations: the materialized and attention-only-recompute modes ([`forward`], [`backward`])
//! and the memory-efficient mode, streaming over key blocks ([`forward_streaming`],
//! [`backward_streaming`]).
//!
//! The generic kernels widen each head's q, k, v to f32 copies and multiply through the f32
//! `gemm` crate. Here the products read q, k, v and dO straight from the bf16 tensors into
//! packed operands ([`crate::kernels::gemm_bf16`]), and P, dS (f32) are rounded to bf16 as they are packed,
//! as PyTorch's bf16 attention rounds them; every product accumulates in f32. The softmax, the
//! scale and dS = P∘(dP − Σ dP·P) stay in f32. Scores are scaled after the product
//! (S = (q·kᵀ)·d_h^−½), so the scale is applied once in f32 rather than to bf16 q.
//!
//! Per thread (at most one per head, all allocated up front like the generic kernels): an f32
//! scratch (`AttnGeom::native_f32_fwd`, `AttnGeom::native_f32_bwd`) and the packed operands ([`packed_lens`]); the budget
//! counts them in bytes (`ditmem_budget::ditmem_cpu::ops::native_attention_scratch`,
//! `streaming_attention_scratch`).

use std::mem::MaybeUninit;

use candle_core::CpuStorage;
use half::bf16;
use rayon::prelude::*;

use super::dropout::{mask_at, Dropout};
use super::geom::{attn_threads, AttnGeom, AttnKeep};
use crate::kernels::gemm_bf16::{
    self, gemm_packed_serial, pack_a_serial, pack_b_serial, packed_a_len, packed_b_len, ToBf16,
    View,
};
use crate::kernels::shared_ptr::SharedMut;
use crate::kernels::vecmath;
use crate::ops::storage::{err, CResult};

/// Whether the native path runs for bf16 storage: where the spec's path is the kernel (every mode).
pub fn applies() -> bool {
    gemm_bf16::in_use()
}

/// (u32 elements of packed A, u16 elements of packed B) one thread needs for every product of
/// a head's forward: A is at most s × max(s, d_h), B either d_h × s or s × d_h.
pub(crate) fn packed_lens(s: usize, dh: usize) -> (usize, usize) {
    (
        packed_a_len(s, s.max(dh)),
        packed_b_len(dh, s).max(packed_b_len(s, dh)),
    )
}

/// Query rows per block of [`backward`]: P and dP of a block are this × s, not s × s (at 1,024
/// tokens 1 MiB per thread instead of 8 MiB). Twice the kernel's depth block
/// (`gemm_bf16::KC_PAIRS` pairs), so that dk and dv, summed over the blocks, add one depth
/// block at a time as one product over all queries does. Budget twin:
/// `ditmem_budget::ditmem_cpu::ops::NATIVE_ATTN_BWD_ROWS`.
pub(crate) const NATIVE_BWD_ROWS: usize = 2 * gemm_bf16::KC_PAIRS;

/// (u32 elements of packed A, u16 elements of packed B) one thread needs for every product of
/// [`backward`]'s blocks of m = min(s, [`NATIVE_BWD_ROWS`]) rows: A is m × d_h (the block's dO
/// or q), m × s (dS) or s × m (Pᵀ, dSᵀ); B is d_h × s (kᵀ, vᵀ), s × d_h (k) or m × d_h (dO, q).
pub(crate) fn packed_lens_bwd(s: usize, dh: usize) -> (usize, usize) {
    let m = NATIVE_BWD_ROWS.min(s);
    (
        packed_a_len(m, dh)
            .max(packed_a_len(m, s))
            .max(packed_a_len(s, m)),
        packed_b_len(dh, s)
            .max(packed_b_len(s, dh))
            .max(packed_b_len(m, dh)),
    )
}

impl AttnGeom {
    /// f32 elements of one thread's forward scratch on the native path: the head's output and S.
    pub(crate) fn native_f32_fwd(s: usize, dh: usize) -> usize {
        s * dh + s * s
    }
    /// f32 elements of one thread's backward scratch: dq, dk, dv, and P and dP of a block of
    /// [`NATIVE_BWD_ROWS`] query rows.
    pub(crate) fn native_f32_bwd(s: usize, dh: usize) -> usize {
        3 * s * dh + 2 * NATIVE_BWD_ROWS.min(s) * s
    }
}

/// Runs `f(head, f32 scratch, packed A, packed B)` for every head, in parallel: at most one
/// thread per head, each with its own scratch of `per` f32, `pa` u32 and `pb` u16, all allocated
/// up front (so the transient bytes are deterministic) and freed when every head is done.
fn for_each_head(
    nh: usize,
    per: usize,
    pa: usize,
    pb: usize,
    f: impl Fn(usize, &mut [f32], &mut [u32], &mut [u16]) + Sync,
) {
    let nt = attn_threads(nh);
    let mut scratch = vec![0f32; nt * per];
    let mut pas = vec![0u32; nt * pa];
    let mut pbs = vec![0u16; nt * pb];
    scratch
        .par_chunks_mut(per)
        .zip(pas.par_chunks_mut(pa))
        .zip(pbs.par_chunks_mut(pb))
        .enumerate()
        .for_each(|(t, ((sc, pa), pb))| {
            for hi in (t..nh).step_by(nt) {
                f(hi, sc, pa, pb);
            }
        });
}

/// Writes one head's dq·scale, dk·scale and dv (s × d_h each, f32) into its q, k and v columns
/// of dqkv (b·s, 3D), row by row through the vector narrowing (dq and dk are scaled in place
/// first: the same products, rounded once, as scaling each element on its way out).
///
/// # Safety
/// `pd` must point to dqkv's b·s·3D elements, and no other thread may write head (bi, hd)'s
/// columns meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn write_dqkv(
    pd: &SharedMut<bf16>,
    g: &AttnGeom,
    (bi, hd): (usize, usize),
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &[f32],
    scale: f32,
) {
    let (s, dh, d) = (g.s, g.dh, g.d());
    for x in dq[..s * dh].iter_mut().chain(dk[..s * dh].iter_mut()) {
        *x *= scale;
    }
    for i in 0..s {
        let row = (bi * s + i) * 3 * d + hd * dh;
        for (off, src) in [(0, &*dq), (d, &*dk), (2 * d, dv)] {
            // SAFETY: bi < b, i < s and hd < a, so the dh elements from row + off (off ≤ 2D)
            // lie inside the b·s·3D elements `pd` points to; they are head (bi, hd)'s own
            // columns, which the caller guarantees no other thread writes. The narrowing writes
            // every one (bf16 is `Copy`: nothing is dropped).
            let dst: &mut [MaybeUninit<bf16>] =
                unsafe { std::slice::from_raw_parts_mut(pd.at(row + off).cast(), dh) };
            vecmath::narrow_serial(&src[i * dh..(i + 1) * dh], dst);
        }
    }
}

/// The operands of head (bi, hd) as views on the bf16 tensors.
struct Head<'a> {
    q: View<'a, bf16>,
    k: View<'a, bf16>,
    v: View<'a, bf16>,
    kt: View<'a, bf16>,
    vt: View<'a, bf16>,
}

fn head<'a>(qkv: &'a [bf16], g: &AttnGeom, bi: usize, hd: usize) -> Head<'a> {
    let (s, dh, d) = (g.s, g.dh, g.d());
    let base = bi * s * 3 * d + hd * dh;
    let row = |off: usize| View::rows(&qkv[base + off..], 3 * d);
    let col = |off: usize| View::cols(&qkv[base + off..], 3 * d);
    Head {
        q: row(0),
        k: row(d),
        v: row(2 * d),
        kt: col(d),
        vt: col(2 * d),
    }
}

/// The output gradient of head (bi, hd) as a view on dO (b·s, D).
fn head_go<'a>(go_all: &'a [bf16], g: &AttnGeom, bi: usize, hd: usize) -> View<'a, bf16> {
    View::rows(&go_all[bi * g.s * g.d() + hd * g.dh..], g.d())
}

/// c = a·b on the kernel, on the calling thread (c is overwritten).
#[allow(clippy::too_many_arguments)]
fn product<TA: ToBf16, TB: ToBf16>(
    m: usize,
    n: usize,
    k: usize,
    a: View<'_, TA>,
    b: View<'_, TB>,
    c: &mut [f32],
    pa: &mut [u32],
    pb: &mut [u16],
) {
    c[..m * n].fill(0.0);
    accumulate(m, n, k, a, b, c, pa, pb);
}

/// c += a·b on the kernel, on the calling thread.
#[allow(clippy::too_many_arguments)]
fn accumulate<TA: ToBf16, TB: ToBf16>(
    m: usize,
    n: usize,
    k: usize,
    a: View<'_, TA>,
    b: View<'_, TB>,
    c: &mut [f32],
    pa: &mut [u32],
    pb: &mut [u16],
) {
    pack_a_serial(m, k, a, pa);
    pack_b_serial(k, n, b, pb);
    gemm_packed_serial(m, n, k, pa, pb, c, n);
}

/// c = a·b on the kernel with A already packed (`pa`), on the calling thread (c is overwritten).
#[allow(clippy::too_many_arguments)]
fn product_packed_a<TB: ToBf16>(
    m: usize,
    n: usize,
    k: usize,
    pa: &[u32],
    b: View<'_, TB>,
    c: &mut [f32],
    pb: &mut [u16],
) {
    pack_b_serial(k, n, b, pb);
    c[..m * n].fill(0.0);
    gemm_packed_serial(m, n, k, pa, pb, c, n);
}

/// The rows of `v` from row `i0` on.
fn from_row<T>(v: View<'_, T>, i0: usize) -> View<'_, T> {
    View {
        data: &v.data[i0 * v.rs..],
        ..v
    }
}

/// The columns of `v` from column `j0` on.
fn from_col<T>(v: View<'_, T>, j0: usize) -> View<'_, T> {
    View {
        data: &v.data[j0 * v.cs..],
        ..v
    }
}

/// Rounds row `i` of head (bi, hd)'s output (`oi`, d_h values) into its columns of the output
/// (b·s, D).
///
/// # Safety
/// `po` must point to the output's b·s·D elements, and no other thread may write head
/// (bi, hd)'s columns meanwhile.
#[inline]
unsafe fn write_out_row(
    po: &SharedMut<bf16>,
    g: &AttnGeom,
    (bi, hd): (usize, usize),
    i: usize,
    oi: &[f32],
) {
    let (s, dh, d) = (g.s, g.dh, g.d());
    // SAFETY: the row's dh elements from (bi·s + i)·D + hd·dh lie below b·s·D, the elements `po`
    // points to; head (bi, hd)'s columns are the caller's alone. The narrowing writes every one.
    let dst: &mut [MaybeUninit<bf16>] =
        unsafe { std::slice::from_raw_parts_mut(po.at((bi * s + i) * d + hd * dh).cast(), dh) };
    vecmath::narrow_serial(oi, dst);
}

/// P of `m` query rows `q` of one head over its s keys (softmax of the scaled scores) into
/// `p` (m × s), on the calling thread.
#[allow(clippy::too_many_arguments)]
fn probabilities(
    h: &Head<'_>,
    q: View<'_, bf16>,
    (m, s, dh): (usize, usize, usize),
    scale: f32,
    p: &mut [f32],
    pa: &mut [u32],
    pb: &mut [u16],
) {
    product(m, s, dh, q, h.kt, p, pa, pb);
    for x in p[..m * s].iter_mut() {
        *x *= scale;
    }
    vecmath::softmax_rows(&mut p[..m * s], s);
}

/// Forward of all heads: the output (b·s, D) and, when `save`, P (b·a·s², bf16).
pub fn forward(
    qkv: &[bf16],
    g: &AttnGeom,
    keep: AttnKeep,
    dropout: Option<Dropout>,
    save: bool,
) -> (Vec<bf16>, Option<CpuStorage>) {
    let (s, dh, d) = (g.s, g.dh, g.d());
    let nh = g.heads();
    // Written whole through raw pointers below, then given its length: no zeroing.
    let mut out: Vec<bf16> = Vec::with_capacity(g.b * s * d);
    let save_p = save && keep == AttnKeep::Probabilities;
    let mut p_keep: Vec<bf16> = Vec::with_capacity(if save_p { nh * s * s } else { 0 });
    let per = AttnGeom::native_f32_fwd(s, dh);
    let (pa_len, pb_len) = packed_lens(s, dh);
    let scale = crate::mutation::attention_scale(dh) as f32;
    let (po, pp) = (SharedMut(out.as_mut_ptr()), SharedMut(p_keep.as_mut_ptr()));
    for_each_head(nh, per, pa_len, pb_len, |hi, sc, pa, pb| {
        let (o, p) = sc.split_at_mut(s * dh);
        let (bi, hd) = (hi / g.a, hi % g.a);
        let h = head(qkv, g, bi, hd);
        probabilities(&h, h.q, (s, s, dh), scale, p, pa, pb);
        if save_p {
            // SAFETY: hi < b·a, and `p_keep` has capacity b·a·s² when P is saved, so its
            // elements hi·s²..(hi+1)·s² lie inside it; `for_each_head` hands head `hi` to one
            // task only, and only that task touches them. The narrowing writes every one.
            let dst: &mut [MaybeUninit<bf16>] =
                unsafe { std::slice::from_raw_parts_mut(pp.at(hi * s * s).cast(), s * s) };
            vecmath::narrow_serial(p, dst);
        }
        if let Some(dr) = dropout {
            for (i, v) in p.iter_mut().enumerate() {
                *v *= mask_at::<f32>(dr, hi * s * s + i);
            }
        }
        let pv = View::rows(&*p, s);
        product(s, dh, s, pv, h.v, o, pa, pb);
        for (i, oi) in o.chunks(dh).enumerate() {
            // SAFETY: `po` points to `out`'s b·s·D elements (its capacity); head (bi, hd) is one
            // task's alone and only it writes columns hd·dh..(hd+1)·dh of batch bi's rows.
            unsafe { write_out_row(&po, g, (bi, hd), i, oi) };
        }
    });
    // SAFETY: the heads' columns cover every row of `out` (b·s·D elements, its capacity), and
    // P's blocks cover all of `p_keep` when it is kept (its capacity is 0 otherwise); bf16 has
    // no invalid bit patterns and every element was written.
    unsafe {
        out.set_len(g.b * s * d);
        p_keep.set_len(p_keep.capacity());
    }
    let saved = save_p.then_some(CpuStorage::BF16(p_keep));
    (out, saved)
}

/// Backward of all heads: dqkv (b·s, 3D). Each head runs by blocks of [`NATIVE_BWD_ROWS`]
/// query rows: the block's P (from the kept one, or recomputed) and dP = dO·vᵀ, dS = P∘(dP −
/// Σ dP·P) in place, dq of the block's rows = dS·k, and dv += Pᵀ·dO, dk += dSᵀ·q summed over
/// the blocks in order.
pub fn backward(
    qkv: &[bf16],
    go_all: &[bf16],
    saved: Option<&CpuStorage>,
    g: &AttnGeom,
    keep: AttnKeep,
    dropout: Option<Dropout>,
) -> CResult<Vec<bf16>> {
    let (s, dh, d) = (g.s, g.dh, g.d());
    let nh = g.heads();
    let p_saved: Option<&[bf16]> = match (keep, saved) {
        (AttnKeep::Probabilities, Some(st)) => Some(st.as_slice::<bf16>()?),
        (AttnKeep::Probabilities, None) => {
            return Err(err("attention backward: probabilities were not kept"))
        }
        _ => None,
    };
    // Written whole through raw pointers below, then given its length: no zeroing.
    let mut dqkv: Vec<bf16> = Vec::with_capacity(g.b * s * 3 * d);
    let per = AttnGeom::native_f32_bwd(s, dh);
    let (pa_len, pb_len) = packed_lens_bwd(s, dh);
    let scale = crate::mutation::attention_scale(dh) as f32;
    let pd = SharedMut(dqkv.as_mut_ptr());
    let rows = NATIVE_BWD_ROWS.min(s);
    for_each_head(nh, per, pa_len, pb_len, |hi, sc, pa, pb| {
        let (dq, rest) = sc.split_at_mut(s * dh);
        let (dk, rest) = rest.split_at_mut(s * dh);
        let (dv, rest) = rest.split_at_mut(s * dh);
        let (p, dp) = rest.split_at_mut(rows * s);
        let (bi, hd) = (hi / g.a, hi % g.a);
        let h = head(qkv, g, bi, hd);
        let go_head = head_go(go_all, g, bi, hd);
        dk.fill(0.0);
        dv.fill(0.0);
        let mut i0 = 0;
        while i0 < s {
            let m = rows.min(s - i0);
            let (p, dp) = (&mut p[..m * s], &mut dp[..m * s]);
            // The block's rows of q and dO, and where its P and mask start.
            let (qi, go) = (from_row(h.q, i0), from_row(go_head, i0));
            let at = hi * s * s + i0 * s;
            let load_p = |p: &mut [f32], pa: &mut [u32], pb: &mut [u16]| match p_saved {
                Some(ps) => {
                    for (x, y) in p.iter_mut().zip(&ps[at..][..m * s]) {
                        *x = y.to_f32();
                    }
                }
                None => {
                    // Recomputed and rounded as the stored mode keeps it (bitwise twins).
                    probabilities(&h, qi, (m, s, dh), scale, p, pa, pb);
                    for x in p.iter_mut() {
                        *x = bf16::from_f32(*x).to_f32();
                    }
                }
            };
            load_p(p, pa, pb);
            // dP̃ = dO·vᵀ.
            product(m, s, dh, go, h.vt, dp, pa, pb);
            if let Some(dr) = dropout {
                // dv += (P∘M)ᵀ·dO: scale P in place, rebuild it after.
                for (i, (x, y)) in p.iter_mut().zip(dp.iter_mut()).enumerate() {
                    let mk = mask_at::<f32>(dr, at + i);
                    *x *= mk;
                    *y *= mk;
                }
            }
            let pt = View::cols(&*p, s);
            accumulate(s, dh, m, pt, go, dv, pa, pb);
            if dropout.is_some() {
                load_p(p, pa, pb);
            }
            // dS = P∘(dP − Σ_j dP·P), in dp.
            vecmath::softmax_grad_rows(p, dp, s);
            let ds = View::rows(&*dp, s);
            product(m, dh, s, ds, h.k, &mut dq[i0 * dh..], pa, pb);
            let dst = View::cols(&*dp, s);
            accumulate(s, dh, m, dst, qi, dk, pa, pb);
            i0 += m;
        }
        // SAFETY: `pd` points to dqkv's b·s·3D elements (its capacity) and head (bi, hd) is this
        // task's alone, so no other thread writes its q, k, v columns.
        unsafe { write_dqkv(&pd, g, (bi, hd), dq, dk, dv, scale) };
    });
    // SAFETY: the heads' q, k and v columns cover every element of the b·s·3D rows (the
    // capacity), each written once above.
    unsafe { dqkv.set_len(g.b * s * 3 * d) };
    Ok(dqkv)
}

/// Forward of all heads, streaming over blocks of `g.kb()` keys with an online softmax: the
/// output (b·s, D) and, when `save`, the log-sum-exp per query row (b·a·s, f32).
pub(crate) fn forward_streaming(
    qkv: &[bf16],
    g: &AttnGeom,
    save: bool,
) -> (Vec<bf16>, Option<CpuStorage>) {
    let (s, dh, d) = (g.s, g.dh, g.d());
    let (nh, kb) = (g.heads(), g.kb());
    // Written whole through raw pointers below, then given its length: no zeroing.
    let mut out: Vec<bf16> = Vec::with_capacity(g.b * s * d);
    let mut lse = if save { vec![0f32; nh * s] } else { Vec::new() };
    let per = s * dh + s * kb + 2 * s;
    let (aq_len, ap_len) = (packed_a_len(s, dh), packed_a_len(s, kb));
    let b_len = packed_b_len(dh, kb).max(packed_b_len(kb, dh));
    let scale = crate::mutation::attention_scale(dh) as f32;
    let (po, pl) = (SharedMut(out.as_mut_ptr()), SharedMut(lse.as_mut_ptr()));
    for_each_head(nh, per, aq_len + ap_len, b_len, |hi, sc, pa, pb| {
        let (o, rest) = sc.split_at_mut(s * dh);
        let (sb, ml) = rest.split_at_mut(s * kb);
        let (m, l) = ml.split_at_mut(s);
        let (aq, ap) = pa.split_at_mut(aq_len);
        let (bi, hd) = (hi / g.a, hi % g.a);
        let h = head(qkv, g, bi, hd);
        pack_a_serial(s, dh, h.q, aq);
        m.fill(f32::NEG_INFINITY);
        l.fill(0.0);
        o.fill(0.0);
        let mut j0 = 0;
        while j0 < s {
            let n = kb.min(s - j0);
            let blk = &mut sb[..s * n];
            // S = (q·k_blkᵀ)·scale.
            product_packed_a(s, n, dh, aq, from_col(h.kt, j0), blk, pb);
            for x in blk.iter_mut() {
                *x *= scale;
            }
            for i in 0..s {
                let row = &mut blk[i * n..(i + 1) * n];
                let bmax = if crate::mutation::active(crate::mutation::Mutation::SoftmaxNoMax) {
                    0.0
                } else {
                    vecmath::max_of(row).max(m[i])
                };
                let corr = if m[i] == f32::NEG_INFINITY {
                    0.0
                } else {
                    (m[i] - bmax).exp()
                };
                let z = vecmath::exp_sub_sum_of(row, bmax);
                l[i] = l[i] * corr + z;
                for x in o[i * dh..(i + 1) * dh].iter_mut() {
                    *x *= corr;
                }
                m[i] = bmax;
            }
            // o += P_blk·v_blk.
            let pblk = View::rows(&*blk, n);
            accumulate(s, dh, n, pblk, from_row(h.v, j0), o, ap, pb);
            j0 += n;
        }
        for i in 0..s {
            let inv = 1.0 / l[i];
            let oi = &mut o[i * dh..(i + 1) * dh];
            for x in oi.iter_mut() {
                *x *= inv;
            }
            // SAFETY: `po` points to `out`'s b·s·D elements (its capacity); head (bi, hd) is one
            // task's alone and only it writes columns hd·dh..(hd+1)·dh of batch bi's rows.
            unsafe { write_out_row(&po, g, (bi, hd), i, oi) };
            if save {
                // SAFETY: `lse` holds b·a·s elements when saved and hi·s + i < b·a·s; only head
                // `hi`'s task writes lse[hi·s..(hi+1)·s].
                unsafe { *pl.at(hi * s + i) = m[i] + l[i].ln() };
            }
        }
    });
    // SAFETY: the heads' columns cover every element of `out` (b·s·D, its capacity), each
    // written once above.
    unsafe { out.set_len(g.b * s * d) };
    let saved = save.then_some(CpuStorage::F32(lse));
    (out, saved)
}

/// Δ of head (bi, hd): Δ_i = dO_i · o_i for each of its s rows (o and dO (b·s, D)).
fn row_dots(
    delta: &mut [f32],
    (o_all, go_all): (&[bf16], &[bf16]),
    g: &AttnGeom,
    (bi, hd): (usize, usize),
) {
    let (s, dh, d) = (g.s, g.dh, g.d());
    for (i, dl) in delta.iter_mut().enumerate() {
        let orow = &o_all[(bi * s + i) * d + hd * dh..][..dh];
        let grow = &go_all[(bi * s + i) * d + hd * dh..][..dh];
        *dl = grow
            .iter()
            .zip(orow)
            .map(|(a, b)| a.to_f32() * b.to_f32())
            .sum();
    }
}

/// dS = P∘(dP − Δ) over dP, row by row (`n` a row; `delta_i` one Δ a row).
fn score_grad(p: &[f32], dp: &mut [f32], delta_i: &[f32], n: usize) {
    for (i, &di) in delta_i.iter().enumerate() {
        for (a, b) in p[i * n..(i + 1) * n]
            .iter()
            .zip(dp[i * n..(i + 1) * n].iter_mut())
        {
            *b = *a * (*b - di);
        }
    }
}

// Kept whole (> 100 lines): one head's task is one closure over its scratch, in the order the
// budget counts it; split further, the buffers' carving would spread over functions.
/// Backward of the streaming mode: dqkv (b·s, 3D), P recomputed block by block from the kept
/// log-sum-exp.
pub(crate) fn backward_streaming(
    qkv: &[bf16],
    o_all: &[bf16],
    go_all: &[bf16],
    saved: Option<&CpuStorage>,
    g: &AttnGeom,
) -> CResult<Vec<bf16>> {
    let (s, dh, d) = (g.s, g.dh, g.d());
    let (nh, kb) = (g.heads(), g.kb());
    let qb = NATIVE_BWD_ROWS.min(s);
    let lse_all: &[f32] = match saved {
        Some(st) => st.as_slice::<f32>()?,
        None => return Err(err("attention backward: the log-sum-exp was not kept")),
    };
    // Written whole through raw pointers below, then given its length: no zeroing.
    let mut dqkv: Vec<bf16> = Vec::with_capacity(g.b * s * 3 * d);
    let per = 3 * s * dh + 2 * qb * kb + s;
    let a_qd = packed_a_len(qb, dh);
    let a_blk = packed_a_len(qb, kb).max(packed_a_len(kb, qb));
    let b_len = packed_b_len(dh, kb)
        .max(packed_b_len(kb, dh))
        .max(packed_b_len(qb, dh));
    let scale = crate::mutation::attention_scale(dh) as f32;
    let pd = SharedMut(dqkv.as_mut_ptr());
    for_each_head(nh, per, 2 * a_qd + a_blk, b_len, |hi, sc, pa, pb| {
        let (dq, rest) = sc.split_at_mut(s * dh);
        let (dk, rest) = rest.split_at_mut(s * dh);
        let (dv, rest) = rest.split_at_mut(s * dh);
        let (pblk, rest) = rest.split_at_mut(qb * kb);
        let (dpblk, delta) = rest.split_at_mut(qb * kb);
        let (aq, rest) = pa.split_at_mut(a_qd);
        let (ado, ab) = rest.split_at_mut(a_qd);
        let (bi, hd) = (hi / g.a, hi % g.a);
        let h = head(qkv, g, bi, hd);
        let go_head = head_go(go_all, g, bi, hd);
        let lse = &lse_all[hi * s..][..s];
        row_dots(delta, (o_all, go_all), g, (bi, hd));
        dq.fill(0.0);
        dk.fill(0.0);
        dv.fill(0.0);
        // By blocks of qb queries, each over blocks of kb keys: dq of the query block, dk and dv
        // of the key block summed over the query blocks in order.
        let mut i0 = 0;
        while i0 < s {
            let m = qb.min(s - i0);
            let (qi, goi) = (from_row(h.q, i0), from_row(go_head, i0));
            pack_a_serial(m, dh, qi, aq);
            pack_a_serial(m, dh, goi, ado);
            let (lse_i, delta_i) = (&lse[i0..i0 + m], &delta[i0..i0 + m]);
            let dqi = &mut dq[i0 * dh..(i0 + m) * dh];
            let mut j0 = 0;
            while j0 < s {
                let n = kb.min(s - j0);
                let p = &mut pblk[..m * n];
                let dp = &mut dpblk[..m * n];
                // P = exp(S·scale − lse).
                product_packed_a(m, n, dh, aq, from_col(h.kt, j0), p, pb);
                for x in p.iter_mut() {
                    *x *= scale;
                }
                vecmath::exp_rows(p, n, lse_i);
                // dv_blk += Pᵀ·dO_i.
                let pt = View::cols(&*p, n);
                accumulate(n, dh, m, pt, goi, &mut dv[j0 * dh..(j0 + n) * dh], ab, pb);
                // dP = dO_i·v_blkᵀ.
                product_packed_a(m, n, dh, ado, from_col(h.vt, j0), dp, pb);
                score_grad(p, dp, delta_i, n);
                // dq_i += dS·k_blk.
                let ds = View::rows(&*dp, n);
                accumulate(m, dh, n, ds, from_row(h.k, j0), dqi, ab, pb);
                // dk_blk += dSᵀ·q_i.
                let dst = View::cols(&*dp, n);
                accumulate(n, dh, m, dst, qi, &mut dk[j0 * dh..(j0 + n) * dh], ab, pb);
                j0 += n;
            }
            i0 += m;
        }
        // SAFETY: `pd` points to dqkv's b·s·3D elements (its capacity) and head (bi, hd) is this
        // task's alone, so no other thread writes its q, k, v columns.
        unsafe { write_dqkv(&pd, g, (bi, hd), dq, dk, dv, scale) };
    });
    // SAFETY: the heads' q, k and v columns cover every element of the b·s·3D rows (the
    // capacity), each written once above.
    unsafe { dqkv.set_len(g.b * s * 3 * d) };
    Ok(dqkv)
}
