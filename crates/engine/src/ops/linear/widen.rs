//! The fused linear on bf16/f16 without the AVX512-BF16 kernel: W widened to f32 once, x and g
//! by chunks of [`LINEAR_ROWS`] rows, every f32 buffer laid out so that `gemm` packs nothing.

use rayon::prelude::*;

use crate::kernels::gemm::{gemm_threads, mm_strided};
use crate::kernels::scalar::Elem;
use crate::ops::storage::PAR_CHUNK;

use super::common::{add_column_sums, read_as, LinearGrads, LINEAR_ROWS};

/// dst[k·n + i] = src[i·src_rs + k] for i < n, k < c: a column-major f32 copy of an (n × c) block,
/// one column per parallel task.
fn to_colmajor<T: Elem<f32> + Sync>(src: &[T], src_rs: usize, n: usize, c: usize, dst: &mut [f32]) {
    dst[..n * c]
        .par_chunks_mut(n)
        .enumerate()
        .with_min_len((PAR_CHUNK / n.max(1)).max(1))
        .for_each(|(k, col)| {
            for (i, d) in col.iter_mut().enumerate() {
                *d = src[i * src_rs + k].to_acc();
            }
        });
}

/// dst[i·c + k] = src[k·n + i]: back from column-major, one row per parallel task.
fn from_colmajor<T: Elem<f32> + Send>(src: &[f32], n: usize, c: usize, dst: &mut [T]) {
    dst[..n * c]
        .par_chunks_mut(c)
        .enumerate()
        .with_min_len((PAR_CHUNK / c.max(1)).max(1))
        .for_each(|(i, row)| {
            for (k, d) in row.iter_mut().enumerate() {
                *d = T::from_acc(src[k * n + i]);
            }
        });
}

/// A weight (or bias) in f32 as the compute dtype `T` sees it (see [`read_as`]), in parallel.
fn widen_weight_into<T: Elem<f32>, W: Elem<f32> + Sync>(src: &[W], dst: &mut [f32]) {
    dst.par_iter_mut()
        .zip(src.par_iter())
        .with_min_len(PAR_CHUNK)
        .for_each(|(d, s)| *d = read_as::<T, W>(*s));
}

/// Elementwise widening copy, in parallel.
fn widen_into<T: Elem<f32> + Sync>(src: &[T], dst: &mut [f32]) {
    dst.par_iter_mut()
        .zip(src.par_iter())
        .with_min_len(PAR_CHUNK)
        .for_each(|(d, s)| *d = s.to_acc());
}

/// bf16/f16 forward, widened to f32 by chunks. The chunk buffers are column-major (see
/// [`mm_strided`](crate::kernels::gemm::mm_strided)): x32[k·n + i] holds row i, column k of the chunk, y32[j·n + i] likewise.
pub(super) fn linear_fwd_widen<T: Elem<f32> + Send + Sync, W: Elem<f32> + Sync>(
    x: &[T],
    w: &[W],
    b: &[W],
    rows: usize,
    inp: usize,
    out: usize,
) -> Vec<T> {
    let mut y: Vec<T> = vec![T::from_acc(0.0); rows * out];
    let r = LINEAR_ROWS.min(rows);
    // W as the rhs (k = in, n = out) with unit row stride: its natural row-major layout.
    let mut w32: Vec<f32> = vec![0.0; out * inp];
    widen_weight_into::<T, W>(w, &mut w32);
    let b32: Vec<f32> = b.iter().map(|v| read_as::<T, W>(*v)).collect();
    let mut x32: Vec<f32> = vec![0.0; r * inp];
    let mut y32: Vec<f32> = vec![0.0; r * out];
    let mut r0 = 0;
    while r0 < rows {
        let n = r.min(rows - r0);
        to_colmajor(&x[r0 * inp..], inp, n, inp, &mut x32);
        for (j, bj) in b32.iter().enumerate() {
            y32[j * n..(j + 1) * n].iter_mut().for_each(|v| *v = *bj);
        }
        mm_strided(
            n,
            out,
            inp,
            (&mut y32, 1, n),
            (&x32, 1, n),
            (&w32, 1, inp),
            true,
            gemm_threads(),
        );
        from_colmajor(&y32, n, out, &mut y[r0 * out..]);
        r0 += n;
    }
    y
}

/// bf16/f16 backward, widened to f32 by chunks; dW and db accumulate in f32. Every f32 buffer is
/// laid out so that gemm packs nothing (see [`mm_strided`](crate::kernels::gemm::mm_strided)): g twice (row- and column-major), W
/// transposed, x, dx and dW column-major.
#[allow(clippy::type_complexity)]
pub(super) fn linear_bwd_widen<T: Elem<f32> + Send + Sync, W: Elem<f32> + Send + Sync>(
    x: &[T],
    w: &[W],
    g: &[T],
    (rows, inp, out): (usize, usize, usize),
    want: LinearGrads,
) -> (Option<Vec<T>>, Option<Vec<W>>, Option<Vec<W>>) {
    let par = gemm_threads();
    // Outputs first, then the scratch (the budget counts both alive together).
    let mut dx: Option<Vec<T>> = want.x.then(|| vec![T::from_acc(0.0); rows * inp]);
    let mut dw: Option<Vec<W>> = want.w.then(|| vec![W::from_acc(0.0); out * inp]);
    let mut db: Option<Vec<W>> = want.b.then(|| vec![W::from_acc(0.0); out]);
    let r = LINEAR_ROWS.min(rows);
    // g chunk row-major (the lhs of dW = gᵀ·x, unit row stride after the transpose) …
    let mut g32: Vec<f32> = vec![0.0; r * out];
    // … and, for dx, column-major, with Wᵀ (wt32[j·out + o] = W[o][j]) as a unit-row-stride rhs.
    let mut gc32: Option<Vec<f32>> = want.x.then(|| vec![0.0; r * out]);
    let wt32: Option<Vec<f32>> = want.x.then(|| {
        let mut t = vec![0.0f32; out * inp];
        t.par_chunks_mut(out)
            .enumerate()
            .with_min_len((PAR_CHUNK / out.max(1)).max(1))
            .for_each(|(j, col)| {
                for (o, d) in col.iter_mut().enumerate() {
                    *d = read_as::<T, W>(w[o * inp + j]);
                }
            });
        t
    });
    let mut dx32: Option<Vec<f32>> = want.x.then(|| vec![0.0; r * inp]);
    // dW column-major: dw32[j·out + o].
    let mut dw32: Option<Vec<f32>> = want.w.then(|| vec![0.0; out * inp]);
    let mut x32: Option<Vec<f32>> = want.w.then(|| vec![0.0; r * inp]);
    let mut db32: Option<Vec<f32>> = want.b.then(|| vec![0.0; out]);
    let mut r0 = 0;
    while r0 < rows {
        let n = r.min(rows - r0);
        widen_into(&g[r0 * out..(r0 + n) * out], &mut g32[..n * out]);
        if let (Some(dx), Some(dx32), Some(gc32), Some(wt32)) =
            (dx.as_mut(), dx32.as_mut(), gc32.as_mut(), wt32.as_ref())
        {
            to_colmajor(&g32, out, n, out, gc32);
            mm_strided(
                n,
                inp,
                out,
                (dx32, 1, n),
                (gc32, 1, n),
                (wt32, 1, out),
                false,
                par,
            );
            from_colmajor(dx32, n, inp, &mut dx[r0 * inp..]);
        }
        if let (Some(dw32), Some(x32)) = (dw32.as_mut(), x32.as_mut()) {
            to_colmajor(&x[r0 * inp..], inp, n, inp, x32);
            // dW (out × in) += gᵀ (out × n) · x (n × in).
            mm_strided(
                out,
                inp,
                n,
                (dw32, 1, out),
                (&g32, 1, out),
                (x32, 1, n),
                true,
                par,
            );
        }
        if let Some(db32) = db32.as_mut() {
            add_column_sums(&g32[..n * out], out, db32);
        }
        r0 += n;
    }
    if let (Some(dw), Some(dw32)) = (dw.as_mut(), dw32.as_ref()) {
        from_colmajor(dw32, out, inp, dw);
    }
    if let (Some(db), Some(db32)) = (db.as_mut(), db32.as_ref()) {
        for (d, s) in db.iter_mut().zip(db32) {
            *d = W::from_acc(*s);
        }
    }
    (dx, dw, db)
}
