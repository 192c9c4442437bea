//! [`rms_norm_rows`]: (Wan's q/k norms across heads; Flux's per-head op is [`super::rms_norm`]) RMSNorm over the last dimension, `x·rsqrt(mean(x²) + eps)·w`, as one node
//! written in the output dtype. Candle's fused `rms_norm` has no backward, and the composed one
//! keeps x², the mean and the scaled copy in the gradient graph; this op keeps only its
//! argument and one rstd per row in the accumulation type (f32, f64 for f64 inputs). Backward
//! returns dx (in x's dtype) and dw (in w's dtype) for the inputs that track. diffusers'
//! `RMSNorm` (Wan's `norm_q` / `norm_k` across heads, Flux's per head) computes the statistic
//! in float32 the same way. Budget twin: the `rms_norm` rule of
//! `ditmem_budget::ditmem_cpu::ops`.

use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor, WithDType,
};
use rayon::prelude::*;

use super::storage::{
    cpu_slice, dispatch_ln, err, par_rows, with_cpu, with_cpus, CResult, PAR_CHUNK,
};
use crate::kernels::scalar::{Acc, Elem};
use crate::ops::custom_op::{Cpu, CpuOp, Grads, Op};
use crate::ops::storage::Saved;

/// RMSNorm over the last dimension of x (any rank, contiguous), with an optional weight (D) of
/// x's dtype; the output has x's shape in `out`.
#[derive(Debug)]
pub(crate) struct RmsNormRows {
    out: DType,
    eps: f64,
    /// Per-row rstd kept for the backward, in the accumulation type.
    rstd: Saved,
}

/// `x·rsqrt(mean(x²) + eps)·w` over the last dimension, in `out` dtype (see the module docs).
pub fn rms_norm_rows(x: &Tensor, weight: Option<&Tensor>, eps: f64, out: DType) -> CResult<Tensor> {
    let op = RmsNormRows {
        out,
        eps,
        rstd: Saved::default(),
    };
    match weight {
        Some(w) => x.apply_op2(w, Op(op)),
        None => x.apply_op1(op),
    }
}

/// (rows, d) of x.
fn geom(lx: &Layout) -> CResult<(usize, usize)> {
    let d = *lx
        .dims()
        .last()
        .ok_or_else(|| err("rms_norm: x is a scalar"))?;
    if d == 0 {
        return Err(err("rms_norm: empty last dimension"));
    }
    Ok((lx.shape().elem_count() / d, d))
}

/// Forward kernel: y (rows·d in `O`) and one rstd per row.
fn fwd_cpu<T, O, A>(x: &[T], w: Option<&[T]>, d: usize, eps: f64) -> (Vec<O>, Vec<A>)
where
    T: Elem<A> + Send + Sync,
    O: Elem<A> + Send + Sync,
    A: Acc + Send + Sync,
{
    let rows = x.len() / d;
    let mut y: Vec<O> = vec![O::from_acc(A::ZERO); rows * d];
    let mut rs: Vec<A> = vec![A::ZERO; rows];
    let inv_d = A::from_f64(1.0 / d as f64);
    let (eps, one) = (A::from_f64(eps), A::from_f64(1.0));
    y.par_chunks_mut(d)
        .zip(rs.par_iter_mut())
        .enumerate()
        .with_min_len((PAR_CHUNK / d).max(1))
        .for_each(|(r, (yr, rr))| {
            let xr = &x[r * d..(r + 1) * d];
            let mut ss = A::ZERO;
            for v in xr {
                let a = v.to_acc();
                ss += a * a;
            }
            let rstd = one / (ss * inv_d + eps).sqrt();
            *rr = rstd;
            match w {
                Some(w) => {
                    for j in 0..d {
                        yr[j] = O::from_acc(xr[j].to_acc() * rstd * w[j].to_acc());
                    }
                }
                None => {
                    for j in 0..d {
                        yr[j] = O::from_acc(xr[j].to_acc() * rstd);
                    }
                }
            }
        });
    (y, rs)
}

/// Backward kernel: with ĝ = g·w and x̂ = x·rstd, dx = rstd·(ĝ − x̂·mean(ĝ·x̂)) and
/// dw = Σ_rows g·x̂ (when `want_w`), fresh, in x's type.
fn bwd_cpu<T, O, A>(
    x: &[T],
    w: Option<&[T]>,
    gy: &[O],
    rs: &[A],
    d: usize,
    want_w: bool,
) -> (Vec<T>, Option<Vec<T>>)
where
    T: Elem<A> + Send + Sync,
    O: Elem<A> + Send + Sync,
    A: Acc + Send + Sync,
{
    let rows = x.len() / d;
    let inv_d = A::from_f64(1.0 / d as f64);
    let wv = |j: usize| w.map_or(A::from_f64(1.0), |w| w[j].to_acc());
    let dx = par_rows(T::from_acc(A::ZERO), (rows, d), |r, dxr| {
        let (xr, gr, rstd) = (&x[r * d..(r + 1) * d], &gy[r * d..(r + 1) * d], rs[r]);
        let mut dot = A::ZERO;
        for j in 0..d {
            dot += gr[j].to_acc() * wv(j) * xr[j].to_acc() * rstd;
        }
        let m = dot * inv_d;
        for j in 0..d {
            let xh = xr[j].to_acc() * rstd;
            dxr[j] = T::from_acc(rstd * (gr[j].to_acc() * wv(j) - xh * m));
        }
    });
    let dw = want_w.then(|| {
        // Column sums in blocks of columns, so a wide norm parallelises.
        const COLS: usize = 64;
        let mut dw: Vec<T> = vec![T::from_acc(A::ZERO); d];
        dw.par_chunks_mut(COLS).enumerate().for_each(|(cb, dwc)| {
            let j0 = cb * COLS;
            let mut acc = [A::ZERO; COLS];
            for r in 0..rows {
                let rstd = rs[r];
                for (j, a) in acc.iter_mut().enumerate().take(dwc.len()) {
                    *a += gy[r * d + j0 + j].to_acc() * x[r * d + j0 + j].to_acc() * rstd;
                }
            }
            for (o, a) in dwc.iter_mut().zip(acc) {
                *o = T::from_acc(a);
            }
        });
        dw
    });
    (dx, dw)
}

impl RmsNormRows {
    pub(crate) fn forward_on(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        w: Option<(&CpuStorage, &Layout)>,
    ) -> CResult<(CpuStorage, Shape)> {
        let (_, d) = geom(lx)?;
        if let Some((sw, lw)) = w {
            if sw.dtype() != sx.dtype() || lw.shape().elem_count() != d {
                return Err(err(format!(
                    "rms_norm: weight {:?} {:?} does not match x's last dimension {d} and dtype {:?}",
                    lw.dims(),
                    sw.dtype(),
                    sx.dtype()
                )));
            }
        }
        let (out, rs) = dispatch_ln!(sx.dtype(), self.out, |T, O, A| {
            let x = cpu_slice::<T>(sx, lx, "rms_norm x")?;
            let w = match w {
                Some((sw, lw)) => Some(cpu_slice::<T>(sw, lw, "rms_norm weight")?),
                None => None,
            };
            let (y, rs) = fwd_cpu::<T, O, A>(x, w, d, self.eps);
            (O::to_cpu_storage_owned(y), A::to_cpu_storage_owned(rs))
        });
        *self.rstd.lock("rms lock poisoned")? = Some(rs);
        Ok((out, lx.shape().clone()))
    }

    /// The op, for a caller that runs it on storages inside its own node
    /// ([`super::attention::cross::CrossAttention`]).
    pub(crate) fn new(eps: f64, out: DType) -> Self {
        RmsNormRows {
            out,
            eps,
            rstd: Saved::default(),
        }
    }

    /// Frees the kept statistics, once the backward has run.
    pub(crate) fn release(&self) {
        self.rstd.release();
    }

    fn bwd_impl(
        &self,
        x: &Tensor,
        w: Option<&Tensor>,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let want_w = w.is_some_and(|w| w.track_op());
        self.bwd_parts(x, w, grad, (x.track_op(), want_w))
    }

    /// The backward with the gradients chosen by the caller: `(want_x, want_w)`.
    pub(crate) fn bwd_parts(
        &self,
        x: &Tensor,
        w: Option<&Tensor>,
        grad: &Tensor,
        (want_x, want_w): (bool, bool),
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let guard = self.rstd.lock("rms lock poisoned")?;
        let rs = guard
            .as_ref()
            .ok_or_else(|| err("rms_norm backward before forward"))?;
        let grad = grad.contiguous()?;
        let want_w = want_w && w.is_some();
        let w_c = w.map(|w| w.contiguous()).transpose()?;
        let (dx, dw) = with_cpus([x, &grad], |[(sx, lx), (sg, lg)]| {
            let (_, d) = geom(lx)?;
            let run = |ws: Option<(&CpuStorage, &Layout)>| -> CResult<(Tensor, Option<Tensor>)> {
                Ok(dispatch_ln!(sx.dtype(), self.out, |T, O, A| {
                    let st = rs.as_slice::<A>()?;
                    let wsl = match ws {
                        Some((s, l)) => Some(cpu_slice::<T>(s, l, "rms_norm weight")?),
                        None => None,
                    };
                    let (dx, dw) = bwd_cpu::<T, O, A>(
                        cpu_slice::<T>(sx, lx, "rms_norm x")?,
                        wsl,
                        cpu_slice::<O>(sg, lg, "rms_norm grad")?,
                        st,
                        d,
                        want_w,
                    );
                    let dev = Device::Cpu;
                    (
                        Tensor::from_vec(dx, lx.shape(), &dev)?,
                        match dw {
                            Some(v) => Some(Tensor::from_vec(v, d, &dev)?),
                            None => None,
                        },
                    )
                }))
            };
            match &w_c {
                Some(wt) => with_cpu(wt, |sw, lw| run(Some((sw, lw)))),
                None => run(None),
            }
        })?;
        let dw = match (dw, w) {
            (Some(g), Some(w)) => Some(g.reshape(w.shape())?),
            _ => None,
        };
        Ok((want_x.then_some(dx), dw))
    }
}

impl CustomOp1 for RmsNormRows {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        self.forward_on(s, l, None)
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        Ok(self.bwd_impl(arg, None, grad)?.0)
    }
}

impl CpuOp<2> for RmsNormRows {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn fwd(&self, [(s1, l1), (s2, l2)]: [Cpu<'_>; 2]) -> CResult<(CpuStorage, Shape)> {
        self.forward_on(s1, l1, Some((s2, l2)))
    }

    fn bwd(&self, [x, w]: [&Tensor; 2], _res: &Tensor, grad: &Tensor) -> Grads<2> {
        let (dx, dw) = self.bwd_impl(x, Some(w), grad)?;
        Ok([dx, dw])
    }
}

/// The same op composed of candle primitives in f64 (the tests' reference).
pub fn rms_norm_rows_reference(x: &Tensor, weight: Option<&Tensor>, eps: f64) -> CResult<Tensor> {
    let x = x.to_dtype(DType::F64)?;
    let ms = x.sqr()?.mean_keepdim(candle_core::D::Minus1)?;
    let y = x.broadcast_div(&(ms + eps)?.sqrt()?)?;
    match weight {
        Some(w) => y.broadcast_mul(&w.to_dtype(DType::F64)?),
        None => Ok(y),
    }
}
