//! [`lora_linear`]: a frozen linear and its LoRA branch, `y = x·Wᵀ + b + (x·Aᵀ)·Bᵀ`, as one
//! node on (x, A, B); W and b (frozen, no gradient) are held by the op.
//!
//! Why: composed (the fused linear, two candle matmuls and an add), candle's graph keeps the
//! base output, the branch's product and their sum (three output-sized tensors) and x·Aᵀ until
//! the block's backward ends, though no backward reads the first two; and it adds the base's and
//! the branch's dx through the gradient store. A PixArt block under LoRA on its eight attention
//! linears kept 936 KiB of the three in 1.49 MiB, 624 KiB beyond one output per linear (the tiny
//! `pixart-bf16-lora8-none` spec). PyTorch keeps none of them: a frozen base linear saves
//! nothing for its backward. This op keeps nothing beyond its inputs: the backward recomputes
//! x·Aᵀ (r wide) and returns dx (the base's and the branch's parts summed in the op, or added
//! into the input sink), dA and dB.
//!
//! Every product is the engine's linear (`linear_fwd_storage` / `linear_bwd_storage`; the
//! branch's two with a zero bias), so bf16/f16 products round as the fused linear's do; the sum
//! y + x·Aᵀ·Bᵀ and dx's two parts are added in the compute dtype. Values equal the composition's
//! to the dtype's rounding (candle's matmuls and store sum the same terms in another order;
//! `tests/lora.rs`). Budget twin: `lora_linear` of `ditmem_budget::ditmem_cpu::block` (its
//! workspaces phase by phase: [`lora_linear`]'s steps below, in order).

use std::sync::Arc;

use candle_core::{backend::BackendStorage, CpuStorage, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::linear::{
    linear_bwd_storage, linear_fwd_storage, storage_tensor, InputSink, LinearGrads,
};
use super::storage::{err, with_cpu, with_cpus, CResult, PAR_CHUNK};
use crate::kernels::scalar::{Acc, Elem};
use crate::ops::custom_op::{Cpu, CpuOp, Grads, Op};

/// The op (see the module docs).
#[derive(Debug)]
pub(crate) struct LoraLinear {
    w: Tensor,
    b: Tensor,
    dx_sink: Option<Arc<InputSink>>,
}

/// `x·Wᵀ + b + (x·Aᵀ)·Bᵀ` on a 2-D x (rows, in) with the frozen W (out, in) and b (out), the
/// adapters A (r, in) and B (out, r) → (rows, out) in x's dtype. With `dx_sink` (and a tracked
/// x) the backward adds dx into the sink instead of handing it to candle.
pub fn lora_linear(
    x: &Tensor,
    a: &Tensor,
    bm: &Tensor,
    (w, b): (&Tensor, &Tensor),
    dx_sink: Option<&Arc<InputSink>>,
) -> CResult<Tensor> {
    if w.track_op() || b.track_op() {
        return Err(err("lora linear: the base weights must be frozen"));
    }
    x.apply_op3(
        a,
        bm,
        Op(LoraLinear {
            w: w.clone(),
            b: b.clone(),
            dx_sink: dx_sink.map(Arc::clone),
        }),
    )
}

/// A zero bias of `n` elements in `dt` and its layout (the branch's products have none).
fn zeros(dt: DType, n: usize) -> CResult<(CpuStorage, Layout)> {
    let s = match dt {
        DType::F32 => CpuStorage::F32(vec![0.0; n]),
        DType::F64 => CpuStorage::F64(vec![0.0; n]),
        DType::BF16 => CpuStorage::BF16(vec![half::bf16::ZERO; n]),
        DType::F16 => CpuStorage::F16(vec![half::f16::ZERO; n]),
        other => return Err(err(format!("lora linear: unsupported dtype {other:?}"))),
    };
    Ok((s, Layout::contiguous(n)))
}

/// `y += z` elementwise in the storage's dtype (rounded once per element), on the pool: it runs
/// on every adapted linear's (rows, out) output and (rows, in) dx.
fn add_into(y: &mut CpuStorage, z: &CpuStorage) -> CResult<()> {
    fn go<T: Elem<A> + Send + Sync, A: Acc>(y: &mut [T], z: &[T]) {
        y.par_iter_mut()
            .zip(z.par_iter())
            .with_min_len(PAR_CHUNK)
            .for_each(|(a, b)| *a = T::from_acc(a.to_acc() + b.to_acc()));
    }
    match (y, z) {
        (CpuStorage::F32(y), CpuStorage::F32(z)) => go::<f32, f32>(y, z),
        (CpuStorage::F64(y), CpuStorage::F64(z)) => go::<f64, f64>(y, z),
        (CpuStorage::BF16(y), CpuStorage::BF16(z)) => go::<half::bf16, f32>(y, z),
        (CpuStorage::F16(y), CpuStorage::F16(z)) => go::<half::f16, f32>(y, z),
        _ => return Err(err("lora linear: the two parts differ in dtype")),
    }
    Ok(())
}

/// (rows, in, out, r) of a call, checked.
fn dims(lx: &Layout, la: &Layout, lb: &Layout, w: &Tensor) -> CResult<[usize; 4]> {
    let (rows, inp) = lx.shape().dims2()?;
    let (r, ain) = la.shape().dims2()?;
    let (out, br) = lb.shape().dims2()?;
    let (wout, win) = w.dims2()?;
    if ain != inp || br != r || wout != out || win != inp {
        return Err(err(format!(
            "lora linear: x {:?}, A {:?}, B {:?} and W {:?} do not chain",
            lx.dims(),
            la.dims(),
            lb.dims(),
            w.dims()
        )));
    }
    Ok([rows, inp, out, r])
}

impl CpuOp<3> for LoraLinear {
    fn name(&self) -> &'static str {
        "lora-linear"
    }

    /// Steps: the base y; x·Aᵀ (beside a zero bias of r); x·Aᵀ·Bᵀ (beside a zero bias of out),
    /// x·Aᵀ freed; y += it, freed.
    fn fwd(&self, [(sx, lx), (sa, la), (sbm, lbm)]: [Cpu<'_>; 3]) -> CResult<(CpuStorage, Shape)> {
        let [rows, _, out, r] = dims(lx, la, lbm, &self.w)?;
        let (mut y, shape) = with_cpus([&self.w, &self.b], |[(sw, lw), (sb, lb)]| {
            linear_fwd_storage((sx, lx), (sw, lw), (sb, lb))
        })?;
        let xa = {
            let (zr, lzr) = zeros(sa.dtype(), r)?;
            linear_fwd_storage((sx, lx), (sa, la), (&zr, &lzr))?.0
        };
        let xab = {
            let (zo, lzo) = zeros(sbm.dtype(), out)?;
            let lxa = Layout::contiguous((rows, r));
            linear_fwd_storage((&xa, &lxa), (sbm, lbm), (&zo, &lzo))?.0
        };
        drop(xa);
        add_into(&mut y, &xab)?;
        Ok((y, shape))
    }

    /// Steps: the base's dx; x·Aᵀ again (beside a zero bias of r); g·B and dB; the branch's dx
    /// and dA from g·B; dx += the branch's, x·Aᵀ, g·B and the branch's dx freed.
    fn bwd(&self, [x, a, bm]: [&Tensor; 3], _res: &Tensor, grad: &Tensor) -> Grads<3> {
        let grad = grad.contiguous()?;
        let (want_x, want_a, want_b) = (x.track_op(), a.track_op(), bm.track_op());
        let [rows, _, out, r] = dims(x.layout(), a.layout(), bm.layout(), &self.w)?;
        let (dx, da, db) = with_cpus(
            [x, a, bm, &grad],
            |[(sx, lx), (sa, la), (sbm, lbm), (sg, lg)]| {
                let mut dx = if want_x {
                    with_cpu(&self.w, |sw, lw| {
                        let want = LinearGrads {
                            x: true,
                            w: false,
                            b: false,
                        };
                        let lb = self.b.layout();
                        let g = linear_bwd_storage(
                            (sx, lx),
                            (sw, lw),
                            (self.b.dtype(), lb),
                            (sg, lg),
                            want,
                        )?;
                        Ok(g.0)
                    })?
                } else {
                    None
                };
                let xa = {
                    let (zr, lzr) = zeros(sa.dtype(), r)?;
                    linear_fwd_storage((sx, lx), (sa, la), (&zr, &lzr))?.0
                };
                let lxa = Layout::contiguous((rows, r));
                let lzo = Layout::contiguous(out);
                let (gb, db, _) = linear_bwd_storage(
                    (&xa, &lxa),
                    (sbm, lbm),
                    (sbm.dtype(), &lzo),
                    (sg, lg),
                    LinearGrads {
                        x: want_x || want_a,
                        w: want_b,
                        b: false,
                    },
                )?;
                drop(xa);
                let (dxl, da) = match gb {
                    Some(gb) => {
                        let lzr = Layout::contiguous(r);
                        let (dxl, da, _) = linear_bwd_storage(
                            (sx, lx),
                            (sa, la),
                            (sa.dtype(), &lzr),
                            (&gb, &lxa),
                            LinearGrads {
                                x: want_x,
                                w: want_a,
                                b: false,
                            },
                        )?;
                        (dxl, da)
                    }
                    None => (None, None),
                };
                if let (Some(d), Some(l)) = (dx.as_mut(), dxl.as_ref()) {
                    add_into(d, l)?;
                }
                Ok((dx, da, db))
            },
        )?;
        let mut dx = dx.map(|v| storage_tensor(v, x.shape())).transpose()?;
        if let (Some(sink), Some(d)) = (&self.dx_sink, &dx) {
            sink.add(d)?;
            dx = None;
        }
        let da = da.map(|v| storage_tensor(v, a.shape())).transpose()?;
        let db = db.map(|v| storage_tensor(v, bm.shape())).transpose()?;
        Ok([dx, da, db])
    }
}
