//! [`gelu_tanh`]: GELU with the tanh approximation as a custom op. It saves its input only
//! (which the graph holds anyway as the op's argument); the derivative is analytic with the
//! exact constants. f32/bf16/f16 run through the vectorised maps of
//! [`crate::kernels::vecmath`], f64 (the reference path) through scalar loops. Budget twin: the
//! `gelu` rule of `ditmem_budget::ditmem_cpu::ops` (output fresh, backward one fresh dx).

use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor,
};
use rayon::prelude::*;

use super::storage::{cpu_slice, err, with_cpus, CResult, PAR_CHUNK};
use crate::kernels::scalar::Acc;
use crate::kernels::vecmath::{self, Lanes};

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
pub(crate) fn gelu_fwd_storage(s: &CpuStorage, l: &Layout) -> CResult<CpuStorage> {
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

/// `dst[i] = f(dst[i], y[i])` in place (y absent: `f(dst[i], 0)`): [`vecmath::map_in_place`],
/// the same per-element arithmetic as [`vecmath::map1`] / [`vecmath::map2`] (so the same bits),
/// without a fresh buffer. Callers hold dst and y to one length.
fn map_in_place<T: Lanes, F: Fn(f32, f32) -> f32 + Sync>(dst: &mut [T], y: Option<&[T]>, f: F) {
    let same = vecmath::map_in_place(dst, y, f);
    debug_assert!(
        same.is_some(),
        "gelu: in-place map over slices of different lengths"
    );
}

/// GELU over a storage in place (the fused MLP turns the fc1 output it kept into the
/// activation): the forward's values, bit for bit.
pub(crate) fn gelu_in_place(s: &mut CpuStorage) -> CResult<()> {
    match s {
        CpuStorage::F64(v) => f64::gelu_over(v),
        CpuStorage::F32(v) => f32::gelu_over(v),
        CpuStorage::BF16(v) => map_in_place(v, None, |x, _| gelu_f32(x)),
        CpuStorage::F16(v) => map_in_place(v, None, |x, _| gelu_f32(x)),
        other => return Err(err(format!("gelu: unsupported dtype {:?}", other.dtype()))),
    }
    Ok(())
}

/// `g ← g · gelu'(x)` in place (the fused MLP's du over its dh): the backward's values, bit for
/// bit. g and x must share dtype and length.
pub(crate) fn gelu_grad_in_place(g: &mut CpuStorage, x: &CpuStorage) -> CResult<()> {
    let short = || err("gelu backward: gradient shape or dtype differs");
    match (g, x) {
        (CpuStorage::F64(g), CpuStorage::F64(x)) if g.len() == x.len() => g
            .par_iter_mut()
            .zip(x.par_iter())
            .with_min_len(PAR_CHUNK)
            .for_each(|(gv, &v)| *gv *= gelu_deriv(v)),
        (CpuStorage::F32(g), CpuStorage::F32(x)) if g.len() == x.len() => {
            map_in_place(g, Some(x), |gv, v| gelu_grad_f32(v, gv))
        }
        (CpuStorage::BF16(g), CpuStorage::BF16(x)) if g.len() == x.len() => {
            map_in_place(g, Some(x), |gv, v| gelu_grad_f32(v, gv))
        }
        (CpuStorage::F16(g), CpuStorage::F16(x)) if g.len() == x.len() => {
            map_in_place(g, Some(x), |gv, v| gelu_grad_f32(v, gv))
        }
        _ => return Err(short()),
    }
    Ok(())
}

/// The GELU's maps on f32/f64 slices, for the fused MLP's backward on the direct (`gemm`)
/// path, which works on row chunks: the same per-element arithmetic as [`gelu_in_place`] and
/// [`gelu_grad_in_place`] (so the same bits).
pub(crate) trait GeluSlice: Sized {
    /// `v ← gelu(v)`.
    fn gelu_over(v: &mut [Self]);
    /// `x ← g · gelu'(x)`: the input's gradient written over the input (x and g of one length).
    fn grad_over_input(x: &mut [Self], g: &[Self]);
}

impl GeluSlice for f32 {
    fn gelu_over(v: &mut [f32]) {
        map_in_place(v, None, |x, _| gelu_f32(x));
    }
    fn grad_over_input(x: &mut [f32], g: &[f32]) {
        debug_assert_eq!(x.len(), g.len());
        map_in_place(x, Some(g), gelu_grad_f32);
    }
}

impl GeluSlice for f64 {
    fn gelu_over(v: &mut [f64]) {
        v.par_iter_mut()
            .with_min_len(PAR_CHUNK)
            .for_each(|x| *x = gelu_val(*x));
    }
    fn grad_over_input(x: &mut [f64], g: &[f64]) {
        debug_assert_eq!(x.len(), g.len());
        x.par_iter_mut()
            .zip(g.par_iter())
            .with_min_len(PAR_CHUNK)
            .for_each(|(v, &gv)| *v = gv * gelu_deriv(*v));
    }
}

/// bf16/f16: the same per-element f32 arithmetic and narrowing as [`gelu_in_place`] and
/// [`gelu_grad_in_place`] on their storages (the widened fused MLP's backward works on row
/// chunks of them).
macro_rules! gelu_slice_half {
    ($t:ty) => {
        impl GeluSlice for $t {
            fn gelu_over(v: &mut [$t]) {
                map_in_place(v, None, |x, _| gelu_f32(x));
            }
            fn grad_over_input(x: &mut [$t], g: &[$t]) {
                debug_assert_eq!(x.len(), g.len());
                map_in_place(x, Some(g), gelu_grad_f32);
            }
        }
    };
}
gelu_slice_half!(half::bf16);
gelu_slice_half!(half::f16);

/// The GELU-tanh custom op (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct GeluTanh;

/// GELU with the tanh approximation, differentiable, saving only its input.
pub fn gelu_tanh(x: &Tensor) -> CResult<Tensor> {
    x.apply_op1(GeluTanh)
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
        let dx = with_cpus([arg, &grad], |[(xs, xl), (gs, gl)]| {
            gelu_bwd_tensor(xs, xl, gs, gl)
        })?;
        Ok(Some(dx))
    }
}
