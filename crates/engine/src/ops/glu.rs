//! [`glu_silu`]: the gate of Sana's Mix-FFN (`GLUMBConv`: `hidden, gate = chunk(x, 2, dim=1);
//! hidden · SiLU(gate)`) as one custom op over channels-last rows: u (rows, 2H) → (rows, H).
//! It keeps nothing beyond its input; backward returns one fresh (rows, 2H) gradient
//! (g·SiLU(gate) for the hidden half, g·hidden·SiLU'(gate) for the gate half). Composed in
//! candle it would keep the SiLU's output and the chunk views' product inputs. Budget twin:
//! `ditmem_budget::ditmem_cpu::sana::glu`.

use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor, WithDType,
};
use rayon::prelude::*;

use super::storage::{cpu_slice, dispatch_float, err, with_cpus, CResult, PAR_CHUNK};
use crate::kernels::scalar::{Acc, Elem};

/// The op (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct GluSilu;

/// `u[:, :H] · SiLU(u[:, H:])` of u (rows, 2H) → (rows, H) in u's dtype.
pub(crate) fn glu_silu(u: &Tensor) -> CResult<Tensor> {
    u.apply_op1(GluSilu)
}

pub(crate) fn glu_geom(l: &Layout) -> CResult<(usize, usize)> {
    match l.dims() {
        &[r, c2] if c2 % 2 == 0 && c2 > 0 => Ok((r, c2 / 2)),
        dims => Err(err(format!("glu expects (rows, 2H), got {dims:?}"))),
    }
}

#[inline]
fn sigmoid<A: Acc>(x: A) -> A {
    let one = A::from_f64(1.0);
    one / (one + (A::ZERO - x).exp())
}

pub(crate) fn glu_fwd<T: Elem<A> + Send + Sync, A: Acc + Send + Sync>(u: &[T], h: usize) -> Vec<T> {
    let rows = u.len() / (2 * h);
    let mut out: Vec<T> = vec![T::from_acc(A::ZERO); rows * h];
    out.par_chunks_mut(h)
        .enumerate()
        .with_min_len((PAR_CHUNK / h).max(1))
        .for_each(|(r, o)| {
            let (a, g) = u[r * 2 * h..(r + 1) * 2 * h].split_at(h);
            for j in 0..h {
                let gv = g[j].to_acc();
                o[j] = T::from_acc(a[j].to_acc() * gv * sigmoid(gv));
            }
        });
    out
}

/// The gradient of u (rows, 2H) written over u: g·SiLU(gate) over the hidden half,
/// g·hidden·SiLU'(gate) over the gate half (each row reads only its own hidden and gate). The
/// fused Mix-FFN writes dc2 over its c2 this way; the op below over a copy of u.
pub(crate) fn glu_bwd_over<T: Elem<A> + Send + Sync, A: Acc + Send + Sync>(
    u: &mut [T],
    go: &[T],
    h: usize,
) {
    let one = A::from_f64(1.0);
    u.par_chunks_mut(2 * h)
        .enumerate()
        .with_min_len((PAR_CHUNK / (2 * h)).max(1))
        .for_each(|(r, d)| {
            let gr = &go[r * h..(r + 1) * h];
            let (a, g) = d.split_at_mut(h);
            for j in 0..h {
                let (av, gv, o) = (a[j].to_acc(), g[j].to_acc(), gr[j].to_acc());
                let s = sigmoid(gv);
                a[j] = T::from_acc(o * gv * s);
                g[j] = T::from_acc(o * av * s * (one + gv * (one - s)));
            }
        });
}

impl CustomOp1 for GluSilu {
    fn name(&self) -> &'static str {
        "glu-silu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let (rows, h) = glu_geom(l)?;
        let n = "glu";
        let out = dispatch_float!(s.dtype(), n, |T, A| {
            T::to_cpu_storage_owned(glu_fwd::<T, A>(cpu_slice::<T>(s, l, n)?, h))
        });
        Ok((out, Shape::from((rows, h))))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let grad = grad.contiguous()?;
        let n = "glu backward";
        let du = with_cpus([arg, &grad], |[(s, l), (sg, lg)]| {
            let (_, h) = glu_geom(l)?;
            Ok(dispatch_float!(s.dtype(), n, |T, A| {
                let mut du = cpu_slice::<T>(s, l, n)?.to_vec();
                glu_bwd_over::<T, A>(&mut du, cpu_slice::<T>(sg, lg, n)?, h);
                Tensor::from_vec(du, l.shape(), &Device::Cpu)?
            }))
        })?;
        Ok(Some(du))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::test_values::{grads_against, max_abs_diff};
    use candle_core::Var;

    #[test]
    fn glu_matches_composed_reference() {
        let dev = Device::Cpu;
        let (r, h) = (5, 6);
        let v: Vec<f64> = (0..r * 2 * h)
            .map(|i| (i as f64 * 0.37).sin() * 2.0)
            .collect();
        let u = Var::from_tensor(&Tensor::from_vec(v, (r, 2 * h), &dev).unwrap()).unwrap();
        let w = Tensor::from_vec(
            (0..r * h)
                .map(|i| (i as f64 * 0.91).cos())
                .collect::<Vec<_>>(),
            (r, h),
            &dev,
        )
        .unwrap();
        let re = (u.narrow(1, 0, h).unwrap() * u.narrow(1, h, h).unwrap().silu().unwrap()).unwrap();
        let rg = grads_against(&re, &w);
        let o = glu_silu(u.as_tensor()).unwrap();
        let d = max_abs_diff(&o, &re);
        assert!(d < 1e-13);
        let g = grads_against(&o, &w);
        let d = max_abs_diff(
            g.get(u.as_tensor()).unwrap(),
            rg.get(u.as_tensor()).unwrap(),
        );
        assert!(d < 1e-12);
    }
}
