//! [`silu_dwconv3x3`]: SiLU followed by a depthwise 3×3 convolution (stride 1, zero padding 1,
//! one filter per channel, with bias) over channels-last tokens, as one custom op
//! ([`SiluDwConv`]): Sana's Mix-FFN (`GLUMBConv`) applies `conv_inverted`'s SiLU and then
//! `conv_depth` (a `Conv2d(2H, 2H, 3, padding=1, groups=2H)`) on the (H/p, W/p) token grid.
//!
//! Composed, the SiLU output (the conv's input) would be kept beside the SiLU's own input, two
//! (b·s, C) tensors; fused, the op keeps only its pre-activation input (its argument) and
//! recomputes the SiLU where the backward needs it. candle's conv2d would also work in NCHW (a
//! transposed copy each way) and its backward does not cover groups.
//!
//! Inputs: x (b·s, C) or (b, s, C) with s = rows·cols, in any float dtype; the weight
//! (C, 1, 3, 3) and bias (C) in any float dtype (f32 master weights are read rounded to x's
//! dtype, as the fused linear reads them). Output: (b·s, C) in x's dtype. Workspace: the
//! weights widened tap-major (9C + C accumulation-type values) in forward; in backward the
//! widened weights (9C) and the per-channel sums of dW and db (10C). Backward returns fresh
//! dx, dW, db for the inputs that track, each in its input's dtype. Budget twin:
//! `ditmem_budget::ditmem_cpu::sana::silu_dwconv`.

use candle_core::{
    backend::BackendStorage, CpuStorage, DType, Device, Layout, Shape, Tensor, WithDType,
};
use rayon::prelude::*;

use super::storage::{cpu_slice, dispatch_float, err, with_cpus, CResult};
use crate::kernels::scalar::{Acc, Elem};
use crate::ops::custom_op::{Cpu, CpuOp, Grads, Op};

/// Accumulation-type elements of the forward workspace for C channels: the budget's
/// `dwconv_elems` (`ditmem_budget::ditmem_cpu::ops`, which lists the buffers; the `ditmem-cpu`
/// runtime predicts by it).
pub(crate) fn dwconv_fwd_scratch(c: usize) -> usize {
    ditmem_budget::ditmem_cpu::ops::dwconv_elems(c as u64).0 as usize
}

/// Accumulation-type elements of the backward workspace for C channels (as
/// [`dwconv_fwd_scratch`]).
pub(crate) fn dwconv_bwd_scratch(c: usize) -> usize {
    ditmem_budget::ditmem_cpu::ops::dwconv_elems(c as u64).1 as usize
}

/// The op (see the module docs): the token grid of each batch entry.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SiluDwConv {
    rows: usize,
    cols: usize,
}

/// SiLU then depthwise 3×3 conv of x (b·s, C) on a `rows × cols` grid per batch entry.
pub(crate) fn silu_dwconv3x3(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    rows: usize,
    cols: usize,
) -> CResult<Tensor> {
    x.apply_op3(w, b, Op(SiluDwConv { rows, cols }))
}

/// (batch, C).
pub(crate) fn dw_geom(
    lx: &Layout,
    lw: &Layout,
    lb: &Layout,
    rows: usize,
    cols: usize,
) -> CResult<(usize, usize)> {
    let n = lx.shape().elem_count();
    let c = *lx.dims().last().unwrap_or(&0);
    let s = rows * cols;
    if c == 0 || s == 0 || !n.is_multiple_of(s * c) {
        return Err(err(format!(
            "depthwise conv: x {:?} is not (b·{rows}·{cols}, C)",
            lx.dims()
        )));
    }
    if lw.dims() != [c, 1, 3, 3] || lb.dims() != [c] {
        return Err(err(format!(
            "depthwise conv: weight {:?} / bias {:?}; expected ({c}, 1, 3, 3) / ({c})",
            lw.dims(),
            lb.dims()
        )));
    }
    if lw.contiguous_offsets().is_none() || lb.contiguous_offsets().is_none() {
        return Err(err("depthwise conv: weight and bias must be contiguous"));
    }
    Ok((n / (s * c), c))
}

/// A float storage under `l` as accumulation-type values, each rounded through `T` (the dtype
/// the op computes in), written into `dst` at `dst[perm(i)]`.
pub(crate) fn widen_rounded<T: Elem<A>, A: Acc>(
    s: &CpuStorage,
    l: &Layout,
    dst: &mut [A],
    perm: impl Fn(usize) -> usize,
) -> CResult<()> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| err("expected a contiguous weight"))?;
    let put = |v: f64| T::from_acc(A::from_f64(v)).to_acc();
    match s {
        CpuStorage::F32(v) => v[a..b]
            .iter()
            .enumerate()
            .for_each(|(i, x)| dst[perm(i)] = put(f64::from(*x))),
        CpuStorage::F64(v) => v[a..b]
            .iter()
            .enumerate()
            .for_each(|(i, x)| dst[perm(i)] = put(*x)),
        CpuStorage::BF16(v) => v[a..b]
            .iter()
            .enumerate()
            .for_each(|(i, x)| dst[perm(i)] = put(x.to_f64())),
        CpuStorage::F16(v) => v[a..b]
            .iter()
            .enumerate()
            .for_each(|(i, x)| dst[perm(i)] = put(x.to_f64())),
        other => return Err(err(format!("unsupported weight dtype {:?}", other.dtype()))),
    }
    Ok(())
}

/// Accumulation-type values (an iterator of `shape`'s count) as a fresh tensor of `dt`.
pub(crate) fn narrow_to<A: Acc + Into<f64>>(
    v: impl Iterator<Item = A>,
    dt: DType,
    shape: &Shape,
) -> CResult<Tensor> {
    let dev = Device::Cpu;
    match dt {
        DType::F32 => Tensor::from_vec(v.map(|x| x.into() as f32).collect::<Vec<_>>(), shape, &dev),
        DType::F64 => Tensor::from_vec(v.map(|x| x.into()).collect::<Vec<f64>>(), shape, &dev),
        DType::BF16 => Tensor::from_vec(
            v.map(|x| half::bf16::from_f64(x.into()))
                .collect::<Vec<_>>(),
            shape,
            &dev,
        ),
        DType::F16 => Tensor::from_vec(
            v.map(|x| half::f16::from_f64(x.into())).collect::<Vec<_>>(),
            shape,
            &dev,
        ),
        other => Err(err(format!("unsupported gradient dtype {other:?}"))),
    }
}

#[inline]
fn sigmoid<A: Acc>(x: A) -> A {
    let one = A::from_f64(1.0);
    one / (one + (A::ZERO - x).exp())
}

#[inline]
fn silu<A: Acc>(x: A) -> A {
    x * sigmoid(x)
}

#[inline]
fn silu_deriv<A: Acc>(x: A) -> A {
    let one = A::from_f64(1.0);
    let s = sigmoid(x);
    s * (one + x * (one - s))
}

/// The taps (dy, dx) ∈ {−1, 0, 1}² in the weight's order (row-major over the 3×3 kernel).
const TAPS: [(isize, isize); 9] = [
    (-1, -1),
    (-1, 0),
    (-1, 1),
    (0, -1),
    (0, 0),
    (0, 1),
    (1, -1),
    (1, 0),
    (1, 1),
];

/// The token grid of a batch: b entries of rows × cols tokens, c channels each.
pub(crate) struct Grid {
    pub(crate) b: usize,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) c: usize,
}

impl Grid {
    /// The token of (batch, row + dy, col + dx), if inside the grid.
    #[inline]
    fn at(&self, bi: usize, r: usize, col: usize, (dy, dx): (isize, isize)) -> Option<usize> {
        let (rr, cc) = (r as isize + dy, col as isize + dx);
        if rr < 0 || cc < 0 || rr >= self.rows as isize || cc >= self.cols as isize {
            return None;
        }
        Some((bi * self.rows + rr as usize) * self.cols + cc as usize)
    }
}

/// out[t, ch] = b[ch] + Σ_taps w[ch, tap]·silu(x[t + tap, ch]).
pub(crate) fn dw_fwd<T: Elem<A> + Send + Sync, A: Acc + Send + Sync>(
    x: &[T],
    wt: &[A],
    bias: &[A],
    gr: &Grid,
) -> Vec<T> {
    let c = gr.c;
    let mut out: Vec<T> = vec![T::from_acc(A::ZERO); gr.b * gr.rows * gr.cols * c];
    out.par_chunks_mut(gr.cols * c)
        .enumerate()
        .for_each(|(row, orow)| {
            let (bi, r) = (row / gr.rows, row % gr.rows);
            for col in 0..gr.cols {
                let src: [Option<usize>; 9] = TAPS.map(|t| gr.at(bi, r, col, t));
                for ch in 0..c {
                    let mut acc = bias[ch];
                    for (k, s) in src.iter().enumerate() {
                        if let Some(s) = s {
                            acc += wt[k * c + ch] * silu(x[s * c + ch].to_acc());
                        }
                    }
                    orow[col * c + ch] = T::from_acc(acc);
                }
            }
        });
    out
}

/// dx[t, ch] = silu'(x[t, ch])·Σ_taps w[ch, tap]·g[t − tap, ch], written over x: token t's dx
/// reads x at t only (the neighbours enter through g), so x can be the destination. The fused
/// Mix-FFN writes df1 over its kept f1 this way; the op below over a copy of x.
pub(crate) fn dw_dx_over<T: Elem<A> + Send + Sync, A: Acc + Send + Sync>(
    x: &mut [T],
    g: &[T],
    wt: &[A],
    gr: &Grid,
) {
    let c = gr.c;
    x.par_chunks_mut(gr.cols * c)
        .enumerate()
        .for_each(|(row, xrow)| {
            let (bi, r) = (row / gr.rows, row % gr.rows);
            for col in 0..gr.cols {
                let dst: [Option<usize>; 9] = TAPS.map(|(dy, dx)| gr.at(bi, r, col, (-dy, -dx)));
                for ch in 0..c {
                    let mut acc = A::ZERO;
                    for (k, t) in dst.iter().enumerate() {
                        if let Some(t) = t {
                            acc += wt[k * c + ch] * g[t * c + ch].to_acc();
                        }
                    }
                    let xv = xrow[col * c + ch].to_acc();
                    xrow[col * c + ch] = T::from_acc(acc * silu_deriv(xv));
                }
            }
        });
}

/// conv(silu(x)) of x (b·s, C) with the conv's weight and bias storages: the widened weights
/// (tap-major, [`dwconv_fwd_scratch`] accumulation values) live for the call only. Shared by
/// [`SiluDwConv`]'s forward and the fused Mix-FFN (`super::mix_ffn`).
pub(crate) fn silu_dwconv_fwd<T: Elem<A> + Send + Sync, A: Acc + Send + Sync>(
    x: &[T],
    (sw, lw): (&CpuStorage, &Layout),
    (sb, lb): (&CpuStorage, &Layout),
    gr: &Grid,
) -> CResult<Vec<T>> {
    let c = gr.c;
    let mut ws: Vec<A> = vec![A::ZERO; dwconv_fwd_scratch(c)];
    let (wt, bias) = ws.split_at_mut(9 * c);
    // Weight (C, 1, 3, 3) row-major → tap-major (9, C).
    widen_rounded::<T, A>(sw, lw, wt, |i| (i % 9) * c + i / 9)?;
    widen_rounded::<T, A>(sb, lb, bias, |i| i)?;
    Ok(dw_fwd::<T, A>(x, wt, bias, gr))
}

/// The workspace of the conv's backward ([`dwconv_bwd_scratch`] accumulation values): the
/// widened weights, tap-major (9·C, which [`dw_dx_over`] reads), then room for the per-channel
/// sums of [`dwconv_weight_grads`] (10·C).
pub(crate) fn dwconv_bwd_workspace<T: Elem<A>, A: Acc>(
    (sw, lw): (&CpuStorage, &Layout),
    c: usize,
) -> CResult<Vec<A>> {
    let mut ws: Vec<A> = vec![A::ZERO; dwconv_bwd_scratch(c)];
    widen_rounded::<T, A>(sw, lw, &mut ws[..9 * c], |i| (i % 9) * c + i / 9)?;
    Ok(ws)
}

/// The conv's dW and db, as `want` = (w, b) asks, from x and g: summed per channel into the
/// workspace's tail ([`dwconv_bwd_workspace`]), then narrowed to fresh tensors of the weight's
/// and the bias's dtype and shape. Shared by [`SiluDwConv`]'s backward and the fused Mix-FFN.
#[allow(clippy::type_complexity)]
pub(crate) fn dwconv_weight_grads<T, A>(
    (x, g): (&[T], &[T]),
    ws: &mut [A],
    (w, b): (&Tensor, &Tensor),
    (want_w, want_b): (bool, bool),
    gr: &Grid,
) -> CResult<(Option<Tensor>, Option<Tensor>)>
where
    T: Elem<A> + Send + Sync,
    A: Acc + Send + Sync + Into<f64>,
{
    let c = gr.c;
    if !(want_w || want_b) {
        return Ok((None, None));
    }
    let acc = &mut ws[9 * c..];
    dw_dw::<T, A>(x, g, gr, acc);
    // (C, 10) → (C, 1, 3, 3); the tenth column is db.
    let dw = want_w
        .then(|| {
            narrow_to(
                (0..9 * c).map(|i| acc[(i / 9) * 10 + i % 9]),
                w.dtype(),
                w.shape(),
            )
        })
        .transpose()?;
    let db = want_b
        .then(|| narrow_to((0..c).map(|ch| acc[ch * 10 + 9]), b.dtype(), b.shape()))
        .transpose()?;
    Ok((dw, db))
}

/// Per channel: dW[ch, tap] = Σ_t g[t, ch]·silu(x[t + tap, ch]) and db[ch] = Σ_t g[t, ch], into
/// `acc` laid out (C, 10) (the tenth column is db).
pub(crate) fn dw_dw<T: Elem<A> + Send + Sync, A: Acc + Send + Sync>(
    x: &[T],
    g: &[T],
    gr: &Grid,
    acc: &mut [A],
) {
    let c = gr.c;
    const CB: usize = 16;
    acc.par_chunks_mut(10 * CB)
        .enumerate()
        .for_each(|(blk, a)| {
            a.iter_mut().for_each(|v| *v = A::ZERO);
            let c0 = blk * CB;
            let nc = a.len() / 10;
            for bi in 0..gr.b {
                for r in 0..gr.rows {
                    for col in 0..gr.cols {
                        let t = (bi * gr.rows + r) * gr.cols + col;
                        let src: [Option<usize>; 9] = TAPS.map(|tp| gr.at(bi, r, col, tp));
                        for j in 0..nc {
                            let ch = c0 + j;
                            let gv = g[t * c + ch].to_acc();
                            for (k, s) in src.iter().enumerate() {
                                if let Some(s) = s {
                                    a[j * 10 + k] += gv * silu(x[s * c + ch].to_acc());
                                }
                            }
                            a[j * 10 + 9] += gv;
                        }
                    }
                }
            }
        });
}

impl CpuOp<3> for SiluDwConv {
    fn name(&self) -> &'static str {
        "silu-dwconv3x3"
    }

    fn fwd(&self, [(sx, lx), (sw, lw), (sb, lb)]: [Cpu<'_>; 3]) -> CResult<(CpuStorage, Shape)> {
        let (b, c) = dw_geom(lx, lw, lb, self.rows, self.cols)?;
        let gr = Grid {
            b,
            rows: self.rows,
            cols: self.cols,
            c,
        };
        let n = "depthwise conv";
        let out = dispatch_float!(sx.dtype(), n, |T, A| {
            let x = cpu_slice::<T>(sx, lx, n)?;
            T::to_cpu_storage_owned(silu_dwconv_fwd::<T, A>(x, (sw, lw), (sb, lb), &gr)?)
        });
        Ok((out, Shape::from((b * self.rows * self.cols, c))))
    }

    fn bwd(&self, [x, w, bias]: [&Tensor; 3], _res: &Tensor, grad: &Tensor) -> Grads<3> {
        let grad = grad.contiguous()?;
        let (tx, tw, tb) = (x.track_op(), w.track_op(), bias.track_op());
        let n = "depthwise conv backward";
        with_cpus([x, w, &grad], |[(sx, lx), (sw, lw), (sg, lg)]| {
            let (b, c) = dw_geom(lx, lw, bias.layout(), self.rows, self.cols)?;
            let gr = Grid {
                b,
                rows: self.rows,
                cols: self.cols,
                c,
            };
            let dev = Device::Cpu;
            Ok(dispatch_float!(sx.dtype(), n, |T, A| {
                let xv = cpu_slice::<T>(sx, lx, n)?;
                let gv = cpu_slice::<T>(sg, lg, n)?;
                let mut ws = dwconv_bwd_workspace::<T, A>((sw, lw), c)?;
                let dx = if tx {
                    let mut dx = xv.to_vec();
                    dw_dx_over::<T, A>(&mut dx, gv, &ws[..9 * c], &gr);
                    Some(Tensor::from_vec(dx, lx.shape(), &dev)?)
                } else {
                    None
                };
                let (dw, db) = dwconv_weight_grads((xv, gv), &mut ws, (w, bias), (tw, tb), &gr)?;
                drop(ws);
                [dx, dw, db]
            }))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::test_values::{grads_against, max_abs_diff};
    use candle_core::{Device, Var};

    fn data(n: usize, salt: f64) -> Vec<f64> {
        (0..n)
            .map(|i| (i as f64 * 0.613 + salt).sin() * 1.7)
            .collect()
    }

    /// SiLU then the depthwise conv composed from candle ops in f64 (zero-padded grid, one
    /// shifted slice per tap): x (b, R, W, C) → (b·R·W, C).
    fn reference(x: &Tensor, w: &Tensor, bias: &Tensor, b: usize, r: usize, wd: usize) -> Tensor {
        let c = bias.dim(0).unwrap();
        let a = x.silu().unwrap().reshape((b, r, wd, c)).unwrap();
        let p = a
            .pad_with_zeros(1, 1, 1)
            .unwrap()
            .pad_with_zeros(2, 1, 1)
            .unwrap();
        let wt = w.reshape((c, 9)).unwrap();
        let mut out = bias
            .reshape((1, 1, 1, c))
            .unwrap()
            .broadcast_as((b, r, wd, c))
            .unwrap()
            .contiguous()
            .unwrap();
        for k in 0..9 {
            let (dy, dx) = (k / 3, k % 3);
            let sl = p.narrow(1, dy, r).unwrap().narrow(2, dx, wd).unwrap();
            let wk = wt.narrow(1, k, 1).unwrap().reshape((1, 1, 1, c)).unwrap();
            out = (out + sl.broadcast_mul(&wk).unwrap()).unwrap();
        }
        out.reshape((b * r * wd, c)).unwrap()
    }

    /// Output and dx, dW, db match the composed reference on an odd, non-square grid.
    #[test]
    fn silu_dwconv_matches_composed_reference() {
        let dev = Device::Cpu;
        let (b, r, wd, c) = (2, 3, 5, 20);
        let x = Var::from_tensor(
            &Tensor::from_vec(data(b * r * wd * c, 0.3), (b * r * wd, c), &dev).unwrap(),
        )
        .unwrap();
        let w = Var::from_tensor(&Tensor::from_vec(data(c * 9, 1.1), (c, 1, 3, 3), &dev).unwrap())
            .unwrap();
        let bias = Var::from_tensor(&Tensor::from_vec(data(c, 2.2), c, &dev).unwrap()).unwrap();
        let gw = Tensor::from_vec(data(b * r * wd * c, 4.4), (b * r * wd, c), &dev).unwrap();
        let re = reference(x.as_tensor(), w.as_tensor(), bias.as_tensor(), b, r, wd);
        let rg = grads_against(&re, &gw);
        let o = silu_dwconv3x3(x.as_tensor(), w.as_tensor(), bias.as_tensor(), r, wd).unwrap();
        let diff = max_abs_diff(&o, &re);
        assert!(diff < 1e-12, "{diff}");
        let g = grads_against(&o, &gw);
        for v in [&x, &w, &bias] {
            let (ge, gr) = (
                g.get(v.as_tensor()).unwrap(),
                rg.get(v.as_tensor()).unwrap(),
            );
            let diff = max_abs_diff(ge, gr);
            assert!(diff < 1e-11, "{diff}");
        }
    }
}
