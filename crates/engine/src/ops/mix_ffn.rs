//! [`mix_ffn`]: Sana's Mix-FFN (`GLUMBConv`: `conv_inverted` 1×1 → SiLU → depthwise 3×3
//! `conv_depth` → `hidden · SiLU(gate)` → `conv_point` 1×1) as one node on its input h (rows, D)
//! and the depthwise conv's weight and bias ([`MixFfn`]). Budget twin:
//! `ditmem_budget::ditmem_cpu::sana::mix_ffn` and `mix_ffn_workspace`.
//!
//! Why: composed of the two linears, [`silu_dwconv3x3`](super::dwconv::silu_dwconv3x3) and
//! [`glu_silu`](super::glu::glu_silu), the graph keeps f1 = conv_inverted(h) (rows × 2H), the
//! conv's output c2 (rows × 2H) and the gate's output (rows × H), and candle's backward folds
//! each gradient into its store as `zeros_like + add` while the node's own output gradient is
//! alive (candle-core 0.11 `backprop.rs`): dc2, its zeros and its sum beside dgl at the gate;
//! df1, its zeros and its sum beside dc2 at the conv — the Sana block's worst moment. This op
//! keeps f1 only. Its backward recomputes c2 from f1 and the gate's output from c2 (for
//! `conv_point`'s dW, freed at once), makes dgl, writes dc2 over c2, takes the conv's dW and db
//! from f1 and dc2, writes df1 over f1 (a token's df1 reads f1 at that token only), frees dc2
//! and runs `conv_inverted`'s backward on df1: the two linears' weight gradients go to their
//! [`GradSink`](super::GradSink)s, the conv's to candle (9 + 1 values per channel), and only dh
//! (width D) enters candle's store. Its peak is f1 + c2 + (the gate's output or dgl): 5H per
//! row, where the composition held 2H + 2H + H kept plus 6H of gradients.
//!
//! Numerics: the same kernel calls as the composition (the fused linear's storage functions,
//! the conv's and the gate's kernels, in place where the composition wrote a fresh copy), so
//! the same bits in every dtype.

use candle_core::{backend::BackendStorage, CpuStorage, DType, Layout, Shape, Tensor, WithDType};

use super::dwconv::{
    dw_dx_over, dw_geom, dwconv_bwd_workspace, dwconv_weight_grads, silu_dwconv_fwd, Grid,
};
use super::glu::{glu_bwd_over, glu_fwd};
use super::mlp_linear::{fc1_backward, MlpLinear};
use super::storage::{cpu_slice, dispatch_float, err, with_cpu, with_cpus, CResult};
use crate::kernels::scalar::{Acc, Elem};
use crate::ops::custom_op::{Cpu, CpuOp, Grads, Op};
use crate::ops::storage::Saved;

/// The fused Mix-FFN (see the module docs).
#[derive(Debug)]
pub(crate) struct MixFfn {
    inv: MlpLinear,
    point: MlpLinear,
    /// The token grid (rows, cols) of each batch entry.
    grid: (usize, usize),
    /// Keep f1 for a backward (an input tracks); otherwise nothing is kept.
    keep: bool,
    /// f1 = conv_inverted(h) from the forward, taken (and turned into df1) by the backward; a
    /// second backward on the same graph recomputes it from h.
    f1: Saved,
}

/// `conv_point(glu_silu(silu_dwconv3x3(conv_inverted(h), wd, bd)))` of h (rows, D) on a
/// `grid` = (rows, cols) token grid per batch entry, written as (rows, D). A linear's weights
/// must not track unless it has a sink (the op hands candle dh and the conv's dW, db only).
pub fn mix_ffn(
    h: &Tensor,
    inv: MlpLinear,
    (wd, bd): (&Tensor, &Tensor),
    point: MlpLinear,
    grid: (usize, usize),
) -> CResult<Tensor> {
    MlpLinear::require_sinks(
        &[&inv, &point],
        "mix_ffn: a linear whose weights track needs a gradient sink",
    )?;
    let (c2h, hid) = (inv.w.dims2()?.0, point.w.dims2()?.1);
    if c2h != 2 * hid {
        return Err(err(format!(
            "mix_ffn: conv_inverted makes {c2h} channels, conv_point reads {hid} (needs half)"
        )));
    }
    let keep = h.track_op() || wd.track_op() || bd.track_op();
    h.apply_op3(
        wd,
        bd,
        Op(MixFfn {
            inv,
            point,
            grid,
            keep,
            f1: Saved::default(),
        }),
    )
}

impl MixFfn {
    /// The grid of f1 (n, 2H) under the conv's weight and bias layouts.
    fn grid_of(&self, n: usize, lw: &Layout, lb: &Layout) -> CResult<Grid> {
        let c = self.inv.w.dims2()?.0;
        let (b, c) = dw_geom(
            &Layout::contiguous((n, c)),
            lw,
            lb,
            self.grid.0,
            self.grid.1,
        )?;
        Ok(Grid {
            b,
            rows: self.grid.0,
            cols: self.grid.1,
            c,
        })
    }

    /// The forward from f1 on: c2, the gate's output, y = conv_point(·); frees f1 after c2 when
    /// it is not kept, c2 after the gate, the gate's output after y.
    #[allow(clippy::too_many_arguments)]
    fn fwd_typed<T: Elem<A> + WithDType + Send + Sync, A: Acc + Send + Sync>(
        &self,
        f1: CpuStorage,
        w: (&CpuStorage, &Layout),
        b: (&CpuStorage, &Layout),
        gr: &Grid,
    ) -> CResult<(CpuStorage, Option<CpuStorage>)> {
        let n = gr.b * gr.rows * gr.cols;
        let hid = gr.c / 2;
        let c2 = {
            let f = cpu_slice::<T>(&f1, &Layout::contiguous((n, gr.c)), "mix_ffn f1")?;
            silu_dwconv_fwd::<T, A>(f, w, b, gr)?
        };
        let kept = if self.keep {
            Some(f1)
        } else {
            drop(f1);
            None
        };
        let gl = T::to_cpu_storage_owned(glu_fwd::<T, A>(&c2, hid));
        drop(c2);
        let (y, _) = self.point.forward((&gl, &Layout::contiguous((n, hid))))?;
        Ok((y, kept))
    }

    /// The backward from f1 and g (n, D): see the module docs for the order. Returns dh (when h
    /// tracks) and the conv's dW, db (when they track).
    #[allow(clippy::type_complexity)]
    fn bwd_typed<T: Elem<A> + WithDType + Send + Sync, A: Acc + Send + Sync + Into<f64>>(
        &self,
        f1: CpuStorage,
        (h, wd, bd): (&Tensor, &Tensor, &Tensor),
        grad: &Tensor,
        gr: &Grid,
    ) -> Grads<3> {
        let n = gr.b * gr.rows * gr.cols;
        let (c, hid) = (gr.c, gr.c / 2);
        let what = "mix_ffn backward";
        let mut f1 = T::cpu_storage_data(f1)?;
        let c2 = with_cpus([wd, bd], |[w, b]| silu_dwconv_fwd::<T, A>(&f1, w, b, gr))?;
        let c2 = T::to_cpu_storage_owned(c2);
        let lgl = Layout::contiguous((n, hid));
        // conv_point's dW, db from the gate's output, freed at once; then dgl = g·Wp (the
        // gate's output is gone; dx reads no x).
        let dgl = self.point.grads_remade(grad, &lgl, || {
            let gl = glu_fwd::<T, A>(cpu_slice::<T>(&c2, &Layout::contiguous((n, c)), what)?, hid);
            Ok(T::to_cpu_storage_owned(gl))
        })?;
        // dc2 over c2, then the conv's weight gradients and df1 over f1.
        let mut dc2 = T::cpu_storage_data(c2)?;
        glu_bwd_over::<T, A>(&mut dc2, cpu_slice::<T>(&dgl, &lgl, what)?, hid);
        drop(dgl);
        let (tw, tb) = (wd.track_op(), bd.track_op());
        let (ti, (iw, ib)) = (h.track_op(), self.inv.wants());
        let mut ws = with_cpu(wd, |sw, lw| dwconv_bwd_workspace::<T, A>((sw, lw), c))?;
        let (dwd, dbd) = dwconv_weight_grads((&f1, &dc2), &mut ws, (wd, bd), (tw, tb), gr)?;
        if ti || iw || ib {
            dw_dx_over::<T, A>(&mut f1, &dc2, &ws[..9 * c], gr);
        }
        drop(ws);
        drop(dc2);
        if !(ti || iw || ib) {
            return Ok([None, dwd, dbd]);
        }
        let df1 = T::to_cpu_storage_owned(f1);
        let dh = fc1_backward(&self.inv, h, &df1, (n, c))?;
        drop(df1);
        Ok([dh, dwd, dbd])
    }
}

impl CpuOp<3> for MixFfn {
    fn name(&self) -> &'static str {
        "mix-ffn"
    }

    fn fwd(&self, [(sh, lh), (sw, lw), (sb, lb)]: [Cpu<'_>; 3]) -> CResult<(CpuStorage, Shape)> {
        let (f1, shape) = self.inv.forward((sh, lh))?;
        let n = shape.dims2()?.0;
        let gr = self.grid_of(n, lw, lb)?;
        let (y, kept) = dispatch_float!(f1.dtype(), "mix_ffn", |T, A| {
            self.fwd_typed::<T, A>(f1, (sw, lw), (sb, lb), &gr)?
        });
        *self.f1.lock("mix_ffn: kept f1 poisoned")? = kept;
        let d = self.point.w.dims2()?.0;
        Ok((y, Shape::from((n, d))))
    }

    fn bwd(&self, [h, wd, bd]: [&Tensor; 3], _res: &Tensor, grad: &Tensor) -> Grads<3> {
        let grad = grad.contiguous()?;
        let kept = self.f1.lock("mix_ffn: kept f1 poisoned")?.take();
        // f1, from the forward or (a second backward) recomputed from h.
        let f1 = match kept {
            Some(f1) => f1,
            None => with_cpu(h, |sx, lx| self.inv.forward((sx, lx)))?.0,
        };
        let n = grad.dims2()?.0;
        let gr = self.grid_of(n, wd.layout(), bd.layout())?;
        Ok(dispatch_float!(f1.dtype(), "mix_ffn backward", |T, A| {
            self.bwd_typed::<T, A>(f1, (h, wd, bd), &grad, &gr)?
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::dwconv::silu_dwconv3x3;
    use crate::ops::glu::glu_silu;
    use crate::ops::linear_sunk;
    use crate::ops::test_values::*;
    use candle_core::Var;
    use std::sync::Arc;

    /// y, dh, dWi, dbi, dWd, dbd, dWp, dbp of h (b·rows·cols, d) through a Mix-FFN of hidden
    /// width `hid` with gradient r of y, fused or composed of the sunk linears, the conv and the
    /// gate. The conv's weight and bias are Vars (their gradients come back through candle).
    fn run(
        fused: bool,
        (dt, wdt): (DType, DType),
        (b, rows, cols, d, hid): (usize, usize, usize, usize, usize),
    ) -> Vec<Tensor> {
        let n = b * rows * cols;
        let h = Var::from_tensor(&t(n * d, &[n, d], 1, dt)).unwrap();
        let (si, sp) = (new_sink(), new_sink());
        let inv = seeded_linear((2 * hid, d), 2, wdt, Some(Arc::clone(&si)));
        let wd = Var::from_tensor(&t(2 * hid * 9, &[2 * hid, 1, 3, 3], 4, wdt)).unwrap();
        let bd = Var::from_tensor(&t(2 * hid, &[2 * hid], 5, wdt)).unwrap();
        let point = seeded_linear((d, hid), 6, wdt, Some(Arc::clone(&sp)));
        let r = t(n * d, &[n, d], 8, dt);
        let conv = (wd.as_tensor(), bd.as_tensor());
        let y = if fused {
            mix_ffn(h.as_tensor(), inv, conv, point, (rows, cols)).unwrap()
        } else {
            let f1 = linear_sunk(h.as_tensor(), &inv.w, &inv.b, &si).unwrap();
            let c2 = silu_dwconv3x3(&f1, conv.0, conv.1, rows, cols).unwrap();
            let gl = glu_silu(&c2).unwrap();
            linear_sunk(&gl, &point.w, &point.b, &sp).unwrap()
        };
        let grads = grads_against(&y, &r);
        let dh = grads.get(h.as_tensor()).unwrap().clone();
        let [dwi, dbi, dwp, dbp]: [Tensor; 4] = take_sunk(&[&si, &sp]).try_into().unwrap();
        let [dwd, dbd] = [conv.0, conv.1].map(|v| grads.get(v).unwrap().clone());
        vec![y, dh, dwi, dbi, dwd, dbd, dwp, dbp]
    }

    /// The fused Mix-FFN's output, dh and all six weight gradients are the composition's, bit
    /// for bit, on f64, f32, bf16 and f16 with weights in the compute dtype or f32 masters, on a
    /// square and an odd non-square grid, with row counts past one linear chunk.
    #[test]
    fn mix_ffn_equals_the_composition_bit_for_bit() {
        let names = ["y", "dh", "dWi", "dbi", "dWd", "dbd", "dWp", "dbp"];
        let cases = [(2, 4, 4, 8, 20), (3, 5, 7, 12, 30), (2, 16, 17, 16, 40)];
        assert_fused_is_composition(&names, &[1], &cases, run);
    }

    /// A second backward on the same graph recomputes f1 from h and gives the same gradients.
    #[test]
    fn a_second_backward_gives_the_same_gradients() {
        let (rows, cols, d, hid) = (3, 4, 8, 12);
        let n = 2 * rows * cols;
        let h = Var::from_tensor(&t(n * d, &[n, d], 1, DType::F32)).unwrap();
        let l = |dims, s| seeded_linear(dims, s, DType::F32, Some(new_sink()));
        let wd = Var::from_tensor(&t(2 * hid * 9, &[2 * hid, 1, 3, 3], 9, DType::F32)).unwrap();
        let bd = Var::from_tensor(&t(2 * hid, &[2 * hid], 10, DType::F32)).unwrap();
        let y = mix_ffn(
            h.as_tensor(),
            l((2 * hid, d), 2),
            (wd.as_tensor(), bd.as_tensor()),
            l((d, hid), 4),
            (rows, cols),
        )
        .unwrap();
        assert_backward_twice_agrees(&y, &[h.as_tensor(), wd.as_tensor(), bd.as_tensor()]);
    }

    /// Tracking linear weights without a sink, and mismatched widths, are refused.
    #[test]
    fn bad_linears_are_refused() {
        let (rows, cols, d, hid) = (2, 2, 4, 6);
        let h = t(4 * d, &[4, d], 1, DType::F32);
        let wd = t(2 * hid * 9, &[2 * hid, 1, 3, 3], 2, DType::F32);
        let bd = t(2 * hid, &[2 * hid], 3, DType::F32);
        let inv = seeded_linear((2 * hid, d), 4, DType::F32, None);
        let point = |k: usize| seeded_linear((d, k), 6, DType::F32, None);
        let e = mix_ffn(
            &h,
            tracking(inv.clone()),
            (&wd, &bd),
            point(hid),
            (rows, cols),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("sink"), "{e}");
        let e = mix_ffn(&h, inv, (&wd, &bd), point(hid + 1), (rows, cols))
            .unwrap_err()
            .to_string();
        assert!(e.contains("half"), "{e}");
    }
}

#[cfg(test)]
mod budget_twin {
    use super::MixFfn;

    /// The op's heap bytes beside f1 are the budget's.
    #[test]
    fn mix_ffn_op_bytes_are_the_budgets() {
        use ditmem_budget::ditmem_cpu::sana::MIX_FFN_OP_BYTES;
        assert_eq!(32 + std::mem::size_of::<MixFfn>() as u64, MIX_FFN_OP_BYTES);
    }
}
