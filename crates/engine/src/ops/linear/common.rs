//! What the three kernel paths of the fused linear share: the row chunk of the low-precision
//! paths ([`LINEAR_ROWS`]) and of the direct path's weight gradient ([`DW_ROWS`]), which gradients a backward computes ([`LinearGrads`]), how a master
//! weight is read in the compute dtype ([`read_as`]) and the bias gradient's column sums.

use rayon::prelude::*;

use crate::kernels::scalar::{Acc, Elem};
use crate::kernels::vecmath;

/// Rows per chunk of a low-precision linear (its f32 accumulators and packed operands).
pub const LINEAR_ROWS: usize = 128;

/// Rows of g and x per product of an f32/f64 linear's weight gradient (`direct.rs`): `gemm`
/// packs a panel of g (depth block × out) on the heap per call, the depth block up to the
/// whole row count (1,024 on a 48 KiB L1d, 512 on a 32 KiB one); by chunks of 256 rows that
/// panel is at most 256 × out (DiT-S/2 fc1 at 512+ rows: 1.5 MiB instead of 3 or 6). The
/// chunks' sum costs 1–5 % of the product's time (AMD EPYC Zen 1, 2 threads, f32, out 1,152
/// and 1,536 × in 384 at 512 and 4,096 rows; 128-row chunks cost 4–14 %). Budget twin:
/// `ditmem_budget::ditmem_cpu::ops::DW_ROWS`.
pub const DW_ROWS: usize = 256;

/// Widest block of dW's rows (the linear's outputs) per product of an f32/f64 weight gradient:
/// `gemm` packs the (chunk rows × block) panel of g, so with [`DW_ROWS`] it packs at most
/// 256 × 128 elements (128 KiB f32) however wide the layer (DiT-S/2 fc1, out 1,536: 1.5 MiB as
/// one block; PixArt's tiny fc1, out 256: 256 KiB, the peak of its block's backward). The
/// blocks split the product's columns, not its depth: each element's sum is the same, bit for
/// bit. [`dw_blocks`] evens them out. 128 rather than 512 costs no time measurably in the
/// linear alone (AMD EPYC Zen 1, 2 threads, f32 linear backward at 512 and 4,096 rows × 384 ↔
/// 1,536, and 256 × 64 → 256: medians of 15 within the run-to-run spread of 5–20 %, both
/// ways); with the fused MLP's column blocks ([`crate::ops::fused_mlp::MLP_COLS`]) a DiT-S/2
/// step at 256² b2 takes 1.6–2.5 % longer (`bench/torch_peer/results/ab_blocks_dit_256x2.txt`).
/// Budget twin:
/// `ditmem_budget::ditmem_cpu::ops::DW_COLS`.
pub const DW_COLS: usize = 128;

/// The (first row, rows) blocks of dW's `out` rows: ⌈out / [`DW_COLS`]⌉ blocks of equal width
/// rounded up to 16 rows (whole SIMD lanes), the last what remains.
pub fn dw_blocks(out: usize) -> impl Iterator<Item = (usize, usize)> {
    let n = out.div_ceil(DW_COLS).max(1);
    let width = out.div_ceil(n).next_multiple_of(16).max(1);
    (0..out)
        .step_by(width)
        .map(move |o0| (o0, width.min(out - o0)))
}

/// Which gradients a linear's backward computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearGrads {
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
