//! The fused linear on f32/f64: `gemm` straight on the tensors' data (W read transposed in
//! place), no workspace; dx and dW are written by `gemm` into fresh, unzeroed memory.

use crate::kernels::gemm::{gemm_threads, mm_fresh, mm_par, mm_strided};
use crate::kernels::scalar::{Acc, Elem};

use super::common::{add_column_sums, LinearGrads, DW_ROWS};

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

/// f32/f64 backward: dW = gᵀ·x (by chunks of [`DW_ROWS`] rows), db = Σ_rows g, then dx = g·W.
/// dW's product is the one for which `gemm` packs a (depth block × out) panel of g on the heap
/// (the dx product reads g in place): made first, that panel is never alive beside dx, and
/// made by chunks its depth is at most [`DW_ROWS`]
/// (`ditmem_budget::ditmem_cpu::ops::direct_linear_packing` counts both).
#[allow(clippy::type_complexity)]
pub(super) fn linear_bwd_direct<A: Acc + Elem<A> + Send + Sync + 'static>(
    x: &[A],
    w: &[A],
    g: &[A],
    (rows, inp, out): (usize, usize, usize),
    want: LinearGrads,
) -> (Option<Vec<A>>, Option<Vec<A>>, Option<Vec<A>>) {
    let par = gemm_threads();
    let dw = want.w.then(|| {
        // dW = Σ over chunks of DW_ROWS rows of g_cᵀ·x_c: the first chunk's product written
        // fresh, the others added to it.
        let first = rows.min(DW_ROWS);
        let mut dw = mm_fresh(out, inp, first, (g, 1, out), (x, inp, 1), par);
        for r0 in (first..rows).step_by(DW_ROWS) {
            let k = DW_ROWS.min(rows - r0);
            mm_strided(
                out,
                inp,
                k,
                (&mut dw, inp, 1),
                (&g[r0 * out..], 1, out),
                (&x[r0 * inp..], inp, 1),
                true,
                par,
            );
        }
        dw
    });
    let db = want.b.then(|| {
        let mut db = vec![A::ZERO; out];
        add_column_sums(g, out, &mut db);
        db
    });
    let dx = want
        .x
        .then(|| mm_fresh(rows, inp, out, (g, out, 1), (w, inp, 1), par));
    (dx, dw, db)
}
