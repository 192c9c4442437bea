//! What the three kernel paths of the fused linear share: the row chunk of the low-precision
//! paths ([`LINEAR_ROWS`]), which gradients a backward computes ([`LinearGrads`]), how a master
//! weight is read in the compute dtype ([`read_as`]) and the bias gradient's column sums.

use rayon::prelude::*;

use crate::kernels::scalar::{Acc, Elem};

/// Rows per chunk of a low-precision linear (its f32 accumulators and packed operands).
pub const LINEAR_ROWS: usize = 128;

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
