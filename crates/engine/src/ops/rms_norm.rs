//! [`rms_norm_heads`]: diffusers' `RMSNorm(head_dim)` on each head of a (rows, heads·d_h)
//! projection (the q/k norms of SD3.5 and Flux: `norm_q`, `norm_k`, `norm_added_q`,
//! `norm_added_k`), `x·rsqrt(mean(x²) + eps)·w` with the statistics in the accumulation type.
//! It keeps the per-(row, head) rstd (rows·heads values, f32, f64 for f64 inputs) beside its
//! input; the output is fresh in x's dtype. Backward: a fresh dx (x's dtype and shape) and dw
//! (w's). Budget twin: `rms_norm_heads` of `ditmem_budget::ditmem_cpu::sd3`.

use std::sync::Mutex;

use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp2, DType, Device, Layout, Shape, Tensor, WithDType,
};

use super::storage::{cpu_slice, dispatch_float, err, with_cpu, CResult};
use crate::kernels::scalar::{Acc, Elem};

#[derive(Debug)]
enum Rstd {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// The op (see the module docs).
#[derive(Debug)]
pub struct RmsNormHeads {
    heads: usize,
    eps: f64,
    rstd: Mutex<Option<Rstd>>,
}

/// Per-head RMSNorm of x (rows, heads·d_h) with weight w (d_h) of x's dtype.
pub fn rms_norm_heads(x: &Tensor, w: &Tensor, heads: usize, eps: f64) -> CResult<Tensor> {
    x.apply_op2(
        w,
        RmsNormHeads {
            heads,
            eps,
            rstd: Mutex::new(None),
        },
    )
}

fn geom(lx: &Layout, lw: &Layout, heads: usize) -> CResult<(usize, usize)> {
    let (rows, d) = match lx.dims() {
        &[r, d] => (r, d),
        dims => {
            return Err(err(format!(
                "rms_norm_heads expects x (rows, D), got {dims:?}"
            )))
        }
    };
    if heads == 0 || d % heads != 0 || lw.dims() != [d / heads] {
        return Err(err(format!(
            "rms_norm_heads: x {:?} with {heads} heads and weight {:?}",
            lx.dims(),
            lw.dims()
        )));
    }
    Ok((rows, d / heads))
}

fn fwd<T: Elem<A>, A: Acc + IntoRstd>(x: &[T], w: &[T], dh: usize, eps: f64) -> (Vec<T>, Vec<A>) {
    let groups = x.len() / dh;
    let mut out = Vec::with_capacity(x.len());
    let mut rstd = Vec::with_capacity(groups);
    let e = A::from_f64(eps);
    let n = A::from_f64(dh as f64);
    for g in x.chunks_exact(dh) {
        let mut ss = A::from_f64(0.0);
        for &v in g {
            let v = v.to_acc();
            ss += v * v;
        }
        let r = A::from_f64(1.0) / (ss / n + e).sqrt();
        rstd.push(r);
        for (&v, &wv) in g.iter().zip(w) {
            out.push(T::from_acc(v.to_acc() * r * wv.to_acc()));
        }
    }
    (out, rstd)
}

fn bwd<T: Elem<A>, A: Acc>(x: &[T], w: &[T], g: &[T], rstd: &[A], dh: usize) -> (Vec<T>, Vec<T>) {
    let mut dx = Vec::with_capacity(x.len());
    let mut dw = vec![A::from_f64(0.0); dh];
    let n = A::from_f64(dh as f64);
    for ((xg, gg), &r) in x.chunks_exact(dh).zip(g.chunks_exact(dh)).zip(rstd) {
        // dxhat = g·w; dx = r·(dxhat − xhat·mean(dxhat·xhat)).
        let mut dot = A::from_f64(0.0);
        for j in 0..dh {
            let xh = xg[j].to_acc() * r;
            let gv = gg[j].to_acc();
            dw[j] += gv * xh;
            dot += gv * w[j].to_acc() * xh;
        }
        let m = dot / n;
        for j in 0..dh {
            let xh = xg[j].to_acc() * r;
            let dxh = gg[j].to_acc() * w[j].to_acc();
            dx.push(T::from_acc(r * (dxh - xh * m)));
        }
    }
    (dx, dw.into_iter().map(T::from_acc).collect())
}

impl CustomOp2 for RmsNormHeads {
    fn name(&self) -> &'static str {
        "rms-norm-heads"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let what = "rms_norm_heads";
        let (_, dh) = geom(lx, lw, self.heads)?;
        if sx.dtype() != sw.dtype() {
            return Err(err(format!(
                "{what}: x {:?} and weight {:?} differ",
                sx.dtype(),
                sw.dtype()
            )));
        }
        let out = dispatch_float!(sx.dtype(), what, |T, A| {
            let (o, r) = fwd::<T, A>(
                cpu_slice(sx, lx, what)?,
                cpu_slice(sw, lw, what)?,
                dh,
                self.eps,
            );
            *self
                .rstd
                .lock()
                .map_err(|_| err("rms_norm_heads: poisoned"))? = Some(A::into_rstd(r));
            T::to_cpu_storage_owned(o)
        });
        Ok((out, lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let what = "rms_norm_heads backward";
        let grad = grad.contiguous()?;
        let guard = self
            .rstd
            .lock()
            .map_err(|_| err("rms_norm_heads: poisoned"))?;
        let rstd = guard
            .as_ref()
            .ok_or_else(|| err("rms_norm_heads backward before forward"))?;
        let (dx, dw) = with_cpu(x, |sx, lx| {
            with_cpu(w, |sw, lw| {
                with_cpu(&grad, |sg, lg| {
                    let (_, dh) = geom(lx, lw, self.heads)?;
                    let dev = &Device::Cpu;
                    dispatch_float!(sx.dtype(), what, |T, A| {
                        let r = A::from_rstd(rstd)
                            .ok_or_else(|| err("rms_norm_heads: statistics of another dtype"))?;
                        let (dx, dw) = bwd::<T, A>(
                            cpu_slice(sx, lx, what)?,
                            cpu_slice(sw, lw, what)?,
                            cpu_slice(sg, lg, what)?,
                            r,
                            dh,
                        );
                        Ok((
                            Tensor::from_vec(dx, lx.shape(), dev)?,
                            Tensor::from_vec(dw, lw.shape(), dev)?,
                        ))
                    })
                })
            })
        })?;
        Ok((x.track_op().then_some(dx), w.track_op().then_some(dw)))
    }
}

/// f32 statistics as `Rstd`, or f64 ones.
trait IntoRstd: Sized {
    fn into_rstd(v: Vec<Self>) -> Rstd;
    fn from_rstd(s: &Rstd) -> Option<&[Self]>;
}
impl IntoRstd for f32 {
    fn into_rstd(v: Vec<Self>) -> Rstd {
        Rstd::F32(v)
    }
    fn from_rstd(s: &Rstd) -> Option<&[Self]> {
        match s {
            Rstd::F32(v) => Some(v),
            Rstd::F64(_) => None,
        }
    }
}
impl IntoRstd for f64 {
    fn into_rstd(v: Vec<Self>) -> Rstd {
        Rstd::F64(v)
    }
    fn from_rstd(s: &Rstd) -> Option<&[Self]> {
        match s {
            Rstd::F64(v) => Some(v),
            Rstd::F32(_) => None,
        }
    }
}
