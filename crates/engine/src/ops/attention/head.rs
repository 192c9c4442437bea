//! One head's attention in the accumulation type, shared by the generic qkv kernels
//! ([`super::generic`], s_q = s_kv) and the separate q, k, v kernels ([`super::separate`]): the
//! heads' tasks ([`super::geom::for_each_head`]), gathering a head's columns ([`gather_head`]), what the
//! forward keeps ([`Kept`]), the forward ([`head_fwd`]) and the backward ([`head_bwd`]) of one
//! head whose q (already scaled), k, v (and dO) sit in the task's scratch. The callers differ
//! only in where a head's columns lie (one (b·s, 3D) qkv tensor, or three tensors).

use candle_core::{CpuStorage, Layout, WithDType};

use super::dropout::{mask_at, Dropout};
use super::geom::AttnKeep;
use crate::kernels::gemm::mm;
use crate::kernels::scalar::{Acc, Elem};
use crate::kernels::shared_ptr::SharedMut;
use crate::ops::storage::{cpu_slice, err, CResult};

/// Copies a head's `d_h` columns from `col` on of `n` rows from `row0` on (rows `stride`
/// elements apart) into an (n × d_h) buffer, times `scale`; `read(i)` is element i of the
/// source in the accumulation type.
#[inline]
pub(super) fn gather_head<A: Acc>(
    (n, dh): (usize, usize),
    (row0, stride, col): (usize, usize, usize),
    scale: A,
    dst: &mut [A],
    read: impl Fn(usize) -> A,
) {
    for i in 0..n {
        let src = (row0 + i) * stride + col;
        for (j, o) in dst[i * dh..(i + 1) * dh].iter_mut().enumerate() {
            *o = read(src + j) * scale;
        }
    }
}

/// Rounds values through the storage type: the recomputed P of the attention-only policy then
/// equals the P the materialized mode stores in the compute dtype, so both modes' gradients are
/// bitwise the same (the recompute twin test of `ditmem verify`).
fn round_through<T: Elem<A>, A: Acc>(x: &mut [A]) {
    for v in x.iter_mut() {
        *v = T::from_acc(*v).to_acc();
    }
}

/// The softmax's backward over rows of `n` in place: dP becomes dS = P∘(dP − Σ_j dP·P).
fn softmax_bwd_rows<A: Acc>(p: &[A], dp: &mut [A], n: usize) {
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

/// What a forward keeps for its backward, for all heads: P (b·a·s_q·s_kv, compute dtype) when
/// materialized, the log-sum-exp (b·a·s_q, accumulation type) when streaming; nothing when the
/// caller does not save (no backward) or the mode keeps nothing.
pub(super) struct Kept<T, A> {
    p: Option<Vec<T>>,
    lse: Option<Vec<A>>,
}

/// Where the heads' tasks write [`Kept`]'s buffers (`None`: not kept).
pub(super) type KeptAt<T, A> = (Option<SharedMut<T>>, Option<SharedMut<A>>);

impl<T: Elem<A> + WithDType, A: Acc + WithDType> Kept<T, A> {
    pub(super) fn new(keep: AttnKeep, save: bool, nh: usize, (sq, sk): (usize, usize)) -> Self {
        let p = (save && keep == AttnKeep::Probabilities)
            .then(|| vec![T::from_acc(A::ZERO); nh * sq * sk]);
        let lse = (save && keep == AttnKeep::LogSumExp).then(|| vec![A::ZERO; nh * sq]);
        Kept { p, lse }
    }

    pub(super) fn at(&mut self) -> KeptAt<T, A> {
        (
            self.p.as_mut().map(|p| SharedMut(p.as_mut_ptr())),
            self.lse.as_mut().map(|l| SharedMut(l.as_mut_ptr())),
        )
    }

    pub(super) fn into_storage(self) -> Option<CpuStorage> {
        match (self.p, self.lse) {
            (Some(p), _) => Some(T::to_cpu_storage_owned(p)),
            (None, Some(l)) => Some(A::to_cpu_storage_owned(l)),
            (None, None) => None,
        }
    }
}

/// What the backward of every head reads beside q, k and v: the forward's output `o` and its
/// gradient `go` ((b·s_q, D) each), what the forward kept, the mode, and the dropout (the qkv
/// kernels'; none for separate q, k, v).
pub(super) struct BwdIn<'a, T> {
    pub(super) o: &'a [T],
    pub(super) go: &'a [T],
    pub(super) saved: Option<&'a CpuStorage>,
    pub(super) keep: AttnKeep,
    pub(super) dropout: Option<Dropout>,
}

impl<'a, T: WithDType> BwdIn<'a, T> {
    /// The inputs from the output's and its gradient's storages (contiguous).
    pub(super) fn read(
        (so, lo): (&'a CpuStorage, &Layout),
        (sg, lg): (&'a CpuStorage, &Layout),
        saved: Option<&'a CpuStorage>,
        (keep, dropout): (AttnKeep, Option<Dropout>),
    ) -> CResult<Self> {
        Ok(BwdIn {
            o: cpu_slice::<T>(so, lo, "attention output")?,
            go: cpu_slice::<T>(sg, lg, "attention gradient")?,
            saved,
            keep,
            dropout,
        })
    }
}

/// The backward's view of what the forward kept: (P, log-sum-exp), the one `keep` needs.
pub(super) type KeptView<'a, T, A> = (Option<&'a [T]>, Option<&'a [A]>);

/// Reads `saved` as `keep` left it; an error when the mode keeps something and it is missing.
pub(super) fn kept_view<T: WithDType, A: WithDType>(
    keep: AttnKeep,
    saved: Option<&CpuStorage>,
) -> CResult<KeptView<'_, T, A>> {
    match (keep, saved) {
        (AttnKeep::Probabilities, Some(st)) => Ok((Some(st.as_slice::<T>()?), None)),
        (AttnKeep::Probabilities, None) => {
            Err(err("attention backward: probabilities were not kept"))
        }
        (AttnKeep::LogSumExp, Some(st)) => Ok((None, Some(st.as_slice::<A>()?))),
        (AttnKeep::LogSumExp, None) => Err(err("attention backward: the log-sum-exp was not kept")),
        (AttnKeep::Nothing, _) => Ok((None, None)),
    }
}

/// The forward of head `head` (s_q queries over s_kv keys, head width d_h, q already scaled)
/// into `o` (s_q × d_h); `rest` is the task's scratch behind o. Materialized and attention-only:
/// P = softmax(q·kᵀ) in `rest`, stored (compute dtype) when kept, through the dropout mask,
/// o = P·v. Streaming: per block of `kb` keys the online softmax (running row max m and sum l,
/// o rescaled by exp(m_old − m_new)), then o /= l and lse = m + ln l when kept.
/// `no_max_mutable`: whether the `SoftmaxNoMax` mutation reaches this kernel (the qkv kernels;
/// `ditmem verify`'s mutation runs).
///
/// # Safety
/// The pointers of `to` must point to all heads' P (b·a·s_q·s_kv) and lse (b·a·s_q) as
/// [`Kept`] allocated them, and no other thread may write head `head`'s block of them.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn head_fwd<T: Elem<A>, A: Acc + WithDType>(
    (sq, sk, dh): (usize, usize, usize),
    (q, k, v): (&[A], &[A], &[A]),
    keep: AttnKeep,
    (head, dropout, no_max_mutable): (usize, Option<Dropout>, bool),
    (kb, o, rest): (usize, &mut [A], &mut [A]),
    (pp, pl): KeptAt<T, A>,
) {
    match keep {
        AttnKeep::Probabilities | AttnKeep::Nothing => {
            let p = &mut rest[..sq * sk];
            mm(sq, sk, dh, p, (q, dh, 1), (k, 1, dh), false);
            A::softmax_rows(p, sk);
            if let Some(pp) = pp {
                for (i, x) in p.iter().enumerate() {
                    // SAFETY: P holds b·a·s_q·s_kv elements when kept and
                    // head·s_q·s_kv + i is below that; only this task writes head's block
                    // (the caller's contract).
                    unsafe { *pp.at(head * sq * sk + i) = T::from_acc(*x) };
                }
            }
            if let Some(dr) = dropout {
                for (i, x) in p.iter_mut().enumerate() {
                    *x *= mask_at::<A>(dr, head * sq * sk + i);
                }
            }
            mm(sq, dh, sk, o, (p, sk, 1), (v, dh, 1), false);
        }
        AttnKeep::LogSumExp => {
            let (sb, ml) = rest.split_at_mut(sq * kb);
            let (m, l) = ml.split_at_mut(sq);
            m.iter_mut().for_each(|x| *x = A::NEG_INF);
            l.iter_mut().for_each(|x| *x = A::ZERO);
            o.iter_mut().for_each(|x| *x = A::ZERO);
            let mut j0 = 0;
            while j0 < sk {
                let n = kb.min(sk - j0);
                let blk = &mut sb[..sq * n];
                mm(sq, n, dh, blk, (q, dh, 1), (&k[j0 * dh..], 1, dh), false);
                for i in 0..sq {
                    let row = &mut blk[i * n..(i + 1) * n];
                    let rmax = if no_max_mutable
                        && crate::mutation::active(crate::mutation::Mutation::SoftmaxNoMax)
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
                mm(sq, dh, n, o, (blk, n, 1), (&v[j0 * dh..], dh, 1), true);
                j0 += n;
            }
            for i in 0..sq {
                let inv = <A as Acc>::from_f64(1.0) / l[i];
                for x in o[i * dh..(i + 1) * dh].iter_mut() {
                    *x *= inv;
                }
                if let Some(pl) = pl {
                    // SAFETY: the lse holds b·a·s_q elements when kept and head·s_q + i is
                    // below that; only this task writes head's s_q values.
                    unsafe { *pl.at(head * sq + i) = m[i] + l[i].ln() };
                }
            }
        }
    }
}

/// The backward of head `head` (q already scaled; dO gathered beside q, k, v) into dq, dk, dv
/// (each overwritten); `rest` is the task's scratch behind them, `o` the head's columns of the
/// forward's output (rows of width `d`, batch entry `bi`, head `hd`). Materialized and
/// attention-only: P reloaded from the kept P or recomputed (rounded through the compute dtype
/// as the materialized mode stores it), dP = dO·vᵀ, with dropout P and dP through the mask for
/// dv = (P∘M)ᵀ·dO and P rebuilt after, else dv = Pᵀ·dO; dS = P∘(dP − Σ_j dP·P), dq = dS·k,
/// dk = dSᵀ·q. Streaming: [`streaming_head_bwd`] from the kept log-sum-exp.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub(super) fn head_bwd<T: Elem<A>, A: Acc + WithDType>(
    dims: (usize, usize, usize),
    ins: (&[A], &[A], &[A], &[A]),
    o: (&[T], usize, usize, usize),
    (kept, head, dropout): (KeptView<'_, T, A>, usize, Option<Dropout>),
    keep: AttnKeep,
    (qbl, kb, rest): (usize, usize, &mut [A]),
    grads: (&mut [A], &mut [A], &mut [A]),
) {
    let (sq, sk, dh) = dims;
    let (q, go, k, v) = ins;
    match keep {
        AttnKeep::Probabilities | AttnKeep::Nothing => {
            let (dq, dk, dv) = grads;
            let (p, dp) = rest.split_at_mut(sq * sk);
            let dp = &mut dp[..sq * sk];
            let p_saved = kept.0.map(|ps| &ps[head * sq * sk..][..sq * sk]);
            let load_p = |p: &mut [A]| match p_saved {
                Some(ps) => {
                    for (x, y) in p.iter_mut().zip(ps) {
                        *x = y.to_acc();
                    }
                }
                None => {
                    mm(sq, sk, dh, p, (q, dh, 1), (k, 1, dh), false);
                    A::softmax_rows(p, sk);
                    round_through::<T, A>(p);
                }
            };
            load_p(p);
            // dP̃ = dO·vᵀ, then through the mask.
            mm(sq, sk, dh, dp, (go, dh, 1), (v, 1, dh), false);
            if let Some(dr) = dropout {
                // dv = (P∘M)ᵀ·dO needs P∘M: scale P in place, rebuild it after (the mask
                // zeroed some entries).
                for (i, (x, y)) in p.iter_mut().zip(dp.iter_mut()).enumerate() {
                    let mk = mask_at::<A>(dr, head * sq * sk + i);
                    *x *= mk;
                    *y *= mk;
                }
                mm(sk, dh, sq, dv, (p, 1, sk), (go, dh, 1), false);
                load_p(p);
            } else {
                mm(sk, dh, sq, dv, (p, 1, sk), (go, dh, 1), false);
            }
            softmax_bwd_rows(p, dp, sk);
            mm(sq, dh, sk, dq, (dp, sk, 1), (k, dh, 1), false);
            mm(sk, dh, sq, dk, (dp, 1, sk), (q, dh, 1), false);
        }
        AttnKeep::LogSumExp => {
            let lse = &kept.1.unwrap_or(&[])[head * sq..][..sq];
            let (pb, rest) = rest.split_at_mut(qbl * kb);
            let (dpb, delta) = rest.split_at_mut(qbl * kb);
            streaming_head_bwd(dims, ins, o, (lse, delta), (qbl, kb, pb, dpb), grads);
        }
    }
}

/// The streaming backward of one head (s_q queries over s_kv keys, head width d_h, q already
/// scaled): Δ_i = dO_i · o_i from the head's columns of `o_all` (rows of width `d`, batch entry
/// `bi`, head `hd`), then per block of `kb` keys and, within it, per block of `qbl` queries: P =
/// exp(q·kᵀ − lse) into `pb`, dv += Pᵀ·dO, dP = dO·vᵀ into `dpb`, dS = P ⊙ (dP − Δ) over it,
/// dq += dS·k and dk += dSᵀ·q (dv and dk sum the query blocks in order).
#[allow(clippy::type_complexity)]
fn streaming_head_bwd<T: Elem<A>, A: Acc + WithDType>(
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
