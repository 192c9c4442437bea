//! [`rms_norm`]: RMSNorm with a weight (diffusers `RMSNorm(dim, eps, elementwise_affine=True)`,
//! Sana's `caption_norm`) over rows (rows, D), as one custom op ([`RmsNorm`]): y = x·rstd·w with
//! rstd = 1/√(mean(x²) + eps), the statistics in the accumulation type (diffusers' float32
//! variance). It keeps x (its argument) and rstd per row (rows accumulation-type values, held by
//! the op); the weight is read rounded to x's dtype (f32 master weights go in as they are).
//! Workspace: the widened weight (D) in forward; the widened weight and the dW sums (2D) in
//! backward, which returns fresh dx and dW for the inputs that track. Budget twin:
//! `ditmem_budget::ditmem_cpu::sana::rms_norm`.

use std::sync::Mutex;

use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp2, DType, Device, Layout, Shape, Tensor, WithDType,
};
use rayon::prelude::*;

use super::dwconv::{narrow_to, widen_rounded};
use super::storage::{cpu_slice, dispatch_float, err, with_cpu, CResult, PAR_CHUNK};
use crate::kernels::scalar::{Acc, Elem};

#[derive(Debug)]
enum Rstd {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// The op (see the module docs).
#[derive(Debug)]
pub struct RmsNorm {
    eps: f64,
    rstd: Mutex<Option<Rstd>>,
}

/// RMSNorm of x (rows, D) with weight w (D), output in x's dtype.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> CResult<Tensor> {
    x.apply_op2(
        w,
        RmsNorm {
            eps,
            rstd: Mutex::new(None),
        },
    )
}

fn rms_geom(lx: &Layout, lw: &Layout) -> CResult<(usize, usize)> {
    match lx.dims() {
        &[r, d] if lw.dims() == [d] => Ok((r, d)),
        dims => Err(err(format!(
            "rms_norm expects x (rows, D) and w (D), got {dims:?} and {:?}",
            lw.dims()
        ))),
    }
}

trait Keep: Sized {
    fn keep(v: Vec<Self>) -> Rstd;
    fn read(r: &Rstd) -> Option<&[Self]>;
}
impl Keep for f32 {
    fn keep(v: Vec<f32>) -> Rstd {
        Rstd::F32(v)
    }
    fn read(r: &Rstd) -> Option<&[f32]> {
        match r {
            Rstd::F32(v) => Some(v),
            Rstd::F64(_) => None,
        }
    }
}
impl Keep for f64 {
    fn keep(v: Vec<f64>) -> Rstd {
        Rstd::F64(v)
    }
    fn read(r: &Rstd) -> Option<&[f64]> {
        match r {
            Rstd::F64(v) => Some(v),
            Rstd::F32(_) => None,
        }
    }
}

fn rms_fwd<T: Elem<A> + Send + Sync, A: Acc + Send + Sync>(
    x: &[T],
    w: &[A],
    d: usize,
    eps: f64,
) -> (Vec<T>, Vec<A>) {
    let rows = x.len() / d;
    let mut y: Vec<T> = vec![T::from_acc(A::ZERO); rows * d];
    let mut rs: Vec<A> = vec![A::ZERO; rows];
    let (inv_d, eps, one) = (
        A::from_f64(1.0 / d as f64),
        A::from_f64(eps),
        A::from_f64(1.0),
    );
    y.par_chunks_mut(d)
        .zip(rs.par_iter_mut())
        .enumerate()
        .with_min_len((PAR_CHUNK / d.max(1)).max(1))
        .for_each(|(r, (yr, rr))| {
            let xr = &x[r * d..(r + 1) * d];
            let mut ss = A::ZERO;
            for v in xr {
                ss += v.to_acc() * v.to_acc();
            }
            let rstd = one / (ss * inv_d + eps).sqrt();
            for j in 0..d {
                yr[j] = T::from_acc(xr[j].to_acc() * rstd * w[j]);
            }
            *rr = rstd;
        });
    (y, rs)
}

/// dx = rstd·(w·g − x·rstd²·mean(g·w·x)), fresh; dW = Σ_rows g·x·rstd into `dw`.
fn rms_bwd<T: Elem<A> + Send + Sync, A: Acc + Send + Sync>(
    x: &[T],
    g: &[T],
    w: &[A],
    rs: &[A],
    d: usize,
    dw: Option<&mut [A]>,
    want_dx: bool,
) -> Option<Vec<T>> {
    let rows = x.len() / d;
    let inv_d = A::from_f64(1.0 / d as f64);
    let dx = want_dx.then(|| {
        let mut dx: Vec<T> = vec![T::from_acc(A::ZERO); rows * d];
        dx.par_chunks_mut(d)
            .enumerate()
            .with_min_len((PAR_CHUNK / d.max(1)).max(1))
            .for_each(|(r, dr)| {
                let (xr, gr, rstd) = (&x[r * d..(r + 1) * d], &g[r * d..(r + 1) * d], rs[r]);
                let mut m = A::ZERO;
                for j in 0..d {
                    m += gr[j].to_acc() * w[j] * xr[j].to_acc();
                }
                let m = m * inv_d * rstd * rstd;
                for j in 0..d {
                    dr[j] = T::from_acc(rstd * (w[j] * gr[j].to_acc() - xr[j].to_acc() * m));
                }
            });
        dx
    });
    if let Some(dw) = dw {
        dw.iter_mut().for_each(|v| *v = A::ZERO);
        for r in 0..rows {
            let rstd = rs[r];
            for j in 0..d {
                dw[j] += g[r * d + j].to_acc() * x[r * d + j].to_acc() * rstd;
            }
        }
    }
    dx
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let (_, d) = rms_geom(lx, lw)?;
        let n = "rms_norm";
        let (out, kept) = dispatch_float!(sx.dtype(), n, |T, A| {
            let x = cpu_slice::<T>(sx, lx, n)?;
            let mut wv: Vec<A> = vec![A::ZERO; d];
            widen_rounded::<T, A>(sw, lw, &mut wv, |i| i)?;
            let (y, rs) = rms_fwd::<T, A>(x, &wv, d, self.eps);
            drop(wv);
            (T::to_cpu_storage_owned(y), A::keep(rs))
        });
        *self
            .rstd
            .lock()
            .map_err(|_| err("rms_norm lock poisoned"))? = Some(kept);
        Ok((out, lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let guard = self
            .rstd
            .lock()
            .map_err(|_| err("rms_norm lock poisoned"))?;
        let kept = guard
            .as_ref()
            .ok_or_else(|| err("rms_norm backward: no statistics kept"))?;
        let grad = grad.contiguous()?;
        let (tx, tw) = (x.track_op(), w.track_op());
        let wdt = w.dtype();
        let n = "rms_norm backward";
        with_cpu(x, |sx, lx| {
            with_cpu(w, |sw, lw| {
                with_cpu(&grad, |sg, lg| {
                    let (_, d) = rms_geom(lx, lw)?;
                    Ok(dispatch_float!(sx.dtype(), n, |T, A| {
                        let rs = A::read(kept).ok_or_else(|| err("rms_norm: statistics dtype"))?;
                        let mut ws: Vec<A> = vec![A::ZERO; 2 * d];
                        let (wv, dwv) = ws.split_at_mut(d);
                        widen_rounded::<T, A>(sw, lw, wv, |i| i)?;
                        let xv = cpu_slice::<T>(sx, lx, n)?;
                        let gv = cpu_slice::<T>(sg, lg, n)?;
                        let dx = rms_bwd::<T, A>(xv, gv, wv, rs, d, tw.then_some(&mut *dwv), tx);
                        let dx = match dx {
                            Some(v) => Some(Tensor::from_vec(v, lx.shape(), &Device::Cpu)?),
                            None => None,
                        };
                        let dw = if tw {
                            Some(narrow_to(dwv.iter().copied(), wdt, lw.shape())?)
                        } else {
                            None
                        };
                        drop(ws);
                        (dx, dw)
                    }))
                })
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    #[test]
    fn rms_norm_matches_composed_reference() {
        let dev = Device::Cpu;
        let (r, d) = (5, 8);
        let mk = |n: usize, salt: f64, shape: &[usize]| {
            let v: Vec<f64> = (0..n)
                .map(|i| (i as f64 * 0.53 + salt).sin() * 1.5)
                .collect();
            Var::from_tensor(&Tensor::from_vec(v, shape, &dev).unwrap()).unwrap()
        };
        let x = mk(r * d, 0.2, &[r, d]);
        let w = mk(d, 1.3, &[d]);
        let gw = mk(r * d, 2.9, &[r, d]).as_tensor().detach();
        let ms = x.sqr().unwrap().mean_keepdim(1).unwrap();
        let rstd = (ms + 1e-5).unwrap().sqrt().unwrap().recip().unwrap();
        let re = x
            .broadcast_mul(&rstd)
            .unwrap()
            .broadcast_mul(w.as_tensor())
            .unwrap();
        let rg = re.mul(&gw).unwrap().sum_all().unwrap().backward().unwrap();
        let o = rms_norm(x.as_tensor(), w.as_tensor(), 1e-5).unwrap();
        let dd = (&o - &re)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        assert!(dd < 1e-13);
        let g = o.mul(&gw).unwrap().sum_all().unwrap().backward().unwrap();
        for v in [&x, &w] {
            let dd = (g.get(v.as_tensor()).unwrap() - rg.get(v.as_tensor()).unwrap())
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
            assert!(dd < 1e-12, "{dd}");
        }
    }
}
