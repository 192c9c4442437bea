//! The fused linear on f32/f64: `gemm` straight on the tensors' data (W read transposed in
//! place), no workspace; dx and dW are written by `gemm` into fresh, unzeroed memory.

use crate::kernels::gemm::{gemm_threads, mm_fresh, mm_into_spare, mm_strided};
use crate::kernels::scalar::{Acc, Elem};

use super::common::{add_column_sums, dw_blocks, LinearGrads, DW_ROWS};

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
    mm_strided(
        rows,
        out,
        inp,
        (&mut y, out, 1),
        (x, inp, 1),
        (w, 1, inp),
        true,
        gemm_threads(),
    );
    y
}

/// f32/f64 backward: dW = gᵀ·x (by chunks of [`DW_ROWS`] rows, [`dw_add_chunk`]), db = Σ_rows
/// g, then dx = g·W. dW's product is the one for which `gemm` packs a (depth block × out) panel
/// of g on the heap (the dx product reads g in place): made first, that panel is never alive
/// beside dx, and made by chunks and blocks it is at most [`DW_ROWS`] × [`DW_COLS`](super::common::DW_COLS)
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
        let mut dw = None;
        for r0 in (0..rows).step_by(DW_ROWS) {
            let k = DW_ROWS.min(rows - r0);
            dw_add_chunk(
                &mut dw,
                (&g[r0 * out..], &x[r0 * inp..], inp),
                (k, inp, out),
                rows,
            );
        }
        dw.unwrap_or_else(|| vec![A::ZERO; out * inp])
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

/// One chunk of `k` rows of a weight gradient: dW (out × inp) = g_cᵀ·x_c when `dw` is `None`
/// (a fresh dW, written without zeroing), else dW += g_cᵀ·x_c. g_c: k rows of `out` at row
/// stride `out`; x_c: k rows of `inp` at row stride `x_rs`. One `gemm` call per block of dW's
/// rows ([`dw_blocks`] of the gradient's `rows` in all), so `gemm` packs at most a (k × block)
/// panel of g. The fused MLP's fc2
/// makes its dW2 with the same chunks and blocks (`fused_mlp::fc2_gelu_bwd_direct`), so it has
/// the linear's bits.
fn dw_add_chunk<A: Acc + 'static>(
    dw: &mut Option<Vec<A>>,
    (g_c, x_c, x_rs): (&[A], &[A], usize),
    (k, inp, out): (usize, usize, usize),
    rows: usize,
) {
    let par = gemm_threads();
    let fresh = dw.is_none();
    let d = dw.get_or_insert_with(|| Vec::with_capacity(out * inp));
    for (o0, mb) in dw_blocks(rows, out) {
        let lhs = (&g_c[o0..], 1, out);
        let rhs = (x_c, x_rs, 1);
        if fresh {
            // SAFETY: `d` has capacity out·inp; rows o0..o0 + mb of the row-major (out × inp)
            // destination lie inside it, and with `acc` false `gemm` writes every element of
            // the block without reading it. The blocks cover 0..out, so every element is
            // written before `set_len` below.
            unsafe { mm_into_spare(d, (mb, inp, k), o0 * inp, lhs, rhs, par) };
        } else {
            mm_strided(
                mb,
                inp,
                k,
                (&mut d[o0 * inp..], inp, 1),
                lhs,
                rhs,
                true,
                par,
            );
        }
    }
    if fresh {
        // SAFETY: every block of rows 0..out was written above (`dw_blocks` covers them), so
        // all out·inp elements of the capacity are initialised. With k = 0 `gemm` writes nothing:
        // zero them first.
        unsafe {
            if k == 0 {
                std::ptr::write_bytes(d.as_mut_ptr(), 0, out * inp);
            }
            d.set_len(out * inp);
        }
    }
}
