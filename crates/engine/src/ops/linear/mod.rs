//! [`linear`]: `x·Wᵀ + b` as one fused node ([`LinearOp`]) and, through [`linear_sunk`], its
//! weight gradients handed to a [`GradSink`]. Three kernel paths: `direct` (f32/f64 through
//! `gemm`), `bf16` (the AVX512-BF16 kernel) and `widen` (bf16/f16 widened to f32 by chunks).
//! Budget twin: `ditmem_budget::ditmem_cpu::ops::fused_linear`; its workspace is stated once,
//! there (`fused_linear_scratch`), over the chunk sizes this op allocates by (`common.rs`,
//! `bf16::dx_panel_cols`: the budget's `ops::sizes`).

mod bf16;
mod common;
mod direct;
mod input_sink;
mod sink;
mod widen;

use std::sync::Arc;

use candle_core::{backend::BackendStorage, CpuStorage, DType, Layout, Shape, Tensor};

use crate::kernels::gemm_bf16;
use crate::ops::custom_op::{Cpu, CpuOp, Grads, Op};
pub(crate) use crate::ops::storage::storage_tensor;
use crate::ops::storage::{cpu_slice, err, with_cpus, CResult};

pub(crate) use bf16::{dw_chunk, dx_chunk};
use bf16::{linear_bwd_bf16, linear_fwd_bf16};
pub(crate) use common::add_column_sums;
pub(crate) use common::GradFromF32;
pub(crate) use common::LinearGrads;
pub use common::{dw_blocks, DW_COLS, DW_PANEL_SHARE, DW_ROWS, LINEAR_ROWS};
use direct::{linear_bwd_direct, linear_fwd_direct};
pub use input_sink::InputSink;
pub use sink::GradSink;
pub(crate) use widen::{from_colmajor, to_colmajor, widen_into, widened_transpose};
use widen::{linear_bwd_widen, linear_fwd_widen};

/// `y = x·Wᵀ + b` on a 2-D x as one node: candle's composition keeps both the product and the
/// biased sum alive (two (rows, out) tensors per linear) and, in bf16, widens the whole of both
/// operands to f32 for every product. This op keeps nothing beyond its inputs, calls `gemm`
/// directly on f32/f64 data (W read transposed in place); on bf16 with AVX512-BF16 it packs W
/// once and x by chunks of [`LINEAR_ROWS`] rows for [`crate::kernels::gemm_bf16`], otherwise (and on
/// f16) it widens W once and x by chunks to f32; both accumulate in f32. Backward returns dx,
/// dW, db for the inputs that track (a frozen LoRA base gets only dx).
///
/// With a [`GradSink`], W and b go in untracked and the backward hands their gradients to the
/// sink instead of returning them to candle: candle would fold each into its store as
/// `zeros_like(W) + dW`, a memset and an add over every weight of the model per step (and a
/// moment with three weight-sized buffers alive), only for the trainer to take the sum out.
/// With an [`InputSink`], dx goes the same way: added in place into the sink's running sum
/// (the text context every block's cross-attention reads).
#[derive(Debug, Clone, Default)]
pub(crate) struct LinearOp {
    sink: Option<Arc<GradSink>>,
    dx_sink: Option<Arc<InputSink>>,
}

/// Fused linear (see [`LinearOp`]): x (rows, in), w (out, in), b (out) → (rows, out).
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> CResult<Tensor> {
    x.apply_op3(w, b, Op(LinearOp::default()))
}

/// The fused linear with its weight gradients handed to `sink` (see [`LinearOp`]). `w` and `b`
/// should not track (pass detached tensors); which of dW, db the backward computes is the sink's
/// [`GradSink::new`] choice. The backward runs only if x tracks (candle calls a node's backward
/// only when one of its inputs tracks), so use it where the input does.
pub fn linear_sunk(x: &Tensor, w: &Tensor, b: &Tensor, sink: &Arc<GradSink>) -> CResult<Tensor> {
    x.apply_op3(
        w,
        b,
        Op(LinearOp {
            sink: Some(Arc::clone(sink)),
            dx_sink: None,
        }),
    )
}

/// The fused linear with its weight gradients handed to `sink` when given (as [`linear_sunk`];
/// else to candle) and dx added into `dx_sink` (see [`InputSink`]) instead of candle's store.
/// x must track for the backward to run.
pub(crate) fn linear_into(
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    sink: Option<&Arc<GradSink>>,
    dx_sink: &Arc<InputSink>,
) -> CResult<Tensor> {
    x.apply_op3(
        w,
        b,
        Op(LinearOp {
            sink: sink.map(Arc::clone),
            dx_sink: Some(Arc::clone(dx_sink)),
        }),
    )
}

fn linear_dims(lx: &Layout, lw: &Layout, lb: &Layout) -> CResult<(usize, usize, usize)> {
    match (lx.dims(), lw.dims(), lb.dims()) {
        (&[rows, inp], &[out, inp2], &[out2]) if inp == inp2 && out == out2 => Ok((rows, inp, out)),
        (x, w, b) => Err(err(format!(
            "linear expects x (rows, in), w (out, in), b (out); got {x:?}, {w:?}, {b:?}"
        ))),
    }
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

/// The linear's forward on CPU storages: `y = x·Wᵀ + b` through the kernel path of the dtypes
/// (see [`LinearOp`]); the fused MLP calls it for both of its products.
pub(crate) fn linear_fwd_storage(
    (sx, lx): (&CpuStorage, &Layout),
    (sw, lw): (&CpuStorage, &Layout),
    (sb, lb): (&CpuStorage, &Layout),
) -> CResult<(CpuStorage, Shape)> {
    let (rows, inp, out) = linear_dims(lx, lw, lb)?;
    linear_dtypes(sx.dtype(), sw.dtype(), sb.dtype())?;
    let n = "linear";
    let native = gemm_bf16::in_use();
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
        (DType::BF16, DType::BF16) if native => CpuStorage::BF16(call!(linear_fwd_bf16::<bf16>)),
        (DType::BF16, _) if native => CpuStorage::BF16(call!(linear_fwd_bf16::<f32>)),
        (DType::BF16, DType::BF16) => CpuStorage::BF16(call!(linear_fwd_widen::<bf16, bf16>)),
        (DType::BF16, _) => CpuStorage::BF16(call!(linear_fwd_widen::<bf16, f32>)),
        (DType::F16, DType::F16) => CpuStorage::F16(call!(linear_fwd_widen::<f16, f16>)),
        (DType::F16, _) => CpuStorage::F16(call!(linear_fwd_widen::<f16, f32>)),
        (other, _) => return Err(err(format!("linear: unsupported dtype {other:?}"))),
    };
    Ok((y, Shape::from((rows, out))))
}

/// The gradients (dx, dW, db) a linear's backward computes, as CPU storages.
pub(crate) type LinearGradStorages = (Option<CpuStorage>, Option<CpuStorage>, Option<CpuStorage>);

/// The linear's backward on CPU storages: the gradients `want` asks for, from x, W, b's layout
/// and dtype, and the output gradient g (contiguous). x is read only for dW.
pub(crate) fn linear_bwd_storage(
    (sx, lx): (&CpuStorage, &Layout),
    (sw, lw): (&CpuStorage, &Layout),
    (bdt, lb): (DType, &Layout),
    (sg, lg): (&CpuStorage, &Layout),
    want: LinearGrads,
) -> CResult<LinearGradStorages> {
    let dims = linear_dims(lx, lw, lb)?;
    linear_dtypes(sx.dtype(), sw.dtype(), bdt)?;
    let native = gemm_bf16::in_use();
    let n = "linear backward";
    // x is read for dW alone: a caller may have released a frozen linear's input
    // (`ops::release`), so it is not even sliced then.
    macro_rules! run {
        ($f:expr, $sx:path, $sw:path) => {{
            let (dx, dw, db) = $f(
                if want.w { cpu_slice(sx, lx, n)? } else { &[] },
                cpu_slice(sw, lw, n)?,
                cpu_slice(sg, lg, n)?,
                dims,
                want,
            );
            Ok((dx.map($sx), dw.map($sw), db.map($sw)))
        }};
    }
    use half::{bf16, f16};
    use CpuStorage as S;
    match (sx.dtype(), sw.dtype()) {
        (DType::F32, _) => run!(linear_bwd_direct::<f32>, S::F32, S::F32),
        (DType::F64, _) => run!(linear_bwd_direct::<f64>, S::F64, S::F64),
        (DType::BF16, DType::BF16) if native => run!(linear_bwd_bf16::<bf16>, S::BF16, S::BF16),
        (DType::BF16, _) if native => run!(linear_bwd_bf16::<f32>, S::BF16, S::F32),
        (DType::BF16, DType::BF16) => run!(linear_bwd_widen::<bf16, bf16>, S::BF16, S::BF16),
        (DType::BF16, _) => run!(linear_bwd_widen::<bf16, f32>, S::BF16, S::F32),
        (DType::F16, DType::F16) => run!(linear_bwd_widen::<f16, f16>, S::F16, S::F16),
        (DType::F16, _) => run!(linear_bwd_widen::<f16, f32>, S::F16, S::F32),
        (other, _) => Err(err(format!("linear backward: unsupported dtype {other:?}"))),
    }
}

/// dx = g·W alone, without x: the kernels read x only for dW, so a caller that has dropped x
/// (the fused MLP beside a side input drops its concatenation before dx) passes none. The same
/// dtype paths and bits as [`linear_bwd_storage`] with only `x` wanted.
pub(crate) fn linear_dx_storage(
    (sw, lw): (&CpuStorage, &Layout),
    (bdt, lb): (DType, &Layout),
    (sg, lg): (&CpuStorage, &Layout),
) -> CResult<CpuStorage> {
    let (rows, out) = match lg.dims() {
        &[rows, out] => (rows, out),
        d => return Err(err(format!("linear dx: gradient must be 2-D, got {d:?}"))),
    };
    let inp = match lw.dims() {
        &[o, i] if o == out => i,
        d => {
            return Err(err(format!(
                "linear dx: w {d:?} does not match the gradient's {out} columns"
            )))
        }
    };
    if lb.dims() != [out] {
        return Err(err(format!("linear dx: b {:?} is not ({out})", lb.dims())));
    }
    linear_dtypes(sg.dtype(), sw.dtype(), bdt)?;
    let native = gemm_bf16::in_use();
    let n = "linear dx";
    let want = LinearGrads {
        x: true,
        w: false,
        b: false,
    };
    macro_rules! run {
        ($f:expr, $sx:path, $t:ty) => {{
            let none: &[$t] = &[];
            let (dx, _, _) = $f(
                none,
                cpu_slice(sw, lw, n)?,
                cpu_slice(sg, lg, n)?,
                (rows, inp, out),
                want,
            );
            dx.map($sx).ok_or_else(|| err("linear dx: no dx"))
        }};
    }
    use half::{bf16, f16};
    use CpuStorage as S;
    match (sg.dtype(), sw.dtype()) {
        (DType::F32, _) => run!(linear_bwd_direct::<f32>, S::F32, f32),
        (DType::F64, _) => run!(linear_bwd_direct::<f64>, S::F64, f64),
        (DType::BF16, DType::BF16) if native => run!(linear_bwd_bf16::<bf16>, S::BF16, bf16),
        (DType::BF16, _) if native => run!(linear_bwd_bf16::<f32>, S::BF16, bf16),
        (DType::BF16, DType::BF16) => run!(linear_bwd_widen::<bf16, bf16>, S::BF16, bf16),
        (DType::BF16, _) => run!(linear_bwd_widen::<bf16, f32>, S::BF16, bf16),
        (DType::F16, DType::F16) => run!(linear_bwd_widen::<f16, f16>, S::F16, f16),
        (DType::F16, _) => run!(linear_bwd_widen::<f16, f32>, S::F16, f16),
        (other, _) => Err(err(format!("linear dx: unsupported dtype {other:?}"))),
    }
}

/// The weight and bias gradients of a linear as tensors of W's and b's shapes.
pub(crate) fn weight_grads(
    (dw, db): (Option<CpuStorage>, Option<CpuStorage>),
    (out, inp): (usize, usize),
) -> CResult<(Option<Tensor>, Option<Tensor>)> {
    Ok((
        dw.map(|v| storage_tensor(v, (out, inp))).transpose()?,
        db.map(|v| storage_tensor(v, out)).transpose()?,
    ))
}

impl CpuOp<3> for LinearOp {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn fwd(&self, [(sx, lx), (sw, lw), (sb, lb)]: [Cpu<'_>; 3]) -> CResult<(CpuStorage, Shape)> {
        linear_fwd_storage((sx, lx), (sw, lw), (sb, lb))
    }

    fn bwd(&self, [x, w, b]: [&Tensor; 3], _res: &Tensor, grad: &Tensor) -> Grads<3> {
        let want = LinearGrads {
            x: x.track_op(),
            w: w.track_op() || self.sink.as_ref().is_some_and(|s| s.want_w),
            b: b.track_op() || self.sink.as_ref().is_some_and(|s| s.want_b),
        };
        let grad = grad.contiguous()?;
        let (dx, dw, db) = with_cpus([x, w, &grad], |[(sx, lx), (sw, lw), (sg, lg)]| {
            linear_bwd_storage((sx, lx), (sw, lw), (b.dtype(), b.layout()), (sg, lg), want)
        })?;
        let mut dx = dx.map(|v| storage_tensor(v, x.shape())).transpose()?;
        if let (Some(sink), Some(d)) = (&self.dx_sink, &dx) {
            // Added into the running sum and freed before the weights' gradients are handed on.
            sink.add(d)?;
            dx = None;
        }
        let (dw, db) = weight_grads((dw, db), w.dims2()?)?;
        match &self.sink {
            Some(sink) => {
                sink.put_both(dw, db)?;
                Ok([dx, None, None])
            }
            None => Ok([dx, dw, db]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The row chunks the budget counts are the engine's.
    #[test]
    fn row_chunks_are_the_budgets() {
        use ditmem_budget::ditmem_cpu::ops;
        assert_eq!(LINEAR_ROWS as u64, ops::LINEAR_ROWS);
        assert_eq!(DW_ROWS as u64, ops::DW_ROWS);
        assert_eq!(DW_COLS as u64, ops::DW_COLS);
        assert_eq!(DW_PANEL_SHARE as u64, ops::DW_PANEL_SHARE);
        for rows in [1, 64, 256, 512, 2100, 4096, 32768] {
            for out in [1, 7, 16, 384, 511, 512, 513, 1152, 1536, 4096, 5000] {
                let engine: Vec<(u64, u64)> = dw_blocks(rows, out)
                    .map(|(o, n)| (o as u64, n as u64))
                    .collect();
                let at = format!("rows {rows}, out {out}");
                assert_eq!(
                    engine,
                    ops::dw_blocks(rows as u64, out as u64).collect::<Vec<_>>(),
                    "{at}"
                );
                assert_eq!(engine.iter().map(|b| b.1).sum::<u64>(), out as u64, "{at}");
                // Each block within the cap (rounded up to whole lanes): 128 rows of dW, or
                // a panel of at most 1/16 of g.
                let cap = DW_COLS.max(rows * out / (DW_PANEL_SHARE * DW_ROWS));
                let widest = engine.iter().map(|b| b.1).max().unwrap_or(0) as usize;
                assert!(widest <= cap.next_multiple_of(16), "{at}: {engine:?}");
            }
        }
        // Few rows: blocks of at most 128 (the panel's floor); many: one block.
        assert_eq!(dw_blocks(512, 1536).count(), 8);
        assert_eq!(dw_blocks(256, 1536).count(), 12);
        assert_eq!(dw_blocks(4096, 1536).collect::<Vec<_>>(), vec![(0, 1536)]);
    }

    /// Two linears on one tracked input (a cross-attention's k and v projections of the
    /// context): with an input sink their dx's land in the sink's buffer, not in candle's
    /// store, and sum to the store's gradient without the sink (exactly on f32/f64: two
    /// contributions added to zero in either order); the weights' gradients are unchanged.
    #[test]
    fn input_sink_takes_the_inputs_gradient() {
        use candle_core::Var;
        let dev = Device::Cpu;
        for dt in [DType::F32, DType::F64] {
            let val = |n: usize, s: usize| -> Vec<f64> {
                (0..n)
                    .map(|i| ((i * 37 + s * 11) % 23) as f64 / 23.0 - 0.5)
                    .collect()
            };
            let t = |v: Vec<f64>, shape: (usize, usize)| {
                Tensor::from_vec(v, shape, &dev)
                    .unwrap()
                    .to_dtype(dt)
                    .unwrap()
            };
            let (rows, inp, out) = (40, 6, 5);
            let x = Var::from_tensor(&t(val(rows * inp, 1), (rows, inp))).unwrap();
            let wk = Var::from_tensor(&t(val(out * inp, 2), (out, inp))).unwrap();
            let wv = Var::from_tensor(&t(val(out * inp, 3), (out, inp))).unwrap();
            let b = Tensor::zeros(out, dt, &dev).unwrap();
            let loss = |k: Tensor, v: Tensor| (k.sqr().unwrap() + v).unwrap().sum_all().unwrap();

            let plain = loss(
                linear(x.as_tensor(), wk.as_tensor(), &b).unwrap(),
                linear(x.as_tensor(), wv.as_tensor(), &b).unwrap(),
            )
            .backward()
            .unwrap();
            let sink = Arc::new(InputSink::default());
            sink.set(Tensor::zeros((rows, inp), dt, &dev).unwrap())
                .unwrap();
            let sunk = loss(
                linear_into(x.as_tensor(), wk.as_tensor(), &b, None, &sink).unwrap(),
                linear_into(x.as_tensor(), wv.as_tensor(), &b, None, &sink).unwrap(),
            )
            .backward()
            .unwrap();
            assert!(sunk.get(x.as_tensor()).is_none(), "{dt:?}: dx in the store");
            let flat = |t: &Tensor| t.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
            let got = flat(&sink.take().unwrap()).to_vec1::<f64>().unwrap();
            let want = flat(plain.get(x.as_tensor()).unwrap())
                .to_vec1::<f64>()
                .unwrap();
            assert_eq!(got, want, "{dt:?} dx");
            for w in [&wk, &wv] {
                let a = flat(sunk.get(w.as_tensor()).unwrap())
                    .to_vec1::<f64>()
                    .unwrap();
                let b = flat(plain.get(w.as_tensor()).unwrap())
                    .to_vec1::<f64>()
                    .unwrap();
                assert_eq!(a, b, "{dt:?} dW");
            }
        }
    }

    /// The direct path's dW, summed over row chunks (three here, the last ragged), and its dx
    /// and db are the plain sums: exact to f64 rounding on f64, to f32 rounding on f32.
    #[test]
    fn chunked_weight_gradient_is_the_plain_sum() {
        let (rows, inp, out) = (2 * DW_ROWS + 88, 5, 7);
        let val = |i: usize, s: usize| ((i * 37 + s * 11) % 23) as f64 / 23.0 - 0.5;
        let x: Vec<f64> = (0..rows * inp).map(|i| val(i, 1)).collect();
        let w: Vec<f64> = (0..out * inp).map(|i| val(i, 2)).collect();
        let g: Vec<f64> = (0..rows * out).map(|i| val(i, 3)).collect();
        let mut dw = vec![0.0; out * inp];
        let mut dx = vec![0.0; rows * inp];
        let mut db = vec![0.0; out];
        for r in 0..rows {
            for o in 0..out {
                db[o] += g[r * out + o];
                for i in 0..inp {
                    dw[o * inp + i] += g[r * out + o] * x[r * inp + i];
                    dx[r * inp + i] += g[r * out + o] * w[o * inp + i];
                }
            }
        }
        let all = LinearGrads {
            x: true,
            w: true,
            b: true,
        };
        let close = |got: &[f64], want: &[f64], tol: f64, what: &str| {
            assert_eq!(got.len(), want.len(), "{what}");
            for (a, b) in got.iter().zip(want) {
                assert!((a - b).abs() <= tol * (1.0 + b.abs()), "{what}: {a} vs {b}");
            }
        };
        let (gx, gw, gb) = direct::linear_bwd_direct(&x, &w, &g, (rows, inp, out), all);
        close(&gw.unwrap(), &dw, 1e-12, "f64 dW");
        close(&gx.unwrap(), &dx, 1e-12, "f64 dx");
        close(&gb.unwrap(), &db, 1e-12, "f64 db");
        let f = |v: &[f64]| v.iter().map(|&a| a as f32).collect::<Vec<f32>>();
        let back = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<f64>>();
        let (gx, gw, _) = direct::linear_bwd_direct(&f(&x), &f(&w), &f(&g), (rows, inp, out), all);
        close(&back(gw.unwrap()), &dw, 1e-4, "f32 dW");
        close(&back(gx.unwrap()), &dx, 1e-5, "f32 dx");
    }
}
