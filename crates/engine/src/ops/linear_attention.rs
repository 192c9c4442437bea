//! [`linear_attention`]: Sana's ReLU linear attention (diffusers `SanaLinearAttnProcessor2_0`)
//! over separate q, k, v (b·s, D) projections as one custom op ([`LinearAttention`]). Per batch
//! entry and head, with φ = ReLU:
//!
//! ```text
//! KV = vᵀ·φ(k)   (d_h × d_h),   z = Σ_n φ(k)_n   (d_h),
//! o_n = (KV·φ(q)_n) / (z·φ(q)_n + 1e-15)
//! ```
//!
//! which is diffusers' padding trick (v padded with a row of ones, `matmul(v, kᵀ)` then
//! `matmul(·, q)`, the last row dividing the others, `+ 1e-15`). diffusers runs the kernel on
//! `.float()` copies; the op computes in the accumulation type (f32, f64 on the reference path)
//! and writes the output in the inputs' dtype.
//!
//! It keeps nothing beyond its three inputs: KV, z and the denominators are d_h² + d_h + s
//! values per head, recomputed by the backward. Forward and backward run head by head on one
//! scratch per thread (at most one per head, allocated up front): [`lin_fwd_scratch`] /
//! [`lin_bwd_scratch`] elements. The backward returns three fresh gradients. Plain loops, no
//! `gemm` (whose per-call packing buffers the budget would not see). Budget twin:
//! `ditmem_budget::ditmem_cpu::sana::linear_attention`.

use candle_core::{
    backend::BackendStorage, CpuStorage, DType, Device, Layout, Shape, Tensor, WithDType,
};

use super::attention::geom::{carve, for_each_head};
use crate::kernels::scalar::{Acc, Elem};
use crate::kernels::shared_ptr::SharedMut;
use crate::ops::custom_op::{Cpu, CpuOp, Grads, Op};
use crate::ops::storage::{cpu_slice, cpu_slices, dispatch_float, err, with_cpus, CResult};

/// diffusers' epsilon of the denominator (`hidden_states[:, :, -1:] + 1e-15`).
pub const LINEAR_ATTN_EPS: f64 = 1e-15;

/// Shapes of one call: batch, heads, tokens, head width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LinGeom {
    pub b: usize,
    pub a: usize,
    pub s: usize,
    pub dh: usize,
}

impl LinGeom {
    fn d(&self) -> usize {
        self.a * self.dh
    }
}

/// Scratch elements (accumulation type) per head of the forward: the budget's
/// `linear_attention_head_elems` (`ditmem_budget::ditmem_cpu::ops`, which lists the buffers; the
/// `ditmem-cpu` runtime predicts by it).
pub(crate) fn lin_fwd_scratch(g: &LinGeom) -> usize {
    lin_head_elems(g).0
}

/// Scratch elements (accumulation type) per head of the backward (as [`lin_fwd_scratch`]).
pub(crate) fn lin_bwd_scratch(g: &LinGeom) -> usize {
    lin_head_elems(g).1
}

fn lin_head_elems(g: &LinGeom) -> (usize, usize) {
    let (fwd, bwd) =
        ditmem_budget::ditmem_cpu::ops::linear_attention_head_elems(g.s as u64, g.dh as u64);
    (fwd as usize, bwd as usize)
}

/// The op (see the module docs).
#[derive(Debug, Clone, Copy)]
pub(crate) struct LinearAttention {
    batch: usize,
    heads: usize,
}

/// ReLU linear attention of q, k, v (b·s, D) → (b·s, D) in their dtype.
pub fn linear_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    batch: usize,
    heads: usize,
) -> CResult<Tensor> {
    q.apply_op3(k, v, Op(LinearAttention { batch, heads }))
}

fn lin_geom(lq: &Layout, lk: &Layout, lv: &Layout, batch: usize, heads: usize) -> CResult<LinGeom> {
    let (r, d) = match lq.dims() {
        &[r, c] => (r, c),
        dims => {
            return Err(err(format!(
                "linear attention expects q (b·s, D), got {dims:?}"
            )))
        }
    };
    if lk.dims() != lq.dims() || lv.dims() != lq.dims() {
        return Err(err(format!(
            "linear attention: q {:?}, k {:?}, v {:?} differ",
            lq.dims(),
            lk.dims(),
            lv.dims()
        )));
    }
    if batch == 0 || heads == 0 || r % batch != 0 || d % heads != 0 {
        return Err(err(format!(
            "linear attention: ({r}, {d}) does not split into batch {batch} × {heads} heads"
        )));
    }
    Ok(LinGeom {
        b: batch,
        a: heads,
        s: r / batch,
        dh: d / heads,
    })
}

/// Head (bi, hd) of a (b·s, D) operand into an (s × d_h) buffer, through ReLU when `relu`.
fn gather<T: Elem<A>, A: Acc>(
    x: &[T],
    g: &LinGeom,
    (bi, hd): (usize, usize),
    relu: bool,
    dst: &mut [A],
) {
    let (s, dh, d) = (g.s, g.dh, g.d());
    for i in 0..s {
        let src = &x[(bi * s + i) * d + hd * dh..][..dh];
        for (o, v) in dst[i * dh..(i + 1) * dh].iter_mut().zip(src) {
            let a = v.to_acc();
            *o = if relu && a <= A::ZERO { A::ZERO } else { a };
        }
    }
}

/// Writes an (s × d_h) head buffer into head (bi, hd)'s columns of a (b·s, D) output.
///
/// # Safety
/// `p` must point to b·s·D elements, and no other thread may write head (bi, hd)'s columns.
unsafe fn scatter<T: Elem<A>, A: Acc>(
    p: &SharedMut<T>,
    g: &LinGeom,
    (bi, hd): (usize, usize),
    src: &[A],
) {
    let (s, dh, d) = (g.s, g.dh, g.d());
    for i in 0..s {
        for j in 0..dh {
            // SAFETY: bi < b, i < s, hd·dh + j < D: inside the b·s·D buffer; head (bi, hd)'s own
            // columns, which the caller guarantees no other thread writes.
            unsafe { *p.at((bi * s + i) * d + hd * dh + j) = T::from_acc(src[i * dh + j]) };
        }
    }
}

/// KV = vᵀ·φ(k) (row i: Σ_n v[n,i]·φ(k)[n,·]) and z = Σ_n φ(k)_n.
fn kv_state<A: Acc>(rk: &[A], v: &[A], s: usize, dh: usize, kv: &mut [A], z: &mut [A]) {
    kv.iter_mut().for_each(|x| *x = A::ZERO);
    z.iter_mut().for_each(|x| *x = A::ZERO);
    for n in 0..s {
        let (kr, vr) = (&rk[n * dh..(n + 1) * dh], &v[n * dh..(n + 1) * dh]);
        for (zj, kj) in z.iter_mut().zip(kr) {
            *zj += *kj;
        }
        for (i, vi) in vr.iter().enumerate() {
            for (o, kj) in kv[i * dh..(i + 1) * dh].iter_mut().zip(kr) {
                *o += *vi * *kj;
            }
        }
    }
}

/// o_n = (KV·φ(q)_n) / den_n with den_n = z·φ(q)_n + eps.
fn kv_read<A: Acc>(rq: &[A], kv: &[A], z: &[A], dh: usize, o: &mut [A], den: &mut [A]) {
    let eps = A::from_f64(LINEAR_ATTN_EPS);
    for (n, dn) in den.iter_mut().enumerate() {
        let qr = &rq[n * dh..(n + 1) * dh];
        let mut zz = eps;
        for (a, b) in z.iter().zip(qr) {
            zz += *a * *b;
        }
        *dn = zz;
        for i in 0..dh {
            let mut acc = A::ZERO;
            for (a, b) in kv[i * dh..(i + 1) * dh].iter().zip(qr) {
                acc += *a * *b;
            }
            o[n * dh + i] = acc / zz;
        }
    }
}

fn lin_fwd<T, A>((q, k, v): (&[T], &[T], &[T]), g: &LinGeom) -> Vec<T>
where
    T: Elem<A> + WithDType,
    A: Acc + WithDType,
{
    let (s, dh) = (g.s, g.dh);
    let nh = g.b * g.a;
    let mut out: Vec<T> = vec![T::from_acc(A::ZERO); g.b * s * g.d()];
    let po = SharedMut(out.as_mut_ptr());
    for_each_head(nh, lin_fwd_scratch(g), |head, sc: &mut [A]| {
        let ([rq, rk, vb, o, kv, z], den) =
            carve(sc, [s * dh, s * dh, s * dh, s * dh, dh * dh, dh]);
        let bh = (head / g.a, head % g.a);
        gather(q, g, bh, true, rq);
        gather(k, g, bh, true, rk);
        gather(v, g, bh, false, vb);
        kv_state(rk, vb, s, dh, kv, z);
        kv_read(rq, kv, z, dh, o, &mut den[..s]);
        // SAFETY: `out` holds b·s·D elements; heads are dealt to tasks by residue, so only
        // this task writes head (bi, hd).
        unsafe { scatter(&po, g, bh, o) };
    });
    out
}

fn lin_bwd<T, A>((q, k, v): (&[T], &[T], &[T]), go_all: &[T], g: &LinGeom) -> [Vec<T>; 3]
where
    T: Elem<A> + WithDType,
    A: Acc + WithDType,
{
    let (s, dh) = (g.s, g.dh);
    let nh = g.b * g.a;
    let n_all = g.b * s * g.d();
    let mut dq_all: Vec<T> = vec![T::from_acc(A::ZERO); n_all];
    let mut dk_all: Vec<T> = vec![T::from_acc(A::ZERO); n_all];
    let mut dv_all: Vec<T> = vec![T::from_acc(A::ZERO); n_all];
    let (pq, pk, pv) = (
        SharedMut(dq_all.as_mut_ptr()),
        SharedMut(dk_all.as_mut_ptr()),
        SharedMut(dv_all.as_mut_ptr()),
    );
    for_each_head(nh, lin_bwd_scratch(g), |head, sc: &mut [A]| {
        let ([rq, rk, vb, go, o, dk, dv], rest) = carve(sc, [s * dh; 7]);
        let ([kv, dkv, z, dz, den], rest) = carve(rest, [dh * dh, dh * dh, dh, dh, s]);
        let dden = &mut rest[..s];
        let bh = (head / g.a, head % g.a);
        gather(q, g, bh, true, rq);
        gather(k, g, bh, true, rk);
        gather(v, g, bh, false, vb);
        gather(go_all, g, bh, false, go);
        kv_state(rk, vb, s, dh, kv, z);
        kv_read(rq, kv, z, dh, o, den);
        // o = N / den: dN = dO / den, dden = −Σ_i dO·o / den.
        for n in 0..s {
            let inv = <A as Acc>::from_f64(1.0) / den[n];
            let mut acc = A::ZERO;
            for i in 0..dh {
                acc += go[n * dh + i] * o[n * dh + i];
                go[n * dh + i] *= inv;
            }
            dden[n] = A::ZERO - acc * inv;
        }
        // dφ(q)_n = KVᵀ·dN_n + dden_n·z (into o, now free); dKV = dNᵀ·φ(q); dz = Σ dden·φ(q).
        let dq = &mut *o;
        dkv.iter_mut().for_each(|x| *x = A::ZERO);
        dz.iter_mut().for_each(|x| *x = A::ZERO);
        for n in 0..s {
            let (qr, gr) = (&rq[n * dh..(n + 1) * dh], &go[n * dh..(n + 1) * dh]);
            let dr = &mut dq[n * dh..(n + 1) * dh];
            for (j, x) in dr.iter_mut().enumerate() {
                *x = dden[n] * z[j];
            }
            for (i, gi) in gr.iter().enumerate() {
                let row = &kv[i * dh..(i + 1) * dh];
                for (x, kij) in dr.iter_mut().zip(row) {
                    *x += *gi * *kij;
                }
                for (x, qj) in dkv[i * dh..(i + 1) * dh].iter_mut().zip(qr) {
                    *x += *gi * *qj;
                }
            }
            for (x, qj) in dz.iter_mut().zip(qr) {
                *x += dden[n] * *qj;
            }
            // ReLU: the gradient passes where q > 0 (where φ(q) > 0).
            for (x, qj) in dr.iter_mut().zip(qr) {
                if *qj <= A::ZERO {
                    *x = A::ZERO;
                }
            }
        }
        // dφ(k)_n = dKVᵀ·v_n + dz; dv_n = dKV·φ(k)_n.
        for n in 0..s {
            let (kr, vr) = (&rk[n * dh..(n + 1) * dh], &vb[n * dh..(n + 1) * dh]);
            let dkr = &mut dk[n * dh..(n + 1) * dh];
            dkr.copy_from_slice(dz);
            for (i, vi) in vr.iter().enumerate() {
                let row = &dkv[i * dh..(i + 1) * dh];
                for (x, d) in dkr.iter_mut().zip(row) {
                    *x += *vi * *d;
                }
                let mut acc = A::ZERO;
                for (d, kj) in row.iter().zip(kr) {
                    acc += *d * *kj;
                }
                dv[n * dh + i] = acc;
            }
            for (x, kj) in dkr.iter_mut().zip(kr) {
                if *kj <= A::ZERO {
                    *x = A::ZERO;
                }
            }
        }
        // SAFETY: each buffer holds b·s·D elements; only this task (head ≡ t mod nt) writes
        // head (bi, hd)'s columns.
        unsafe {
            scatter(&pq, g, bh, dq);
            scatter(&pk, g, bh, dk);
            scatter(&pv, g, bh, dv);
        }
    });
    [dq_all, dk_all, dv_all]
}

impl CpuOp<3> for LinearAttention {
    fn name(&self) -> &'static str {
        "linear-attention"
    }

    fn fwd(&self, [(sq, lq), (sk, lk), (sv, lv)]: [Cpu<'_>; 3]) -> CResult<(CpuStorage, Shape)> {
        let g = lin_geom(lq, lk, lv, self.batch, self.heads)?;
        if sk.dtype() != sq.dtype() || sv.dtype() != sq.dtype() {
            return Err(err("linear attention: q, k and v must share one dtype"));
        }
        let n = "linear attention";
        let out = dispatch_float!(sq.dtype(), n, |T, A| {
            let [q, k, v] = cpu_slices::<T, 3>([(sq, lq), (sk, lk), (sv, lv)], n)?;
            let ins = (q, k, v);
            T::to_cpu_storage_owned(lin_fwd::<T, A>(ins, &g))
        });
        Ok((out, lq.shape().clone()))
    }

    fn bwd(&self, [q, k, v]: [&Tensor; 3], _res: &Tensor, grad: &Tensor) -> Grads<3> {
        let grad = grad.contiguous()?;
        let n = "linear attention backward";
        let (dq, dk, dv) = with_cpus(
            [q, k, v, &grad],
            |[(sq, lq), (sk, lk), (sv, lv), (sg, lg)]| {
                let g = lin_geom(lq, lk, lv, self.batch, self.heads)?;
                let dev = Device::Cpu;
                Ok(dispatch_float!(sq.dtype(), n, |T, A| {
                    let [q, k, v] = cpu_slices::<T, 3>([(sq, lq), (sk, lk), (sv, lv)], n)?;
                    let ins = (q, k, v);
                    let go = cpu_slice::<T>(sg, lg, n)?;
                    let [dq, dk, dv] = lin_bwd::<T, A>(ins, go, &g);
                    (
                        Tensor::from_vec(dq, lq.shape(), &dev)?,
                        Tensor::from_vec(dk, lk.shape(), &dev)?,
                        Tensor::from_vec(dv, lv.shape(), &dev)?,
                    )
                }))
            },
        )?;
        Ok([Some(dq), Some(dk), Some(dv)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::test_values::grads_against;
    use candle_core::{Device, Var};

    /// diffusers' processor composed in f64: v padded with ones, (v·φ(k)ᵀ)·φ(q), last row divides.
    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, b: usize, a: usize) -> Tensor {
        let (r, d) = q.dims2().unwrap();
        let (s, dh) = (r / b, d / a);
        // (b, a, d_h, s) as diffusers' `transpose(1, 2).unflatten(1, (heads, -1))`.
        let split = |x: &Tensor| {
            x.reshape((b, s, a, dh))
                .unwrap()
                .permute((0, 2, 3, 1))
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let qh = split(&q.relu().unwrap());
        let kh = split(&k.relu().unwrap()).transpose(2, 3).unwrap();
        let vh = split(v);
        let ones = Tensor::ones((b, a, 1, s), DType::F64, &Device::Cpu).unwrap();
        let vp = Tensor::cat(&[&vh, &ones], 2).unwrap();
        let sc = vp.matmul(&kh.contiguous().unwrap()).unwrap();
        let hs = sc.matmul(&qh).unwrap();
        let num = hs.narrow(2, 0, dh).unwrap();
        let den = (hs.narrow(2, dh, 1).unwrap() + LINEAR_ATTN_EPS).unwrap();
        let o = num.broadcast_div(&den).unwrap();
        o.permute((0, 3, 1, 2))
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((r, d))
            .unwrap()
    }

    fn data(n: usize, salt: f64) -> Vec<f64> {
        (0..n)
            .map(|i| (i as f64 * 0.731 + salt).sin() * 1.3 + 0.2)
            .collect()
    }

    /// Output and the three gradients match diffusers' composition in f64 (ReLU zeroes part of
    /// q and k, so the masks are exercised).
    #[test]
    fn linear_attention_matches_diffusers_composition() {
        let dev = Device::Cpu;
        let (b, a, d, s) = (2, 2, 8, 7);
        let mk = |salt: f64| {
            Var::from_tensor(&Tensor::from_vec(data(b * s * d, salt), (b * s, d), &dev).unwrap())
                .unwrap()
        };
        let (q, k, v) = (mk(0.1), mk(0.7), mk(1.9));
        let w = Tensor::from_vec(data(b * s * d, 3.3), (b * s, d), &dev).unwrap();
        let r = reference(q.as_tensor(), k.as_tensor(), v.as_tensor(), b, a);
        let rg = grads_against(&r, &w);
        let o = linear_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), b, a).unwrap();
        let diff = (&o - &r).unwrap().abs().unwrap().max_all().unwrap();
        assert!(diff.to_scalar::<f64>().unwrap() < 1e-12);
        let g = grads_against(&o, &w);
        for x in [&q, &k, &v] {
            let (ge, gr) = (
                g.get(x.as_tensor()).unwrap(),
                rg.get(x.as_tensor()).unwrap(),
            );
            let scale = gr
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
            let diff = (ge - gr).unwrap().abs().unwrap().max_all().unwrap();
            assert!(diff.to_scalar::<f64>().unwrap() < 1e-10 * scale.max(1.0));
        }
        // f32 runs the same kernel in f32.
        let o32 = linear_attention(
            &q.as_tensor().to_dtype(DType::F32).unwrap(),
            &k.as_tensor().to_dtype(DType::F32).unwrap(),
            &v.as_tensor().to_dtype(DType::F32).unwrap(),
            b,
            a,
        )
        .unwrap();
        let diff = (o32.to_dtype(DType::F64).unwrap() - &r)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        assert!(diff.to_scalar::<f64>().unwrap() < 1e-4);
    }
}
