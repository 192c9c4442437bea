//! The parts the fused MLPs share ([`super::fused_mlp`], `fused_mlp_dx`, `fused_mlp_widen`,
//! `fused_mlp_side`, `mix_ffn`): one linear with its gradient sink ([`MlpLinear`], whose forward
//! and backward the joint linear and the cross and projected attention use too), the column
//! blocks of the hidden width ([`mlp_col_blocks`]) and fc1's backward ([`fc1_backward`]). A file
//! of its own so that each of those files uses it and none uses another back
//! (`crates/cli/tests/no_import_cycles.rs`).

use std::sync::Arc;

use candle_core::{CpuStorage, Layout, Shape, Tensor};
use ditmem_budget::ditmem_cpu::ops;

use super::linear::{
    linear_bwd_storage, linear_dx_storage, linear_fwd_storage, storage_tensor, weight_grads,
    GradSink, LinearGradStorages, LinearGrads,
};
use super::storage::{err, with_cpus, CResult};

/// One linear of the fused MLP: its weight and bias (detached when a sink takes their
/// gradients) and the sink.
#[derive(Debug, Clone)]
pub struct MlpLinear {
    pub w: Tensor,
    pub b: Tensor,
    pub sink: Option<Arc<GradSink>>,
}

impl MlpLinear {
    /// Refuses linears whose weights track without a sink (a fused op hands candle its
    /// inputs' gradients only): `msg` is the error.
    pub(crate) fn require_sinks(ls: &[&MlpLinear], msg: &str) -> CResult<()> {
        if ls
            .iter()
            .any(|l| l.sink.is_none() && (l.w.track_op() || l.b.track_op()))
        {
            return Err(err(msg));
        }
        Ok(())
    }

    /// y = x·Wᵀ + b on x's storage, and y's shape.
    pub(crate) fn forward(&self, x: (&CpuStorage, &Layout)) -> CResult<(CpuStorage, Shape)> {
        with_cpus([&self.w, &self.b], |[w, b]| linear_fwd_storage(x, w, b))
    }

    /// The backward on the output gradient `g` of this linear over x: dx (when `want_x`), dW
    /// and db (as the sink wants them) as bare storages.
    pub(crate) fn grads(
        &self,
        x: &Tensor,
        g: (&CpuStorage, &Layout),
        want_x: bool,
    ) -> CResult<LinearGradStorages> {
        let (w, b) = self.wants();
        let want = LinearGrads { x: want_x, w, b };
        let bias = (self.b.dtype(), self.b.layout());
        with_cpus([x, &self.w], |[sx, sw]| {
            linear_bwd_storage(sx, sw, bias, g, want)
        })
    }

    /// The backward on `grad` when the input is not kept: dW and db (as the sink wants them)
    /// from the input `remake` makes again (laid out as `lx`), freed at once, into the sink;
    /// then dx = g·W, which reads no input.
    pub(crate) fn grads_remade(
        &self,
        grad: &Tensor,
        lx: &Layout,
        remake: impl FnOnce() -> CResult<CpuStorage>,
    ) -> CResult<CpuStorage> {
        let (w, b) = self.wants();
        let bias = (self.b.dtype(), self.b.layout());
        with_cpus([&self.w, grad], |[sw, sg]| {
            if w || b {
                let x = remake()?;
                let want = LinearGrads { x: false, w, b };
                let (_, dw, db) = linear_bwd_storage((&x, lx), sw, bias, sg, want)?;
                drop(x);
                self.sink_grads(dw, db)?;
            }
            linear_dx_storage(sw, bias, sg)
        })
    }

    /// Which gradients of this linear the backward hands over (to the sink; none without one).
    pub(crate) fn wants(&self) -> (bool, bool) {
        self.sink.as_ref().map_or((false, false), |s| s.wants())
    }

    /// A backward's dW and db (bare storages of W's and b's sizes) into the sink, if any.
    pub(crate) fn sink_grads(&self, dw: Option<CpuStorage>, db: Option<CpuStorage>) -> CResult<()> {
        let (dw, db) = weight_grads((dw, db), self.w.dims2()?)?;
        if let Some(s) = &self.sink {
            s.put_both(dw, db)?;
        }
        Ok(())
    }
}

/// Target width of the blocks of u's columns (the hidden width) the f32/f64 backward of fc2
/// and the GELU handles at a time ([`mlp_col_blocks`]; the widest is 129, at ffn 129): its one
/// chunk buffer holds [`DW_ROWS`] rows of a block, so on a narrow hidden layer or a few hundred rows it is not u's own size (PixArt's
/// tiny spec, 256 rows × ffn 256: 128 KiB instead of 256 KiB; DiT-S/2 at 512 rows, ffn 1,536:
/// 128 KiB instead of 1.5 MiB). Its value is the budget's `ditmem_budget::ditmem_cpu::ops::MLP_COLS`
/// (the one place the rule is set; the budget predicts with it, the engine allocates with it).
pub const MLP_COLS: usize = ops::MLP_COLS as usize;

/// The (first column, columns) blocks of a hidden width `ffn`: ⌈ffn / [`MLP_COLS`]⌉ blocks whose
/// widths differ by at most one, but never so many that a block is 64 columns or narrower
/// (ffn 129 stays one block of 129 rather than 64 + 65): `gemm` then never takes its
/// small-size branch (m, n ≤ 64, gemm-common 0.19 `gemm.rs`) where the whole product does not
/// (it blocks a depth beyond 512 differently), so each element of dh and dW2 has the
/// composition's sum, bit for bit. A hidden width of 64 or less is one block, as the
/// composition's own product.
pub fn mlp_col_blocks(ffn: usize) -> impl Iterator<Item = (usize, usize)> {
    ops::mlp_col_blocks(ffn as u64).map(|(c0, n)| (c0 as usize, n as usize))
}

/// The kept storage's contiguous layout.
pub(super) fn wide(rows: usize, ffn: usize) -> Layout {
    Layout::contiguous((rows, ffn))
}

/// fc1's backward on du (rows × ffn): dx = du·W1, dW1 = duᵀ·x and db1 = Σ du, the weight
/// gradients to fc1's sink; returns dx when x tracks. Shared by both fused MLPs and the fused
/// Mix-FFN (its `conv_inverted` on df1).
pub(super) fn fc1_backward(
    fc1: &MlpLinear,
    x: &Tensor,
    du: &CpuStorage,
    dims: (usize, usize),
) -> CResult<Option<Tensor>> {
    fc1_grads(fc1, x, du, dims, x.track_op())?
        .map(|v| storage_tensor(v, x.shape()))
        .transpose()
}

/// dW1 = duᵀ·x and db1 = Σ du (as fc1's sink wants them) into the sink, and dx = du·W1 as a
/// bare storage when `dx` ([`fc1_backward`]; without dx for [`fc1_backward_over`], which
/// writes dx over du itself).
pub(super) fn fc1_grads(
    fc1: &MlpLinear,
    x: &Tensor,
    du: &CpuStorage,
    (rows, ffn): (usize, usize),
    dx: bool,
) -> CResult<Option<CpuStorage>> {
    let (dx, dw, db) = fc1.grads(x, (du, &wide(rows, ffn)), dx)?;
    fc1.sink_grads(dw, db)?;
    Ok(dx)
}
