//! What the three kernel paths of the fused linear share: the row chunk of the low-precision
//! paths ([`LINEAR_ROWS`]) and of the direct path's weight gradient ([`DW_ROWS`]), which gradients a backward computes ([`LinearGrads`]), how a master
//! weight is read in the compute dtype ([`read_as`]) and the bias gradient's column sums.

use ditmem_budget::ditmem_cpu::ops;
use rayon::prelude::*;

use crate::kernels::scalar::{Acc, Elem};
use crate::kernels::vecmath;

/// Rows per chunk of a low-precision linear (its f32 accumulators and packed operands).
pub const LINEAR_ROWS: usize = ops::LINEAR_ROWS as usize;

/// Rows of g and x per product of an f32/f64 linear's weight gradient (`direct.rs`): `gemm`
/// packs a panel of g (depth block × out) on the heap per call, the depth block up to the
/// whole row count (1,024 on a 48 KiB L1d, 512 on a 32 KiB one); by chunks of 256 rows that
/// panel is at most 256 × out (DiT-S/2 fc1 at 512+ rows: 1.5 MiB instead of 3 or 6). The
/// chunks' sum costs 1–5 % of the product's time (AMD EPYC Zen 1, 2 threads, f32, out 1,152
/// and 1,536 × in 384 at 512 and 4,096 rows; 128-row chunks cost 4–14 %). Budget twin:
/// `ditmem_budget::ditmem_cpu::ops::DW_ROWS`.
pub const DW_ROWS: usize = ops::DW_ROWS as usize;

/// Narrowest cap on a block of dW's rows (the linear's outputs) per product of an f32/f64
/// weight gradient: `gemm` packs the (chunk rows × block) panel of g, so with [`DW_ROWS`] it
/// packs 256 × 128 elements (128 KiB f32) per call where the layer's gradient is small
/// (PixArt's tiny fc1, out 256 at 256 rows: 256 KiB as one block, the peak of its block's
/// backward). The blocks split the product's columns, not its depth: each element's sum is
/// the same, bit for bit. Budget twin: `ditmem_budget::ditmem_cpu::ops::DW_COLS`.
pub const DW_COLS: usize = ops::DW_COLS as usize;

/// How much smaller than g (rows × out) the packed panel of one weight-gradient product may
/// be: a block of dW's rows is up to rows·out / ([`DW_PANEL_SHARE`]·[`DW_ROWS`]) wide (never
/// under [`DW_COLS`]), so the panel is at most 1/16 of g, which is alive beside it. Narrow
/// blocks cost time where the rows are many: at 4,096 rows × in 384 → out 1,536 (DiT-S/2 fc1
/// at 256² batch 16), blocks of 128 made dW at 79 GFLOP/s against 103–105 as one block or the
/// blocks of this rule (`cargo bench --bench matmul`, medians of 21 alternating runs, AMD EPYC
/// family 25 AVX2, 2 threads, chunks of 256 rows); a DiT-S/2 256² b16 fp32 step
/// (memory-efficient, EMA off, no recompute) took 0.94–0.98× its CPU time with these blocks,
/// 512² b4 with recompute 0.88–0.95× (3 alternating rounds, steal 5 %,
/// `bench/torch_peer/runs/2026-12-03-epyc-ab-dw-blocks-widen128-dit/ab_dw_blocks_widen128_dit.txt`).
/// Budget twin: `ditmem_budget::ditmem_cpu::ops::DW_PANEL_SHARE`.
pub const DW_PANEL_SHARE: usize = ops::DW_PANEL_SHARE as usize;

/// The (first row, rows) blocks of dW's `out` rows for a gradient of `rows` rows: as few blocks
/// as keep each under the cap of [`DW_PANEL_SHARE`] (at least [`DW_COLS`]), of equal width
/// rounded up to 16 rows (whole SIMD lanes), the last what remains.
pub fn dw_blocks(rows: usize, out: usize) -> impl Iterator<Item = (usize, usize)> {
    ops::dw_blocks(rows as u64, out as u64).map(|(o0, n)| (o0 as usize, n as usize))
}

/// Which gradients a linear's backward computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LinearGrads {
    pub x: bool,
    pub w: bool,
    pub b: bool,
}

/// The value of `v` read in the compute dtype `T`: an f32 master weight rounded to `T` (what a
/// cast copy would hold), a `T` value unchanged.
#[inline]
pub(crate) fn read_as<T: Elem<f32>, W: Elem<f32>>(v: W) -> f32 {
    T::from_acc(v.to_acc()).to_acc()
}

/// `acc[c] += Σ_r rows[r·cols + c]` (a bias gradient), in parallel over ranges of columns; each
/// column is summed in row order, so the result is the serial loop's, bit for bit.
pub(crate) fn add_column_sums<T: Elem<A> + Sync, A: Acc + Send>(
    rows: &[T],
    cols: usize,
    acc: &mut [A],
) {
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

/// A weight's gradient in the weight's dtype from its f32 accumulator: the accumulator itself
/// for an f32 (master) weight, a parallel narrowing copy for a bf16/f16 one (made while the
/// caller's workspace is alive; the budget counts it so).
pub(crate) trait GradFromF32: Sized {
    fn grad_from_f32(v: Vec<f32>) -> Vec<Self>;
}

impl GradFromF32 for f32 {
    fn grad_from_f32(v: Vec<f32>) -> Vec<f32> {
        v
    }
}

macro_rules! narrowed_grad {
    ($t:ty) => {
        impl GradFromF32 for $t {
            fn grad_from_f32(v: Vec<f32>) -> Vec<$t> {
                let mut d = vec![<$t>::ZERO; v.len()];
                vecmath::narrow_into(&v, &mut d);
                d
            }
        }
    };
}
narrowed_grad!(half::bf16);
narrowed_grad!(half::f16);
