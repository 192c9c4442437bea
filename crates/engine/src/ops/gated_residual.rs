//! [`gated_residual`]: the adaLN-Zero residual `x + y·gate` as one node, keeping nothing beyond
//! its inputs and reading y in the compute dtype. Budget twin: the `gated_residual` rule of
//! `ditmem_budget::ditmem_cpu::ops`.

use candle_core::{
    backend::BackendStorage, CpuStorage, DType, Device, Layout, Shape, Tensor, WithDType,
};
use rayon::prelude::*;

use super::storage::{cpu_slice, dispatch_ln, err, par_rows, rows_view, with_cpus, CResult};
use crate::kernels::scalar::{Acc, Elem};
use crate::ops::custom_op::{Cpu, CpuOp, Grads, Op};

/// `x + y·gate` with gate (b, D) broadcast over the tokens: the adaLN-Zero residual. Composed in
/// candle it keeps the (b·s, D) product (the sum's input) and, under mixed precision, y's cast to
/// the accumulation dtype; fused it keeps nothing beyond its inputs and reads y in the compute
/// dtype. Backward: dx = g (the output gradient itself, no copy: PyTorch's AddBackward also
/// hands its gradient on as is, `torch/csrc/autograd/generated/Functions.cpp`), dy = g·gate in
/// y's dtype, dgate = Σ_s g·y.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct GatedResidual;

/// Fused gated residual: x (b, s, D) in the accumulation dtype, y (b·s, D) or (b, s, D) in any
/// float dtype, gate (b, D) with unit column stride in x's dtype → (b, s, D) in x's dtype.
pub fn gated_residual(x: &Tensor, y: &Tensor, gate: &Tensor) -> CResult<Tensor> {
    x.apply_op3(y, gate, Op(GatedResidual))
}

/// (b, s, d, gate offset, gate row stride).
fn gated_geom(
    lx: &Layout,
    ly: &Layout,
    lg: &Layout,
) -> CResult<(usize, usize, usize, usize, usize)> {
    let (b, s, d) = match lx.dims() {
        &[b, s, d] => (b, s, d),
        dims => {
            return Err(err(format!(
                "gated residual expects x (b, s, D), got {dims:?}"
            )))
        }
    };
    if ly.shape().elem_count() != b * s * d || ly.dims().last() != Some(&d) {
        return Err(err(format!(
            "gated residual: y {:?} does not match x {:?}",
            ly.dims(),
            lx.dims()
        )));
    }
    let (off, rs) = rows_view(lg, b, d, "gated residual gate")?;
    Ok((b, s, d, off, rs))
}

/// Forward kernel of [`GatedResidual`].
fn gated_fwd_cpu<T, O, A>(
    x: &[T],
    y: &[O],
    gate: &[T],
    geom: (usize, usize, usize, usize, usize),
) -> Vec<T>
where
    T: Elem<A> + Send + Sync,
    O: Elem<A> + Send + Sync,
    A: Acc,
{
    let (b, s, d, off, rs) = geom;
    par_rows(T::from_acc(A::ZERO), (b * s, d), |r, orow| {
        let gr = &gate[off + (r / s) * rs..][..d];
        let (xr, yr) = (&x[r * d..(r + 1) * d], &y[r * d..(r + 1) * d]);
        for j in 0..d {
            orow[j] = T::from_acc(xr[j].to_acc() + yr[j].to_acc() * gr[j].to_acc());
        }
    })
}

/// dy = g·gate (in y's type), one fresh buffer.
fn gated_dy_cpu<T, O, A>(g: &[T], gate: &[T], geom: (usize, usize, usize, usize, usize)) -> Vec<O>
where
    T: Elem<A> + Send + Sync,
    O: Elem<A> + Send + Sync,
    A: Acc,
{
    let (b, s, d, off, rs) = geom;
    par_rows(O::from_acc(A::ZERO), (b * s, d), |r, row| {
        let gr = &gate[off + (r / s) * rs..][..d];
        for j in 0..d {
            row[j] = O::from_acc(g[r * d + j].to_acc() * gr[j].to_acc());
        }
    })
}

/// dgate = Σ_s g·y per batch entry (b, D), one fresh buffer.
fn gated_dgate_cpu<T, O, A>(g: &[T], y: &[O], geom: (usize, usize, usize, usize, usize)) -> Vec<T>
where
    T: Elem<A> + Send + Sync,
    O: Elem<A> + Send + Sync,
    A: Acc,
{
    let (b, s, d, _, _) = geom;
    let mut v: Vec<T> = vec![T::from_acc(A::ZERO); b * d];
    // By blocks of columns, the tokens outer: rows read in order and a block of sums the
    // compiler vectorises, where a column at a time strode over every row (and one task per
    // batch entry left a thread idle at batch 1). Each sum still adds its tokens in order: the
    // same bits.
    const COLS: usize = 64;
    v.par_chunks_mut(d.max(1))
        .enumerate()
        .for_each(|(bi, row)| {
            row.par_chunks_mut(COLS).enumerate().for_each(|(cb, out)| {
                let mut acc = [A::ZERO; COLS];
                let acc = &mut acc[..out.len()];
                for si in 0..s {
                    let r = (bi * s + si) * d + cb * COLS;
                    let (gr, yr) = (&g[r..r + acc.len()], &y[r..r + acc.len()]);
                    for ((a, gv), yv) in acc.iter_mut().zip(gr).zip(yr) {
                        *a += gv.to_acc() * yv.to_acc();
                    }
                }
                for (o, a) in out.iter_mut().zip(acc.iter()) {
                    *o = T::from_acc(*a);
                }
            })
        });
    v
}

impl CpuOp<3> for GatedResidual {
    fn name(&self) -> &'static str {
        "gated-residual"
    }

    fn fwd(&self, [(sx, lx), (sy, ly), (sg, lg)]: [Cpu<'_>; 3]) -> CResult<(CpuStorage, Shape)> {
        let (b, s, d, off, rs) = gated_geom(lx, ly, lg)?;
        if sg.dtype() != sx.dtype() {
            return Err(err("gated residual: gate and x must share one dtype"));
        }
        let out = dispatch_ln!(sx.dtype(), sy.dtype(), |T, O, A| {
            let x = cpu_slice::<T>(sx, lx, "gated residual x")?;
            let y = cpu_slice::<O>(sy, ly, "gated residual y")?;
            let gate = sg.as_slice::<T>()?;
            let o = gated_fwd_cpu::<T, O, A>(x, y, gate, (b, s, d, off, rs));
            T::to_cpu_storage_owned(o)
        });
        Ok((out, lx.shape().clone()))
    }

    fn bwd(&self, [x, y, gate]: [&Tensor; 3], _res: &Tensor, grad: &Tensor) -> Grads<3> {
        let grad = grad.contiguous()?;
        let (wx, wy, wg) = (x.track_op(), y.track_op(), gate.track_op());
        let dev = Device::Cpu;
        with_cpus([y, gate, &grad], |[(sy, ly), (sgt, lgt), (sg, lg)]| {
            let (b, s, d, off, rs) = gated_geom(x.layout(), ly, lgt)?;
            Ok(dispatch_ln!(sg.dtype(), sy.dtype(), |T, O, A| {
                let g = cpu_slice::<T>(sg, lg, "gated residual grad")?;
                let gate = sgt.as_slice::<T>()?;
                // dx = g: the output gradient itself (candle only reads it, adding it
                // into x's entry), not a copy.
                let dx = wx.then(|| grad.clone());
                let geom = (b, s, d, off, rs);
                let dy = if wy {
                    let v = gated_dy_cpu::<T, O, A>(g, gate, geom);
                    Some(Tensor::from_vec(v, ly.shape(), &dev)?)
                } else {
                    None
                };
                // y is read for dgate alone: under a frozen gate the caller may have
                // released it (`ops::release`).
                let dg = if wg {
                    let yv = cpu_slice::<O>(sy, ly, "gated residual y")?;
                    let v = gated_dgate_cpu::<T, O, A>(g, yv, geom);
                    Some(Tensor::from_vec(v, lgt.shape(), &dev)?)
                } else {
                    None
                };
                [dx, dy, dg]
            }))
        })
    }
}
