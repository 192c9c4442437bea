//! [`norm_rope`] and [`joint_norm_rope`]: Flux's per-head q/k RMSNorm and the RoPE after it as
//! one custom op on a (b·n, heads·d_h) projection. `joint_norm_rope` takes the double-stream
//! block's joint [text; image] projection with two weights: `norm_added_q` (or `_k`) for each
//! sample's first `t` tokens, `norm_q` (`norm_k`) for the rest.
//!
//! Why: composed ([`rms_norm`](super::rms_norm), the per-sample [`concat`](super::tokens::concat)
//! of the two streams, [`rope`](super::rope)), candle's graph keeps the normalised copy, and in
//! the double-stream block the concatenation too, until the block's backward ends, though no
//! backward reads them (RoPE's backward is the rotation by the opposite angle, the
//! concatenation's a split): one (b·n, D) tensor per q and k in a single-stream block, two in a
//! double-stream one, beside the two the backward does read (the projection and the rotated
//! output the attention keeps). Flux's recomputed double-stream block held four of them through
//! its whole backward: the step's peak (Flux bf16 recompute-all, issue 15). This op keeps
//! nothing beyond its inputs; its backward takes the un-rotated gradient ((b·n, D) in x's dtype)
//! and one rstd per (row, head) (accumulation type) as workspace, sized by `norm_rope_bwd_elems`
//! (`ditmem_budget::ditmem_cpu::ops`, which the `ditmem-cpu` runtime predicts by), and returns
//! a fresh dx and one dw per tracked weight.
//!
//! Numerics: the norm's output is rounded through x's dtype before the rotation, and the
//! un-rotated gradient before the norm's backward, as the composition's tensors are; the same
//! per-element formulas (`rms_norm::rstd`, `rms_norm::group_dx`, `rope::rotate`) and each dw
//! summed over its stream's groups in the composition's order: the same bits in every dtype
//! (`tests/flux_ops.rs`). Budget twin: `norm_rope` of `ditmem_budget::ditmem_cpu::flux`.

use std::sync::Arc;

use candle_core::{
    backend::BackendStorage, CpuStorage, DType, Device, Layout, Shape, Tensor, WithDType,
};
use ditmem_budget::ditmem_cpu::ops::norm_rope_bwd_elems;
use rayon::prelude::*;

use super::rms_norm::{group_dw, group_dx, rstd};
use super::rope::{rope_geom, rotate, RopeTable};
use super::storage::{cpu_slice, dispatch_ln, err, par_rows, with_cpus, CResult, PAR_CHUNK};
use crate::kernels::scalar::{Acc, Elem};
use crate::ops::custom_op::{Cpu, CpuOp, Grads, Op};

/// The op (see the module docs): rows whose token (row mod n) is below `first` take the first
/// weight, the others the second; [`norm_rope`] has one weight and `first` 0.
#[derive(Debug, Clone)]
pub(crate) struct NormRope {
    eps: f64,
    table: Arc<RopeTable>,
    first: usize,
}

/// RMSNorm per head of x (b·n, heads·d_h) with w (d_h), then RoPE by the table's (n, d_h)
/// angles → a fresh (b·n, heads·d_h) in x's dtype (the single-stream block's q and k).
pub fn norm_rope(x: &Tensor, w: &Tensor, eps: f64, table: &Arc<RopeTable>) -> CResult<Tensor> {
    x.apply_op2(
        w,
        Op(NormRope {
            eps,
            table: table.clone(),
            first: 0,
        }),
    )
}

/// [`norm_rope`] of the joint [text; image] projection x (b·(t + s), D): each sample's first
/// `t` tokens normalised with `w_text`, the rest with `w_image` (the double-stream block's q
/// and k; the weights of one dtype).
pub fn joint_norm_rope(
    x: &Tensor,
    w_text: &Tensor,
    w_image: &Tensor,
    t: usize,
    eps: f64,
    table: &Arc<RopeTable>,
) -> CResult<Tensor> {
    x.apply_op3(
        w_text,
        w_image,
        Op(NormRope {
            eps,
            table: table.clone(),
            first: t,
        }),
    )
}

/// (n, D, d_h) of a call: x (rows, D) whole samples of the table's n tokens, whole heads of d_h.
fn geom(table: &RopeTable, lx: &Layout, lw: &[&Layout]) -> CResult<(usize, usize, usize)> {
    let (n, d, dh) = rope_geom(table, lx, "norm-rope")?;
    for l in lw {
        if l.dims() != [dh] {
            return Err(err(format!(
                "norm-rope: a weight is {:?}, not the head width ({dh})",
                l.dims()
            )));
        }
    }
    Ok((n, d, dh))
}

fn forward<T, W, A>(
    x: &[T],
    ws: [&[W]; 2],
    (cos, sin): (&[A], &[A]),
    (n, d, dh, first): (usize, usize, usize, usize),
    eps: f64,
) -> Vec<T>
where
    T: Elem<A> + Send + Sync,
    W: Elem<A> + Send + Sync,
    A: Acc + Send + Sync,
{
    let eps = A::from_f64(eps);
    let sign = A::from_f64(1.0);
    par_rows(T::from_acc(A::ZERO), (x.len() / d, d), |r, orow| {
        let xrow = &x[r * d..(r + 1) * d];
        let tok = r % n;
        let w = ws[usize::from(tok >= first)];
        let (c, s) = (&cos[tok * dh..][..dh], &sin[tok * dh..][..dh]);
        for (oh, xh) in orow.chunks_exact_mut(dh).zip(xrow.chunks_exact(dh)) {
            let rg = rstd(xh, eps);
            // The norm's output in x's dtype (`rms_norm`), then `rope::rotate`'s formula.
            let y = |j: usize| T::from_acc(xh[j].to_acc() * rg * w[j].to_acc()).to_acc();
            for i in (0..dh).step_by(2) {
                let (x0, x1) = (y(i), y(i + 1));
                oh[i] = T::from_acc(x0 * c[i] - sign * x1 * s[i]);
                oh[i + 1] = T::from_acc(x1 * c[i + 1] + sign * x0 * s[i + 1]);
            }
        }
    })
}

/// (dx, [dw of the first weight, dw of the second]) for the wanted ones.
#[allow(clippy::type_complexity)]
fn backward<T, W, A>(
    x: &[T],
    ws: [&[W]; 2],
    g: &[T],
    (cos, sin): (&[A], &[A]),
    (n, d, dh, first): (usize, usize, usize, usize),
    eps: f64,
    (want_x, want_w): (bool, [bool; 2]),
) -> (Option<Vec<T>>, [Option<Vec<W>>; 2])
where
    T: Elem<A> + Send + Sync,
    W: Elem<A> + Send + Sync,
    A: Acc + Send + Sync,
{
    let eps = A::from_f64(eps);
    // RoPE's backward in x's dtype, as the composition's rope node hands it on.
    let (gu_len, r_len) = norm_rope_bwd_elems(x.len() as u64, dh as u64);
    let gu = rotate::<T, A>(g, cos, sin, (n, d, dh), A::from_f64(-1.0));
    debug_assert_eq!(
        gu.len() as u64,
        gu_len,
        "norm-rope: the un-rotated gradient is x's size"
    );
    let mut r: Vec<A> = Vec::with_capacity(r_len as usize);
    x.par_chunks(dh)
        .with_min_len((PAR_CHUNK / dh).max(1))
        .map(|xg| rstd(xg, eps))
        .collect_into_vec(&mut r);
    let heads = d / dh;
    let dx = want_x.then(|| {
        par_rows(T::from_acc(A::ZERO), (x.len() / d, d), |row, dr| {
            let (xr, gr) = (&x[row * d..(row + 1) * d], &gu[row * d..(row + 1) * d]);
            let w = ws[usize::from(row % n >= first)];
            for (h, ((dg, xg), gg)) in dr
                .chunks_exact_mut(dh)
                .zip(xr.chunks_exact(dh))
                .zip(gr.chunks_exact(dh))
                .enumerate()
            {
                group_dx::<T, W, A>(xg, gg, w, r[row * heads + h], dg);
            }
        })
    });
    // Each weight's dw per channel over its stream's groups, in order (the composition's sum
    // over the stream tensor's groups).
    let dw = |which: usize| {
        group_dw::<T, W, A>(x, &gu, &r, dh, |k| {
            usize::from((k / heads) % n >= first) == which
        })
    };
    let dws = [want_w[0].then(|| dw(0)), want_w[1].then(|| dw(1))];
    (dx, dws)
}

/// A fresh tensor of `l`'s shape from a gradient's values, when there is one.
fn tensor<T: WithDType>(v: Option<Vec<T>>, l: &Layout) -> CResult<Option<Tensor>> {
    v.map(|v| Tensor::from_vec(v, l.shape(), &Device::Cpu))
        .transpose()
}

impl NormRope {
    fn forward_on(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        w: [(&CpuStorage, &Layout); 2],
    ) -> CResult<CpuStorage> {
        let (n, d, dh) = geom(&self.table, lx, &[w[0].1, w[1].1])?;
        if w[0].0.dtype() != w[1].0.dtype() {
            return Err(err("norm-rope: the two weights must share one dtype"));
        }
        let dims = (n, d, dh, self.first);
        with_cpus([&self.table.cos, &self.table.sin], |[(sc, lc), (ss, ls)]| {
            Ok(dispatch_ln!(sx.dtype(), w[0].0.dtype(), |T, W, A| {
                let x = cpu_slice::<T>(sx, lx, "norm-rope x")?;
                let wa = cpu_slice::<W>(w[0].0, w[0].1, "norm-rope w")?;
                let wb = cpu_slice::<W>(w[1].0, w[1].1, "norm-rope w")?;
                let cos = cpu_slice::<A>(sc, lc, "rope cos")?;
                let sin = cpu_slice::<A>(ss, ls, "rope sin")?;
                let o = forward::<T, W, A>(x, [wa, wb], (cos, sin), dims, self.eps);
                T::to_cpu_storage_owned(o)
            }))
        })
    }

    /// (dx, [dw of the first weight, dw of the second]) of the tracked ones.
    fn bwd_all(
        &self,
        x: &Tensor,
        w: [&Tensor; 2],
        grad: &Tensor,
        want_w: [bool; 2],
    ) -> CResult<(Option<Tensor>, [Option<Tensor>; 2])> {
        let grad = grad.contiguous()?;
        let want_x = x.track_op();
        with_cpus(
            [x, w[0], w[1], &grad, &self.table.cos, &self.table.sin],
            |[(sx, lx), (swa, lwa), (swb, lwb), (sg, lg), (sc, lc), (ss, ls)]| {
                let (n, d, dh) = geom(&self.table, lx, &[lwa, lwb])?;
                if sg.dtype() != sx.dtype() || lg.shape() != lx.shape() {
                    return Err(err("norm-rope backward: gradient differs from x"));
                }
                let dims = (n, d, dh, self.first);
                Ok(dispatch_ln!(sx.dtype(), swa.dtype(), |T, W, A| {
                    let xv = cpu_slice::<T>(sx, lx, "norm-rope x")?;
                    let wa = cpu_slice::<W>(swa, lwa, "norm-rope w")?;
                    let wb = cpu_slice::<W>(swb, lwb, "norm-rope w")?;
                    let g = cpu_slice::<T>(sg, lg, "norm-rope grad")?;
                    let cos = cpu_slice::<A>(sc, lc, "rope cos")?;
                    let sin = cpu_slice::<A>(ss, ls, "rope sin")?;
                    let (dx, [da, db]) = backward::<T, W, A>(
                        xv,
                        [wa, wb],
                        g,
                        (cos, sin),
                        dims,
                        self.eps,
                        (want_x, want_w),
                    );
                    let t = (tensor(dx, lx)?, tensor(da, lwa)?, tensor(db, lwb)?);
                    (t.0, [t.1, t.2])
                }))
            },
        )
    }
}

impl CpuOp<2> for NormRope {
    fn name(&self) -> &'static str {
        "norm-rope"
    }

    fn fwd(&self, [(sx, lx), (sw, lw)]: [Cpu<'_>; 2]) -> CResult<(CpuStorage, Shape)> {
        Ok((
            self.forward_on(sx, lx, [(sw, lw), (sw, lw)])?,
            lx.shape().clone(),
        ))
    }

    fn bwd(&self, [x, w]: [&Tensor; 2], _res: &Tensor, grad: &Tensor) -> Grads<2> {
        // Every row takes the second weight (`first` is 0).
        let (dx, [_, dw]) = self.bwd_all(x, [w, w], grad, [false, w.track_op()])?;
        Ok([dx, dw])
    }
}

impl CpuOp<3> for NormRope {
    fn name(&self) -> &'static str {
        "joint-norm-rope"
    }

    fn fwd(&self, [(sx, lx), (sa, la), (sb, lb)]: [Cpu<'_>; 3]) -> CResult<(CpuStorage, Shape)> {
        Ok((
            self.forward_on(sx, lx, [(sa, la), (sb, lb)])?,
            lx.shape().clone(),
        ))
    }

    fn bwd(&self, [x, wa, wb]: [&Tensor; 3], _res: &Tensor, grad: &Tensor) -> Grads<3> {
        let want = [wa.track_op(), wb.track_op()];
        let (dx, [da, db]) = self.bwd_all(x, [wa, wb], grad, want)?;
        Ok([dx, da, db])
    }
}

/// Keeps `DType` in scope for the dispatch macro.
const _: Option<DType> = None;
