//! [`ln_modulate`]: LayerNorm fused with the adaLN modulation, `LN(x)·(1 + scale) + shift`,
//! written directly in the compute dtype as the (b·s, D) rows the next linear takes. It saves x
//! (its argument) and the per-row mean and rstd in the accumulation type (f32, f64 for f64
//! inputs), 2·rows values held by the op; backward returns dx, dshift, dscale. Budget twin: the
//! `ln_modulate` rule of `ditmem_budget::ditmem_cpu::ops`.

use candle_core::{
    backend::BackendStorage, CpuStorage, DType, Device, Layout, Shape, Tensor, WithDType,
};
use rayon::prelude::*;

use super::storage::{
    cpu_slice, dispatch_ln, err, par_rows, rows_view, with_cpus, CResult, PAR_CHUNK,
};
use crate::kernels::scalar::{Acc, Elem};
use crate::ops::custom_op::{Cpu, CpuOp, Grads, Op};
use crate::ops::storage::Saved;

/// `LN(x)·(1 + scale) + shift` (no affine of its own, eps inside the square root) over x (b, s, D)
/// with shift, scale (b, D); the output is written in `out` dtype as rows (b·s, D).
#[derive(Debug)]
pub(crate) struct LnModulate {
    out: DType,
    eps: f64,
    /// Per-row statistics kept for the backward: (mean, rstd) interleaved, 2·rows values in the
    /// accumulation type.
    stats: Saved,
}

/// Fused LayerNorm + modulate, differentiable in x, shift and scale (see the module docs).
pub fn ln_modulate(
    x: &Tensor,
    shift: &Tensor,
    scale: &Tensor,
    eps: f64,
    out: DType,
) -> CResult<Tensor> {
    x.apply_op3(
        shift,
        scale,
        Op(LnModulate {
            out,
            eps,
            stats: Saved::default(),
        }),
    )
}

/// Geometry of the LayerNorm kernels: x is (b, s, d) contiguous, row
/// `i` of shift/scale starts at `offset + i·row_stride` of its storage.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LnGeom {
    pub b: usize,
    pub s: usize,
    pub d: usize,
    /// (offset, row stride) of shift and scale.
    pub shift: (usize, usize),
    pub scale: (usize, usize),
}

fn ln_geom(lx: &Layout, lsh: &Layout, lsc: &Layout) -> CResult<LnGeom> {
    let (b, s, d) = match lx.dims() {
        &[b, s, d] => (b, s, d),
        dims => {
            return Err(err(format!(
                "ln_modulate expects x of shape (b, s, D), got {dims:?}"
            )))
        }
    };
    Ok(LnGeom {
        b,
        s,
        d,
        shift: rows_view(lsh, b, d, "ln_modulate shift")?,
        scale: rows_view(lsc, b, d, "ln_modulate scale")?,
    })
}

/// Forward kernel: returns y (b·s·D in `O`) and the interleaved (mean, rstd) per row.
pub(crate) fn ln_modulate_fwd_cpu<T, O, A>(
    x: &[T],
    shift: &[T],
    scale: &[T],
    g: &LnGeom,
    eps: f64,
) -> (Vec<O>, Vec<A>)
where
    T: Elem<A> + Send + Sync,
    O: Elem<A> + Send + Sync,
    A: Acc + Send + Sync,
    half::bf16: Elem<A>,
{
    let (s, d) = (g.s, g.d);
    let rows = g.b * s;
    // The planted bug: when bf16 is involved (bf16 input, or a bf16 output under bf16-mixed)
    // the statistics are accumulated and kept in bf16.
    let bf16_name = std::any::type_name::<half::bf16>();
    let stats_bf16 = crate::mutation::active(crate::mutation::Mutation::LayerNormStatsBf16)
        && (std::any::type_name::<T>() == bf16_name || std::any::type_name::<O>() == bf16_name);
    let mut y: Vec<O> = vec![O::from_acc(A::ZERO); rows * d];
    let mut st: Vec<A> = vec![A::ZERO; 2 * rows];
    let inv_d = A::from_f64(1.0 / d as f64);
    let eps = A::from_f64(eps);
    y.par_chunks_mut(d)
        .zip(st.par_chunks_mut(2))
        .enumerate()
        .with_min_len((PAR_CHUNK / d.max(1)).max(1))
        .for_each(|(r, (yr, sr))| {
            let bi = r / s;
            let xr = &x[r * d..(r + 1) * d];
            let sh = &shift[g.shift.0 + bi * g.shift.1..][..d];
            let sc = &scale[g.scale.0 + bi * g.scale.1..][..d];
            if stats_bf16 {
                let (mean, rstd) = bf16_stats(xr, inv_d, eps);
                modulate_row((xr, sh, sc), (mean, rstd), yr);
                (sr[0], sr[1]) = (mean, rstd);
            } else {
                (sr[0], sr[1]) = fwd_row((xr, sh, sc), (inv_d, eps), yr);
            }
        });
    (y, st)
}

/// The planted bug's statistics: accumulated and kept in bf16, the variance in one pass
/// (E[x²] − mean²) as a bf16 kernel would.
fn bf16_stats<T: Elem<A>, A: Acc>(xr: &[T], inv_d: A, eps: A) -> (A, A)
where
    half::bf16: Elem<A>,
{
    let r16 = |v: A| -> A { <half::bf16 as Elem<A>>::from_acc(v).to_acc() };
    let mut sum = A::ZERO;
    for v in xr {
        sum = r16(sum + v.to_acc());
    }
    let mean = r16(sum * inv_d);
    let mut var = A::ZERO;
    for v in xr {
        var = r16(var + r16(v.to_acc() * v.to_acc()));
    }
    var = r16(var - r16(r16(mean * mean) * A::from_f64(xr.len() as f64)));
    (mean, r16(A::from_f64(1.0) / (var * inv_d + eps).sqrt()))
}

/// Lanes of the row sums: each row's sums run as [`LANES`] interleaved partial sums added
/// pairwise at the end. A single running sum is a chain of d dependent additions (384 at
/// DiT-S/2, four cycles each), which was most of the LayerNorm's time; the partial sums are
/// independent chains the CPU overlaps, and no less accurate.
const LANES: usize = 8;

/// Σ f(j) for j < n in [`LANES`] partial sums (see there), in a fixed order: the same bits on
/// every CPU and in every build.
#[inline(always)]
fn lane_sum<A: Acc>(n: usize, f: impl Fn(usize) -> A) -> A {
    let mut p = [A::ZERO; LANES];
    let whole = n / LANES * LANES;
    for j0 in (0..whole).step_by(LANES) {
        for (l, pl) in p.iter_mut().enumerate() {
            *pl += f(j0 + l);
        }
    }
    for j in whole..n {
        p[j - whole] += f(j);
    }
    ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7]))
}

/// One row of the forward: mean and rstd by lane sums (the variance about the mean, two
/// passes), then the modulated output. In the build for this CPU (the row body is generic
/// scalar code the compiler vectorises for the features it may use).
#[inline]
fn fwd_row<T: Elem<A>, O: Elem<A>, A: Acc>(
    row: (&[T], &[T], &[T]),
    (inv_d, eps): (A, A),
    yr: &mut [O],
) -> (A, A) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::vecmath::avx512() {
        // SAFETY: `vecmath::avx512` is true only where the CPU has every feature enabled
        // here; the function has no other precondition.
        return unsafe { fwd_row_avx512(row, (inv_d, eps), yr) };
    }
    fwd_row_body(row, (inv_d, eps), yr)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn fwd_row_avx512<T: Elem<A>, O: Elem<A>, A: Acc>(
    row: (&[T], &[T], &[T]),
    st: (A, A),
    yr: &mut [O],
) -> (A, A) {
    fwd_row_body(row, st, yr)
}

#[inline(always)]
fn fwd_row_body<T: Elem<A>, O: Elem<A>, A: Acc>(
    (xr, sh, sc): (&[T], &[T], &[T]),
    (inv_d, eps): (A, A),
    yr: &mut [O],
) -> (A, A) {
    let d = xr.len();
    let mean = lane_sum(d, |j| xr[j].to_acc()) * inv_d;
    let var = lane_sum(d, |j| {
        let c = xr[j].to_acc() - mean;
        c * c
    });
    let rstd = A::from_f64(1.0) / (var * inv_d + eps).sqrt();
    modulate_row((xr, sh, sc), (mean, rstd), yr);
    (mean, rstd)
}

/// y = (x − mean)·rstd·(1 + scale) + shift over one row.
#[inline(always)]
fn modulate_row<T: Elem<A>, O: Elem<A>, A: Acc>(
    (xr, sh, sc): (&[T], &[T], &[T]),
    (mean, rstd): (A, A),
    yr: &mut [O],
) {
    let one = A::from_f64(1.0);
    for j in 0..xr.len() {
        let xh = (xr[j].to_acc() - mean) * rstd;
        yr[j] = O::from_acc(xh * (one + sc[j].to_acc()) + sh[j].to_acc());
    }
}

/// Backward kernel: dx (b·s·d), dshift (b·d), dscale (b·d), all fresh, in x's type.
/// With ĝ = g·(1 + scale) and x̂ = (x − mean)·rstd: dshift = Σ_s g, dscale = Σ_s g·x̂,
/// dx = rstd·(ĝ − mean(ĝ) − x̂·mean(ĝ·x̂)).
pub(crate) fn ln_modulate_bwd_cpu<T, O, A>(
    x: &[T],
    shift_scale: (&[T], &[T]),
    gy: &[O],
    st: &[A],
    g: &LnGeom,
) -> (Vec<T>, Vec<T>, Vec<T>)
where
    T: Elem<A> + Send + Sync,
    O: Elem<A> + Send + Sync,
    A: Acc + Send + Sync,
{
    let (_, scale) = shift_scale;
    let (s, d) = (g.s, g.d);
    let rows = g.b * s;
    let inv_d = A::from_f64(1.0 / d as f64);
    let dx = par_rows(T::from_acc(A::ZERO), (rows, d), |r, dxr| {
        let bi = r / s;
        let xr = &x[r * d..(r + 1) * d];
        let gr = &gy[r * d..(r + 1) * d];
        let sc = &scale[g.scale.0 + bi * g.scale.1..][..d];
        bwd_row((xr, gr, sc), (st[2 * r], st[2 * r + 1], inv_d), dxr);
    });
    // dshift, dscale: column sums over the s rows of each batch entry, in column blocks so both
    // a small batch and a wide model parallelise.
    const COLS: usize = 64;
    let mut dsh: Vec<T> = vec![T::from_acc(A::ZERO); g.b * d];
    let mut dsc: Vec<T> = vec![T::from_acc(A::ZERO); g.b * d];
    let blocks_per_row = d.div_ceil(COLS);
    dsh.par_chunks_mut(d)
        .zip(dsc.par_chunks_mut(d))
        .enumerate()
        .for_each(|(bi, (shr, scr))| {
            shr.par_chunks_mut(COLS)
                .zip(scr.par_chunks_mut(COLS))
                .enumerate()
                .with_min_len((blocks_per_row / 8).max(1))
                .for_each(|(cb, (shc, scc))| {
                    let j0 = cb * COLS;
                    let w = shc.len();
                    let mut acc_sh = [A::ZERO; COLS];
                    let mut acc_sc = [A::ZERO; COLS];
                    for si in 0..s {
                        let r = bi * s + si;
                        let (mean, rstd) = (st[2 * r], st[2 * r + 1]);
                        let xr = &x[r * d + j0..r * d + j0 + w];
                        let gr = &gy[r * d + j0..r * d + j0 + w];
                        for j in 0..w {
                            let gv = gr[j].to_acc();
                            acc_sh[j] += gv;
                            acc_sc[j] += gv * ((xr[j].to_acc() - mean) * rstd);
                        }
                    }
                    for j in 0..w {
                        shc[j] = T::from_acc(acc_sh[j]);
                        scc[j] = T::from_acc(acc_sc[j]);
                    }
                });
        });
    (dx, dsh, dsc)
}

/// One row of dx: with ĝ = g·(1 + scale) and x̂ = (x − mean)·rstd, the row means of ĝ and
/// ĝ·x̂ by lane sums ([`lane_sum`]), then dx = rstd·(ĝ − mean(ĝ) − x̂·mean(ĝ·x̂)). In the build
/// for this CPU, like [`fwd_row`].
#[inline]
fn bwd_row<T: Elem<A>, O: Elem<A>, A: Acc>(row: (&[T], &[O], &[T]), st: (A, A, A), dxr: &mut [T]) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::vecmath::avx512() {
        // SAFETY: `vecmath::avx512` is true only where the CPU has every feature enabled
        // here; the function has no other precondition.
        return unsafe { bwd_row_avx512(row, st, dxr) };
    }
    bwd_row_body(row, st, dxr)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn bwd_row_avx512<T: Elem<A>, O: Elem<A>, A: Acc>(
    row: (&[T], &[O], &[T]),
    st: (A, A, A),
    dxr: &mut [T],
) {
    bwd_row_body(row, st, dxr)
}

#[inline(always)]
fn bwd_row_body<T: Elem<A>, O: Elem<A>, A: Acc>(
    (xr, gr, sc): (&[T], &[O], &[T]),
    (mean, rstd, inv_d): (A, A, A),
    dxr: &mut [T],
) {
    let one = A::from_f64(1.0);
    let gh = |j: usize| gr[j].to_acc() * (one + sc[j].to_acc());
    let xh = |j: usize| (xr[j].to_acc() - mean) * rstd;
    let a = lane_sum(xr.len(), gh) * inv_d;
    let bsum = lane_sum(xr.len(), |j| gh(j) * xh(j)) * inv_d;
    for (j, dx) in dxr.iter_mut().enumerate() {
        *dx = T::from_acc(rstd * (gh(j) - a - xh(j) * bsum));
    }
}

impl CpuOp<3> for LnModulate {
    fn name(&self) -> &'static str {
        "layer-norm-modulate"
    }

    fn fwd(
        &self,
        [(sx, lx), (ssh, lsh), (ssc, lsc)]: [Cpu<'_>; 3],
    ) -> CResult<(CpuStorage, Shape)> {
        let g = ln_geom(lx, lsh, lsc)?;
        if ssh.dtype() != sx.dtype() || ssc.dtype() != sx.dtype() {
            return Err(err("ln_modulate: x, shift and scale must share one dtype"));
        }
        let (out, stats) = dispatch_ln!(sx.dtype(), self.out, |T, O, A| {
            let x = cpu_slice::<T>(sx, lx, "ln_modulate x")?;
            let sh = ssh.as_slice::<T>()?;
            let sc = ssc.as_slice::<T>()?;
            let (y, st) = ln_modulate_fwd_cpu::<T, O, A>(x, sh, sc, &g, self.eps);
            (O::to_cpu_storage_owned(y), A::to_cpu_storage_owned(st))
        });
        *self.stats.lock("ln stats lock poisoned")? = Some(stats);
        // Rows (b·s, D), the layout the following linear takes: no reshape node (whose backward
        // would add a zeros + add of the output's size).
        Ok((out, Shape::from((g.b * g.s, g.d))))
    }

    fn bwd(&self, [x, shift, scale]: [&Tensor; 3], _res: &Tensor, grad: &Tensor) -> Grads<3> {
        let guard = self.stats.lock("ln stats lock poisoned")?;
        let stats = guard
            .as_ref()
            .ok_or_else(|| err("ln_modulate backward before forward"))?;
        let grad = grad.contiguous()?;
        let (dx, dsh, dsc) = with_cpus(
            [x, shift, scale, &grad],
            |[(sx, lx), (ssh, lsh), (ssc, lsc), (sg, lg)]| {
                let g = ln_geom(lx, lsh, lsc)?;
                Ok(dispatch_ln!(sx.dtype(), self.out, |T, O, A| {
                    let st = stats.as_slice::<A>()?;
                    let (dx, dsh, dsc) = ln_modulate_bwd_cpu::<T, O, A>(
                        cpu_slice::<T>(sx, lx, "ln_modulate x")?,
                        (ssh.as_slice::<T>()?, ssc.as_slice::<T>()?),
                        cpu_slice::<O>(sg, lg, "ln_modulate grad")?,
                        st,
                        &g,
                    );
                    let dev = Device::Cpu;
                    (
                        Tensor::from_vec(dx, lx.shape(), &dev)?,
                        Tensor::from_vec(dsh, lsh.shape(), &dev)?,
                        Tensor::from_vec(dsc, lsc.shape(), &dev)?,
                    )
                }))
            },
        )?;
        // Only inputs that track get a gradient: candle would otherwise keep the others' in its
        // gradient store until the store is dropped.
        let keep = |t: &Tensor, d: Tensor| t.track_op().then_some(d);
        Ok([keep(x, dx), keep(shift, dsh), keep(scale, dsc)])
    }
}
