//! The fused linear on f32/f64: `gemm` straight on the tensors' data (W read transposed in
//! place), no workspace; dx and dW are written by `gemm` into fresh, unzeroed memory.

use crate::kernels::gemm::{gemm_threads, mm_fresh, mm_par};
use crate::kernels::scalar::{Acc, Elem};

use super::common::{add_column_sums, LinearGrads};

/// f32/f64 forward: y rows start as b, then y += x·Wᵀ.
pub(super) fn linear_fwd_direct<A: Acc + 'static>(
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

/// f32/f64 backward: dx = g·W, dW = gᵀ·x, db = Σ_rows g.
#[allow(clippy::type_complexity)]
pub(super) fn linear_bwd_direct<A: Acc + Elem<A> + Send + Sync + 'static>(
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
