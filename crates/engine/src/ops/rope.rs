//! [`rope`]: Flux's rotary position embedding (diffusers `apply_rotary_emb` with
//! `use_real_unbind_dim=-1`: channel pairs (2i, 2i+1) of each head rotated by the angle of the
//! token's position on their axis) as one custom op on a (b·n, heads·d_h) projection. The cos
//! and sin tables ([`RopeTable`], (n, d_h) each, built once per step from `FluxPosEmbed`'s ids)
//! are shared by every call; the op keeps nothing beyond its input and the table, and its
//! backward (the rotation by the opposite angle) returns one fresh dx in x's dtype, no scratch.
//!
//! out[2i] = x[2i]·cos[2i] − x[2i+1]·sin[2i], out[2i+1] = x[2i+1]·cos[2i+1] + x[2i]·sin[2i+1],
//! computed in the accumulation type and written in x's dtype (diffusers computes in f32 and
//! casts back). Flux's blocks run it fused with the q/k RMSNorm before it ([`super::norm_rope`],
//! whose forward and backward use [`rotate`]); alone it serves `verify`'s score probe.

use std::sync::Arc;

use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor, WithDType,
};

use super::storage::{
    cpu_slice, dispatch_float, err, par_rows, storage_tensor, with_cpu, with_cpus, CResult,
};
use crate::kernels::scalar::{Acc, Elem};

/// The cos and sin tables, (n, d_h) each in the accumulation type (f64 under fp64, else f32).
#[derive(Debug)]
pub struct RopeTable {
    pub cos: Tensor,
    pub sin: Tensor,
}

impl RopeTable {
    /// `FluxPosEmbed(theta, axes_dim)` over `ids` (n rows of one position per axis): per axis of
    /// width a, the angles pos·θ^(−2k/a) (k < a/2), each repeated for its channel pair, the axes
    /// side by side. `ids` holds one position per axis for each token, token after token.
    /// Built in f64, stored in `dtype`.
    pub fn new(ids: &[f64], axes: &[usize], theta: f64, dtype: DType) -> CResult<RopeTable> {
        let dh: usize = axes.iter().sum();
        if axes.is_empty() || !ids.len().is_multiple_of(axes.len()) {
            return Err(err(format!(
                "rope: {} positions are not whole tokens of {} axes",
                ids.len(),
                axes.len()
            )));
        }
        let n = ids.len() / axes.len();
        let mut cos = Vec::with_capacity(n * dh);
        let mut sin = Vec::with_capacity(n * dh);
        for row in ids.chunks_exact(axes.len()) {
            for (&pos, &a) in row.iter().zip(axes) {
                for k in 0..a / 2 {
                    let f = pos * theta.powf(-((2 * k) as f64) / a as f64);
                    let (s, c) = f.sin_cos();
                    cos.extend([c, c]);
                    sin.extend([s, s]);
                }
            }
        }
        let dev = Device::Cpu;
        Ok(RopeTable {
            cos: Tensor::from_vec(cos, (n, dh), &dev)?.to_dtype(dtype)?,
            sin: Tensor::from_vec(sin, (n, dh), &dev)?.to_dtype(dtype)?,
        })
    }

    fn dims(&self) -> CResult<(usize, usize)> {
        self.cos.dims2()
    }
}

/// The op (see the module docs).
#[derive(Debug, Clone)]
pub struct Rope {
    table: Arc<RopeTable>,
}

/// Rotates x (b·n, heads·d_h) by the table's (n, d_h) angles → a fresh (b·n, heads·d_h) in x's
/// dtype.
pub fn rope(x: &Tensor, table: &Arc<RopeTable>) -> CResult<Tensor> {
    x.apply_op1(Rope {
        table: table.clone(),
    })
}

/// Rotates each row of `x` by +angle (`sign` 1) or −angle (`sign` −1).
pub(super) fn rotate<T, A>(
    x: &[T],
    cos: &[A],
    sin: &[A],
    (n, d, dh): (usize, usize, usize),
    sign: A,
) -> Vec<T>
where
    T: Elem<A> + Send + Sync,
    A: Acc + Send + Sync,
{
    par_rows(T::from_acc(A::ZERO), (x.len() / d, d), |r, orow| {
        let xrow = &x[r * d..(r + 1) * d];
        let tok = r % n;
        let (c, s) = (&cos[tok * dh..][..dh], &sin[tok * dh..][..dh]);
        for (oh, xh) in orow.chunks_exact_mut(dh).zip(xrow.chunks_exact(dh)) {
            for i in (0..dh).step_by(2) {
                let (x0, x1) = (xh[i].to_acc(), xh[i + 1].to_acc());
                oh[i] = T::from_acc(x0 * c[i] - sign * x1 * s[i]);
                oh[i + 1] = T::from_acc(x1 * c[i + 1] + sign * x0 * s[i + 1]);
            }
        }
    })
}

/// (n, D, d_h) of x under `l` rotated by `table`: whole samples of the table's n tokens, whole
/// heads of its even d_h; `what` names the op in the error.
pub(super) fn rope_geom(
    table: &RopeTable,
    l: &Layout,
    what: &str,
) -> CResult<(usize, usize, usize)> {
    let (n, dh) = table.dims()?;
    let (rows, d) = match l.dims() {
        &[r, c] => (r, c),
        dims => return Err(err(format!("{what} expects x (b·n, D), got {dims:?}"))),
    };
    if n == 0 || rows % n != 0 || dh == 0 || d % dh != 0 || dh % 2 != 0 {
        return Err(err(format!(
            "{what}: x {:?} is not whole samples of {n} tokens and heads of {dh}",
            l.dims()
        )));
    }
    Ok((n, d, dh))
}

impl Rope {
    /// (n, D, d_h) of a call on `l`.
    fn geom(&self, l: &Layout) -> CResult<(usize, usize, usize)> {
        rope_geom(&self.table, l, "rope")
    }

    fn run(&self, s: &CpuStorage, l: &Layout, sign: f64) -> CResult<CpuStorage> {
        let geom = self.geom(l)?;
        with_cpus([&self.table.cos, &self.table.sin], |[(sc, lc), (ss, ls)]| {
            Ok(dispatch_float!(s.dtype(), "rope", |T, A| {
                let x = cpu_slice::<T>(s, l, "rope x")?;
                let cos = cpu_slice::<A>(sc, lc, "rope cos")?;
                let sin = cpu_slice::<A>(ss, ls, "rope sin")?;
                let o = rotate::<T, A>(x, cos, sin, geom, <A as Acc>::from_f64(sign));
                T::to_cpu_storage_owned(o)
            }))
        })
    }
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        Ok((self.run(s, l, 1.0)?, l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let grad = grad.contiguous()?;
        let shape = grad.shape().clone();
        let dx = with_cpu(&grad, |s, l| self.run(s, l, -1.0))?;
        Ok(Some(storage_tensor(dx, shape)?))
    }
}
