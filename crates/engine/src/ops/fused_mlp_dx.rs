//! fc1's backward in the fused MLP on f32/f64 with dx written over du: after dW1 = duᵀ·x and
//! db1 = Σ du (du read whole), dx = du·W1 is made by chunks of rows, each chunk's rows of dx
//! stored in du's own buffer over du rows already read; the buffer is then cut to rows × in and
//! handed out as dx. Budget twin: `ditmem_budget::ditmem_cpu::ops::fused_mlp_phases` (its last
//! phase on f32/f64); the chunk plan is the budget's `dx_over_du_chunks` itself.
//!
//! Why: fc1's backward was the block backward's worst moment (DiT-S/2 fp32 at 512 rows: du
//! 3 MiB, dW1 and dW2 2.25 MiB each, dx 0.75 MiB beside them). PyTorch's `addmm` backward holds
//! a fresh dx beside its incoming gradient too; writing over du takes dx's bytes off that
//! moment, less the first chunk's buffer ([`DX_FIRST_ROWS`] rows).
//!
//! Numerics: `gemm` computes a row chunk of a product as those rows of the whole product, bit
//! for bit, as long as both take its general path (gemm-common 0.19 `gemm.rs`: the depth block
//! comes from the depth and the CPU's L1 alone, `cache.rs::kernel_params`): chunks of at least
//! 4 rows and `in` above 64 keep every chunk out of the small-size (m, n ≤ 64), horizontal
//! (m·n ≤ 256) and matrix-vector (m ≤ 1) branches, as the whole product is.

use candle_core::{CpuStorage, Tensor};
use ditmem_budget::ditmem_cpu::ops;

use super::linear::storage_tensor;
use super::mlp_linear::{fc1_backward, fc1_grads, MlpLinear};
use super::storage::{cpu_slice, err, with_cpu, CResult};
use crate::kernels::gemm::{gemm_threads, mm_fresh, mm_strided};
use crate::kernels::scalar::Acc;

/// Rows of dx made first, into a buffer of their own: du's first rows are where dx's first
/// rows go, so they cannot be written in place while being read. Each later chunk is written
/// in place over du rows already read, up to r0·(ffn − in)/in rows after r0 rows done.
pub const DX_FIRST_ROWS: usize = ops::DX_FIRST_ROWS as usize;

/// The (first row, rows) chunks of dx over du for `rows` rows of `inp` inputs and `ffn` hidden
/// units, the first through its own buffer, the rest in place; none where dx is not written
/// over du (then fc1's backward makes a fresh dx): `inp` of 64 or less (`gemm`'s small-size
/// branches, module docs), ffn under 2·in (a chunk could not be at least as long as the rows
/// before it) or rows too few to leave a chunk of 4 after the first. Every chunk has 4 rows or
/// more; they cover 0..rows in order. The plan is the budget's own
/// (`ditmem_budget::ditmem_cpu::ops::dx_over_du_chunks`), so the two cannot drift apart.
pub fn dx_over_du_chunks(rows: usize, inp: usize, ffn: usize) -> Vec<(usize, usize)> {
    ops::dx_over_du_chunks(rows as u64, inp as u64, ffn as u64)
        .into_iter()
        .map(|(r0, n)| (r0 as usize, n as usize))
        .collect()
}

/// fc1's backward on du (rows × ffn, taken): dW1 = duᵀ·x and db1 = Σ du to fc1's sink, then
/// dx over du's buffer (module docs) where x tracks, the dtype is f32/f64 and
/// [`dx_over_du_chunks`] has chunks; otherwise [`fc1_backward`] (a fresh dx beside du).
pub(super) fn fc1_backward_over(
    fc1: &MlpLinear,
    x: &Tensor,
    du: CpuStorage,
    (rows, ffn): (usize, usize),
) -> CResult<Option<Tensor>> {
    let inp = fc1.w.dims2()?.1;
    let chunks = dx_over_du_chunks(rows, inp, ffn);
    let direct = matches!(du, CpuStorage::F32(_) | CpuStorage::F64(_));
    if !x.track_op() || !direct || chunks.is_empty() {
        return fc1_backward(fc1, x, &du, (rows, ffn));
    }
    fc1_grads(fc1, x, &du, (rows, ffn), false)?;
    let dx = with_cpu(&fc1.w, |sw, lw| {
        let n = "fused MLP dx";
        Ok(match du {
            CpuStorage::F32(v) => {
                CpuStorage::F32(dx_over(v, cpu_slice(sw, lw, n)?, (inp, ffn), &chunks))
            }
            CpuStorage::F64(v) => {
                CpuStorage::F64(dx_over(v, cpu_slice(sw, lw, n)?, (inp, ffn), &chunks))
            }
            _ => return Err(err("fused MLP dx: du is not f32/f64")),
        })
    })?;
    storage_tensor(dx, x.shape()).map(Some)
}

/// dx = du·W1 (W1: ffn × in, row-major) by `chunks` of rows into du's buffer, which it
/// becomes: the first chunk through a fresh buffer copied to du's first rows, each later one
/// straight into du's rows below those it reads. The buffer is cut to rows × in at the end.
fn dx_over<A: Acc + 'static>(
    mut du: Vec<A>,
    w1: &[A],
    (inp, ffn): (usize, usize),
    chunks: &[(usize, usize)],
) -> Vec<A> {
    let par = gemm_threads();
    for (i, &(r0, n)) in chunks.iter().enumerate() {
        if i == 0 {
            let first = mm_fresh(n, inp, ffn, (&du[r0 * ffn..], ffn, 1), (w1, inp, 1), par);
            du[r0 * inp..(r0 + n) * inp].copy_from_slice(&first);
        } else {
            // Rows r0..r0 + n of dx end at (r0 + n)·in ≤ r0·ffn, where du's rows r0.. begin.
            let (done, unread) = du.split_at_mut(r0 * ffn);
            mm_strided(
                n,
                inp,
                ffn,
                (&mut done[r0 * inp..(r0 + n) * inp], inp, 1),
                (&unread[..n * ffn], ffn, 1),
                (w1, inp, 1),
                false,
                par,
            );
        }
    }
    let rows = chunks.last().map_or(0, |&(r0, n)| r0 + n);
    du.truncate(rows * inp);
    du.shrink_to_fit();
    du
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chunks cover the rows in order, each of 4 rows or more, each in-place chunk below the
    /// du rows it reads; and the cases without chunks are the ones the docs name.
    #[test]
    fn chunks_cover_the_rows_and_stay_below_unread_du() {
        for (inp, ffn) in [(65, 130), (384, 1536), (100, 250), (1152, 4608), (96, 193)] {
            for rows in (0..700).chain([1024, 4096, 4099, 4100, 9000]) {
                let c = dx_over_du_chunks(rows, inp, ffn);
                if rows < DX_FIRST_ROWS + 4 {
                    assert!(c.is_empty(), "rows {rows}");
                    continue;
                }
                assert_eq!(c[0], (0, DX_FIRST_ROWS));
                let mut next = 0;
                for &(r0, n) in &c {
                    assert_eq!(r0, next, "rows {rows}, {inp}/{ffn}: {c:?}");
                    assert!(n >= 4, "rows {rows}, {inp}/{ffn}: {c:?}");
                    if r0 > 0 {
                        assert!((r0 + n) * inp <= r0 * ffn, "rows {rows}: {c:?}");
                    }
                    next = r0 + n;
                }
                assert_eq!(next, rows, "{c:?}");
            }
        }
        assert!(dx_over_du_chunks(512, 64, 256).is_empty());
        assert!(dx_over_du_chunks(512, 384, 767).is_empty());
        assert_eq!(
            dx_over_du_chunks(512, 384, 1536),
            vec![(0, 64), (64, 192), (256, 256)]
        );
    }

    /// dx over du has the bits of the whole product, chunk plans with a ragged and a
    /// 4-row-limited last chunk included.
    #[test]
    fn dx_over_du_is_the_whole_product() {
        for (rows, inp, ffn) in [
            (512, 96, 384),
            (71, 65, 130),
            (300, 100, 250),
            (263, 65, 131),
        ] {
            let chunks = dx_over_du_chunks(rows, inp, ffn);
            assert!(!chunks.is_empty());
            let du: Vec<f32> = (0..rows * ffn)
                .map(|i| ((i * 7919 % 1013) as f32 - 506.0) / 97.0)
                .collect();
            let w1: Vec<f32> = (0..ffn * inp)
                .map(|i| ((i * 104_729 % 991) as f32 - 495.0) / 313.0)
                .collect();
            let whole = mm_fresh(
                rows,
                inp,
                ffn,
                (&du[..], ffn, 1),
                (&w1[..], inp, 1),
                gemm_threads(),
            );
            let over = dx_over(du, &w1, (inp, ffn), &chunks);
            assert_eq!(over.len(), rows * inp);
            let b = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(b(&over), b(&whole), "{rows} × {inp} ← {ffn}: {chunks:?}");
        }
    }
}
