//! [`rms_norm`]: the per-head q/k RMSNorm of SD3.5's and Flux's attention
//! (`torch.nn.RMSNorm(dim_head, eps=1e-6)` on each head of the (b·s, heads·d_h) projection; Sana's
//! caption norm with one head) as one custom op. Flux's blocks run it fused with the RoPE after
//! it ([`super::norm_rope`], through [`rstd`] and [`group_dx`]). candle's fused
//! RmsNorm has no backward, and composed it keeps x², the mean, the rsqrt and the normalised
//! copy; this op keeps nothing beyond its inputs: the backward recomputes the per-group rstd
//! from x (one (rows·heads) accumulation-type scratch) and returns a fresh
//! dx (x's dtype and shape) and a fresh dw (w's dtype), summed per channel over every group.
//!
//! y = x·r·w with r = (mean(x²) + eps)^(−½) over each head's d_h channels, computed in the
//! accumulation type (f64 for f64 x, else f32) and written in x's dtype; w may be the f32 master
//! weight under a low-precision x (read as it is, no cast copy). Backward with ĝ = g·w and
//! x̂ = x·r: dx = r·(ĝ − x̂·mean(ĝ·x̂)), dw = Σ g·x̂. Budget twin: `rms_norm` of
//! `ditmem_budget::ditmem_cpu::flux`.

use candle_core::{
    backend::BackendStorage, CpuStorage, DType, Device, Layout, Shape, Tensor, WithDType,
};
use rayon::prelude::*;

use super::storage::{cpu_slice, dispatch_ln, err, with_cpus, CResult, PAR_CHUNK};
use crate::kernels::scalar::{Acc, Elem};
use crate::ops::custom_op::{Cpu, CpuOp, Grads, Op};

/// RMSNorm epsilon of Flux's q/k norms.
pub const RMS_EPS: f64 = 1e-6;

/// The op (see the module docs).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RmsNorm {
    eps: f64,
}

/// Per-head RMSNorm of x (rows, heads·d_h) with the weight w (d_h) → (rows, heads·d_h) in x's
/// dtype.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> CResult<Tensor> {
    x.apply_op2(w, Op(RmsNorm { eps }))
}

/// (rows, D, d_h) of a call.
fn rms_geom(lx: &Layout, lw: &Layout) -> CResult<(usize, usize, usize)> {
    let (rows, d) = match lx.dims() {
        &[r, c] => (r, c),
        dims => return Err(err(format!("rms norm expects x (rows, D), got {dims:?}"))),
    };
    let dh = match lw.dims() {
        &[h] => h,
        dims => return Err(err(format!("rms norm expects w (d_h), got {dims:?}"))),
    };
    if dh == 0 || d % dh != 0 {
        return Err(err(format!(
            "rms norm: the width {d} is not a whole number of heads of {dh}"
        )));
    }
    Ok((rows, d, dh))
}

/// rstd of one group.
#[inline]
pub(super) fn rstd<T: Elem<A>, A: Acc>(x: &[T], eps: A) -> A {
    let mut ss = A::ZERO;
    for &v in x {
        let a = v.to_acc();
        ss += a * a;
    }
    let n = A::from_f64(x.len() as f64);
    A::from_f64(1.0) / (ss / n + eps).sqrt()
}

fn rms_fwd_cpu<T, W, A>(x: &[T], w: &[W], dh: usize, eps: f64) -> Vec<T>
where
    T: Elem<A> + Send + Sync,
    W: Elem<A> + Send + Sync,
    A: Acc + Send + Sync,
{
    let mut o: Vec<T> = vec![T::from_acc(A::ZERO); x.len()];
    let eps = A::from_f64(eps);
    o.par_chunks_mut(dh)
        .zip(x.par_chunks(dh))
        .with_min_len((PAR_CHUNK / dh).max(1))
        .for_each(|(og, xg)| {
            let r = rstd(xg, eps);
            for j in 0..dh {
                og[j] = T::from_acc(xg[j].to_acc() * r * w[j].to_acc());
            }
        });
    o
}

/// dx of one group of d_h channels with its rstd `rg`: r·(ĝ − x̂·mean(ĝ·x̂)), ĝ = g·w, x̂ = x·r.
#[inline]
pub(super) fn group_dx<T: Elem<A>, W: Elem<A>, A: Acc>(
    xg: &[T],
    gg: &[T],
    w: &[W],
    rg: A,
    dg: &mut [T],
) {
    let dh = xg.len();
    let mut dot = A::ZERO;
    for j in 0..dh {
        dot += gg[j].to_acc() * w[j].to_acc() * xg[j].to_acc() * rg;
    }
    let mean = dot / A::from_f64(dh as f64);
    for j in 0..dh {
        let xh = xg[j].to_acc() * rg;
        dg[j] = T::from_acc(rg * (gg[j].to_acc() * w[j].to_acc() - xh * mean));
    }
}

/// dw of the weight shared by groups of d_h channels with rstds `r`: per channel j, the sum
/// over the groups k that `keep(k)` of g·x·r, in group order (channels in parallel, so each sum
/// runs in one order whatever the thread count).
pub(super) fn group_dw<T, W, A>(
    x: &[T],
    g: &[T],
    r: &[A],
    dh: usize,
    keep: impl Fn(usize) -> bool + Sync,
) -> Vec<W>
where
    T: Elem<A> + Send + Sync,
    W: Elem<A> + Send + Sync,
    A: Acc + Send + Sync,
{
    let mut dw: Vec<W> = Vec::with_capacity(dh);
    (0..dh)
        .into_par_iter()
        .map(|j| {
            let mut s = A::ZERO;
            for (k, &rg) in r.iter().enumerate() {
                if keep(k) {
                    s += g[k * dh + j].to_acc() * x[k * dh + j].to_acc() * rg;
                }
            }
            W::from_acc(s)
        })
        .collect_into_vec(&mut dw);
    dw
}

/// (dx, dw in the accumulation type): dx per group in parallel, dw per channel over every group.
fn rms_bwd_cpu<T, W, A>(
    x: &[T],
    w: &[W],
    g: &[T],
    dh: usize,
    eps: f64,
    (want_x, want_w): (bool, bool),
) -> (Option<Vec<T>>, Option<Vec<W>>)
where
    T: Elem<A> + Send + Sync,
    W: Elem<A> + Send + Sync,
    A: Acc + Send + Sync,
{
    let eps = A::from_f64(eps);
    let chunk = (PAR_CHUNK / dh).max(1);
    // The scratch: one rstd per group.
    let mut r: Vec<A> = Vec::with_capacity(x.len() / dh);
    x.par_chunks(dh)
        .with_min_len(chunk)
        .map(|xg| rstd(xg, eps))
        .collect_into_vec(&mut r);
    let dx = want_x.then(|| {
        let mut dx: Vec<T> = vec![T::from_acc(A::ZERO); x.len()];
        dx.par_chunks_mut(dh)
            .zip(x.par_chunks(dh).zip(g.par_chunks(dh)))
            .zip(r.par_iter())
            .with_min_len(chunk)
            .for_each(|((dg, (xg, gg)), &rg)| group_dx::<T, W, A>(xg, gg, w, rg, dg));
        dx
    });
    let dw = want_w.then(|| group_dw::<T, W, A>(x, g, &r, dh, |_| true));
    (dx, dw)
}

impl CpuOp<2> for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn fwd(&self, [(sx, lx), (sw, lw)]: [Cpu<'_>; 2]) -> CResult<(CpuStorage, Shape)> {
        let (_, _, dh) = rms_geom(lx, lw)?;
        let out = dispatch_ln!(sx.dtype(), sw.dtype(), |T, W, A| {
            let x = cpu_slice::<T>(sx, lx, "rms norm x")?;
            let w = cpu_slice::<W>(sw, lw, "rms norm w")?;
            T::to_cpu_storage_owned(rms_fwd_cpu::<T, W, A>(x, w, dh, self.eps))
        });
        Ok((out, lx.shape().clone()))
    }

    fn bwd(&self, [x, w]: [&Tensor; 2], _res: &Tensor, grad: &Tensor) -> Grads<2> {
        let grad = grad.contiguous()?;
        let want = (x.track_op(), w.track_op());
        let dev = Device::Cpu;
        with_cpus([x, w, &grad], |[(sx, lx), (sw, lw), (sg, lg)]| {
            let (_, _, dh) = rms_geom(lx, lw)?;
            if sg.dtype() != sx.dtype() || lg.shape() != lx.shape() {
                return Err(err("rms norm backward: gradient differs from x"));
            }
            Ok(dispatch_ln!(sx.dtype(), sw.dtype(), |T, W, A| {
                let xv = cpu_slice::<T>(sx, lx, "rms norm x")?;
                let wv = cpu_slice::<W>(sw, lw, "rms norm w")?;
                let g = cpu_slice::<T>(sg, lg, "rms norm grad")?;
                let (dx, dw) = rms_bwd_cpu::<T, W, A>(xv, wv, g, dh, self.eps, want);
                let dx = match dx {
                    Some(v) => Some(Tensor::from_vec(v, lx.shape(), &dev)?),
                    None => None,
                };
                let dw = match dw {
                    Some(v) => Some(Tensor::from_vec(v, lw.shape(), &dev)?),
                    None => None,
                };
                [dx, dw]
            }))
        })
    }
}

/// Keeps `DType` in scope for the dispatch macro.
const _: Option<DType> = None;
