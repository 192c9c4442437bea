//! Fused operations with their own backward, as candle custom ops.
//!
//! Candle's autograd keeps every node of a composed op alive, and its backward rules build each
//! gradient from tracked forward tensors, so a composed GELU or LayerNorm leaves a chain of
//! token-sized temporaries in the gradient store. The ops here keep only what their backward
//! needs and return fresh, untracked gradients computed by plain loops, so nothing chains:
//!
//! - [`gelu_tanh`]: GELU with the tanh approximation. Saves its input only (which the graph holds
//!   anyway as the op's argument); the derivative is analytic with the exact constants.
//! - [`ln_modulate`]: `LN(x)·(1 + scale) + shift` with the result written directly in the compute
//!   dtype, as the (b·s, D) rows the next linear takes. Saves x (its argument) and the per-row mean and rstd in the accumulation type
//!   (f32, f64 for f64 inputs), 2·rows values held by the op; backward returns dx, dshift, dscale.
//! - [`linear`]: `x·Wᵀ + b` as one node (candle keeps the product and the sum), gemm in place on
//!   f32/f64; on bf16 the AVX512-BF16 kernel of [`crate::gemm_bf16`] where the CPU has it,
//!   otherwise (and on f16) widened to f32 by row chunks.
//! - [`qkv_attention`]: attention read in place from the qkv projection (no splits or copies),
//!   keeping P (materialized), nothing (attention-only recompute) or the log-sum-exp
//!   (memory-efficient, streaming over key blocks); the softmax is fused and accumulates in f32.
//!
//! - [`linear_sunk`] / [`GradSink`]: the linear with W and b untracked, dW and db handed to the
//!   trainer instead of candle's store (no `zeros_like` + `add` per weight).
//! - [`backward_from`]: backpropagation from a segment's output with its known gradient (no
//!   composed `sum(out · grad)` root); [`sum_squares`]: the gradient norm without a squared copy.
//!
//! Every kernel is a free function over slices (`*_cpu`) called from `cpu_fwd` / `bwd`, so a CUDA
//! kernel can be added beside it (`cuda_fwd`) without touching the graph side.
//!
//! Allocation rules the budget mirrors (`ditmem_budget::ditmem_cpu::graph::Kind::Custom`): the forward
//! allocates its output, what the op saves, and a workspace freed before it returns; the backward
//! allocates one fresh gradient per input that tracks, in the input's dtype and shape, beside a
//! workspace freed before it returns. The workspace sizes are public functions here
//! ([`AttnGeom::fwd_scratch`], [`linear_bwd_scratch`], …) and are restated in the budget.

use std::sync::{Arc, Mutex};

use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp1, CustomOp3, DType, Device, Layout, Shape,
    Storage, Tensor, WithDType,
};
use rayon::prelude::*;

use crate::attention::{err, Acc, Elem};
use crate::gemm_bf16;
use crate::vecmath;

type CResult<T> = candle_core::Result<T>;

/// Elements per parallel work item of the elementwise kernels (big enough to amortise rayon's
/// scheduling, small enough to balance two to a few dozen threads).
const PAR_CHUNK: usize = 1 << 14;

// ---------------------------------------------------------------------------------------------
// Storage helpers.

/// The contiguous slice of a CPU storage under `l`.
fn cpu_slice<'a, T: WithDType>(s: &'a CpuStorage, l: &Layout, what: &str) -> CResult<&'a [T]> {
    let v = s.as_slice::<T>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => Err(err(format!("{what}: expected a contiguous tensor"))),
    }
}

/// Runs `f` on the CPU storage and layout of `t`.
fn with_cpu<R>(t: &Tensor, f: impl FnOnce(&CpuStorage, &Layout) -> CResult<R>) -> CResult<R> {
    let (st, l) = t.storage_and_layout();
    match &*st {
        Storage::Cpu(c) => f(c, l),
        _ => Err(err("fused ops: only CPU tensors have a kernel so far")),
    }
}

/// A (rows, d) matrix view with unit column stride: (start offset, row stride). The adaLN chunks
/// are `narrow` views of a (b, 6D) tensor, so rows are 6D apart.
fn rows_view(l: &Layout, rows: usize, d: usize, what: &str) -> CResult<(usize, usize)> {
    match (l.dims(), l.stride()) {
        (&[r, c], &[rs, 1]) if r == rows && c == d => Ok((l.start_offset(), rs)),
        (&[r, c], &[_, 1]) if r == rows && c == d && r == 1 => Ok((l.start_offset(), d)),
        (dims, stride) => Err(err(format!(
            "{what}: expected a ({rows}, {d}) matrix with unit column stride, got dims {dims:?} stride {stride:?}"
        ))),
    }
}

// ---------------------------------------------------------------------------------------------
// GELU (tanh approximation).

/// √(2/π).
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of the tanh approximation.
const GELU_C: f64 = 0.044_715;

/// gelu(x) = ½x(1 + tanh u) with u = √(2/π)(x + c·x³). Since ½(1 + tanh u) = σ(2u), it is computed
/// as x·σ(2u) = x / (1 + e^(−2u)): one `exp` instead of libm's `tanh` (which goes through
/// `expm1` and dominated the MLP's time), and no cancellation where 1 + tanh u is tiny.
#[inline]
fn gelu_val<A: Acc>(x: A) -> A {
    let k2 = A::from_f64(-2.0 * SQRT_2_OVER_PI);
    let c = A::from_f64(GELU_C);
    let one = A::from_f64(1.0);
    x / (one + (k2 * x * (one + c * x * x)).exp())
}

/// d gelu / dx = ½(1 + t) + ½·x·(1 − t²)·√(2/π)·(1 + 3c·x²), t = tanh u; with σ = σ(2u) = ½(1 + t)
/// and ½(1 − t²) = 2σ(1 − σ) this is σ + 2xσ(1 − σ)·√(2/π)·(1 + 3c·x²).
#[inline]
fn gelu_deriv<A: Acc>(x: A) -> A {
    let k = A::from_f64(SQRT_2_OVER_PI);
    let k2 = A::from_f64(-2.0 * SQRT_2_OVER_PI);
    let c = A::from_f64(GELU_C);
    let one = A::from_f64(1.0);
    let two = A::from_f64(2.0);
    let three_c = A::from_f64(3.0 * GELU_C);
    let sig = one / (one + (k2 * x * (one + c * x * x)).exp());
    sig + two * x * sig * (one - sig) * k * (one + three_c * x * x)
}

/// gelu on the f32 path, with the vectorised [`vecmath::exp`] (same formula as [`gelu_val`]).
#[inline(always)]
fn gelu_f32(x: f32) -> f32 {
    const K2: f32 = (-2.0 * SQRT_2_OVER_PI) as f32;
    const C: f32 = GELU_C as f32;
    x / (1.0 + vecmath::exp(K2 * x * (1.0 + C * x * x)))
}

/// g · gelu'(x) on the f32 path (same formula as [`gelu_deriv`]).
#[inline(always)]
fn gelu_grad_f32(x: f32, g: f32) -> f32 {
    const K: f32 = SQRT_2_OVER_PI as f32;
    const K2: f32 = (-2.0 * SQRT_2_OVER_PI) as f32;
    const C: f32 = GELU_C as f32;
    const C3: f32 = (3.0 * GELU_C) as f32;
    let sig = 1.0 / (1.0 + vecmath::exp(K2 * x * (1.0 + C * x * x)));
    g * (sig + 2.0 * x * sig * (1.0 - sig) * K * (1.0 + C3 * x * x))
}

/// Forward kernel on f64 (the reference path): one fresh output of x's length.
fn gelu_fwd_f64(x: &[f64]) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    x.par_iter()
        .with_min_len(PAR_CHUNK)
        .map(|&v| gelu_val(v))
        .collect_into_vec(&mut out);
    out
}

/// Backward kernel on f64: dx = g · gelu'(x), one fresh buffer.
fn gelu_bwd_f64(x: &[f64], g: &[f64]) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    x.par_iter()
        .zip(g.par_iter())
        .with_min_len(PAR_CHUNK)
        .map(|(&v, &gv)| gv * gelu_deriv(v))
        .collect_into_vec(&mut out);
    out
}

/// Forward kernel: one fresh output of x's length (vectorised f32 path, f64 reference path).
fn gelu_fwd_storage(s: &CpuStorage, l: &Layout) -> CResult<CpuStorage> {
    let n = "gelu";
    Ok(match s.dtype() {
        DType::F64 => CpuStorage::F64(gelu_fwd_f64(cpu_slice(s, l, n)?)),
        DType::F32 => CpuStorage::F32(vecmath::map1(cpu_slice::<f32>(s, l, n)?, gelu_f32)),
        DType::BF16 => CpuStorage::BF16(vecmath::map1(cpu_slice::<half::bf16>(s, l, n)?, gelu_f32)),
        DType::F16 => CpuStorage::F16(vecmath::map1(cpu_slice::<half::f16>(s, l, n)?, gelu_f32)),
        other => return Err(err(format!("gelu: unsupported dtype {other:?}"))),
    })
}

/// Backward kernel: dx = g · gelu'(x), one fresh tensor of x's dtype and shape.
fn gelu_bwd_tensor(xs: &CpuStorage, xl: &Layout, gs: &CpuStorage, gl: &Layout) -> CResult<Tensor> {
    let n = "gelu backward";
    let short = || err("gelu backward: gradient shape differs");
    let (shape, dev) = (xl.shape(), &Device::Cpu);
    match xs.dtype() {
        DType::F64 => {
            let (x, g) = (cpu_slice::<f64>(xs, xl, n)?, cpu_slice::<f64>(gs, gl, n)?);
            if x.len() != g.len() {
                return Err(short());
            }
            Tensor::from_vec(gelu_bwd_f64(x, g), shape, dev)
        }
        DType::F32 => {
            let x = cpu_slice::<f32>(xs, xl, n)?;
            let dx = vecmath::map2(x, cpu_slice(gs, gl, n)?, gelu_grad_f32).ok_or_else(short)?;
            Tensor::from_vec(dx, shape, dev)
        }
        DType::BF16 => {
            let x = cpu_slice::<half::bf16>(xs, xl, n)?;
            let dx = vecmath::map2(x, cpu_slice(gs, gl, n)?, gelu_grad_f32).ok_or_else(short)?;
            Tensor::from_vec(dx, shape, dev)
        }
        DType::F16 => {
            let x = cpu_slice::<half::f16>(xs, xl, n)?;
            let dx = vecmath::map2(x, cpu_slice(gs, gl, n)?, gelu_grad_f32).ok_or_else(short)?;
            Tensor::from_vec(dx, shape, dev)
        }
        other => Err(err(format!("gelu backward: unsupported dtype {other:?}"))),
    }
}

/// The GELU-tanh custom op (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
pub struct GeluTanh;

/// GELU with the tanh approximation, differentiable, saving only its input.
pub fn gelu_tanh(x: &Tensor) -> CResult<Tensor> {
    x.apply_op1(GeluTanh)
}

macro_rules! dispatch_float {
    ($dt:expr, $what:expr, |$t:ident, $a:ident| $body:expr) => {
        match $dt {
            DType::F32 => {
                type $t = f32;
                type $a = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                type $a = f64;
                $body
            }
            DType::BF16 => {
                type $t = half::bf16;
                type $a = f32;
                $body
            }
            DType::F16 => {
                type $t = half::f16;
                type $a = f32;
                $body
            }
            other => return Err(err(format!("{}: unsupported dtype {other:?}", $what))),
        }
    };
}

impl CustomOp1 for GeluTanh {
    fn name(&self) -> &'static str {
        "gelu-tanh"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        Ok((gelu_fwd_storage(s, l)?, l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let grad = grad.contiguous()?;
        let dx = with_cpu(arg, |xs, xl| {
            with_cpu(&grad, |gs, gl| gelu_bwd_tensor(xs, xl, gs, gl))
        })?;
        Ok(Some(dx))
    }
}

// ---------------------------------------------------------------------------------------------
// Sum of squares (the gradient norm).

/// Elements per partial sum of [`sum_squares`].
pub const SQUARES_CHUNK: usize = 1 << 16;

/// Σ x² of a tensor in f64, without a squared copy: partial sums of [`SQUARES_CHUNK`] elements
/// in parallel (one f64 each, the only allocation), added in order, so the result does not
/// depend on the thread count or scheduling.
pub fn sum_squares(t: &Tensor) -> CResult<f64> {
    fn partials<T: Copy + Sync>(x: &[T], f: impl Fn(T) -> f64 + Sync) -> f64 {
        let mut parts: Vec<f64> = Vec::with_capacity(x.len().div_ceil(SQUARES_CHUNK));
        x.par_chunks(SQUARES_CHUNK)
            .map(|c| c.iter().map(|&v| f(v) * f(v)).sum::<f64>())
            .collect_into_vec(&mut parts);
        parts.iter().sum()
    }
    let t = t.contiguous()?;
    with_cpu(&t, |st, l| {
        let n = "sum of squares";
        Ok(match st.dtype() {
            DType::F32 => partials(cpu_slice::<f32>(st, l, n)?, f64::from),
            DType::F64 => partials(cpu_slice::<f64>(st, l, n)?, |v| v),
            DType::BF16 => partials(cpu_slice::<half::bf16>(st, l, n)?, |v| v.to_f64()),
            DType::F16 => partials(cpu_slice::<half::f16>(st, l, n)?, |v| v.to_f64()),
            other => return Err(err(format!("{n}: unsupported dtype {other:?}"))),
        })
    })
}

// ---------------------------------------------------------------------------------------------
// Backward from a segment's output with a given upstream gradient.

/// A one-element node on `out` whose backward hands `grad` to `out` as is: the root of a
/// segment's backward when the gradient of its output is already known. The composed root
/// `sum(out · grad)` made an output-sized product in forward, and in backward a zeros + add for
/// the product, the product `1·grad`, a zeros + add for `out`, and the product `1·out` plus its
/// zeros + add for `grad` (kept in the store until it is dropped); this makes only `out`'s
/// zeros + add.
#[derive(Debug)]
struct GradSeed {
    grad: Tensor,
}

impl CustomOp1 for GradSeed {
    fn name(&self) -> &'static str {
        "grad-seed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, _l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let zero = match s.dtype() {
            DType::F32 => CpuStorage::F32(vec![0.0]),
            DType::F64 => CpuStorage::F64(vec![0.0]),
            DType::BF16 => CpuStorage::BF16(vec![half::bf16::ZERO]),
            DType::F16 => CpuStorage::F16(vec![half::f16::ZERO]),
            other => return Err(err(format!("grad seed: unsupported dtype {other:?}"))),
        };
        Ok((zero, Shape::from(())))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, _grad: &Tensor) -> CResult<Option<Tensor>> {
        Ok(Some(self.grad.clone()))
    }
}

/// Backpropagates `grad` (the gradient of `out`, same shape and dtype, untracked) through the
/// graph of `out`.
pub fn backward_from(out: &Tensor, grad: &Tensor) -> CResult<candle_core::backprop::GradStore> {
    if out.shape() != grad.shape() || out.dtype() != grad.dtype() {
        return Err(err(format!(
            "backward: gradient {:?} {:?} does not match the output {:?} {:?}",
            grad.shape(),
            grad.dtype(),
            out.shape(),
            out.dtype()
        )));
    }
    out.apply_op1(GradSeed {
        grad: grad.detach(),
    })?
    .backward()
}

// ---------------------------------------------------------------------------------------------
// LayerNorm fused with the adaLN modulation.

/// Per-row statistics the LayerNorm keeps for backward: (mean, rstd) interleaved, 2·rows values.
#[derive(Debug)]
enum Stats {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// `LN(x)·(1 + scale) + shift` (no affine of its own, eps inside the square root) over x (b, s, D)
/// with shift, scale (b, D); the output is written in `out` dtype as rows (b·s, D).
#[derive(Debug)]
pub struct LnModulate {
    out: DType,
    eps: f64,
    stats: Mutex<Option<Stats>>,
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
        LnModulate {
            out,
            eps,
            stats: Mutex::new(None),
        },
    )
}

/// Geometry of the LayerNorm kernels: x is (b, s, d) contiguous, row
/// `i` of shift/scale starts at `offset + i·row_stride` of its storage.
#[derive(Debug, Clone, Copy)]
pub struct LnGeom {
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
{
    let (s, d) = (g.s, g.d);
    let rows = g.b * s;
    let mut y: Vec<O> = vec![O::from_acc(A::ZERO); rows * d];
    let mut st: Vec<A> = vec![A::ZERO; 2 * rows];
    let inv_d = A::from_f64(1.0 / d as f64);
    let eps = A::from_f64(eps);
    let one = A::from_f64(1.0);
    y.par_chunks_mut(d)
        .zip(st.par_chunks_mut(2))
        .enumerate()
        .with_min_len((PAR_CHUNK / d.max(1)).max(1))
        .for_each(|(r, (yr, sr))| {
            let bi = r / s;
            let xr = &x[r * d..(r + 1) * d];
            let sh = &shift[g.shift.0 + bi * g.shift.1..][..d];
            let sc = &scale[g.scale.0 + bi * g.scale.1..][..d];
            let mut sum = A::ZERO;
            for v in xr {
                sum += v.to_acc();
            }
            let mean = sum * inv_d;
            let mut var = A::ZERO;
            for v in xr {
                let c = v.to_acc() - mean;
                var += c * c;
            }
            let rstd = one / (var * inv_d + eps).sqrt();
            for j in 0..d {
                let xh = (xr[j].to_acc() - mean) * rstd;
                yr[j] = O::from_acc(xh * (one + sc[j].to_acc()) + sh[j].to_acc());
            }
            sr[0] = mean;
            sr[1] = rstd;
        });
    (y, st)
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
    let one = A::from_f64(1.0);
    let mut dx: Vec<T> = vec![T::from_acc(A::ZERO); rows * d];
    dx.par_chunks_mut(d)
        .enumerate()
        .with_min_len((PAR_CHUNK / d.max(1)).max(1))
        .for_each(|(r, dxr)| {
            let bi = r / s;
            let xr = &x[r * d..(r + 1) * d];
            let gr = &gy[r * d..(r + 1) * d];
            let sc = &scale[g.scale.0 + bi * g.scale.1..][..d];
            let (mean, rstd) = (st[2 * r], st[2 * r + 1]);
            let (mut a, mut bsum) = (A::ZERO, A::ZERO);
            for j in 0..d {
                let gh = gr[j].to_acc() * (one + sc[j].to_acc());
                a += gh;
                bsum += gh * ((xr[j].to_acc() - mean) * rstd);
            }
            let (a, bsum) = (a * inv_d, bsum * inv_d);
            for j in 0..d {
                let gh = gr[j].to_acc() * (one + sc[j].to_acc());
                let xh = (xr[j].to_acc() - mean) * rstd;
                dxr[j] = T::from_acc(rstd * (gh - a - xh * bsum));
            }
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

/// Dispatches on (x dtype, output dtype); statistics accumulate in f64 for f64 x, else in f32.
macro_rules! dispatch_ln {
    ($xdt:expr, $odt:expr, |$t:ident, $o:ident, $a:ident| $body:expr) => {{
        macro_rules! inner {
            ($tt:ty, $aa:ty) => {
                match $odt {
                    DType::F32 => {
                        type $t = $tt;
                        type $a = $aa;
                        type $o = f32;
                        $body
                    }
                    DType::F64 => {
                        type $t = $tt;
                        type $a = $aa;
                        type $o = f64;
                        $body
                    }
                    DType::BF16 => {
                        type $t = $tt;
                        type $a = $aa;
                        type $o = half::bf16;
                        $body
                    }
                    DType::F16 => {
                        type $t = $tt;
                        type $a = $aa;
                        type $o = half::f16;
                        $body
                    }
                    other => {
                        return Err(err(format!(
                            "ln_modulate: unsupported output dtype {other:?}"
                        )))
                    }
                }
            };
        }
        match $xdt {
            DType::F32 => inner!(f32, f32),
            DType::F64 => inner!(f64, f64),
            DType::BF16 => inner!(half::bf16, f32),
            DType::F16 => inner!(half::f16, f32),
            other => {
                return Err(err(format!(
                    "ln_modulate: x must be a float tensor, got {other:?}"
                )))
            }
        }
    }};
}

/// f32 statistics as `Stats`, or f64 ones.
trait IntoStats: Sized {
    fn into_stats(v: Vec<Self>) -> Stats;
    fn from_stats(s: &Stats) -> Option<&[Self]>;
}
impl IntoStats for f32 {
    fn into_stats(v: Vec<Self>) -> Stats {
        Stats::F32(v)
    }
    fn from_stats(s: &Stats) -> Option<&[Self]> {
        match s {
            Stats::F32(v) => Some(v),
            Stats::F64(_) => None,
        }
    }
}
impl IntoStats for f64 {
    fn into_stats(v: Vec<Self>) -> Stats {
        Stats::F64(v)
    }
    fn from_stats(s: &Stats) -> Option<&[Self]> {
        match s {
            Stats::F64(v) => Some(v),
            Stats::F32(_) => None,
        }
    }
}

impl CustomOp3 for LnModulate {
    fn name(&self) -> &'static str {
        "layer-norm-modulate"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        ssh: &CpuStorage,
        lsh: &Layout,
        ssc: &CpuStorage,
        lsc: &Layout,
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
            (O::to_cpu_storage_owned(y), A::into_stats(st))
        });
        *self
            .stats
            .lock()
            .map_err(|_| err("ln stats lock poisoned"))? = Some(stats);
        // Rows (b·s, D), the layout the following linear takes: no reshape node (whose backward
        // would add a zeros + add of the output's size).
        Ok((out, Shape::from((g.b * g.s, g.d))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        shift: &Tensor,
        scale: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let guard = self
            .stats
            .lock()
            .map_err(|_| err("ln stats lock poisoned"))?;
        let stats = guard
            .as_ref()
            .ok_or_else(|| err("ln_modulate backward before forward"))?;
        let grad = grad.contiguous()?;
        let (dx, dsh, dsc) = with_cpu(x, |sx, lx| {
            with_cpu(shift, |ssh, lsh| {
                with_cpu(scale, |ssc, lsc| {
                    with_cpu(&grad, |sg, lg| {
                        let g = ln_geom(lx, lsh, lsc)?;
                        Ok(dispatch_ln!(sx.dtype(), self.out, |T, O, A| {
                            let st = A::from_stats(stats)
                                .ok_or_else(|| err("ln_modulate: statistics of another dtype"))?;
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
                    })
                })
            })
        })?;
        // Only inputs that track get a gradient: candle would otherwise keep the others' in its
        // gradient store until the store is dropped.
        let keep = |t: &Tensor, d: Tensor| t.track_op().then_some(d);
        Ok((keep(x, dx), keep(shift, dsh), keep(scale, dsc)))
    }
}

// ---------------------------------------------------------------------------------------------
// Attention straight from the fused qkv projection.

/// What the fused attention keeps for its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnKeep {
    /// The probabilities P (b, a, s, s) in the compute dtype: the materialized mode. Its softmax
    /// is fused, so nothing else of size s² is kept (no scores, no exp, no casts).
    Probabilities,
    /// Nothing: backward recomputes P head by head (the attention-only recompute policy).
    Nothing,
    /// The log-sum-exp per query row (b, a, s) in the accumulation type; forward and backward
    /// stream over key blocks and never hold more than s × [`ATTN_KEY_BLOCK`] scores per head
    /// (the memory-efficient mode).
    LogSumExp,
}

/// Keys per block of the streaming kernels.
pub const ATTN_KEY_BLOCK: usize = 128;

/// Attention over the (b·s, 3D) output of the qkv projection, written as (b·s, D): q, k, v are
/// read in place (no narrow, no transposes, no contiguous copies), the output already has the
/// layout the output projection wants, and the gradient comes back as one (b·s, 3D) tensor, so
/// candle never pads a narrow's gradient. Heads run in parallel, each on a private scratch of
/// accumulation-type buffers; every product is a `gemm` call.
#[derive(Debug)]
pub struct QkvAttention {
    batch: usize,
    heads: usize,
    keep: AttnKeep,
    dropout: Option<crate::attention::Dropout>,
    /// Whether the input tracks: an untracked forward saves nothing.
    track: bool,
    saved: Mutex<Option<CpuStorage>>,
}

/// Fused attention from the qkv projection (see [`QkvAttention`]).
pub fn qkv_attention(
    qkv: &Tensor,
    batch: usize,
    heads: usize,
    keep: AttnKeep,
    dropout: Option<crate::attention::Dropout>,
) -> CResult<Tensor> {
    if dropout.is_some() && keep == AttnKeep::LogSumExp {
        return Err(err(
            "attention dropout needs materialized attention (the streaming kernel has no mask)",
        ));
    }
    qkv.apply_op1(QkvAttention {
        batch,
        heads,
        keep,
        dropout: dropout.filter(|d| d.p > 0.0),
        track: qkv.track_op(),
        saved: Mutex::new(None),
    })
}

/// Shapes of one fused attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnGeom {
    pub b: usize,
    pub a: usize,
    pub s: usize,
    pub dh: usize,
}

impl AttnGeom {
    pub(crate) fn d(&self) -> usize {
        self.a * self.dh
    }
    pub(crate) fn heads(&self) -> usize {
        self.b * self.a
    }
    pub(crate) fn kb(&self) -> usize {
        ATTN_KEY_BLOCK.min(self.s)
    }
    /// Scratch elements (accumulation type) per head of the forward.
    pub fn fwd_scratch(&self, keep: AttnKeep) -> usize {
        let (s, dh) = (self.s, self.dh);
        match keep {
            // q, k, v, the head's output, S.
            AttnKeep::Probabilities | AttnKeep::Nothing => 4 * s * dh + s * s,
            // q, k, v, the accumulator, one block of scores, row max and sum.
            AttnKeep::LogSumExp => 4 * s * dh + s * self.kb() + 2 * s,
        }
    }
    /// Scratch elements (accumulation type) per head of the backward.
    pub fn bwd_scratch(&self, keep: AttnKeep) -> usize {
        let (s, dh) = (self.s, self.dh);
        match keep {
            // q, k, v, dO, dq, dk, dv, P, dP.
            AttnKeep::Probabilities | AttnKeep::Nothing => 7 * s * dh + 2 * s * s,
            // q, k, v, dO, dq, dk, dv, a block of P and of dP, the row deltas.
            AttnKeep::LogSumExp => 7 * s * dh + 2 * s * self.kb() + s,
        }
    }
}

/// Threads the head loop uses: rayon's pool size, at most one per head. The scratch of all of
/// them is allocated up front, so the transient bytes are deterministic.
pub fn attn_threads(heads: usize) -> usize {
    rayon::current_num_threads().clamp(1, heads.max(1))
}

fn attn_geom(l: &Layout, batch: usize, heads: usize) -> CResult<AttnGeom> {
    let (rows, d3) = match l.dims() {
        &[r, c] => (r, c),
        dims => {
            return Err(err(format!(
                "attention expects qkv (b·s, 3D), got {dims:?}"
            )))
        }
    };
    if batch == 0 || heads == 0 || rows % batch != 0 || d3 % (3 * heads) != 0 {
        return Err(err(format!(
            "attention: qkv ({rows}, {d3}) does not split into batch {batch} × 3 × {heads} heads"
        )));
    }
    Ok(AttnGeom {
        b: batch,
        a: heads,
        s: rows / batch,
        dh: d3 / (3 * heads),
    })
}

/// A raw pointer the head loop writes disjoint elements through (each head owns its own
/// columns of the output rows and its own block of P).
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<T>(pub(crate) *mut T);
unsafe impl<T> Send for SharedMut<T> {}
unsafe impl<T> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    /// Element `i` (a method, so closures capture the wrapper and not the bare pointer).
    ///
    /// # Safety
    /// `i` must lie inside the buffer, and no other thread may touch element `i` meanwhile.
    #[inline]
    pub(crate) unsafe fn at(&self, i: usize) -> *mut T {
        self.0.add(i)
    }
}

/// `dst (m×n) = lhs (m×k) · rhs (k×n)` (+ dst when `acc`), with explicit (row, column) strides,
/// single-threaded (the callers parallelise over heads).
fn mm<A: 'static + Acc>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [A],
    lhs: (&[A], usize, usize),
    rhs: (&[A], usize, usize),
    acc: bool,
) {
    mm_par(m, n, k, dst, lhs, rhs, acc, gemm::Parallelism::None)
}

/// [`mm`] with an explicit parallelism.
#[allow(clippy::too_many_arguments)]
fn mm_par<A: 'static + Acc>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [A],
    lhs: (&[A], usize, usize),
    rhs: (&[A], usize, usize),
    acc: bool,
    par: gemm::Parallelism,
) {
    mm_strided(m, n, k, (dst, n, 1), lhs, rhs, acc, par)
}

/// A fresh row-major `m × n` product `lhs · rhs` (f32/f64, through `gemm`), written straight into
/// new memory: `gemm` overwrites the destination without reading it, so it is not zeroed first.
fn mm_fresh<A: 'static + Acc>(
    m: usize,
    n: usize,
    k: usize,
    lhs: (&[A], usize, usize),
    rhs: (&[A], usize, usize),
    par: gemm::Parallelism,
) -> Vec<A> {
    if k == 0 || m == 0 || n == 0 {
        return vec![A::ZERO; m * n];
    }
    let mut out: Vec<A> = Vec::with_capacity(m * n);
    // Safety: the spare capacity holds m·n elements (row stride n); the operands' strides stay
    // inside their slices (callers pass row-major buffers or their transposes); with `acc`
    // false `gemm` writes every element of the m × n destination and reads none.
    unsafe {
        gemm_raw(
            (m, n, k),
            (out.spare_capacity_mut().as_mut_ptr().cast::<A>(), n, 1),
            lhs,
            rhs,
            false,
            par,
        );
        out.set_len(m * n);
    }
    out
}

/// The general product: every operand as (slice, row stride, column stride).
///
/// `gemm` allocates packing buffers per call unless the destination is column-major, the lhs is
/// column-major with a row count that fills its SIMD lanes, and the rhs is column-major with at
/// most 128 microkernel rows of destination (`gemm-common` `gemm_basic_generic`). The widened
/// linear lays out its own f32 scratch that way, so its products allocate nothing.
#[allow(clippy::too_many_arguments)]
fn mm_strided<A: 'static + Acc>(
    m: usize,
    n: usize,
    k: usize,
    dst: (&mut [A], usize, usize),
    lhs: (&[A], usize, usize),
    rhs: (&[A], usize, usize),
    acc: bool,
    par: gemm::Parallelism,
) {
    let (dst, dst_rs, dst_cs) = dst;
    debug_assert!(dst.len() >= m * n);
    // Safety: the slices outlive the call, and the strides stay inside them (callers pass
    // row-major buffers or their transposes with the matching extents).
    unsafe {
        gemm_raw(
            (m, n, k),
            (dst.as_mut_ptr(), dst_rs, dst_cs),
            lhs,
            rhs,
            acc,
            par,
        )
    }
}

/// `dst = lhs·rhs` (`+ dst` when `acc`) through `gemm`, the destination as (pointer, row
/// stride, column stride), the operands as (slice, row stride, column stride).
///
/// # Safety
/// The destination must be valid for writes (and reads when `acc`) at every (i, j) of the
/// m × n product under its strides; the operands' strides must stay inside their slices.
unsafe fn gemm_raw<A: 'static + Acc>(
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs, dst_cs): (*mut A, usize, usize),
    lhs: (&[A], usize, usize),
    rhs: (&[A], usize, usize),
    acc: bool,
    par: gemm::Parallelism,
) {
    gemm::gemm(
        m,
        n,
        k,
        dst,
        dst_cs as isize,
        dst_rs as isize,
        acc,
        lhs.0.as_ptr(),
        lhs.2 as isize,
        lhs.1 as isize,
        rhs.0.as_ptr(),
        rhs.2 as isize,
        rhs.1 as isize,
        <A as Acc>::from_f64(1.0),
        <A as Acc>::from_f64(1.0),
        false,
        false,
        false,
        par,
    )
}

/// Keep factor of the dropout mask at flat index `i` of (b, a, s, s): 0 or 1/(1−p), drawn like
/// `attention::dropout_mask` (f32 factor) so all modes see the same mask.
#[inline]
pub(crate) fn mask_at<A: Acc>(d: crate::attention::Dropout, i: usize) -> A {
    let mut r = crate::rng::SplitMix64::skip(d.seed, i as u64);
    if r.uniform() < d.p {
        A::ZERO
    } else {
        <A as Acc>::from_f64(f64::from((1.0 / (1.0 - d.p)) as f32))
    }
}

/// Gathers head `hd` of batch `bi` from the qkv rows into three (s×dh) buffers, q scaled by
/// `q_scale` (k and v as they are).
#[allow(clippy::too_many_arguments)]
fn gather_qkv<T: Elem<A>, A: Acc>(
    qkv: &[T],
    g: &AttnGeom,
    bi: usize,
    hd: usize,
    q_scale: A,
    q: &mut [A],
    k: &mut [A],
    v: &mut [A],
) {
    let (s, dh, d) = (g.s, g.dh, g.d());
    let one = <A as Acc>::from_f64(1.0);
    for (which, (dst, scale)) in [(q, q_scale), (k, one), (v, one)].into_iter().enumerate() {
        for i in 0..s {
            let src = &qkv[(bi * s + i) * 3 * d + which * d + hd * dh..][..dh];
            for (o, x) in dst[i * dh..(i + 1) * dh].iter_mut().zip(src) {
                *o = x.to_acc() * scale;
            }
        }
    }
}

/// Rounds values through the storage type: the recomputed P of the attention-only policy then
/// equals the P the materialized mode stores in the compute dtype, so both modes' gradients are
/// bitwise the same (the recompute twin test of `ditmem verify`).
fn round_through<T: Elem<A>, A: Acc>(x: &mut [A]) {
    for v in x.iter_mut() {
        *v = T::from_acc(*v).to_acc();
    }
}

/// Row softmax of an (s×n) block in place.
fn softmax_rows<A: Acc>(x: &mut [A], n: usize) {
    A::softmax_rows(x, n)
}

/// Forward of all heads: returns o (b·s, D) and what the mode keeps.
fn attn_fwd_cpu<T, A>(
    qkv: &[T],
    g: &AttnGeom,
    keep: AttnKeep,
    dropout: Option<crate::attention::Dropout>,
    save: bool,
) -> (Vec<T>, Option<CpuStorage>)
where
    T: Elem<A> + WithDType,
    A: Acc + WithDType,
{
    let (s, dh, d) = (g.s, g.dh, g.d());
    let nh = g.heads();
    let mut out: Vec<T> = vec![T::from_acc(A::ZERO); g.b * s * d];
    let mut p_keep: Vec<T> = if save && keep == AttnKeep::Probabilities {
        vec![T::from_acc(A::ZERO); nh * s * s]
    } else {
        Vec::new()
    };
    let mut lse: Vec<A> = if save && keep == AttnKeep::LogSumExp {
        vec![A::ZERO; nh * s]
    } else {
        Vec::new()
    };
    let nt = attn_threads(nh);
    let per = g.fwd_scratch(keep);
    let mut scratch: Vec<A> = vec![A::ZERO; nt * per];
    let scale = <A as Acc>::from_f64(1.0 / (dh as f64).sqrt());
    let (po, pp, pl) = (
        SharedMut(out.as_mut_ptr()),
        SharedMut(p_keep.as_mut_ptr()),
        SharedMut(lse.as_mut_ptr()),
    );
    let (save_p, save_l) = (!p_keep.is_empty(), !lse.is_empty());
    let kb = g.kb();
    scratch.par_chunks_mut(per).enumerate().for_each(|(t, sc)| {
        let (q, rest) = sc.split_at_mut(s * dh);
        let (k, rest) = rest.split_at_mut(s * dh);
        let (v, rest) = rest.split_at_mut(s * dh);
        let (o, rest) = rest.split_at_mut(s * dh);
        let mut head = t;
        while head < nh {
            let (bi, hd) = (head / g.a, head % g.a);
            gather_qkv(qkv, g, bi, hd, scale, q, k, v);
            match keep {
                AttnKeep::Probabilities | AttnKeep::Nothing => {
                    let p = &mut rest[..s * s];
                    mm(s, s, dh, p, (q, dh, 1), (k, 1, dh), false);
                    softmax_rows(p, s);
                    if save_p {
                        for (i, v) in p.iter().enumerate() {
                            // Safety: head `head` owns P[head·s²..(head+1)·s²].
                            unsafe { *pp.at(head * s * s + i) = T::from_acc(*v) };
                        }
                    }
                    if let Some(dr) = dropout {
                        for (i, v) in p.iter_mut().enumerate() {
                            *v *= mask_at::<A>(dr, head * s * s + i);
                        }
                    }
                    mm(s, dh, s, o, (p, s, 1), (v, dh, 1), false);
                }
                AttnKeep::LogSumExp => {
                    let (sb, ml) = rest.split_at_mut(s * kb);
                    let (m, l) = ml.split_at_mut(s);
                    m.iter_mut().for_each(|x| *x = A::NEG_INF);
                    l.iter_mut().for_each(|x| *x = A::ZERO);
                    o.iter_mut().for_each(|x| *x = A::ZERO);
                    let mut j0 = 0;
                    while j0 < s {
                        let n = kb.min(s - j0);
                        let blk = &mut sb[..s * n];
                        mm(s, n, dh, blk, (q, dh, 1), (&k[j0 * dh..], 1, dh), false);
                        for i in 0..s {
                            let row = &mut blk[i * n..(i + 1) * n];
                            let rmax = A::max_of(row);
                            let bmax = if rmax > m[i] { rmax } else { m[i] };
                            let corr = if m[i] == A::NEG_INF {
                                A::ZERO
                            } else {
                                (m[i] - bmax).exp()
                            };
                            let z = A::exp_sub_sum(row, bmax);
                            l[i] = l[i] * corr + z;
                            for x in o[i * dh..(i + 1) * dh].iter_mut() {
                                *x *= corr;
                            }
                            m[i] = bmax;
                        }
                        mm(s, dh, n, o, (blk, n, 1), (&v[j0 * dh..], dh, 1), true);
                        j0 += n;
                    }
                    for i in 0..s {
                        let inv = <A as Acc>::from_f64(1.0) / l[i];
                        for x in o[i * dh..(i + 1) * dh].iter_mut() {
                            *x *= inv;
                        }
                        if save_l {
                            // Safety: head `head` owns lse[head·s..(head+1)·s].
                            unsafe { *pl.at(head * s + i) = m[i] + l[i].ln() };
                        }
                    }
                }
            }
            for i in 0..s {
                for j in 0..dh {
                    // Safety: head (bi, hd) owns columns hd·dh.. of the rows of batch bi.
                    unsafe { *po.at((bi * s + i) * d + hd * dh + j) = T::from_acc(o[i * dh + j]) };
                }
            }
            head += nt;
        }
    });
    drop(scratch);
    let saved = if save_p {
        Some(T::to_cpu_storage_owned(p_keep))
    } else if save_l {
        Some(A::to_cpu_storage_owned(lse))
    } else {
        None
    };
    (out, saved)
}

/// Backward of all heads: returns dqkv (b·s, 3D).
#[allow(clippy::too_many_arguments)]
fn attn_bwd_cpu<T, A>(
    qkv: &[T],
    o_all: &[T],
    go_all: &[T],
    saved: Option<&CpuStorage>,
    g: &AttnGeom,
    keep: AttnKeep,
    dropout: Option<crate::attention::Dropout>,
) -> CResult<Vec<T>>
where
    T: Elem<A> + WithDType,
    A: Acc + WithDType,
{
    let (s, dh, d) = (g.s, g.dh, g.d());
    let nh = g.heads();
    let p_saved: Option<&[T]> = match (keep, saved) {
        (AttnKeep::Probabilities, Some(st)) => Some(st.as_slice::<T>()?),
        (AttnKeep::Probabilities, None) => {
            return Err(err("attention backward: probabilities were not kept"))
        }
        _ => None,
    };
    let lse: Option<&[A]> = match (keep, saved) {
        (AttnKeep::LogSumExp, Some(st)) => Some(st.as_slice::<A>()?),
        (AttnKeep::LogSumExp, None) => {
            return Err(err("attention backward: the log-sum-exp was not kept"))
        }
        _ => None,
    };
    let mut dqkv: Vec<T> = vec![T::from_acc(A::ZERO); g.b * s * 3 * d];
    let nt = attn_threads(nh);
    let per = g.bwd_scratch(keep);
    let mut scratch: Vec<A> = vec![A::ZERO; nt * per];
    let scale = <A as Acc>::from_f64(1.0 / (dh as f64).sqrt());
    let pd = SharedMut(dqkv.as_mut_ptr());
    let kb = g.kb();
    scratch.par_chunks_mut(per).enumerate().for_each(|(t, sc)| {
        let (q, rest) = sc.split_at_mut(s * dh);
        let (k, rest) = rest.split_at_mut(s * dh);
        let (v, rest) = rest.split_at_mut(s * dh);
        let (go, rest) = rest.split_at_mut(s * dh);
        let (dq, rest) = rest.split_at_mut(s * dh);
        let (dk, rest) = rest.split_at_mut(s * dh);
        let (dv, rest) = rest.split_at_mut(s * dh);
        let mut head = t;
        while head < nh {
            let (bi, hd) = (head / g.a, head % g.a);
            gather_qkv(qkv, g, bi, hd, scale, q, k, v);
            for i in 0..s {
                let src = &go_all[(bi * s + i) * d + hd * dh..][..dh];
                for (x, y) in go[i * dh..(i + 1) * dh].iter_mut().zip(src) {
                    *x = y.to_acc();
                }
            }
            match keep {
                AttnKeep::Probabilities | AttnKeep::Nothing => {
                    let (p, dp) = rest.split_at_mut(s * s);
                    let dp = &mut dp[..s * s];
                    match p_saved {
                        Some(ps) => {
                            for (x, y) in p.iter_mut().zip(&ps[head * s * s..][..s * s]) {
                                *x = y.to_acc();
                            }
                        }
                        None => {
                            mm(s, s, dh, p, (q, dh, 1), (k, 1, dh), false);
                            softmax_rows(p, s);
                            round_through::<T, A>(p);
                        }
                    }
                    // dP̃ = dO·vᵀ, then through the mask.
                    mm(s, s, dh, dp, (go, dh, 1), (v, 1, dh), false);
                    if let Some(dr) = dropout {
                        // dv = (P∘M)ᵀ·dO needs P∘M: scale P in place, undo after.
                        for (i, (x, y)) in p.iter_mut().zip(dp.iter_mut()).enumerate() {
                            let mk = mask_at::<A>(dr, head * s * s + i);
                            *x *= mk;
                            *y *= mk;
                        }
                        mm(s, dh, s, dv, (p, 1, s), (go, dh, 1), false);
                        // Rebuild P (the mask zeroed some entries): recompute or reload.
                        match p_saved {
                            Some(ps) => {
                                for (x, y) in p.iter_mut().zip(&ps[head * s * s..][..s * s]) {
                                    *x = y.to_acc();
                                }
                            }
                            None => {
                                mm(s, s, dh, p, (q, dh, 1), (k, 1, dh), false);
                                softmax_rows(p, s);
                                round_through::<T, A>(p);
                            }
                        }
                    } else {
                        mm(s, dh, s, dv, (p, 1, s), (go, dh, 1), false);
                    }
                    // dS = P∘(dP − Σ_j dP·P), in dp.
                    for (pr, dr) in p.chunks(s).zip(dp.chunks_mut(s)) {
                        let mut delta = A::ZERO;
                        for (a, b) in pr.iter().zip(dr.iter()) {
                            delta += *a * *b;
                        }
                        for (a, b) in pr.iter().zip(dr.iter_mut()) {
                            *b = *a * (*b - delta);
                        }
                    }
                    mm(s, dh, s, dq, (dp, s, 1), (k, dh, 1), false);
                    mm(s, dh, s, dk, (dp, 1, s), (q, dh, 1), false);
                }
                AttnKeep::LogSumExp => {
                    let lse = &lse.unwrap_or(&[])[head * s..][..s];
                    let (pb, rest) = rest.split_at_mut(s * kb);
                    let (dpb, delta) = rest.split_at_mut(s * kb);
                    // Δ_i = dO_i · o_i.
                    for i in 0..s {
                        let orow = &o_all[(bi * s + i) * d + hd * dh..][..dh];
                        let mut acc = A::ZERO;
                        for (x, y) in go[i * dh..(i + 1) * dh].iter().zip(orow) {
                            acc += *x * y.to_acc();
                        }
                        delta[i] = acc;
                    }
                    dq.iter_mut().for_each(|x| *x = A::ZERO);
                    let mut j0 = 0;
                    while j0 < s {
                        let n = kb.min(s - j0);
                        let p = &mut pb[..s * n];
                        let dp = &mut dpb[..s * n];
                        mm(s, n, dh, p, (q, dh, 1), (&k[j0 * dh..], 1, dh), false);
                        A::exp_rows(p, n, lse);
                        mm(n, dh, s, &mut dv[j0 * dh..], (p, 1, n), (go, dh, 1), false);
                        mm(s, n, dh, dp, (go, dh, 1), (&v[j0 * dh..], 1, dh), false);
                        for i in 0..s {
                            for (a, b) in p[i * n..(i + 1) * n]
                                .iter()
                                .zip(dp[i * n..(i + 1) * n].iter_mut())
                            {
                                *b = *a * (*b - delta[i]);
                            }
                        }
                        mm(s, dh, n, dq, (dp, n, 1), (&k[j0 * dh..], dh, 1), true);
                        mm(n, dh, s, &mut dk[j0 * dh..], (dp, 1, n), (q, dh, 1), false);
                        j0 += n;
                    }
                }
            }
            for i in 0..s {
                let row = (bi * s + i) * 3 * d + hd * dh;
                for j in 0..dh {
                    // Safety: head (bi, hd) owns its q, k, v columns of the rows of batch bi.
                    unsafe {
                        *pd.at(row + j) = T::from_acc(dq[i * dh + j] * scale);
                        *pd.at(row + d + j) = T::from_acc(dk[i * dh + j]);
                        *pd.at(row + 2 * d + j) = T::from_acc(dv[i * dh + j]);
                    }
                }
            }
            head += nt;
        }
    });
    drop(scratch);
    Ok(dqkv)
}

impl CustomOp1 for QkvAttention {
    fn name(&self) -> &'static str {
        "qkv-attention"
    }

    fn cpu_fwd(&self, st: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let g = attn_geom(l, self.batch, self.heads)?;
        if st.dtype() == DType::BF16 && crate::attn_bf16::applies() {
            let qkv = cpu_slice::<half::bf16>(st, l, "attention qkv")?;
            let (o, saved) = if self.keep == AttnKeep::LogSumExp {
                crate::attn_bf16::forward_streaming(qkv, &g, self.track)
            } else {
                crate::attn_bf16::forward(qkv, &g, self.keep, self.dropout, self.track)
            };
            *self
                .saved
                .lock()
                .map_err(|_| err("attention lock poisoned"))? = saved;
            return Ok((CpuStorage::BF16(o), Shape::from((g.b * g.s, g.d()))));
        }
        let (out, saved) = dispatch_float!(st.dtype(), "attention", |T, A| {
            let qkv = cpu_slice::<T>(st, l, "attention qkv")?;
            let (o, saved) = attn_fwd_cpu::<T, A>(qkv, &g, self.keep, self.dropout, self.track);
            (T::to_cpu_storage_owned(o), saved)
        });
        *self
            .saved
            .lock()
            .map_err(|_| err("attention lock poisoned"))? = saved;
        Ok((out, Shape::from((g.b * g.s, g.d()))))
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let guard = self
            .saved
            .lock()
            .map_err(|_| err("attention lock poisoned"))?;
        let grad = grad.contiguous()?;
        let d = with_cpu(arg, |sq, lq| {
            with_cpu(res, |so, lo| {
                with_cpu(&grad, |sg, lg| {
                    let g = attn_geom(lq, self.batch, self.heads)?;
                    if sq.dtype() == DType::BF16 && crate::attn_bf16::applies() {
                        let n = "attention";
                        let (qkv, go) = (
                            cpu_slice::<half::bf16>(sq, lq, n)?,
                            cpu_slice::<half::bf16>(sg, lg, n)?,
                        );
                        let dqkv = if self.keep == AttnKeep::LogSumExp {
                            let o = cpu_slice::<half::bf16>(so, lo, n)?;
                            crate::attn_bf16::backward_streaming(qkv, o, go, guard.as_ref(), &g)?
                        } else {
                            crate::attn_bf16::backward(
                                qkv,
                                go,
                                guard.as_ref(),
                                &g,
                                self.keep,
                                self.dropout,
                            )?
                        };
                        return Tensor::from_vec(dqkv, lq.shape(), &Device::Cpu);
                    }
                    Ok(dispatch_float!(sq.dtype(), "attention backward", |T, A| {
                        let dqkv = attn_bwd_cpu::<T, A>(
                            cpu_slice::<T>(sq, lq, "attention qkv")?,
                            cpu_slice::<T>(so, lo, "attention output")?,
                            cpu_slice::<T>(sg, lg, "attention gradient")?,
                            guard.as_ref(),
                            &g,
                            self.keep,
                            self.dropout,
                        )?;
                        Tensor::from_vec(dqkv, lq.shape(), &Device::Cpu)?
                    }))
                })
            })
        })?;
        Ok(Some(d))
    }
}

// ---------------------------------------------------------------------------------------------
// Linear.

/// Rows per chunk of a low-precision linear (its f32 accumulators and packed operands).
pub const LINEAR_ROWS: usize = 128;

/// `y = x·Wᵀ + b` on a 2-D x as one node: candle's composition keeps both the product and the
/// biased sum alive (two (rows, out) tensors per linear) and, in bf16, widens the whole of both
/// operands to f32 for every product. This op keeps nothing beyond its inputs, calls `gemm`
/// directly on f32/f64 data (W read transposed in place); on bf16 with AVX512-BF16 it packs W
/// once and x by chunks of [`LINEAR_ROWS`] rows for [`crate::gemm_bf16`], otherwise (and on
/// f16) it widens W once and x by chunks to f32; both accumulate in f32. Backward returns dx,
/// dW, db for the inputs that track (a frozen LoRA base gets only dx).
///
/// With a [`GradSink`], W and b go in untracked and the backward hands their gradients to the
/// sink instead of returning them to candle: candle would fold each into its store as
/// `zeros_like(W) + dW`, a memset and an add over every weight of the model per step (and a
/// moment with three weight-sized buffers alive), only for the trainer to take the sum out.
#[derive(Debug, Clone, Default)]
pub struct LinearOp {
    sink: Option<Arc<GradSink>>,
}

/// Fused linear (see [`LinearOp`]): x (rows, in), w (out, in), b (out) → (rows, out).
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> CResult<Tensor> {
    x.apply_op3(w, b, LinearOp::default())
}

/// The fused linear with its weight gradients handed to `sink` (see [`LinearOp`]). `w` and `b`
/// should not track (pass detached tensors); which of dW, db the backward computes is the sink's
/// [`GradSink::new`] choice. The backward runs only if x tracks (candle calls a node's backward
/// only when one of its inputs tracks), so use it where the input does.
pub fn linear_sunk(x: &Tensor, w: &Tensor, b: &Tensor, sink: &Arc<GradSink>) -> CResult<Tensor> {
    x.apply_op3(
        w,
        b,
        LinearOp {
            sink: Some(Arc::clone(sink)),
        },
    )
}

/// Where a fused linear leaves the gradients of its weight and bias (see [`LinearOp`]): each
/// backward adds its dW, db here (moved in when the slot is empty, summed otherwise); the owner
/// takes them out after the backward.
#[derive(Debug, Default)]
pub struct GradSink {
    want_w: bool,
    want_b: bool,
    w: Mutex<Option<Tensor>>,
    b: Mutex<Option<Tensor>>,
}

impl GradSink {
    /// A sink for the gradients of the weight (`want_w`) and/or the bias (`want_b`).
    pub fn new(want_w: bool, want_b: bool) -> GradSink {
        GradSink {
            want_w,
            want_b,
            ..GradSink::default()
        }
    }

    /// The weight gradient left by the backward passes since the last take, if any.
    pub fn take_w(&self) -> Option<Tensor> {
        self.w.lock().ok().and_then(|mut g| g.take())
    }

    /// The bias gradient left since the last take, if any.
    pub fn take_b(&self) -> Option<Tensor> {
        self.b.lock().ok().and_then(|mut g| g.take())
    }

    fn put(slot: &Mutex<Option<Tensor>>, g: Option<Tensor>) -> CResult<()> {
        let Some(g) = g else { return Ok(()) };
        let mut s = slot
            .lock()
            .map_err(|_| err("linear: gradient sink poisoned"))?;
        *s = Some(match s.take() {
            Some(old) => (old + g)?,
            None => g,
        });
        Ok(())
    }
}

/// Which gradients a linear's backward computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearGrads {
    pub x: bool,
    pub w: bool,
    pub b: bool,
}

/// Workspace bytes of a linear's forward: nothing on f32/f64; on bf16 with the AVX512-BF16
/// kernel (`native`) packed Wᵀ, a packed x chunk, an f32 y chunk and an f32 b; when widening
/// (bf16/f16) W, b and a chunk of x and y in f32.
pub fn linear_fwd_scratch(dtype: DType, rows: usize, inp: usize, out: usize, native: bool) -> u64 {
    let r = LINEAR_ROWS.min(rows);
    let n = match dtype {
        DType::BF16 if native => {
            2 * gemm_bf16::packed_b_len(inp, out)
                + 4 * gemm_bf16::packed_a_len(r, inp)
                + 4 * (r * out + out)
        }
        DType::BF16 | DType::F16 => 4 * (out * inp + out + r * (inp + out)),
        _ => 0,
    };
    n as u64
}

/// Workspace bytes of a linear's backward. With the AVX512-BF16 kernel: for dx packed W, a
/// packed g chunk and an f32 dx chunk; for dW an f32 dW (unless the weight is an f32 master,
/// `master`, whose gradient is that buffer), a packed gᵀ chunk and a packed x chunk; for db an
/// f32 db (likewise). Widening: per chunk g; for dx Wᵀ, a column-major copy of the g chunk and a
/// dx chunk; for dW the f32 dW and an x chunk; for db an f32 db (all f32). Nothing on f32/f64.
pub fn linear_bwd_scratch(
    dtype: DType,
    (rows, inp, out): (usize, usize, usize),
    g: LinearGrads,
    native: bool,
    master: bool,
) -> u64 {
    let r = LINEAR_ROWS.min(rows);
    let n = match dtype {
        DType::BF16 if native => {
            let mut n = 0;
            if g.x {
                n += 2 * gemm_bf16::packed_b_len(out, inp)
                    + 4 * gemm_bf16::packed_a_len(r, out)
                    + 4 * r * inp;
            }
            let acc = if master { 0 } else { 4 };
            if g.w {
                n += acc * out * inp
                    + 4 * gemm_bf16::packed_a_len(out, r)
                    + 2 * gemm_bf16::packed_b_len(r, inp);
            }
            if g.b {
                n += acc * out;
            }
            n
        }
        DType::BF16 | DType::F16 => {
            let mut n = r * out;
            if g.x {
                n += out * inp + r * out + r * inp;
            }
            if g.w {
                n += out * inp + r * inp;
            }
            if g.b {
                n += out;
            }
            4 * n
        }
        _ => 0,
    };
    n as u64
}

fn gemm_threads() -> gemm::Parallelism {
    match rayon::current_num_threads() {
        0 | 1 => gemm::Parallelism::None,
        n => gemm::Parallelism::Rayon(n),
    }
}

fn linear_dims(lx: &Layout, lw: &Layout, lb: &Layout) -> CResult<(usize, usize, usize)> {
    match (lx.dims(), lw.dims(), lb.dims()) {
        (&[rows, inp], &[out, inp2], &[out2]) if inp == inp2 && out == out2 => Ok((rows, inp, out)),
        (x, w, b) => Err(err(format!(
            "linear expects x (rows, in), w (out, in), b (out); got {x:?}, {w:?}, {b:?}"
        ))),
    }
}

/// f32/f64 forward: y rows start as b, then y += x·Wᵀ.
fn linear_fwd_direct<A: Acc + 'static>(
    x: &[A],
    w: &[A],
    b: &[A],
    rows: usize,
    inp: usize,
    out: usize,
) -> Vec<A> {
    let mut y: Vec<A> = Vec::with_capacity(rows * out);
    for _ in 0..rows {
        y.extend_from_slice(b);
    }
    mm_par(
        rows,
        out,
        inp,
        &mut y,
        (x, inp, 1),
        (w, 1, inp),
        true,
        gemm_threads(),
    );
    y
}

/// dst[k·n + i] = src[i·src_rs + k] for i < n, k < c: a column-major f32 copy of an (n × c) block,
/// one column per parallel task.
fn to_colmajor<T: Elem<f32> + Sync>(src: &[T], src_rs: usize, n: usize, c: usize, dst: &mut [f32]) {
    dst[..n * c]
        .par_chunks_mut(n)
        .enumerate()
        .with_min_len((PAR_CHUNK / n.max(1)).max(1))
        .for_each(|(k, col)| {
            for (i, d) in col.iter_mut().enumerate() {
                *d = src[i * src_rs + k].to_acc();
            }
        });
}

/// dst[i·c + k] = src[k·n + i]: back from column-major, one row per parallel task.
fn from_colmajor<T: Elem<f32> + Send>(src: &[f32], n: usize, c: usize, dst: &mut [T]) {
    dst[..n * c]
        .par_chunks_mut(c)
        .enumerate()
        .with_min_len((PAR_CHUNK / c.max(1)).max(1))
        .for_each(|(i, row)| {
            for (k, d) in row.iter_mut().enumerate() {
                *d = T::from_acc(src[k * n + i]);
            }
        });
}

/// The value of `v` read in the compute dtype `T`: an f32 master weight rounded to `T` (what a
/// cast copy would hold), a `T` value unchanged.
#[inline]
fn read_as<T: Elem<f32>, W: Elem<f32>>(v: W) -> f32 {
    T::from_acc(v.to_acc()).to_acc()
}

/// A weight (or bias) in f32 as the compute dtype `T` sees it (see [`read_as`]), in parallel.
fn widen_weight_into<T: Elem<f32>, W: Elem<f32> + Sync>(src: &[W], dst: &mut [f32]) {
    dst.par_iter_mut()
        .zip(src.par_iter())
        .with_min_len(PAR_CHUNK)
        .for_each(|(d, s)| *d = read_as::<T, W>(*s));
}

/// Elementwise widening copy, in parallel.
fn widen_into<T: Elem<f32> + Sync>(src: &[T], dst: &mut [f32]) {
    dst.par_iter_mut()
        .zip(src.par_iter())
        .with_min_len(PAR_CHUNK)
        .for_each(|(d, s)| *d = s.to_acc());
}

/// bf16/f16 forward, widened to f32 by chunks. The chunk buffers are column-major (see
/// [`mm_strided`]): x32[k·n + i] holds row i, column k of the chunk, y32[j·n + i] likewise.
fn linear_fwd_widen<T: Elem<f32> + Send + Sync, W: Elem<f32> + Sync>(
    x: &[T],
    w: &[W],
    b: &[W],
    rows: usize,
    inp: usize,
    out: usize,
) -> Vec<T> {
    let mut y: Vec<T> = vec![T::from_acc(0.0); rows * out];
    let r = LINEAR_ROWS.min(rows);
    // W as the rhs (k = in, n = out) with unit row stride: its natural row-major layout.
    let mut w32: Vec<f32> = vec![0.0; out * inp];
    widen_weight_into::<T, W>(w, &mut w32);
    let b32: Vec<f32> = b.iter().map(|v| read_as::<T, W>(*v)).collect();
    let mut x32: Vec<f32> = vec![0.0; r * inp];
    let mut y32: Vec<f32> = vec![0.0; r * out];
    let mut r0 = 0;
    while r0 < rows {
        let n = r.min(rows - r0);
        to_colmajor(&x[r0 * inp..], inp, n, inp, &mut x32);
        for (j, bj) in b32.iter().enumerate() {
            y32[j * n..(j + 1) * n].iter_mut().for_each(|v| *v = *bj);
        }
        mm_strided(
            n,
            out,
            inp,
            (&mut y32, 1, n),
            (&x32, 1, n),
            (&w32, 1, inp),
            true,
            gemm_threads(),
        );
        from_colmajor(&y32, n, out, &mut y[r0 * out..]);
        r0 += n;
    }
    y
}

/// `acc[c] += Σ_r rows[r·cols + c]` (a bias gradient), in parallel over ranges of columns; each
/// column is summed in row order, so the result is the serial loop's, bit for bit.
fn add_column_sums<T: Elem<A> + Sync, A: Acc + Send>(rows: &[T], cols: usize, acc: &mut [A]) {
    const COLS: usize = 256;
    if cols == 0 {
        return;
    }
    acc[..cols]
        .par_chunks_mut(COLS)
        .enumerate()
        .for_each(|(ci, a)| {
            for row in rows.chunks(cols) {
                for (d, v) in a.iter_mut().zip(&row[ci * COLS..]) {
                    *d += v.to_acc();
                }
            }
        });
}

/// bf16 forward on the AVX512-BF16 kernel: Wᵀ packed once, x packed and y accumulated in f32 by
/// chunks of [`LINEAR_ROWS`] rows (each chunk starts as b).
fn linear_fwd_bf16<W: Elem<f32> + gemm_bf16::ToBf16>(
    x: &[half::bf16],
    w: &[W],
    b: &[W],
    rows: usize,
    inp: usize,
    out: usize,
) -> Vec<half::bf16> {
    use gemm_bf16::{pack_a, pack_b, packed_a_len, packed_b_len, View};
    // Every row is narrowed in below: no zeroing.
    let mut y: Vec<half::bf16> = Vec::with_capacity(rows * out);
    let r = LINEAR_ROWS.min(rows);
    // B = Wᵀ (in × out): B(k, j) = W[j][k].
    let mut pb = vec![0u16; packed_b_len(inp, out)];
    pack_b(
        inp,
        out,
        View {
            data: w,
            rs: 1,
            cs: inp,
        },
        &mut pb,
    );
    let mut pa = vec![0u32; packed_a_len(r, inp)];
    let mut c = vec![0f32; r * out];
    let b32: Vec<f32> = b.iter().map(|v| read_as::<half::bf16, W>(*v)).collect();
    let mut r0 = 0;
    while r0 < rows {
        let n = r.min(rows - r0);
        let xv = View {
            data: &x[r0 * inp..(r0 + n) * inp],
            rs: inp,
            cs: 1,
        };
        pack_a(n, inp, xv, &mut pa);
        c[..n * out]
            .par_chunks_mut(out)
            .for_each(|row| row.copy_from_slice(&b32));
        gemm_bf16::gemm_packed(n, out, inp, &pa, &pb, &mut c, out);
        vecmath::narrow_into_uninit(
            &c[..n * out],
            &mut y.spare_capacity_mut()[r0 * out..(r0 + n) * out],
        );
        r0 += n;
    }
    // SAFETY: the chunks above cover rows 0..rows, every element written.
    unsafe { y.set_len(rows * out) };
    y
}

/// A weight's gradient in the weight's dtype from its f32 accumulator: the accumulator itself
/// for an f32 (master) weight, a parallel narrowing copy for a bf16 one.
trait GradFromF32: Sized {
    fn grad_from_f32(v: Vec<f32>) -> Vec<Self>;
}

impl GradFromF32 for f32 {
    fn grad_from_f32(v: Vec<f32>) -> Vec<f32> {
        v
    }
}

impl GradFromF32 for half::bf16 {
    fn grad_from_f32(v: Vec<f32>) -> Vec<half::bf16> {
        let mut d = vec![half::bf16::ZERO; v.len()];
        vecmath::narrow_into(&v, &mut d);
        d
    }
}

/// bf16 backward on the AVX512-BF16 kernel, by chunks of [`LINEAR_ROWS`] rows: dx = g·W into an
/// f32 chunk, dW += gᵀ·x and db += Σ g in f32 over all chunks. The dx output, then all workspace,
/// are allocated before the first product. dW and db are returned in the weight's dtype: for an
/// f32 master weight the accumulators themselves (no copy, no rounding), for a bf16 weight a
/// narrowed copy made while the workspace is still alive (the budget counts it so).
#[allow(clippy::type_complexity)]
fn linear_bwd_bf16<W: gemm_bf16::ToBf16 + GradFromF32>(
    x: &[half::bf16],
    w: &[W],
    g: &[half::bf16],
    (rows, inp, out): (usize, usize, usize),
    want: LinearGrads,
) -> (Option<Vec<half::bf16>>, Option<Vec<W>>, Option<Vec<W>>) {
    use gemm_bf16::{gemm_packed, pack_a, pack_b, packed_a_len, packed_b_len, View};
    // Filled chunk by chunk below: no zeroing.
    let mut dx: Option<Vec<half::bf16>> = want.x.then(|| Vec::with_capacity(rows * inp));
    let r = LINEAR_ROWS.min(rows);
    // dx: B = W (out × in) as stored; A = the g chunk; an f32 dx chunk.
    let mut gx = want.x.then(|| {
        let mut pw = vec![0u16; packed_b_len(out, inp)];
        pack_b(
            out,
            inp,
            View {
                data: w,
                rs: inp,
                cs: 1,
            },
            &mut pw,
        );
        (pw, vec![0u32; packed_a_len(r, out)], vec![0f32; r * inp])
    });
    // dW: f32 dW (out × in); A = gᵀ chunk (out × n), B = x chunk (n × in).
    let mut gw = want.w.then(|| {
        (
            vec![0f32; out * inp],
            vec![0u32; packed_a_len(out, r)],
            vec![0u16; packed_b_len(r, inp)],
        )
    });
    let mut db32: Option<Vec<f32>> = want.b.then(|| vec![0.0; out]);
    let mut r0 = 0;
    while r0 < rows {
        let n = r.min(rows - r0);
        let gc = &g[r0 * out..(r0 + n) * out];
        if let (Some(dx), Some((pw, pa, c))) = (dx.as_mut(), gx.as_mut()) {
            pack_a(
                n,
                out,
                View {
                    data: gc,
                    rs: out,
                    cs: 1,
                },
                pa,
            );
            c[..n * inp].fill(0.0);
            gemm_packed(n, inp, out, pa, pw, c, inp);
            vecmath::narrow_into_uninit(
                &c[..n * inp],
                &mut dx.spare_capacity_mut()[r0 * inp..(r0 + n) * inp],
            );
        }
        if let Some((dw32, pa, pb)) = gw.as_mut() {
            pack_a(
                out,
                n,
                View {
                    data: gc,
                    rs: 1,
                    cs: out,
                },
                pa,
            );
            let xc = &x[r0 * inp..(r0 + n) * inp];
            pack_b(
                n,
                inp,
                View {
                    data: xc,
                    rs: inp,
                    cs: 1,
                },
                pb,
            );
            gemm_packed(out, inp, n, pa, pb, dw32, inp);
        }
        if let Some(db32) = db32.as_mut() {
            add_column_sums(gc, out, db32);
        }
        r0 += n;
    }
    if let Some(dx) = dx.as_mut() {
        // SAFETY: the chunks above cover rows 0..rows, every element written.
        unsafe { dx.set_len(rows * inp) };
    }
    // Every buffer stays alive until the gradients are out (the budget's model of the op).
    let dw = gw.map(|(dw32, pa, pb)| (W::grad_from_f32(dw32), pa, pb));
    let db = db32.map(W::grad_from_f32);
    let out = (dx, dw.map(|(d, _, _)| d), db);
    drop(gx);
    out
}

/// f32/f64 backward: dx = g·W, dW = gᵀ·x, db = Σ_rows g.
#[allow(clippy::type_complexity)]
fn linear_bwd_direct<A: Acc + Elem<A> + Send + Sync + 'static>(
    x: &[A],
    w: &[A],
    g: &[A],
    (rows, inp, out): (usize, usize, usize),
    want: LinearGrads,
) -> (Option<Vec<A>>, Option<Vec<A>>, Option<Vec<A>>) {
    let par = gemm_threads();
    let dx = want
        .x
        .then(|| mm_fresh(rows, inp, out, (g, out, 1), (w, inp, 1), par));
    let dw = want
        .w
        .then(|| mm_fresh(out, inp, rows, (g, 1, out), (x, inp, 1), par));
    let db = want.b.then(|| {
        let mut db = vec![A::ZERO; out];
        add_column_sums(g, out, &mut db);
        db
    });
    (dx, dw, db)
}

/// bf16/f16 backward, widened to f32 by chunks; dW and db accumulate in f32. Every f32 buffer is
/// laid out so that gemm packs nothing (see [`mm_strided`]): g twice (row- and column-major), W
/// transposed, x, dx and dW column-major.
#[allow(clippy::type_complexity)]
fn linear_bwd_widen<T: Elem<f32> + Send + Sync, W: Elem<f32> + Send + Sync>(
    x: &[T],
    w: &[W],
    g: &[T],
    (rows, inp, out): (usize, usize, usize),
    want: LinearGrads,
) -> (Option<Vec<T>>, Option<Vec<W>>, Option<Vec<W>>) {
    let par = gemm_threads();
    // Outputs first, then the scratch (the budget counts both alive together).
    let mut dx: Option<Vec<T>> = want.x.then(|| vec![T::from_acc(0.0); rows * inp]);
    let mut dw: Option<Vec<W>> = want.w.then(|| vec![W::from_acc(0.0); out * inp]);
    let mut db: Option<Vec<W>> = want.b.then(|| vec![W::from_acc(0.0); out]);
    let r = LINEAR_ROWS.min(rows);
    // g chunk row-major (the lhs of dW = gᵀ·x, unit row stride after the transpose) …
    let mut g32: Vec<f32> = vec![0.0; r * out];
    // … and, for dx, column-major, with Wᵀ (wt32[j·out + o] = W[o][j]) as a unit-row-stride rhs.
    let mut gc32: Option<Vec<f32>> = want.x.then(|| vec![0.0; r * out]);
    let wt32: Option<Vec<f32>> = want.x.then(|| {
        let mut t = vec![0.0f32; out * inp];
        t.par_chunks_mut(out)
            .enumerate()
            .with_min_len((PAR_CHUNK / out.max(1)).max(1))
            .for_each(|(j, col)| {
                for (o, d) in col.iter_mut().enumerate() {
                    *d = read_as::<T, W>(w[o * inp + j]);
                }
            });
        t
    });
    let mut dx32: Option<Vec<f32>> = want.x.then(|| vec![0.0; r * inp]);
    // dW column-major: dw32[j·out + o].
    let mut dw32: Option<Vec<f32>> = want.w.then(|| vec![0.0; out * inp]);
    let mut x32: Option<Vec<f32>> = want.w.then(|| vec![0.0; r * inp]);
    let mut db32: Option<Vec<f32>> = want.b.then(|| vec![0.0; out]);
    let mut r0 = 0;
    while r0 < rows {
        let n = r.min(rows - r0);
        widen_into(&g[r0 * out..(r0 + n) * out], &mut g32[..n * out]);
        if let (Some(dx), Some(dx32), Some(gc32), Some(wt32)) =
            (dx.as_mut(), dx32.as_mut(), gc32.as_mut(), wt32.as_ref())
        {
            to_colmajor(&g32, out, n, out, gc32);
            mm_strided(
                n,
                inp,
                out,
                (dx32, 1, n),
                (gc32, 1, n),
                (wt32, 1, out),
                false,
                par,
            );
            from_colmajor(dx32, n, inp, &mut dx[r0 * inp..]);
        }
        if let (Some(dw32), Some(x32)) = (dw32.as_mut(), x32.as_mut()) {
            to_colmajor(&x[r0 * inp..], inp, n, inp, x32);
            // dW (out × in) += gᵀ (out × n) · x (n × in).
            mm_strided(
                out,
                inp,
                n,
                (dw32, 1, out),
                (&g32, 1, out),
                (x32, 1, n),
                true,
                par,
            );
        }
        if let Some(db32) = db32.as_mut() {
            add_column_sums(&g32[..n * out], out, db32);
        }
        r0 += n;
    }
    if let (Some(dw), Some(dw32)) = (dw.as_mut(), dw32.as_ref()) {
        from_colmajor(dw32, out, inp, dw);
    }
    if let (Some(db), Some(db32)) = (db.as_mut(), db32.as_ref()) {
        for (d, s) in db.iter_mut().zip(db32) {
            *d = W::from_acc(*s);
        }
    }
    (dx, dw, db)
}

/// The dtype pairs a linear takes: x in the compute dtype, W and b in it too or, for a bf16/f16
/// compute dtype, in f32 (the master weights, rounded as they are read).
fn linear_dtypes(x: DType, w: DType, b: DType) -> CResult<()> {
    let ok = w == b && (w == x || (w == DType::F32 && matches!(x, DType::BF16 | DType::F16)));
    if ok {
        Ok(())
    } else {
        Err(err(format!(
            "linear: w and b must share x's dtype, or be f32 with a bf16/f16 x; got x {x:?}, w {w:?}, b {b:?}"
        )))
    }
}

impl CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let (rows, inp, out) = linear_dims(lx, lw, lb)?;
        linear_dtypes(sx.dtype(), sw.dtype(), sb.dtype())?;
        let n = "linear";
        let native = gemm_bf16::available();
        macro_rules! call {
            ($f:expr) => {
                $f(
                    cpu_slice(sx, lx, n)?,
                    cpu_slice(sw, lw, n)?,
                    cpu_slice(sb, lb, n)?,
                    rows,
                    inp,
                    out,
                )
            };
        }
        use half::{bf16, f16};
        let y = match (sx.dtype(), sw.dtype()) {
            (DType::F32, _) => CpuStorage::F32(call!(linear_fwd_direct::<f32>)),
            (DType::F64, _) => CpuStorage::F64(call!(linear_fwd_direct::<f64>)),
            (DType::BF16, DType::BF16) if native => {
                CpuStorage::BF16(call!(linear_fwd_bf16::<bf16>))
            }
            (DType::BF16, _) if native => CpuStorage::BF16(call!(linear_fwd_bf16::<f32>)),
            (DType::BF16, DType::BF16) => CpuStorage::BF16(call!(linear_fwd_widen::<bf16, bf16>)),
            (DType::BF16, _) => CpuStorage::BF16(call!(linear_fwd_widen::<bf16, f32>)),
            (DType::F16, DType::F16) => CpuStorage::F16(call!(linear_fwd_widen::<f16, f16>)),
            (DType::F16, _) => CpuStorage::F16(call!(linear_fwd_widen::<f16, f32>)),
            (other, _) => return Err(err(format!("linear: unsupported dtype {other:?}"))),
        };
        Ok((y, Shape::from((rows, out))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let want = LinearGrads {
            x: x.track_op(),
            w: w.track_op() || self.sink.as_ref().is_some_and(|s| s.want_w),
            b: b.track_op() || self.sink.as_ref().is_some_and(|s| s.want_b),
        };
        let grad = grad.contiguous()?;
        let dev = Device::Cpu;
        let native = gemm_bf16::available();
        with_cpu(x, |sx, lx| {
            with_cpu(w, |sw, lw| {
                with_cpu(&grad, |sg, lg| {
                    let dims = linear_dims(lx, lw, b.layout())?;
                    linear_dtypes(sx.dtype(), sw.dtype(), b.dtype())?;
                    let (rows, inp, out) = dims;
                    let n = "linear backward";
                    macro_rules! run {
                        ($f:expr) => {{
                            let (dx, dw, db) = $f(
                                cpu_slice(sx, lx, n)?,
                                cpu_slice(sw, lw, n)?,
                                cpu_slice(sg, lg, n)?,
                                dims,
                                want,
                            );
                            let dx = dx
                                .map(|v| Tensor::from_vec(v, (rows, inp), &dev))
                                .transpose()?;
                            let dw = dw
                                .map(|v| Tensor::from_vec(v, (out, inp), &dev))
                                .transpose()?;
                            let db = db.map(|v| Tensor::from_vec(v, out, &dev)).transpose()?;
                            match &self.sink {
                                Some(sink) => {
                                    GradSink::put(&sink.w, dw)?;
                                    GradSink::put(&sink.b, db)?;
                                    Ok((dx, None, None))
                                }
                                None => Ok((dx, dw, db)),
                            }
                        }};
                    }
                    use half::{bf16, f16};
                    match (sx.dtype(), sw.dtype()) {
                        (DType::F32, _) => run!(linear_bwd_direct::<f32>),
                        (DType::F64, _) => run!(linear_bwd_direct::<f64>),
                        (DType::BF16, DType::BF16) if native => {
                            run!(linear_bwd_bf16::<bf16>)
                        }
                        (DType::BF16, _) if native => run!(linear_bwd_bf16::<f32>),
                        (DType::BF16, DType::BF16) => run!(linear_bwd_widen::<bf16, bf16>),
                        (DType::BF16, _) => run!(linear_bwd_widen::<bf16, f32>),
                        (DType::F16, DType::F16) => run!(linear_bwd_widen::<f16, f16>),
                        (DType::F16, _) => run!(linear_bwd_widen::<f16, f32>),
                        (other, _) => {
                            Err(err(format!("linear backward: unsupported dtype {other:?}")))
                        }
                    }
                })
            })
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Gated residual.

/// `x + y·gate` with gate (b, D) broadcast over the tokens: the adaLN-Zero residual. Composed in
/// candle it keeps the (b·s, D) product (the sum's input) and, under mixed precision, y's cast to
/// the accumulation dtype; fused it keeps nothing beyond its inputs and reads y in the compute
/// dtype. Backward: dx = g (a fresh copy), dy = g·gate in y's dtype, dgate = Σ_s g·y.
#[derive(Debug, Clone, Copy, Default)]
pub struct GatedResidual;

/// Fused gated residual: x (b, s, D) in the accumulation dtype, y (b·s, D) or (b, s, D) in any
/// float dtype, gate (b, D) with unit column stride in x's dtype → (b, s, D) in x's dtype.
pub fn gated_residual(x: &Tensor, y: &Tensor, gate: &Tensor) -> CResult<Tensor> {
    x.apply_op3(y, gate, GatedResidual)
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
    let mut o: Vec<T> = vec![T::from_acc(A::ZERO); b * s * d];
    o.par_chunks_mut(d)
        .enumerate()
        .with_min_len((PAR_CHUNK / d.max(1)).max(1))
        .for_each(|(r, orow)| {
            let gr = &gate[off + (r / s) * rs..][..d];
            let (xr, yr) = (&x[r * d..(r + 1) * d], &y[r * d..(r + 1) * d]);
            for j in 0..d {
                orow[j] = T::from_acc(xr[j].to_acc() + yr[j].to_acc() * gr[j].to_acc());
            }
        });
    o
}

/// dy = g·gate (in y's type), one fresh buffer.
fn gated_dy_cpu<T, O, A>(g: &[T], gate: &[T], geom: (usize, usize, usize, usize, usize)) -> Vec<O>
where
    T: Elem<A> + Send + Sync,
    O: Elem<A> + Send + Sync,
    A: Acc,
{
    let (b, s, d, off, rs) = geom;
    let mut v: Vec<O> = vec![O::from_acc(A::ZERO); b * s * d];
    v.par_chunks_mut(d)
        .enumerate()
        .with_min_len((PAR_CHUNK / d.max(1)).max(1))
        .for_each(|(r, row)| {
            let gr = &gate[off + (r / s) * rs..][..d];
            for j in 0..d {
                row[j] = O::from_acc(g[r * d + j].to_acc() * gr[j].to_acc());
            }
        });
    v
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
    v.par_chunks_mut(d).enumerate().for_each(|(bi, row)| {
        for (j, o) in row.iter_mut().enumerate() {
            let mut a = A::ZERO;
            for si in 0..s {
                let r = (bi * s + si) * d + j;
                a += g[r].to_acc() * y[r].to_acc();
            }
            *o = T::from_acc(a);
        }
    });
    v
}

impl CustomOp3 for GatedResidual {
    fn name(&self) -> &'static str {
        "gated-residual"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sy: &CpuStorage,
        ly: &Layout,
        sg: &CpuStorage,
        lg: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
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

    fn bwd(
        &self,
        x: &Tensor,
        y: &Tensor,
        gate: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let (wx, wy, wg) = (x.track_op(), y.track_op(), gate.track_op());
        let dev = Device::Cpu;
        with_cpu(y, |sy, ly| {
            with_cpu(gate, |sgt, lgt| {
                with_cpu(&grad, |sg, lg| {
                    let (b, s, d, off, rs) = gated_geom(x.layout(), ly, lgt)?;
                    Ok(dispatch_ln!(sg.dtype(), sy.dtype(), |T, O, A| {
                        let g = cpu_slice::<T>(sg, lg, "gated residual grad")?;
                        let yv = cpu_slice::<O>(sy, ly, "gated residual y")?;
                        let gate = sgt.as_slice::<T>()?;
                        let dx = if wx {
                            let mut v: Vec<T> = Vec::with_capacity(g.len());
                            v.extend_from_slice(g);
                            Some(Tensor::from_vec(v, x.shape(), &dev)?)
                        } else {
                            None
                        };
                        let geom = (b, s, d, off, rs);
                        let dy = if wy {
                            let v = gated_dy_cpu::<T, O, A>(g, gate, geom);
                            Some(Tensor::from_vec(v, ly.shape(), &dev)?)
                        } else {
                            None
                        };
                        let dg = if wg {
                            let v = gated_dgate_cpu::<T, O, A>(g, yv, geom);
                            Some(Tensor::from_vec(v, lgt.shape(), &dev)?)
                        } else {
                            None
                        };
                        (dx, dy, dg)
                    }))
                })
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The linear's workspace as the engine states it is the budget's restatement, for every
    /// dtype, path and set of tracked inputs, on whole and ragged shapes.
    #[test]
    fn linear_scratch_is_the_budgets() {
        use ditmem_budget::ditmem_cpu::fused_linear_scratch;
        use ditmem_budget::Dtype;
        for (dt, bd) in [
            (DType::F32, Dtype::F32),
            (DType::F64, Dtype::F64),
            (DType::BF16, Dtype::Bf16),
            (DType::F16, Dtype::F16),
        ] {
            for dims in [(512, 384, 1152), (300, 37, 130), (7, 1, 1)] {
                for (native, master) in [(false, false), (true, false), (false, true), (true, true)]
                {
                    for bits in 0..8u8 {
                        let g = LinearGrads {
                            x: bits & 1 != 0,
                            w: bits & 2 != 0,
                            b: bits & 4 != 0,
                        };
                        let (rows, inp, out) = dims;
                        let budget = fused_linear_scratch(
                            bd,
                            (rows as u64, inp as u64, out as u64),
                            (g.x, g.w, g.b),
                            native,
                            master,
                        );
                        let engine = (
                            linear_fwd_scratch(dt, rows, inp, out, native),
                            linear_bwd_scratch(dt, dims, g, native, master),
                        );
                        assert_eq!(
                            engine, budget,
                            "{dt:?} {dims:?} native {native} master {master} {bits}"
                        );
                    }
                }
            }
        }
    }
}
