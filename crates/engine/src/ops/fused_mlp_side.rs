//! [`fused_mlp_side`]: the feed-forward whose down projection also reads a side input,
//! `y = fc2([side; gelu_tanh(fc1(x))])` per row, as one node on (x, side): Flux's single-stream
//! block, whose `proj_out` reads the attention output beside the MLP's activation. Budget twin:
//! `ditmem_budget::ditmem_cpu::ops::fused_mlp_side` and its workspace `fused_mlp_side_workspace`
//! (the one statement of it: this op allocates by the budget's chunk sizes and blocks, and the
//! agreement grid holds the formula to the measured peaks), and `FUSED_MLP_SIDE_OP_BYTES`.
//!
//! Why: composed (fc1, GELU, the [side; h] concatenation, fc2), the graph keeps u = fc1(x),
//! h = gelu(u) and the concatenation (rows, side + ffn) until the block's backward ends, and
//! candle's backward (candle-core 0.11 `backprop.rs`, the custom-op arms) folds each wide
//! gradient into its store as `zeros_like + add` while the incoming one is still alive: at the
//! concatenation's backward the (rows, side + ffn) gradient sum, the fresh parts, and a zeros
//! and a sum of h's size were alive at once (Flux fp32 recompute-all: the step's peak). This op
//! keeps u only; its backward makes neither the concatenation nor its gradient (by row chunks
//! and column blocks, as the plain fused MLP) except on the AVX512-BF16 kernel, where it
//! rebuilds h and the concatenation as workspace; it hands candle only dx and dside (each
//! (rows, D)), the weight gradients to the linears' [`GradSink`]s.
//!
//! Numerics: the same kernel calls as the composition (the linear on the concatenation for fc2,
//! the GELU's maps element for element, the same per-row copies), so the same bits in every
//! dtype.

use candle_core::{backend::BackendStorage, CpuStorage, DType, Layout, Shape, Tensor};

use super::fused_mlp::fc2_gelu_bwd_storage;
use super::gelu::{gelu_fwd_storage, gelu_grad_in_place, gelu_in_place};
use super::linear::storage_tensor;
use super::mlp_linear::{fc1_backward, MlpLinear};
use super::storage::{err, with_cpu, CResult};
use super::tokens::{concat_storage, slice_storage};
use crate::kernels::gemm_bf16;
use crate::ops::custom_op::{Cpu, CpuOp, Grads, Op};
use crate::ops::storage::Saved;

/// The fused feed-forward with a side input (see the module docs).
#[derive(Debug)]
pub(crate) struct FusedMlpSide {
    fc1: MlpLinear,
    fc2: MlpLinear,
    /// Keep u for a backward (x or side tracks).
    keep: bool,
    kept: Saved,
}

/// `fc2([side; gelu_tanh(fc1(x))])` on 2-D x (rows, inp) and side (rows, ds) as one node (see
/// the module docs); fc2 reads ds + ffn features. A linear's weights must not track unless it
/// has a sink (the op returns only dx and dside to candle).
pub fn fused_mlp_side(
    x: &Tensor,
    side: &Tensor,
    fc1: MlpLinear,
    fc2: MlpLinear,
) -> CResult<Tensor> {
    MlpLinear::require_sinks(
        &[&fc1, &fc2],
        "fused_mlp_side: a linear whose weights track needs a gradient sink",
    )?;
    let (rows, _) = x.dims2()?;
    let (srows, ds) = side.dims2()?;
    let ffn = fc1.w.dims2()?.0;
    if srows != rows || fc2.w.dims2()?.1 != ds + ffn || side.dtype() != x.dtype() {
        return Err(err(format!(
            "fused_mlp_side: side {:?} {:?} and fc1 {:?} do not make fc2's input {:?} for x {:?} {:?}",
            side.dims(),
            side.dtype(),
            fc1.w.dims(),
            fc2.w.dims(),
            x.dims(),
            x.dtype()
        )));
    }
    x.apply_op2(
        side,
        Op(FusedMlpSide {
            fc1,
            fc2,
            keep: x.track_op() || side.track_op(),
            kept: Saved::default(),
        }),
    )
}

impl FusedMlpSide {
    /// c = [side; gelu(u)] per row, h made and dropped on the way.
    fn cat(
        &self,
        side: (&CpuStorage, &Layout),
        u: &CpuStorage,
        rows: usize,
    ) -> CResult<CpuStorage> {
        let lu = Layout::contiguous((rows, u_cols(u, rows)?));
        let h = gelu_fwd_storage(u, &lu)?;
        concat_storage(side, (&h, &lu), rows)
    }

    /// The backward by chunks and column blocks (f32/f64: `fused_mlp::fc2_gelu_bwd_direct`; widened
    /// bf16/f16: `fused_mlp_widen::fc2_gelu_bwd_widen`), so neither the concatenation c nor
    /// its gradient dc (each rows × (ds + ffn)) is ever made: dW2's side columns come from the
    /// side itself, dside = g·W2[:, ..ds] straight into its own buffer, and du is written over
    /// u. Then fc1's backward on du ([`fc1_backward`]).
    fn bwd_direct(
        &self,
        x: &Tensor,
        side: &Tensor,
        mut u: CpuStorage,
        grad: &Tensor,
        (rows, ds, out): (usize, usize, usize),
    ) -> Grads<2> {
        let ffn = u_cols(&u, rows)?;
        let (w2, b2) = self.fc2.wants();
        let want = (w2, b2, side.track_op());
        let dims = (rows, ds, ffn, out);
        let (dw, db, dside) =
            fc2_gelu_bwd_storage(&mut u, Some(side), grad, &self.fc2.w, dims, want)?;
        if w2 || b2 {
            self.fc2.sink_grads(dw, db)?;
        }
        let dx = fc1_backward(&self.fc1, x, &u, (rows, ffn))?;
        drop(u);
        let dside = dside.map(|v| storage_tensor(v, side.shape())).transpose()?;
        Ok([dx, dside])
    }
}

/// The columns of a (rows, ·) storage.
fn u_cols(u: &CpuStorage, rows: usize) -> CResult<usize> {
    let n = match u {
        CpuStorage::F32(v) => v.len(),
        CpuStorage::F64(v) => v.len(),
        CpuStorage::BF16(v) => v.len(),
        CpuStorage::F16(v) => v.len(),
        other => return Err(err(format!("fused_mlp_side: dtype {:?}", other.dtype()))),
    };
    Ok(n / rows.max(1))
}

impl CpuOp<2> for FusedMlpSide {
    fn name(&self) -> &'static str {
        "fused-mlp-side"
    }

    fn fwd(&self, [(sx, lx), (ss, ls)]: [Cpu<'_>; 2]) -> CResult<(CpuStorage, Shape)> {
        let rows = lx.dims()[0];
        let (mut u, _) = self.fc1.forward((sx, lx))?;
        // Kept for a backward: h beside u; otherwise h over u (the same phases, less u).
        let c = if self.keep {
            let c = self.cat((ss, ls), &u, rows)?;
            *self.kept.lock("fused_mlp_side: kept u poisoned")? = Some(u);
            c
        } else {
            gelu_in_place(&mut u)?;
            let lu = Layout::contiguous((rows, u_cols(&u, rows)?));
            concat_storage((ss, ls), (&u, &lu), rows)?
        };
        let lc = Layout::contiguous((rows, u_cols(&c, rows)?));
        self.fc2.forward((&c, &lc))
    }

    fn bwd(&self, [x, side]: [&Tensor; 2], _res: &Tensor, grad: &Tensor) -> Grads<2> {
        let grad = grad.contiguous()?;
        let (rows, out) = grad.dims2()?;
        let ds = side.dims2()?.1;
        let mut kept = self.kept.lock("fused_mlp_side: kept u poisoned")?;
        // u, from the forward or recomputed from x.
        if kept.is_none() {
            *kept = Some(with_cpu(x, |sx, lx| self.fc1.forward((sx, lx)))?.0);
        }
        if grad.dtype() != DType::BF16 || !gemm_bf16::in_use() {
            let u = kept.take().ok_or_else(|| err("fused_mlp_side: no u"))?;
            drop(kept);
            return self.bwd_direct(x, side, u, &grad, (rows, ds, out));
        }
        let u = kept.as_ref().ok_or_else(|| err("fused_mlp_side: no u"))?;
        let ffn = u_cols(u, rows)?;
        let lc = Layout::contiguous((rows, ds + ffn));
        // dW2 = gᵀ·c, db2 = Σ g on c = [side; h], then c is dropped before dc = g·W2 is made,
        // so c and dc (both rows × (ds + ffn)) are never held at once.
        let dc = with_cpu(side, |ss, ls| {
            self.fc2
                .grads_remade(&grad, &lc, || self.cat((ss, ls), u, rows))
        })?;
        // dside and du: the two parts of each row of dc; du = dh ⊙ gelu'(u) in place.
        let dside = if side.track_op() {
            Some(slice_storage((&dc, &lc), rows, (0, ds))?)
        } else {
            None
        };
        let mut du = slice_storage((&dc, &lc), rows, (ds, ds + ffn))?;
        drop(dc);
        gelu_grad_in_place(&mut du, u)?;
        // u is needed no more: freed before fc1's products, as PyTorch frees a node's saved
        // tensors once it has run (the budget's node releases it, `Node::released_by_bwd`); a
        // second backward recomputes it from x.
        *kept = None;
        drop(kept);
        // dx = du·W1, dW1 = duᵀ·x, db1 = Σ du.
        let dx = fc1_backward(&self.fc1, x, &du, (rows, ffn))?;
        drop(du);
        let dside = dside.map(|v| storage_tensor(v, side.shape())).transpose()?;
        Ok([dx, dside])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::test_values::*;
    use crate::ops::tokens::concat;
    use crate::ops::{gelu_tanh, linear_sunk};
    use candle_core::Var;
    use std::sync::Arc;

    /// y, dx, dside, dW1, db1, dW2, db2 through (ffn, out) with side width ds, fused or
    /// composed of the sunk linears, the GELU and the per-row concatenation.
    fn run(
        fused: bool,
        (dt, wdt): (DType, DType),
        (rows, inp, ffn, ds, out): (usize, usize, usize, usize, usize),
    ) -> Vec<Tensor> {
        let x = Var::from_tensor(&t(rows * inp, &[rows, inp], 1, dt)).unwrap();
        let side = Var::from_tensor(&t(rows * ds, &[rows, ds], 7, dt)).unwrap();
        let (s1, s2) = (new_sink(), new_sink());
        let fc1 = seeded_linear((ffn, inp), 2, wdt, Some(Arc::clone(&s1)));
        let fc2 = seeded_linear((out, ds + ffn), 4, wdt, Some(Arc::clone(&s2)));
        let r = t(rows * out, &[rows, out], 6, dt);
        let y = if fused {
            fused_mlp_side(x.as_tensor(), side.as_tensor(), fc1, fc2).unwrap()
        } else {
            let u = linear_sunk(x.as_tensor(), &fc1.w, &fc1.b, &s1).unwrap();
            let h = gelu_tanh(&u).unwrap();
            let c = concat(side.as_tensor(), &h, rows, (rows, ds + ffn)).unwrap();
            linear_sunk(&c, &fc2.w, &fc2.b, &s2).unwrap()
        };
        let grads = grads_against(&y, &r);
        let dx = grads.get(x.as_tensor()).unwrap().clone();
        let dside = grads.get(side.as_tensor()).unwrap().clone();
        [vec![y, dx, dside], take_sunk(&[&s1, &s2])].concat()
    }

    /// The fused op's output, dx, dside and the four weight gradients it sinks are the
    /// composition's, bit for bit, on f64, f32, bf16 and f16 with weights in the compute dtype
    /// or f32 masters, at whole and ragged (multi-chunk) row counts.
    #[test]
    fn fused_mlp_side_equals_the_composition_bit_for_bit() {
        // The last two: several row chunks and column blocks of u (ffn 300: three of 100), and
        // a depth `gemm` blocks in two (out 600) with a ragged 8-row last chunk.
        let cases = [
            (6, 8, 32, 8, 8),
            (150, 16, 40, 16, 12),
            (300, 8, 300, 24, 24),
            (520, 8, 136, 40, 600),
        ];
        let names = ["y", "dx", "dside", "dW1", "db1", "dW2", "db2"];
        assert_fused_is_composition(&names, &[1, 2], &cases, run);
    }

    /// A second backward on the same graph gives the same gradients (u stays kept).
    #[test]
    fn a_second_backward_gives_the_same_gradients() {
        let x = Var::from_tensor(&t(10 * 8, &[10, 8], 1, DType::F32)).unwrap();
        let side = Var::from_tensor(&t(10 * 4, &[10, 4], 9, DType::F32)).unwrap();
        let l = |dims, s| seeded_linear(dims, s, DType::F32, Some(new_sink()));
        let (l1, l2) = (l((24, 8), 2), l((8, 28), 4));
        let y = fused_mlp_side(x.as_tensor(), side.as_tensor(), l1, l2).unwrap();
        assert_backward_twice_agrees(&y, &[x.as_tensor(), side.as_tensor()]);
    }

    /// Mismatched widths and tracking weights without a sink are refused, not panicked on.
    #[test]
    fn bad_inputs_are_errors() {
        let x = t(4 * 8, &[4, 8], 1, DType::F32);
        let side = t(4 * 4, &[4, 4], 2, DType::F32);
        let l = |dims| seeded_linear(dims, 3, DType::F32, None);
        // fc2 reads 16 + 4 = 20 features, not 16.
        let e = fused_mlp_side(&x, &side, l((16, 8)), l((8, 16))).unwrap_err();
        assert!(e.to_string().contains("fc2"), "{e}");
        let tracked = tracking(seeded_linear((16, 8), 2, DType::F32, None));
        let e = fused_mlp_side(&x, &side, tracked, l((8, 20))).unwrap_err();
        assert!(e.to_string().contains("sink"), "{e}");
    }

    /// The op's heap bytes the budget counts beside the u it keeps are its size
    /// (`FUSED_MLP_SIDE_OP_BYTES`); its workspace is the budget's one formula,
    /// `ditmem_budget::ditmem_cpu::ops::fused_mlp_side_workspace`, held to measured peaks by the
    /// agreement grid.
    #[test]
    fn op_bytes_are_the_budgets() {
        use ditmem_budget::ditmem_cpu::ops::FUSED_MLP_SIDE_OP_BYTES;
        assert_eq!(
            32 + std::mem::size_of::<FusedMlpSide>() as u64,
            FUSED_MLP_SIDE_OP_BYTES
        );
    }
}
