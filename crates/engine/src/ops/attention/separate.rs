//! [`attention`]: attention over separate q (b·s_q, D), k and v (b·s_kv, D) projections, as one
//! custom op ([`SeparateAttention`]): the self-attention of a model whose q, k and v are three
//! linears (diffusers' `to_q`, `to_k`, `to_v`) and the cross-attention to text tokens (q from the
//! image tokens, k and v from the caption, s_kv = T). It keeps what [`super::qkv_attention`]
//! keeps: P (b·a·s_q·s_kv, compute dtype) when materialized, nothing under attention-only
//! recompute, the log-sum-exp (b·a·s_q, accumulation type) when memory-efficient.
//!
//! Every dtype runs on the generic kernels (each head's q, k, v gathered into accumulation-type
//! copies, products through the `gemm` crate, the softmax fused), bf16 included: the
//! AVX512-BF16 kernels of [`super::bf16`] read q, k, v in place from one qkv tensor. Per thread
//! (at most one per head, allocated up front) the scratch of [`sep_fwd_scratch`] /
//! [`sep_bwd_scratch`] elements; budget twin: `ditmem_budget::ditmem_cpu::ops::separate_attention`.

use candle_core::{
    backend::BackendStorage, CpuStorage, DType, Device, Layout, Shape, Tensor, WithDType,
};

use super::geom::{carve, for_each_head, head_scratch, AttnKeep, ATTN_KEY_BLOCK, ATTN_QUERY_BLOCK};
use super::head::{gather_head, head_bwd, head_fwd, kept_view, BwdIn, Kept};
use crate::kernels::scalar::{Acc, Elem};
use crate::kernels::shared_ptr::SharedMut;
use crate::ops::custom_op::{Cpu, CpuOp, Grads, Op};
use crate::ops::storage::Saved;
use crate::ops::storage::{cpu_slice, cpu_slices, dispatch_float, err, with_cpus, CResult};

/// Shapes of one call: batch, heads, query and key tokens, head width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SepGeom {
    pub b: usize,
    pub a: usize,
    pub sq: usize,
    pub sk: usize,
    pub dh: usize,
}

impl SepGeom {
    fn d(&self) -> usize {
        self.a * self.dh
    }
    fn kb(&self) -> usize {
        ATTN_KEY_BLOCK.min(self.sk)
    }
    fn qb(&self) -> usize {
        ATTN_QUERY_BLOCK.min(self.sq)
    }
}

/// Scratch elements (accumulation type) per head of the forward (`geom::head_scratch`).
pub(crate) fn sep_fwd_scratch(g: &SepGeom, keep: AttnKeep) -> usize {
    head_scratch((g.sq, g.sk, g.dh), keep).0
}

/// Scratch elements (accumulation type) per head of the backward (`geom::head_scratch`).
pub(crate) fn sep_bwd_scratch(g: &SepGeom, keep: AttnKeep) -> usize {
    head_scratch((g.sq, g.sk, g.dh), keep).1
}

/// The op (see the module docs).
#[derive(Debug)]
pub(crate) struct SeparateAttention {
    batch: usize,
    heads: usize,
    keep: AttnKeep,
    track: bool,
    saved: Saved,
}

impl SeparateAttention {
    /// The op, for a caller that runs it on storages inside its own node
    /// ([`super::cross::CrossAttention`]); `track`: keep what the backward reads.
    pub(crate) fn new(batch: usize, heads: usize, keep: AttnKeep, track: bool) -> Self {
        SeparateAttention {
            batch,
            heads,
            keep,
            track,
            saved: Saved::default(),
        }
    }

    /// The backward with dk and dv written over `k` and `v` (all `lk`), which the caller hands
    /// over (see [`sep_bwd_over`]): (dq, dk, dv).
    pub(crate) fn grads_over(
        &self,
        (sq, lq): (&CpuStorage, &Layout),
        (k, v, lk): (CpuStorage, CpuStorage, &Layout),
        (so, lo): (&CpuStorage, &Layout),
        (sg, lg): (&CpuStorage, &Layout),
    ) -> CResult<(CpuStorage, CpuStorage, CpuStorage)> {
        let guard = self.saved.lock("attention lock poisoned")?;
        let g = sep_geom(lq, lk, lk, self.batch, self.heads)?;
        if k.dtype() != sq.dtype() || v.dtype() != sq.dtype() {
            return Err(err("attention: q, k and v must share one dtype"));
        }
        let n = "attention backward";
        Ok(dispatch_float!(sq.dtype(), n, |T, A| {
            let (mut kv, mut vv) = (T::cpu_storage_data(k)?, T::cpu_storage_data(v)?);
            let q = cpu_slice::<T>(sq, lq, n)?;
            let ins = BwdIn::<T>::read((so, lo), (sg, lg), guard.as_ref(), (self.keep, None))?;
            let dq = sep_bwd_over::<T, A>(q, (&mut kv, &mut vv), &ins, &g)?;
            (
                T::to_cpu_storage_owned(dq),
                T::to_cpu_storage_owned(kv),
                T::to_cpu_storage_owned(vv),
            )
        }))
    }

    /// Frees what the forward kept (P or the log-sum-exp), once its backward has run.
    pub(crate) fn release(&self) {
        self.saved.release();
    }
}

/// Attention of q (b·s_q, D) over k, v (b·s_kv, D), written as (b·s_q, D); `keep` as
/// [`super::qkv_attention`]'s (no dropout).
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    batch: usize,
    heads: usize,
    keep: AttnKeep,
) -> CResult<Tensor> {
    let track = q.track_op() || k.track_op() || v.track_op();
    q.apply_op3(k, v, Op(SeparateAttention::new(batch, heads, keep, track)))
}

fn sep_geom(lq: &Layout, lk: &Layout, lv: &Layout, batch: usize, heads: usize) -> CResult<SepGeom> {
    let (rq, d) = match lq.dims() {
        &[r, c] => (r, c),
        dims => return Err(err(format!("attention expects q (b·s, D), got {dims:?}"))),
    };
    let (rk, dk) = match lk.dims() {
        &[r, c] => (r, c),
        dims => return Err(err(format!("attention expects k (b·T, D), got {dims:?}"))),
    };
    if lv.dims() != lk.dims() || dk != d {
        return Err(err(format!(
            "attention: q {:?}, k {:?}, v {:?} do not share a width, or k and v differ",
            lq.dims(),
            lk.dims(),
            lv.dims()
        )));
    }
    if batch == 0 || heads == 0 || rq % batch != 0 || rk % batch != 0 || d % heads != 0 {
        return Err(err(format!(
            "attention: q ({rq}, {d}) and k ({rk}, {d}) do not split into batch {batch} × {heads} heads"
        )));
    }
    Ok(SepGeom {
        b: batch,
        a: heads,
        sq: rq / batch,
        sk: rk / batch,
        dh: d / heads,
    })
}

/// Where head (bi, hd) of a (b·n, D) operand lies, for [`gather_head`]: its n rows from
/// bi·n, D apart, its columns from hd·d_h.
fn head_cols(g: &SepGeom, n: usize, (bi, hd): (usize, usize)) -> (usize, usize, usize) {
    (bi * n, g.d(), hd * g.dh)
}

/// Writes an (n × d_h) head buffer times `scale` into head (bi, hd)'s columns of a (b·n, D) output.
///
/// # Safety
/// `p` must point to b·n·D elements, and no other thread may write head (bi, hd)'s columns.
unsafe fn scatter<T: Elem<A>, A: Acc>(
    p: &SharedMut<T>,
    n: usize,
    g: &SepGeom,
    (bi, hd): (usize, usize),
    src: &[A],
    scale: A,
) {
    let (dh, d) = (g.dh, g.d());
    for i in 0..n {
        for j in 0..dh {
            // SAFETY: bi < b, i < n, hd·dh + j < D: inside the b·n·D buffer; these are head
            // (bi, hd)'s own columns, which the caller guarantees no other thread writes.
            unsafe { *p.at((bi * n + i) * d + hd * dh + j) = T::from_acc(src[i * dh + j] * scale) };
        }
    }
}

/// Forward of all heads: o (b·s_q, D) and what the mode keeps.
fn sep_fwd<T, A>(
    (q, k, v): (&[T], &[T], &[T]),
    g: &SepGeom,
    keep: AttnKeep,
    save: bool,
) -> (Vec<T>, Option<CpuStorage>)
where
    T: Elem<A> + WithDType,
    A: Acc + WithDType,
{
    let (sq, sk, dh) = (g.sq, g.sk, g.dh);
    let nh = g.b * g.a;
    let mut out: Vec<T> = vec![T::from_acc(A::ZERO); g.b * sq * g.d()];
    let mut kept = Kept::<T, A>::new(keep, save, nh, (sq, sk));
    let scale = <A as Acc>::from_f64(crate::mutation::attention_scale(dh));
    let one = <A as Acc>::from_f64(1.0);
    let (po, to) = (SharedMut(out.as_mut_ptr()), kept.at());
    let kb = g.kb();
    for_each_head(nh, sep_fwd_scratch(g, keep), |head, sc: &mut [A]| {
        let ([qb, kbuf, vb, o], rest) = carve(sc, [sq * dh, sk * dh, sk * dh, sq * dh]);
        let bh = (head / g.a, head % g.a);
        gather_head((sq, dh), head_cols(g, sq, bh), scale, qb, |i| q[i].to_acc());
        gather_head((sk, dh), head_cols(g, sk, bh), one, kbuf, |i| k[i].to_acc());
        gather_head((sk, dh), head_cols(g, sk, bh), one, vb, |i| v[i].to_acc());
        let (ins, blocks) = ((&*qb, &*kbuf, &*vb), (kb, &mut *o, rest));
        // SAFETY: `to` points to what `kept` allocated for all heads; head is this task's alone.
        unsafe { head_fwd::<T, A>((sq, sk, dh), ins, keep, (head, None, false), blocks, to) };
        // SAFETY: `out` holds b·s_q·D elements; only this task writes head (bi, hd).
        unsafe { scatter(&po, sq, g, bh, o, one) };
    });
    (out, kept.into_storage())
}

/// b·s_kv·D, the length k and v (of lengths `k`, `v`) must have.
fn kv_len(g: &SepGeom, k: usize, v: usize) -> CResult<usize> {
    let n = g.b * g.sk * g.d();
    if k != n || v != n {
        return Err(err("attention backward: k or v does not match its shape"));
    }
    Ok(n)
}

/// Backward of all heads: (dq, dk, dv), each fresh.
fn sep_bwd<T, A>(
    (q, k, v): (&[T], &[T], &[T]),
    ins: &BwdIn<'_, T>,
    g: &SepGeom,
) -> CResult<(Vec<T>, Vec<T>, Vec<T>)>
where
    T: Elem<A> + WithDType,
    A: Acc + WithDType,
{
    let n = kv_len(g, k.len(), v.len())?;
    let mut dk_all: Vec<T> = vec![T::from_acc(A::ZERO); n];
    let mut dv_all: Vec<T> = vec![T::from_acc(A::ZERO); n];
    // Read-only sources: nothing writes through these two pointers.
    let src = (
        SharedMut(k.as_ptr().cast_mut()),
        SharedMut(v.as_ptr().cast_mut()),
    );
    let dst = (
        SharedMut(dk_all.as_mut_ptr()),
        SharedMut(dv_all.as_mut_ptr()),
    );
    // SAFETY: k and v hold b·s_kv·D elements each (checked), as do the fresh dk and dv.
    let dq = unsafe { sep_bwd_heads(q, src, dst, ins, g)? };
    Ok((dq, dk_all, dv_all))
}

/// Backward of all heads with dk and dv written over k and v (which the caller owns and no
/// longer needs, the fused cross-attention's kept projections): each head's task reads its
/// columns of k and v into its scratch before it writes that head's gradient columns, and no
/// other task touches them. Returns dq.
fn sep_bwd_over<T, A>(
    q: &[T],
    (k, v): (&mut [T], &mut [T]),
    ins: &BwdIn<'_, T>,
    g: &SepGeom,
) -> CResult<Vec<T>>
where
    T: Elem<A> + WithDType,
    A: Acc + WithDType,
{
    kv_len(g, k.len(), v.len())?;
    let (pk, pv) = (SharedMut(k.as_mut_ptr()), SharedMut(v.as_mut_ptr()));
    // SAFETY: k and v hold b·s_kv·D elements each (checked); sources and destinations are the
    // same buffers, each head's columns read before they are written, by one task.
    unsafe { sep_bwd_heads(q, (pk, pv), (pk, pv), ins, g) }
}

/// The heads' backward (see [`sep_bwd`], [`sep_bwd_over`]): k and v read from `src`, dk and dv
/// written to `dst` (the same buffers or others); returns dq.
///
/// # Safety
/// Every pointer must point to b·s_kv·D initialised elements; no one else may access them
/// during the call.
unsafe fn sep_bwd_heads<T, A>(
    q: &[T],
    (sk_src, sv_src): (SharedMut<T>, SharedMut<T>),
    (pk, pv): (SharedMut<T>, SharedMut<T>),
    ins: &BwdIn<'_, T>,
    g: &SepGeom,
) -> CResult<Vec<T>>
where
    T: Elem<A> + WithDType,
    A: Acc + WithDType,
{
    let (sq, sk, dh, d) = (g.sq, g.sk, g.dh, g.d());
    let (o_all, go_all, keep) = (ins.o, ins.go, ins.keep);
    let kept = kept_view::<T, A>(keep, ins.saved)?;
    let mut dq_all: Vec<T> = vec![T::from_acc(A::ZERO); g.b * sq * d];
    let scale = <A as Acc>::from_f64(crate::mutation::attention_scale(dh));
    let one = <A as Acc>::from_f64(1.0);
    let pq = SharedMut(dq_all.as_mut_ptr());
    let (kb, qbl) = (g.kb(), g.qb());
    for_each_head(g.b * g.a, sep_bwd_scratch(g, keep), |head, sc: &mut [A]| {
        let (qs, ks) = ([sq * dh; 3], [sk * dh; 4]);
        let ([qb, go, dq], rest) = carve(sc, qs);
        let ([kbuf, vb, dk, dv], rest) = carve(rest, ks);
        let bh = (head / g.a, head % g.a);
        let (at_q, at_k) = (head_cols(g, sq, bh), head_cols(g, sk, bh));
        gather_head((sq, dh), at_q, scale, qb, |i| q[i].to_acc());
        // SAFETY: k's buffer holds b·s_kv·D elements (the caller's contract); gather_head reads
        // head (bi, hd)'s columns only, which no task but this one (head ≡ t mod nt) touches.
        let read_k = |i: usize| unsafe { *sk_src.at(i) }.to_acc();
        gather_head((sk, dh), at_k, one, kbuf, read_k);
        // SAFETY: as for k, on v's buffer.
        let read_v = |i: usize| unsafe { *sv_src.at(i) }.to_acc();
        gather_head((sk, dh), at_k, one, vb, read_v);
        gather_head((sq, dh), at_q, one, go, |i| go_all[i].to_acc());
        let (ins, o) = ((&*qb, &*go, &*kbuf, &*vb), (o_all, bh.0, bh.1, d));
        let grads = (&mut *dq, &mut *dk, &mut *dv);
        head_bwd(
            (sq, sk, dh),
            ins,
            o,
            (kept, head, None),
            keep,
            (qbl, kb, rest),
            grads,
        );
        // SAFETY: each buffer holds b·n·D elements for its n; only this task (head ≡ t mod
        // nt) writes head (bi, hd)'s columns.
        unsafe {
            scatter(&pq, sq, g, bh, dq, scale);
            scatter(&pk, sk, g, bh, dk, one);
            scatter(&pv, sk, g, bh, dv, one);
        }
    });
    Ok(dq_all)
}

impl CpuOp<3> for SeparateAttention {
    fn name(&self) -> &'static str {
        "separate-attention"
    }

    fn fwd(&self, [(sq, lq), (sk, lk), (sv, lv)]: [Cpu<'_>; 3]) -> CResult<(CpuStorage, Shape)> {
        let g = sep_geom(lq, lk, lv, self.batch, self.heads)?;
        if sk.dtype() != sq.dtype() || sv.dtype() != sq.dtype() {
            return Err(err("attention: q, k and v must share one dtype"));
        }
        let n = "attention";
        let (out, saved) = dispatch_float!(sq.dtype(), n, |T, A| {
            let [q, k, v] = cpu_slices::<T, 3>([(sq, lq), (sk, lk), (sv, lv)], n)?;
            let ins = (q, k, v);
            let (o, saved) = sep_fwd::<T, A>(ins, &g, self.keep, self.track);
            (T::to_cpu_storage_owned(o), saved)
        });
        *self.saved.lock("attention lock poisoned")? = saved;
        Ok((out, Shape::from((g.b * g.sq, g.d()))))
    }

    fn bwd(&self, [q, k, v]: [&Tensor; 3], res: &Tensor, grad: &Tensor) -> Grads<3> {
        let guard = self.saved.lock("attention lock poisoned")?;
        let grad = grad.contiguous()?;
        let n = "attention backward";
        let ts = [q, k, v, res, &grad];
        let (dq, dk, dv) = with_cpus(ts, |[(sq, lq), (sk, lk), (sv, lv), (so, lo), (sg, lg)]| {
            let g = sep_geom(lq, lk, lv, self.batch, self.heads)?;
            let dev = Device::Cpu;
            Ok(dispatch_float!(sq.dtype(), n, |T, A| {
                let [q, k, v] = cpu_slices::<T, 3>([(sq, lq), (sk, lk), (sv, lv)], n)?;
                let ins = (q, k, v);
                let bwd_in =
                    BwdIn::<T>::read((so, lo), (sg, lg), guard.as_ref(), (self.keep, None))?;
                let (dq, dk, dv) = sep_bwd::<T, A>(ins, &bwd_in, &g)?;
                (
                    Tensor::from_vec(dq, lq.shape(), &dev)?,
                    Tensor::from_vec(dk, lk.shape(), &dev)?,
                    Tensor::from_vec(dv, lv.shape(), &dev)?,
                )
            }))
        })?;
        Ok([Some(dq), Some(dk), Some(dv)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::test_values::grads_against;
    use candle_core::{Device, Var};

    /// softmax(q·kᵀ/√d_h)·v per head, composed in f64.
    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, b: usize, a: usize) -> Tensor {
        let (rq, d) = q.dims2().unwrap();
        let rk = k.dim(0).unwrap();
        let (sq, sk, dh) = (rq / b, rk / b, d / a);
        let split = |x: &Tensor, s: usize| {
            x.reshape((b, s, a, dh))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let (qh, kh, vh) = (split(q, sq), split(k, sk), split(v, sk));
        let s = (qh.matmul(&kh.t().unwrap()).unwrap() / (dh as f64).sqrt()).unwrap();
        let p = candle_nn_softmax(&s);
        p.matmul(&vh)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((rq, d))
            .unwrap()
    }

    fn candle_nn_softmax(s: &Tensor) -> Tensor {
        let m = s.max_keepdim(candle_core::D::Minus1).unwrap().detach();
        let e = s.broadcast_sub(&m).unwrap().exp().unwrap();
        let z = e.sum_keepdim(candle_core::D::Minus1).unwrap();
        e.broadcast_div(&z).unwrap()
    }

    fn data(n: usize, salt: f64) -> Vec<f64> {
        (0..n)
            .map(|i| (i as f64 * 0.731 + salt).sin() * 1.3)
            .collect()
    }

    /// Output and the three gradients of every mode match the composed f64 attention, with a
    /// key count that is not a multiple of the streaming block (and more keys than a block),
    /// and more queries than the backward's query block (150: 64 + 64 + 22).
    #[test]
    fn separate_attention_matches_composed_reference() {
        let dev = Device::Cpu;
        let (b, a, d) = (2, 2, 8);
        for (sq, sk) in [(6, 5), (4, 131), (150, 131)] {
            let mk = |r: usize, salt: f64| {
                Var::from_tensor(&Tensor::from_vec(data(r * d, salt), (r, d), &dev).unwrap())
                    .unwrap()
            };
            let (q, k, v) = (mk(b * sq, 0.1), mk(b * sk, 0.7), mk(b * sk, 1.9));
            let w = Tensor::from_vec(data(b * sq * d, 3.3), (b * sq, d), &dev).unwrap();
            let r = reference(q.as_tensor(), k.as_tensor(), v.as_tensor(), b, a);
            let rg = grads_against(&r, &w);
            for keep in [
                AttnKeep::Probabilities,
                AttnKeep::Nothing,
                AttnKeep::LogSumExp,
            ] {
                let o = attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), b, a, keep).unwrap();
                let diff = (&o - &r).unwrap().abs().unwrap().max_all().unwrap();
                assert!(
                    diff.to_scalar::<f64>().unwrap() < 1e-12,
                    "{keep:?} {sq}/{sk}"
                );
                let g = grads_against(&o, &w);
                for x in [&q, &k, &v] {
                    let (ge, gr) = (
                        g.get(x.as_tensor()).unwrap(),
                        rg.get(x.as_tensor()).unwrap(),
                    );
                    let diff = (ge - gr).unwrap().abs().unwrap().max_all().unwrap();
                    assert!(
                        diff.to_scalar::<f64>().unwrap() < 1e-11,
                        "{keep:?} {sq}/{sk}"
                    );
                }
            }
        }
    }
}
