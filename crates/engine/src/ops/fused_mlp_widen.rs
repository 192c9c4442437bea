//! fc2's and the GELU's backward of the fused MLPs ([`super::fused_mlp`], and
//! [`super::fused_mlp_side`] with its side input) on bf16/f16 where the products are widened to
//! f32 (no AVX512-BF16 kernel: `linear/widen.rs`), by chunks of [`LINEAR_ROWS`] rows and
//! blocks of u's columns ([`widen_col_blocks`]), as the f32/f64 path does
//! ([`super::fused_mlp::fc2_gelu_bwd_direct`]).
//!
//! Why: over whole buffers this backward held u beside dh = g·W2 (two rows × ffn buffers) and,
//! with a side input, the concatenation [side; gelu(u)] and its gradient (rows × (side + ffn)
//! each), plus the widened linear's f32 chunks; it was the worst moment of the step in SD3's
//! and Flux's bf16 blocks with recompute. Here nothing rows-wide is made beside u but dside
//! (an output): per chunk, g's chunk widened once; the side's columns of dW2 from the side; per
//! block of u's columns h = gelu(u) in f32 for its columns of dW2, then the block's dh =
//! g_c·W2 in the same f32 buffer, narrowed and turned into du over u.
//!
//! Numerics: the composition's products split by columns, never by depth (the depth is the
//! chunk's rows for dW2 and `out` for dh, as in the widened linear), the GELU's maps element
//! for element in the compute dtype, and the same f32 accumulators in the same chunk order:
//! the composition's bits (the fused MLPs' tests hold them equal on bf16 and f16).

use ditmem_budget::ditmem_cpu::ops;
use rayon::prelude::*;
use std::ops::Range;

use super::gelu::GeluSlice;
use super::linear::{
    add_column_sums, from_colmajor, to_colmajor, widen_into, widened_transpose, GradFromF32,
    LINEAR_ROWS,
};
use crate::kernels::gemm::{gemm_threads, mm_strided};
use crate::kernels::scalar::Elem;

/// How much smaller than u (rows × ffn) the f32 block buffer of [`fc2_gelu_bwd_widen`] may be:
/// a block of u's columns is up to rows·ffn / (this·[`LINEAR_ROWS`]) wide, never under
/// [`MLP_COLS`](super::mlp_linear::MLP_COLS). Narrow blocks cost time where the rows are many: DiT-S/2 at 256² batch 4,
/// bf16-mixed, memory-efficient attention, EMA off, no recompute, AMD EPYC family 25 (AVX2), 2
/// threads, engine against its previous commit in alternating rounds: with blocks of at most
/// 129 columns (and five parallel passes per block) 1.09–1.18× the CPU time of the
/// whole-buffer backward (3 rounds, steal 5 %, `bench/torch_peer/runs/
/// 2026-12-03-epyc-ab-dw-blocks-widen128-dit/`); with this cap and two passes per block 0.97–1.01× (4
/// rounds, quiet, `ab_widen_mlp_passes_dit_256x4_bf16.txt`). Budget twin:
/// `ditmem_budget::ditmem_cpu::ops::WIDEN_BLOCK_SHARE`.
pub const WIDEN_BLOCK_SHARE: usize = ops::WIDEN_BLOCK_SHARE as usize;

/// The (first column, columns) blocks of u's `ffn` columns the widened backward takes at a time
/// for `rows` rows: ⌈ffn / cap⌉ blocks, the cap [`MLP_COLS`](super::mlp_linear::MLP_COLS) or rows·ffn / ([`WIDEN_BLOCK_SHARE`]
/// · [`LINEAR_ROWS`]) if wider, whose widths differ by at most one, never 64 columns or fewer
/// (`gemm`'s small-size branch, as for [`super::fused_mlp::mlp_col_blocks`]).
pub fn widen_col_blocks(rows: usize, ffn: usize) -> impl Iterator<Item = (usize, usize)> {
    ops::widen_col_blocks(rows as u64, ffn as u64).map(|(c0, n)| (c0 as usize, n as usize))
}

/// The backward of `y = fc2([side; gelu(u)])` per row on the widened path (see the module
/// docs): u (rows × ffn, turned into du), the side (rows × ds, empty when ds is 0), g (rows ×
/// out), W2 (out × (ds + ffn), in the compute dtype or f32 masters read as it). Returns (dW2,
/// db2, dside) as `(w2, b2, side)` asks, the weight gradients in W's dtype. Allocation order:
/// dside, the f32 accumulators (the gradients themselves for f32 masters), then the workspace,
/// dropped before the accumulators are narrowed for bf16/f16 weights (that allocation order,
/// which the budget models, reads in this one function; the per-block passes are helpers).
#[allow(clippy::type_complexity)]
pub(super) fn fc2_gelu_bwd_widen<T, W>(
    u: &mut [T],
    side: &[T],
    g: &[T],
    w2: &[W],
    (rows, ds, ffn, out): (usize, usize, usize, usize),
    (w2_wanted, b2_wanted, side_wanted): (bool, bool, bool),
) -> (Option<Vec<W>>, Option<Vec<W>>, Option<Vec<T>>)
where
    T: Elem<f32> + GeluSlice + Send + Sync,
    W: Elem<f32> + Send + Sync + GradFromF32,
{
    let par = gemm_threads();
    let n2 = ds + ffn;
    let r = LINEAR_ROWS.min(rows);
    let wmax = widen_col_blocks(rows, ffn).map(|b| b.1).max().unwrap_or(0);
    let zero = T::from_acc(0.0);
    let mut dside: Option<Vec<T>> = (side_wanted && ds > 0).then(|| vec![zero; rows * ds]);
    let mut dw32: Option<Vec<f32>> = w2_wanted.then(|| vec![0.0; out * n2]);
    let mut db32: Option<Vec<f32>> = b2_wanted.then(|| vec![0.0; out]);
    // g's chunk column-major (gc32[o·n + i] = g[i][o]), W2ᵀ (wt32[j·out + o] = W2[o][j]), the
    // f32 block and the compute-dtype block.
    let mut gc32: Vec<f32> = vec![0.0; r * out];
    let wt32 = widened_transpose::<T, W>(w2, out, n2);
    let mut b32: Vec<f32> = vec![0.0; r * (ds + wmax)];
    let mut bt: Vec<T> = vec![zero; r * wmax];
    let mut r0 = 0;
    while r0 < rows {
        let n = r.min(rows - r0);
        to_colmajor(&g[r0 * out..], out, n, out, &mut gc32);
        if let Some(db32) = db32.as_mut() {
            add_column_sums(&g[r0 * out..(r0 + n) * out], out, db32);
        }
        if ds > 0 {
            if let Some(dw32) = dw32.as_mut() {
                // dW2's side columns (+)= side_cᵀ·g_c, the side chunk row-major.
                widen_into(&side[r0 * ds..(r0 + n) * ds], &mut b32[..n * ds]);
                add_weight_grad(dw32, 0..ds, &b32, &gc32, (out, n, n2), par);
            }
        }
        let u_c = &mut u[r0 * ffn..(r0 + n) * ffn];
        for (j0, w) in widen_col_blocks(rows, ffn) {
            let t = &mut bt[..n * w];
            if let Some(dw32) = dw32.as_mut() {
                // dW2's columns of the block (+)= h_cᵀ·g_c.
                gelu_block(t, &mut b32[..n * w], u_c, ffn, j0..j0 + w);
                add_weight_grad(dw32, ds + j0..ds + j0 + w, &b32, &gc32, (out, n, n2), par);
            }
            // dh of the block = g_c·W2[:, ds + j0..][..w], column-major, narrowed; du over u.
            // The first block's product also makes dside (the side's columns before it): a
            // product of its own would be at most 64 × 64 on a short last chunk, where `gemm`
            // blocks a depth beyond 512 otherwise (gemm-common 0.19 `gemm.rs`, the small-size
            // branch) than the composition's whole row of dc.
            let (c0, lead) = match dside.as_mut() {
                Some(d) if j0 == 0 => (0, Some(d)),
                _ => (ds + j0, None),
            };
            let cw = ds + j0 + w - c0;
            mm_strided(
                n,
                cw,
                out,
                (&mut b32, 1, n),
                (&gc32, 1, n),
                (&wt32[c0 * out..], 1, out),
                false,
                par,
            );
            let skip = match lead {
                Some(d) => {
                    from_colmajor(&b32, n, ds, &mut d[r0 * ds..]);
                    ds * n
                }
                None => 0,
            };
            du_block(t, &b32[skip..], n, u_c, ffn, j0..j0 + w);
        }
        r0 += n;
    }
    drop((gc32, wt32, b32, bt));
    let dw = dw32.map(W::grad_from_f32);
    let db = db32.map(W::grad_from_f32);
    (dw, db, dside)
}

/// dW2's columns `cols` (of `n2`, row-major over `out` rows) (+)= xᵀ·g_c: x the chunk's `n`
/// rows of `cols.len()` (row-major, `x32`), g_c its output gradient column-major (`gc32`).
fn add_weight_grad(
    dw32: &mut [f32],
    cols: Range<usize>,
    x32: &[f32],
    gc32: &[f32],
    (out, n, n2): (usize, usize, usize),
    par: gemm::Parallelism,
) {
    let w = cols.len();
    mm_strided(
        w,
        out,
        n,
        (&mut dw32[cols.start..], 1, n2),
        (x32, 1, w),
        (gc32, 1, n),
        true,
        par,
    );
}

/// h of the column block `cols` of the rows `u_c` (each `ffn` wide) in the compute dtype into
/// `h` (row-major, `cols.len()` a row) and widened into `h32`: one parallel pass over the rows.
fn gelu_block<T: Elem<f32> + GeluSlice + Send + Sync>(
    h: &mut [T],
    h32: &mut [f32],
    u_c: &[T],
    ffn: usize,
    cols: Range<usize>,
) {
    let w = cols.len();
    h.par_chunks_mut(w)
        .zip(h32.par_chunks_mut(w))
        .zip(u_c.par_chunks(ffn))
        .for_each(|((h, h32), ur)| {
            h.copy_from_slice(&ur[cols.clone()]);
            T::gelu_over(h);
            for (d, v) in h32.iter_mut().zip(h.iter()) {
                *d = v.to_acc();
            }
        });
}

/// dh of the column block `cols` narrowed row by row into `dh` from `dh32` (column-major, `n`
/// rows), then du over u of the rows `u_c` (each `ffn` wide): one parallel pass over the rows.
fn du_block<T: Elem<f32> + GeluSlice + Send + Sync>(
    dh: &mut [T],
    dh32: &[f32],
    n: usize,
    u_c: &mut [T],
    ffn: usize,
    cols: Range<usize>,
) {
    dh.par_chunks_mut(cols.len())
        .zip(u_c.par_chunks_mut(ffn))
        .enumerate()
        .for_each(|(i, (dh, ur))| {
            for (j, d) in dh.iter_mut().enumerate() {
                *d = T::from_acc(dh32[j * n + i]);
            }
            T::grad_over_input(&mut ur[cols.clone()], dh);
        });
}
