//! The fused attention's generic CPU kernels, for every storage dtype with f32 accumulation
//! (f64 for f64): each head's q, k, v gathered into accumulation-type copies, products through
//! the `gemm` crate ([`crate::kernels::gemm::mm`]), the softmax fused. bf16 storage on a CPU
//! with AVX512-BF16 takes [`super::bf16`] instead.

use candle_core::{CpuStorage, WithDType};
use rayon::prelude::*;

use super::dropout::{mask_at, Dropout};
use super::geom::{attn_threads, AttnGeom, AttnKeep};
use crate::kernels::gemm::mm;
use crate::kernels::scalar::{Acc, Elem};
use crate::kernels::shared_ptr::SharedMut;
use crate::ops::storage::{err, CResult};

/// Gathers head `hd` of batch `bi` from the qkv rows into three (s×dh) buffers, q scaled by
/// `q_scale` (k and v as they are). `qkv` points to the (b·s, 3D) rows; only head (bi, hd)'s
/// q, k and v columns are read.
///
/// # Safety
/// `qkv` must point to b·s·3D initialised elements, and no other thread may write head
/// (bi, hd)'s columns during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn gather_qkv<T: Elem<A>, A: Acc>(
    qkv: SharedMut<T>,
    g: &AttnGeom,
    bi: usize,
    hd: usize,
    q_scale: A,
    q: &mut [A],
    k: &mut [A],
    v: &mut [A],
) {
    let (s, dh, d) = (g.s, g.dh, g.d());
    let one = <A as Acc>::from_f64(1.0);
    for (which, (dst, scale)) in [(q, q_scale), (k, one), (v, one)].into_iter().enumerate() {
        for i in 0..s {
            let src = (bi * s + i) * 3 * d + which * d + hd * dh;
            for (j, o) in dst[i * dh..(i + 1) * dh].iter_mut().enumerate() {
                // SAFETY: bi < b, i < s, which < 3, hd < a and j < dh, so the index is below
                // b·s·3D; the caller guarantees no thread writes these columns meanwhile.
                *o = unsafe { *qkv.at(src + j) }.to_acc() * scale;
            }
        }
    }
}

/// Rounds values through the storage type: the recomputed P of the attention-only policy then
/// equals the P the materialized mode stores in the compute dtype, so both modes' gradients are
/// bitwise the same (the recompute twin test of `ditmem verify`).
pub(super) fn round_through<T: Elem<A>, A: Acc>(x: &mut [A]) {
    for v in x.iter_mut() {
        *v = T::from_acc(*v).to_acc();
    }
}

/// The softmax's backward over rows of `n` in place: dP becomes dS = P∘(dP − Σ_j dP·P) (the
/// generic kernels' materialized and attention-only modes, and the separate attention's).
pub(super) fn softmax_bwd_rows<A: Acc>(p: &[A], dp: &mut [A], n: usize) {
    for (pr, dr) in p.chunks(n).zip(dp.chunks_mut(n)) {
        let mut delta = A::ZERO;
        for (a, b) in pr.iter().zip(dr.iter()) {
            delta += *a * *b;
        }
        for (a, b) in pr.iter().zip(dr.iter_mut()) {
            *b = *a * (*b - delta);
        }
    }
}

/// Row softmax of an (s×n) block in place.
fn softmax_rows<A: Acc>(x: &mut [A], n: usize) {
    A::softmax_rows(x, n)
}

/// Forward of all heads: returns o (b·s, D) and what the mode keeps.
pub(super) fn attn_fwd_cpu<T, A>(
    qkv: &[T],
    g: &AttnGeom,
    keep: AttnKeep,
    dropout: Option<Dropout>,
    save: bool,
) -> (Vec<T>, Option<CpuStorage>)
where
    T: Elem<A> + WithDType,
    A: Acc + WithDType,
{
    let (s, dh, d) = (g.s, g.dh, g.d());
    let nh = g.heads();
    let mut out: Vec<T> = vec![T::from_acc(A::ZERO); g.b * s * d];
    let mut p_keep: Vec<T> = if save && keep == AttnKeep::Probabilities {
        vec![T::from_acc(A::ZERO); nh * s * s]
    } else {
        Vec::new()
    };
    let mut lse: Vec<A> = if save && keep == AttnKeep::LogSumExp {
        vec![A::ZERO; nh * s]
    } else {
        Vec::new()
    };
    let nt = attn_threads(nh);
    let per = g.fwd_scratch(keep);
    let mut scratch: Vec<A> = vec![A::ZERO; nt * per];
    let scale = <A as Acc>::from_f64(crate::mutation::attention_scale(dh));
    // The callers slice qkv by the layout `attn_geom` read the geometry from, so this holds;
    // checked because `gather_qkv` reads through a raw pointer.
    assert_eq!(
        qkv.len(),
        g.b * s * 3 * d,
        "attention forward: qkv is not (b·s, 3D)"
    );
    let src = SharedMut(qkv.as_ptr().cast_mut());
    let (po, pp, pl) = (
        SharedMut(out.as_mut_ptr()),
        SharedMut(p_keep.as_mut_ptr()),
        SharedMut(lse.as_mut_ptr()),
    );
    let (save_p, save_l) = (!p_keep.is_empty(), !lse.is_empty());
    let kb = g.kb();
    scratch.par_chunks_mut(per).enumerate().for_each(|(t, sc)| {
        let (q, rest) = sc.split_at_mut(s * dh);
        let (k, rest) = rest.split_at_mut(s * dh);
        let (v, rest) = rest.split_at_mut(s * dh);
        let (o, rest) = rest.split_at_mut(s * dh);
        let mut head = t;
        while head < nh {
            let (bi, hd) = (head / g.a, head % g.a);
            // SAFETY: `src` points to `qkv`, b·s·3D elements (asserted above), which nothing
            // writes meanwhile.
            unsafe { gather_qkv(src, g, bi, hd, scale, q, k, v) };
            match keep {
                AttnKeep::Probabilities | AttnKeep::Nothing => {
                    let p = &mut rest[..s * s];
                    mm(s, s, dh, p, (q, dh, 1), (k, 1, dh), false);
                    softmax_rows(p, s);
                    if save_p {
                        for (i, v) in p.iter().enumerate() {
                            // SAFETY: `p_keep` holds b·a·s² elements when saved and
                            // head·s² + i < b·a·s²; heads are dealt to tasks by residue
                            // (head ≡ t mod nt), so only this task writes head's block of P.
                            unsafe { *pp.at(head * s * s + i) = T::from_acc(*v) };
                        }
                    }
                    if let Some(dr) = dropout {
                        for (i, v) in p.iter_mut().enumerate() {
                            *v *= mask_at::<A>(dr, head * s * s + i);
                        }
                    }
                    mm(s, dh, s, o, (p, s, 1), (v, dh, 1), false);
                }
                AttnKeep::LogSumExp => {
                    let (sb, ml) = rest.split_at_mut(s * kb);
                    let (m, l) = ml.split_at_mut(s);
                    m.iter_mut().for_each(|x| *x = A::NEG_INF);
                    l.iter_mut().for_each(|x| *x = A::ZERO);
                    o.iter_mut().for_each(|x| *x = A::ZERO);
                    let mut j0 = 0;
                    while j0 < s {
                        let n = kb.min(s - j0);
                        let blk = &mut sb[..s * n];
                        mm(s, n, dh, blk, (q, dh, 1), (&k[j0 * dh..], 1, dh), false);
                        for i in 0..s {
                            let row = &mut blk[i * n..(i + 1) * n];
                            let rmax =
                                if crate::mutation::active(crate::mutation::Mutation::SoftmaxNoMax)
                                {
                                    A::ZERO
                                } else {
                                    A::max_of(row)
                                };
                            let bmax = if rmax > m[i] { rmax } else { m[i] };
                            let corr = if m[i] == A::NEG_INF {
                                A::ZERO
                            } else {
                                (m[i] - bmax).exp()
                            };
                            let z = A::exp_sub_sum(row, bmax);
                            l[i] = l[i] * corr + z;
                            for x in o[i * dh..(i + 1) * dh].iter_mut() {
                                *x *= corr;
                            }
                            m[i] = bmax;
                        }
                        mm(s, dh, n, o, (blk, n, 1), (&v[j0 * dh..], dh, 1), true);
                        j0 += n;
                    }
                    for i in 0..s {
                        let inv = <A as Acc>::from_f64(1.0) / l[i];
                        for x in o[i * dh..(i + 1) * dh].iter_mut() {
                            *x *= inv;
                        }
                        if save_l {
                            // SAFETY: `lse` holds b·a·s elements when saved and head·s + i is
                            // below that; only this task writes head's s values.
                            unsafe { *pl.at(head * s + i) = m[i] + l[i].ln() };
                        }
                    }
                }
            }
            for i in 0..s {
                for j in 0..dh {
                    // SAFETY: the index is below b·s·D, the length of `out`; only this task
                    // (head ≡ t mod nt) writes head (bi, hd)'s columns of batch bi's rows.
                    unsafe { *po.at((bi * s + i) * d + hd * dh + j) = T::from_acc(o[i * dh + j]) };
                }
            }
            head += nt;
        }
    });
    drop(scratch);
    let saved = if save_p {
        Some(T::to_cpu_storage_owned(p_keep))
    } else if save_l {
        Some(A::to_cpu_storage_owned(lse))
    } else {
        None
    };
    (out, saved)
}

/// Backward of all heads: returns dqkv (b·s, 3D), a fresh buffer beside qkv.
#[allow(clippy::too_many_arguments)]
pub(super) fn attn_bwd_cpu<T, A>(
    qkv: &[T],
    o_all: &[T],
    go_all: &[T],
    saved: Option<&CpuStorage>,
    g: &AttnGeom,
    keep: AttnKeep,
    dropout: Option<Dropout>,
) -> CResult<Vec<T>>
where
    T: Elem<A> + WithDType,
    A: Acc + WithDType,
{
    check_len(qkv.len(), g)?;
    let mut dqkv: Vec<T> = vec![T::from_acc(A::ZERO); g.b * g.s * 3 * g.d()];
    let (src, dst) = (
        SharedMut(qkv.as_ptr().cast_mut()),
        SharedMut(dqkv.as_mut_ptr()),
    );
    // SAFETY: `src` and `dst` point to two distinct buffers of b·s·3D elements; `qkv` is only
    // read.
    unsafe { attn_bwd_heads::<T, A>((src, dst), (o_all, go_all), saved, g, keep, dropout)? };
    Ok(dqkv)
}

/// [`attn_bwd_cpu`] written over qkv itself: each head's task gathers its q, k, v columns into
/// its scratch before it writes dq, dk, dv over the same columns (no task reads another head's
/// columns), so the backward holds one (b·s, 3D) buffer instead of two. The same bits.
#[allow(clippy::too_many_arguments)]
pub(super) fn attn_bwd_cpu_over<T, A>(
    qkv: &mut [T],
    o_all: &[T],
    go_all: &[T],
    saved: Option<&CpuStorage>,
    g: &AttnGeom,
    keep: AttnKeep,
    dropout: Option<Dropout>,
) -> CResult<()>
where
    T: Elem<A> + WithDType,
    A: Acc + WithDType,
{
    check_len(qkv.len(), g)?;
    let p = SharedMut(qkv.as_mut_ptr());
    // SAFETY: `p` points to the exclusively borrowed qkv of b·s·3D elements; every task reads
    // and then writes only its own head's columns through it (`attn_bwd_heads`).
    unsafe { attn_bwd_heads::<T, A>((p, p), (o_all, go_all), saved, g, keep, dropout) }
}

/// qkv must hold (b·s, 3D) elements.
fn check_len(n: usize, g: &AttnGeom) -> CResult<()> {
    if n == g.b * g.s * 3 * g.d() {
        Ok(())
    } else {
        Err(err(format!(
            "attention backward: qkv holds {n} elements, not b·s·3D = {}",
            g.b * g.s * 3 * g.d()
        )))
    }
}

/// The backward's heads: each (bi, hd) gathers its q, k, v from `src`, computes dq, dk, dv in
/// its task's scratch and writes them into its columns of `dst`.
///
/// # Safety
/// `src` and `dst` must point to b·s·3D elements each (`src` initialised); they may be the
/// same buffer (a head's columns are read before they are written, and by no other head), but
/// nothing else may access them during the call.
#[allow(clippy::too_many_arguments)]
/// The streaming backward of one head (s_q queries over s_kv keys, head width d_h, q already
/// scaled): Δ_i = dO_i · o_i from the head's columns of `o_all` (rows of width `d`, batch entry
/// `bi`, head `hd`), then per block of `kb` keys and, within it, per block of `qbl` queries: P =
/// exp(q·kᵀ − lse) into `pb`, dv += Pᵀ·dO, dP = dO·vᵀ into `dpb`, dS = P ⊙ (dP − Δ) over it,
/// dq += dS·k and dk += dSᵀ·q (dv and dk sum the query blocks in order). Shared by the qkv and
/// the separate q, k, v kernels (`super::separate`).
#[allow(clippy::type_complexity)]
pub(super) fn streaming_head_bwd<T: Elem<A>, A: Acc + WithDType>(
    (sq, sk, dh): (usize, usize, usize),
    (q, go, k, v): (&[A], &[A], &[A], &[A]),
    (o_all, bi, hd, d): (&[T], usize, usize, usize),
    (lse, delta): (&[A], &mut [A]),
    (qbl, kb, pb, dpb): (usize, usize, &mut [A], &mut [A]),
    (dq, dk, dv): (&mut [A], &mut [A], &mut [A]),
) {
    for i in 0..sq {
        let orow = &o_all[(bi * sq + i) * d + hd * dh..][..dh];
        let mut acc = A::ZERO;
        for (x, y) in go[i * dh..(i + 1) * dh].iter().zip(orow) {
            acc += *x * y.to_acc();
        }
        delta[i] = acc;
    }
    dq[..sq * dh].iter_mut().for_each(|x| *x = A::ZERO);
    let mut j0 = 0;
    while j0 < sk {
        let n = kb.min(sk - j0);
        let (kj, vj) = (&k[j0 * dh..], &v[j0 * dh..]);
        let mut i0 = 0;
        while i0 < sq {
            let m = qbl.min(sq - i0);
            let p = &mut pb[..m * n];
            let dp = &mut dpb[..m * n];
            let (qi, goi) = (&q[i0 * dh..], &go[i0 * dh..]);
            let acc = i0 > 0;
            mm(m, n, dh, p, (qi, dh, 1), (kj, 1, dh), false);
            A::exp_rows(p, n, &lse[i0..i0 + m]);
            mm(n, dh, m, &mut dv[j0 * dh..], (p, 1, n), (goi, dh, 1), acc);
            mm(m, n, dh, dp, (goi, dh, 1), (vj, 1, dh), false);
            for i in 0..m {
                for (a, b) in p[i * n..(i + 1) * n]
                    .iter()
                    .zip(dp[i * n..(i + 1) * n].iter_mut())
                {
                    *b = *a * (*b - delta[i0 + i]);
                }
            }
            mm(m, dh, n, &mut dq[i0 * dh..], (dp, n, 1), (kj, dh, 1), true);
            mm(n, dh, m, &mut dk[j0 * dh..], (dp, 1, n), (qi, dh, 1), acc);
            i0 += m;
        }
        j0 += n;
    }
}

unsafe fn attn_bwd_heads<T, A>(
    (src, pd): (SharedMut<T>, SharedMut<T>),
    (o_all, go_all): (&[T], &[T]),
    saved: Option<&CpuStorage>,
    g: &AttnGeom,
    keep: AttnKeep,
    dropout: Option<Dropout>,
) -> CResult<()>
where
    T: Elem<A> + WithDType,
    A: Acc + WithDType,
{
    let (s, dh, d) = (g.s, g.dh, g.d());
    let nh = g.heads();
    let p_saved: Option<&[T]> = match (keep, saved) {
        (AttnKeep::Probabilities, Some(st)) => Some(st.as_slice::<T>()?),
        (AttnKeep::Probabilities, None) => {
            return Err(err("attention backward: probabilities were not kept"))
        }
        _ => None,
    };
    let lse: Option<&[A]> = match (keep, saved) {
        (AttnKeep::LogSumExp, Some(st)) => Some(st.as_slice::<A>()?),
        (AttnKeep::LogSumExp, None) => {
            return Err(err("attention backward: the log-sum-exp was not kept"))
        }
        _ => None,
    };
    let nt = attn_threads(nh);
    let per = g.bwd_scratch(keep);
    let mut scratch: Vec<A> = vec![A::ZERO; nt * per];
    let scale = <A as Acc>::from_f64(crate::mutation::attention_scale(dh));
    let (kb, qbl) = (g.kb(), g.qb());
    scratch.par_chunks_mut(per).enumerate().for_each(|(t, sc)| {
        let (q, rest) = sc.split_at_mut(s * dh);
        let (k, rest) = rest.split_at_mut(s * dh);
        let (v, rest) = rest.split_at_mut(s * dh);
        let (go, rest) = rest.split_at_mut(s * dh);
        let (dq, rest) = rest.split_at_mut(s * dh);
        let (dk, rest) = rest.split_at_mut(s * dh);
        let (dv, rest) = rest.split_at_mut(s * dh);
        let mut head = t;
        while head < nh {
            let (bi, hd) = (head / g.a, head % g.a);
            // SAFETY: the caller's contract: `src` holds b·s·3D elements, and only this task
            // (head ≡ t mod nt) touches head (bi, hd)'s columns, which it writes only below.
            unsafe { gather_qkv(src, g, bi, hd, scale, q, k, v) };
            for i in 0..s {
                let src = &go_all[(bi * s + i) * d + hd * dh..][..dh];
                for (x, y) in go[i * dh..(i + 1) * dh].iter_mut().zip(src) {
                    *x = y.to_acc();
                }
            }
            match keep {
                AttnKeep::Probabilities | AttnKeep::Nothing => {
                    let (p, dp) = rest.split_at_mut(s * s);
                    let dp = &mut dp[..s * s];
                    match p_saved {
                        Some(ps) => {
                            for (x, y) in p.iter_mut().zip(&ps[head * s * s..][..s * s]) {
                                *x = y.to_acc();
                            }
                        }
                        None => {
                            mm(s, s, dh, p, (q, dh, 1), (k, 1, dh), false);
                            softmax_rows(p, s);
                            round_through::<T, A>(p);
                        }
                    }
                    // dP̃ = dO·vᵀ, then through the mask.
                    mm(s, s, dh, dp, (go, dh, 1), (v, 1, dh), false);
                    if let Some(dr) = dropout {
                        // dv = (P∘M)ᵀ·dO needs P∘M: scale P in place, undo after.
                        for (i, (x, y)) in p.iter_mut().zip(dp.iter_mut()).enumerate() {
                            let mk = mask_at::<A>(dr, head * s * s + i);
                            *x *= mk;
                            *y *= mk;
                        }
                        mm(s, dh, s, dv, (p, 1, s), (go, dh, 1), false);
                        // Rebuild P (the mask zeroed some entries): recompute or reload.
                        match p_saved {
                            Some(ps) => {
                                for (x, y) in p.iter_mut().zip(&ps[head * s * s..][..s * s]) {
                                    *x = y.to_acc();
                                }
                            }
                            None => {
                                mm(s, s, dh, p, (q, dh, 1), (k, 1, dh), false);
                                softmax_rows(p, s);
                                round_through::<T, A>(p);
                            }
                        }
                    } else {
                        mm(s, dh, s, dv, (p, 1, s), (go, dh, 1), false);
                    }
                    // dS = P∘(dP − Σ_j dP·P), in dp.
                    softmax_bwd_rows(p, dp, s);
                    mm(s, dh, s, dq, (dp, s, 1), (k, dh, 1), false);
                    mm(s, dh, s, dk, (dp, 1, s), (q, dh, 1), false);
                }
                AttnKeep::LogSumExp => {
                    let lse = &lse.unwrap_or(&[])[head * s..][..s];
                    let (pb, rest) = rest.split_at_mut(qbl * kb);
                    let (dpb, delta) = rest.split_at_mut(qbl * kb);
                    let (blocks, grads) = ((qbl, kb, pb, dpb), (&mut *dq, &mut *dk, &mut *dv));
                    let ins = (&*q, &*go, &*k, &*v);
                    let o = (o_all, bi, hd, d);
                    streaming_head_bwd((s, s, dh), ins, o, (lse, delta), blocks, grads);
                }
            }
            for i in 0..s {
                let row = (bi * s + i) * 3 * d + hd * dh;
                for j in 0..dh {
                    // SAFETY: row + 2d + j < b·s·3D, the length of `dst` (the caller's
                    // contract); only this task (head ≡ t mod nt) touches head (bi, hd)'s q, k,
                    // v columns, and it has gathered them above.
                    unsafe {
                        *pd.at(row + j) = T::from_acc(dq[i * dh + j] * scale);
                        *pd.at(row + d + j) = T::from_acc(dk[i * dh + j]);
                        *pd.at(row + 2 * d + j) = T::from_acc(dv[i * dh + j]);
                    }
                }
            }
            head += nt;
        }
    });
    drop(scratch);
    Ok(())
}
