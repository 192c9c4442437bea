//! The fused linear on bf16/f16 without the AVX512-BF16 kernel: W widened to f32 once, x and g
//! by chunks of [`LINEAR_ROWS`] rows, every f32 buffer laid out so that `gemm` packs nothing.

use rayon::prelude::*;

use crate::kernels::gemm::{gemm_threads, mm_strided};
use crate::kernels::scalar::Elem;
use crate::ops::storage::PAR_CHUNK;

use super::common::{add_column_sums, read_as, GradFromF32, LinearGrads, LINEAR_ROWS};

/// dst[k·n + i] = src[i·src_rs + k] for i < n, k < c: a column-major f32 copy of an (n × c) block,
/// one column per parallel task.
pub(crate) fn to_colmajor<T: Elem<f32> + Sync>(
    src: &[T],
    src_rs: usize,
    n: usize,
    c: usize,
    dst: &mut [f32],
) {
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
pub(crate) fn from_colmajor<T: Elem<f32> + Send>(src: &[f32], n: usize, c: usize, dst: &mut [T]) {
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

/// Wᵀ of an (out × inp) weight in f32 as the compute dtype `T` reads it (see [`read_as`]):
/// wt[j·out + o] = W[o][j], one column of W per parallel task. The rhs of dx = g·W in the
/// widened linear and in the widened fused MLP (`fused_mlp_widen`).
pub(crate) fn widened_transpose<T: Elem<f32>, W: Elem<f32> + Sync>(
    w: &[W],
    out: usize,
    inp: usize,
) -> Vec<f32> {
    let mut wt = vec![0.0f32; out * inp];
    wt.par_chunks_mut(out.max(1))
        .enumerate()
        .with_min_len((PAR_CHUNK / out.max(1)).max(1))
        .for_each(|(j, col)| {
            for (o, d) in col.iter_mut().enumerate() {
                *d = read_as::<T, W>(w[o * inp + j]);
            }
        });
    wt
}

/// A weight (or bias) in f32 as the compute dtype `T` sees it (see [`read_as`]), in parallel.
fn widen_weight_into<T: Elem<f32>, W: Elem<f32> + Sync>(src: &[W], dst: &mut [f32]) {
    dst.par_iter_mut()
        .zip(src.par_iter())
        .with_min_len(PAR_CHUNK)
        .for_each(|(d, s)| *d = read_as::<T, W>(*s));
}

/// Elementwise widening copy, in parallel.
pub(crate) fn widen_into<T: Elem<f32> + Sync>(src: &[T], dst: &mut [f32]) {
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

/// bf16/f16 backward, widened to f32 by chunks, in two passes over the row chunks: dx, then dW
/// and db (accumulated in f32). Every f32 buffer is laid out so that gemm packs nothing (see
/// [`mm_strided`](crate::kernels::gemm::mm_strided)): one column-major copy of the g chunk
/// serves as the lhs of dx = g·W (with W transposed) and, made again in the second pass, as
/// the rhs of dWᵀ = xᵀ·g, whose column-major destination is dW row-major, and whose lhs is the x
/// chunk row-major; so dW accumulates in place in the gradient itself for an f32 master weight
/// (one narrowed copy at the end for a bf16/f16 one), and db sums g's columns as they are (the
/// widening is exact). Why two passes: Wᵀ and the dx chunk are freed before dW's accumulator
/// and the x chunk exist (SD3's and PixArt's tiny bf16 fc1 backward: 262 KiB of f32 workspace
/// beside the gradients → 163 KiB), for one more widening of g per chunk (rows × out
/// conversions against rows × in × out multiply-adds). The dx output, then the g chunk, are
/// allocated before the first product.
#[allow(clippy::type_complexity)]
pub(super) fn linear_bwd_widen<
    T: Elem<f32> + Send + Sync,
    W: Elem<f32> + Send + Sync + GradFromF32,
>(
    x: &[T],
    w: &[W],
    g: &[T],
    (rows, inp, out): (usize, usize, usize),
    want: LinearGrads,
) -> (Option<Vec<T>>, Option<Vec<W>>, Option<Vec<W>>) {
    let par = gemm_threads();
    let mut dx: Option<Vec<T>> = want.x.then(|| vec![T::from_acc(0.0); rows * inp]);
    let r = LINEAR_ROWS.min(rows);
    // The g chunk column-major: gc32[o·n + i] = g[i][o].
    let mut gc32: Vec<f32> = if want.x || want.w {
        vec![0.0; r * out]
    } else {
        Vec::new()
    };
    if let Some(dx) = dx.as_mut() {
        // Wᵀ as the unit-row-stride rhs of dx, and a dx chunk.
        let wt32 = widened_transpose::<T, W>(w, out, inp);
        let mut dx32: Vec<f32> = vec![0.0; r * inp];
        for r0 in (0..rows).step_by(r.max(1)) {
            let n = r.min(rows - r0);
            to_colmajor(&g[r0 * out..], out, n, out, &mut gc32);
            mm_strided(
                n,
                inp,
                out,
                (&mut dx32, 1, n),
                (&gc32, 1, n),
                (&wt32, 1, out),
                false,
                par,
            );
            from_colmajor(&dx32, n, inp, &mut dx[r0 * inp..]);
        }
    }
    // dW row-major (dw32[o·inp + j]), the x chunk row-major (x32[i·inp + j]), db.
    let mut dw32: Option<Vec<f32>> = want.w.then(|| vec![0.0; out * inp]);
    let mut x32: Option<Vec<f32>> = want.w.then(|| vec![0.0; r * inp]);
    let mut db32: Option<Vec<f32>> = want.b.then(|| vec![0.0; out]);
    if want.w || want.b {
        for r0 in (0..rows).step_by(r.max(1)) {
            let n = r.min(rows - r0);
            if let (Some(dw32), Some(x32)) = (dw32.as_mut(), x32.as_mut()) {
                to_colmajor(&g[r0 * out..], out, n, out, &mut gc32);
                widen_into(&x[r0 * inp..(r0 + n) * inp], &mut x32[..n * inp]);
                // dWᵀ (in × out) += xᵀ (in × n) · g (n × out).
                mm_strided(
                    inp,
                    out,
                    n,
                    (dw32, 1, inp),
                    (x32, 1, inp),
                    (&gc32, 1, n),
                    true,
                    par,
                );
            }
            if let Some(db32) = db32.as_mut() {
                add_column_sums(&g[r0 * out..(r0 + n) * out], out, db32);
            }
        }
    }
    // The weight's gradients while the g and x chunks are still alive (the budget's model of
    // the op).
    let dw = dw32.map(W::grad_from_f32);
    let db = db32.map(W::grad_from_f32);
    drop((gc32, x32));
    (dx, dw, db)
}
