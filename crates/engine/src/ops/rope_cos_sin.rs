//! [`rope`]: rotary position embedding on interleaved channel pairs as one node, written in x's
//! dtype. diffusers' `apply_rotary_emb` (Wan's `WanAttnProcessor`, Flux's with
//! `use_real_unbind_dim=-1`) rotates each pair (x[2i], x[2i+1]) of a head by the angle of its
//! token's position: `(x₁·cos − x₂·sin, x₁·sin + x₂·cos)`. Composed in candle it would keep
//! both halves, four products and the tables' broadcasts; the rotation is linear, so this op
//! keeps nothing (the cos/sin tables are constants the caller holds) and its backward is the
//! inverse rotation of the gradient, one fresh dx. Budget twin: the `rope` rule of
//! `ditmem_budget::ditmem_cpu::ops`.
//!
//! Layout: x is contiguous, either (…, W) rows with W = heads·d_h (e.g. (b·s, D) or (b, s, D))
//! or (b, s, heads, d_h) (rows of heads·d_h); cos and sin are (s, d_h/2), one angle per pair,
//! in the accumulation type (f64 for f64 x, else f32). Row r of x sits at position r mod s.

use candle_core::{backend::BackendStorage, CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::storage::{
    cpu_slice, dispatch_float, err, storage_tensor, with_cpu, with_cpus, CResult, PAR_CHUNK,
};
use crate::kernels::scalar::{Acc, Elem};

/// The RoPE custom op over the tables it holds (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct RopeCosSin {
    cos: Tensor,
    sin: Tensor,
}

/// RoPE of x by the (s, d_h/2) tables (see the module docs for the layout).
pub fn rope_cos_sin(x: &Tensor, cos: &Tensor, sin: &Tensor) -> CResult<Tensor> {
    x.apply_op1(RopeCosSin {
        cos: cos.contiguous()?,
        sin: sin.contiguous()?,
    })
}

/// (rows, W, s, half) of x under the tables.
fn geom(lx: &Layout, cos: &Tensor, sin: &Tensor) -> CResult<(usize, usize, usize, usize)> {
    let (s, half) = cos.dims2()?;
    if sin.dims2()? != (s, half) || half == 0 || s == 0 {
        return Err(err(format!(
            "rope: cos {:?} and sin {:?} must be one (s, d_h/2) shape",
            cos.dims(),
            sin.dims()
        )));
    }
    let dims = lx.dims();
    let w = match dims {
        [_, _, h, dh] => h * dh,
        [.., w] => *w,
        [] => return Err(err("rope: x is a scalar")),
    };
    let n = lx.shape().elem_count();
    if w == 0 || !w.is_multiple_of(2 * half) || !n.is_multiple_of(w) || !(n / w).is_multiple_of(s) {
        return Err(err(format!(
            "rope: x {dims:?} is not rows of heads·{} at {s} positions",
            2 * half
        )));
    }
    Ok((n / w, w, s, half))
}

/// Rotates every pair of x by the angles of its row's position; `sign` −1 rotates back (the
/// backward). One fresh output of x's type.
fn rotate<T, A>(x: &[T], cos: &[A], sin: &[A], g: (usize, usize, usize, usize), sign: f64) -> Vec<T>
where
    T: Elem<A> + Send + Sync,
    A: Acc + Send + Sync,
{
    let (rows, w, s, half) = g;
    let dh = 2 * half;
    let sg = A::from_f64(sign);
    let mut out: Vec<T> = vec![T::from_acc(A::ZERO); rows * w];
    out.par_chunks_mut(w)
        .enumerate()
        .with_min_len((PAR_CHUNK / w).max(1))
        .for_each(|(r, orow)| {
            let p = r % s;
            let (cr, sr) = (
                &cos[p * half..(p + 1) * half],
                &sin[p * half..(p + 1) * half],
            );
            let xr = &x[r * w..(r + 1) * w];
            for h0 in (0..w).step_by(dh) {
                for i in 0..half {
                    let (a, b) = (xr[h0 + 2 * i].to_acc(), xr[h0 + 2 * i + 1].to_acc());
                    let (c, sn) = (cr[i], sg * sr[i]);
                    orow[h0 + 2 * i] = T::from_acc(a * c - b * sn);
                    orow[h0 + 2 * i + 1] = T::from_acc(a * sn + b * c);
                }
            }
        });
    out
}

impl RopeCosSin {
    fn run(&self, sx: &CpuStorage, lx: &Layout, sign: f64) -> CResult<CpuStorage> {
        let g = geom(lx, &self.cos, &self.sin)?;
        let want = if sx.dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        if self.cos.dtype() != want || self.sin.dtype() != want {
            return Err(err(format!(
                "rope: tables must be {want:?} for x of {:?}",
                sx.dtype()
            )));
        }
        with_cpus([&self.cos, &self.sin], |[(sc, lc), (ss, ls)]| {
            Ok(dispatch_float!(sx.dtype(), "rope", |T, A| {
                let x = cpu_slice::<T>(sx, lx, "rope x")?;
                let c = cpu_slice::<A>(sc, lc, "rope cos")?;
                let s = cpu_slice::<A>(ss, ls, "rope sin")?;
                <T as candle_core::WithDType>::to_cpu_storage_owned(rotate::<T, A>(
                    x, c, s, g, sign,
                ))
            }))
        })
    }
}

impl CustomOp1 for RopeCosSin {
    fn name(&self) -> &'static str {
        "rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        Ok((self.run(s, l, 1.0)?, l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let grad = grad.contiguous()?;
        let dx = with_cpu(&grad, |sg, lg| {
            let st = self.run(sg, lg, -1.0)?;
            storage_tensor(st, lg.shape())
        })?;
        Ok(Some(dx.to_dtype(arg.dtype())?))
    }
}

/// The rotation composed of candle primitives in f64 (the tests' reference): x as rows of
/// pairs, cos/sin broadcast over the batch and the heads.
pub fn rope_cos_sin_reference(x: &Tensor, cos: &Tensor, sin: &Tensor) -> CResult<Tensor> {
    let (s, half) = cos.dims2()?;
    let n = x.elem_count();
    let x = x.to_dtype(DType::F64)?;
    let rows = n / (2 * half);
    // (rows_per_pos·…): view x as (b, s, heads, half, 2).
    let per_s = rows / s;
    let b = x.dims()[0];
    let heads = per_s / b.max(1);
    let x5 = x.reshape((b, s, heads, half, 2))?;
    let a = x5.narrow(4, 0, 1)?.squeeze(4)?;
    let bb = x5.narrow(4, 1, 1)?.squeeze(4)?;
    let c = cos.to_dtype(DType::F64)?.reshape((1, s, 1, half))?;
    let sn = sin.to_dtype(DType::F64)?.reshape((1, s, 1, half))?;
    let o1 = (a.broadcast_mul(&c)? - bb.broadcast_mul(&sn)?)?;
    let o2 = (a.broadcast_mul(&sn)? + bb.broadcast_mul(&c)?)?;
    Tensor::stack(&[o1, o2], 4)?.reshape(x.shape())
}
