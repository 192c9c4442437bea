//! The fused attention's generic CPU kernels, for every storage dtype with f32 accumulation
//! (f64 for f64): each head's q, k, v gathered into accumulation-type copies, products through
//! the `gemm` crate ([`crate::kernels::gemm::mm`]), the softmax fused. bf16 storage on a CPU
//! with AVX512-BF16 takes [`super::bf16`] instead.

use candle_core::{CpuStorage, WithDType};

use super::dropout::Dropout;
use super::geom::{carve, for_each_head, AttnGeom, AttnKeep};
use super::head::{gather_head, head_bwd, head_fwd, kept_view, BwdIn, Kept};
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
        // SAFETY: bi < b, i < s, which < 3, hd < a and j < dh, so every index read is below
        // b·s·3D; the caller guarantees no thread writes these columns meanwhile.
        let read = |i: usize| unsafe { *qkv.at(i) }.to_acc();
        gather_head(
            (s, dh),
            (bi * s, 3 * d, which * d + hd * dh),
            scale,
            dst,
            read,
        );
    }
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
    let mut kept = Kept::<T, A>::new(keep, save, nh, (s, s));
    let scale = <A as Acc>::from_f64(crate::mutation::attention_scale(dh));
    // The callers slice qkv by the layout `attn_geom` read the geometry from, so this holds;
    // checked because `gather_qkv` reads through a raw pointer.
    assert_eq!(
        qkv.len(),
        g.b * s * 3 * d,
        "attention forward: qkv is not (b·s, 3D)"
    );
    let src = SharedMut(qkv.as_ptr().cast_mut());
    let (po, to) = (SharedMut(out.as_mut_ptr()), kept.at());
    let kb = g.kb();
    for_each_head(nh, g.fwd_scratch(keep), |head, sc: &mut [A]| {
        let ([q, k, v, o], rest) = carve(sc, [s * dh; 4]);
        let (bi, hd) = (head / g.a, head % g.a);
        // SAFETY: `src` points to `qkv`, b·s·3D elements (asserted above), which nothing
        // writes meanwhile.
        unsafe { gather_qkv(src, g, bi, hd, scale, q, k, v) };
        let how = (head, dropout, true);
        // SAFETY: `to` points to what `kept` allocated for all heads; head is this task's alone.
        unsafe { head_fwd::<T, A>((s, s, dh), (q, k, v), keep, how, (kb, o, rest), to) };
        for i in 0..s {
            for j in 0..dh {
                // SAFETY: the index is below b·s·D, the length of `out`; only this task
                // (head ≡ t mod nt) writes head (bi, hd)'s columns of batch bi's rows.
                unsafe { *po.at((bi * s + i) * d + hd * dh + j) = T::from_acc(o[i * dh + j]) };
            }
        }
    });
    (out, kept.into_storage())
}

/// Backward of all heads: returns dqkv (b·s, 3D), a fresh buffer beside qkv.
#[allow(clippy::too_many_arguments)]
pub(super) fn attn_bwd_cpu<T, A>(qkv: &[T], ins: &BwdIn<'_, T>, g: &AttnGeom) -> CResult<Vec<T>>
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
    unsafe { attn_bwd_heads::<T, A>((src, dst), ins, g)? };
    Ok(dqkv)
}

/// [`attn_bwd_cpu`] written over qkv itself: each head's task gathers its q, k, v columns into
/// its scratch before it writes dq, dk, dv over the same columns (no task reads another head's
/// columns), so the backward holds one (b·s, 3D) buffer instead of two. The same bits.
pub(super) fn attn_bwd_cpu_over<T, A>(
    qkv: &mut [T],
    ins: &BwdIn<'_, T>,
    g: &AttnGeom,
) -> CResult<()>
where
    T: Elem<A> + WithDType,
    A: Acc + WithDType,
{
    check_len(qkv.len(), g)?;
    let p = SharedMut(qkv.as_mut_ptr());
    // SAFETY: `p` points to the exclusively borrowed qkv of b·s·3D elements; every task reads
    // and then writes only its own head's columns through it (`attn_bwd_heads`).
    unsafe { attn_bwd_heads::<T, A>((p, p), ins, g) }
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
unsafe fn attn_bwd_heads<T, A>(
    (src, pd): (SharedMut<T>, SharedMut<T>),
    ins: &BwdIn<'_, T>,
    g: &AttnGeom,
) -> CResult<()>
where
    T: Elem<A> + WithDType,
    A: Acc + WithDType,
{
    let (s, dh, d) = (g.s, g.dh, g.d());
    let (o_all, go_all, keep, dropout) = (ins.o, ins.go, ins.keep, ins.dropout);
    let kept = kept_view::<T, A>(keep, ins.saved)?;
    let scale = <A as Acc>::from_f64(crate::mutation::attention_scale(dh));
    let (kb, qbl) = (g.kb(), g.qb());
    let one = <A as Acc>::from_f64(1.0);
    for_each_head(g.heads(), g.bwd_scratch(keep), |head, sc: &mut [A]| {
        let ([q, k, v, go, dq, dk, dv], rest) = carve(sc, [s * dh; 7]);
        let (bi, hd) = (head / g.a, head % g.a);
        // SAFETY: the caller's contract: `src` holds b·s·3D elements, and only this task
        // (head ≡ t mod nt) touches head (bi, hd)'s columns, which it writes only below.
        unsafe { gather_qkv(src, g, bi, hd, scale, q, k, v) };
        let read = |i: usize| go_all[i].to_acc();
        gather_head((s, dh), (bi * s, d, hd * dh), one, go, read);
        let (ins, o) = ((&*q, &*go, &*k, &*v), (o_all, bi, hd, d));
        let how = (kept, head, dropout);
        let grads = (&mut *dq, &mut *dk, &mut *dv);
        head_bwd((s, s, dh), ins, o, how, keep, (qbl, kb, rest), grads);
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
    });
    Ok(())
}
