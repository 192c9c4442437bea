//! [`fused_mlp`]: the feed-forward `y = fc2(gelu_tanh(fc1(x)))` as one node on x. Budget twin:
//! `ditmem_budget::ditmem_cpu::ops::fused_mlp`, its workspace `fused_mlp_workspace` (the one
//! statement of it, over the chunk and column blocks this op allocates by) and
//! `FUSED_MLP_OP_BYTES`.
//!
//! Why: composed of two linears and a GELU, candle's backward (candle-core 0.11
//! `backprop.rs`, the custom-op arms) folds the GELU's dx into its store as
//! `zeros_like(u) + du` while the GELU's own output gradient is still alive: four (rows, ffn)
//! tensors at once (dh, du, the zeros, the sum), and the same three at fc2's backward; the
//! graph also keeps both u = fc1(x) and h = gelu(u). This op keeps u only (h is recomputed
//! from it). On f32/f64 its backward holds no second (rows, ffn) buffer: by chunks of
//! [`DW_ROWS`] rows and blocks of [`MLP_COLS`] columns through one chunk buffer it adds
//! g_cᵀ·gelu(u_c) into dW2, then makes dh_c = g_c·W2 and writes du_c = dh_c ⊙ gelu'(u_c) over
//! u_c (PyTorch holds u, gelu(u) and dh there: three). On bf16/f16 with the products widened
//! to f32 it does the same through f32 blocks ([`super::fused_mlp_widen`]). On bf16 with the
//! AVX512-BF16 kernel by chunks of rows too ([`super::fused_mlp_bf16`]): dh_c = g_c·W2 and
//! h_c = gelu(u_c) for dW2 in chunk buffers, du_c written over u_c.
//! Nothing wide enters candle's store: the weight gradients go to the linears'
//! [`GradSink`]s, only dx is returned.
//!
//! Numerics: the same kernel calls as the composition ([`linear`](super::linear()) for both
//! products — on f32/f64 dh by row chunks, which `gemm` computes row for row alike — and the
//! GELU's maps element for element), so the same bits in every dtype. One exception: with
//! ffn ≤ 64, out > 512 and a last chunk of ≤ 64 rows, `gemm` (gemm-common 0.19 `gemm.rs`, its
//! small-size branch) blocks that chunk's depth by 512 where the whole product blocks it evenly,
//! so those rows' dh differ in rounding; no model this tool builds has ffn ≤ 64.

use std::sync::Mutex;

use candle_core::{backend::BackendStorage, CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

use super::fused_mlp_bf16::fc2_gelu_bwd_bf16;
use super::fused_mlp_dx::fc1_backward_over;
use super::fused_mlp_widen::fc2_gelu_bwd_widen;
use super::gelu::{gelu_fwd_storage, gelu_in_place, GeluSlice};
use super::linear::{add_column_sums, dw_blocks, DW_ROWS};
pub use super::mlp_linear::{mlp_col_blocks, MlpLinear, MLP_COLS};
use super::release::release_whole;
use super::storage::{cpu_slice, err, with_cpu, with_cpus, CResult};
use crate::kernels::gemm::{gemm_threads, mm_fresh, mm_strided};
use crate::kernels::gemm_bf16;
use crate::kernels::scalar::{Acc, Elem};
use rayon::prelude::*;

/// What the op keeps for its backward: the fc1 output u, which the backward takes out (on
/// f32/f64 turning it into du in place, on bf16/f16 into h for dW2) and frees before it returns,
/// as PyTorch frees a node's saved tensors once it has run: the rest of the block's backward
/// runs without it (the budget's node releases it, `Node::released_by_bwd`). A second backward
/// on the same graph recomputes u from x.
#[derive(Debug)]
enum Kept {
    Nothing,
    U(CpuStorage),
}

/// The fused feed-forward (see the module docs).
#[derive(Debug)]
pub(crate) struct FusedMlp {
    fc1: MlpLinear,
    fc2: MlpLinear,
    /// Keep u for a backward (x tracks); otherwise h is written over u.
    keep: bool,
    kept: Mutex<Kept>,
}

/// `fc2(gelu_tanh(fc1(x)))` on a 2-D x as one node (see the module docs). A linear's weights
/// must not track unless it has a sink (the op returns only dx to candle); with a sink they go
/// in as given and their gradients to the sink.
pub fn fused_mlp(x: &Tensor, fc1: MlpLinear, fc2: MlpLinear) -> CResult<Tensor> {
    MlpLinear::require_sinks(
        &[&fc1, &fc2],
        "fused_mlp: a linear whose weights track needs a gradient sink",
    )?;
    x.apply_op1(FusedMlp {
        fc1,
        fc2,
        keep: x.track_op(),
        kept: Mutex::new(Kept::Nothing),
    })
}

impl FusedMlp {
    /// fc2's and the GELU's backward on bf16 with the AVX512-BF16 kernel, by chunks of
    /// [`LINEAR_ROWS`](super::linear::LINEAR_ROWS) rows ([`fc2_gelu_bwd_bf16`]): u becomes du
    /// in place, dW2 and db2 go to fc2's sink. Phase peak: u, the chunk workspace and dW2, db2.
    fn fc2_gelu_bwd_native(
        &self,
        mut u: CpuStorage,
        grad: &Tensor,
        (rows, ffn, out): (usize, usize, usize),
    ) -> CResult<CpuStorage> {
        let wants = self.fc2.wants();
        let dims = (rows, ffn, out);
        let (dw, db) = with_cpus([&self.fc2.w, grad], |[(sw, lw), (sg, lg)]| {
            let n = "fused_mlp backward";
            let g = cpu_slice::<half::bf16>(sg, lg, n)?;
            let CpuStorage::BF16(uv) = &mut u else {
                return Err(err("fused_mlp: bf16 backward on a non-bf16 u"));
            };
            Ok(match sw.dtype() {
                DType::F32 => {
                    let w = cpu_slice::<f32>(sw, lw, n)?;
                    let (dw, db) = fc2_gelu_bwd_bf16(uv, w, g, dims, wants);
                    (dw.map(CpuStorage::F32), db.map(CpuStorage::F32))
                }
                DType::BF16 => {
                    let w = cpu_slice::<half::bf16>(sw, lw, n)?;
                    let (dw, db) = fc2_gelu_bwd_bf16(uv, w, g, dims, wants);
                    (dw.map(CpuStorage::BF16), db.map(CpuStorage::BF16))
                }
                other => {
                    return Err(err(format!(
                        "fused_mlp: bf16 backward with {other:?} weights"
                    )))
                }
            })
        })?;
        if wants.0 || wants.1 {
            self.fc2.sink_grads(dw, db)?;
        }
        Ok(u)
    }

    /// fc2's and the GELU's backward by chunks of rows and blocks of columns through one chunk
    /// buffer (f32/f64: [`fc2_gelu_bwd_direct`]; widened bf16/f16: [`fc2_gelu_bwd_widen`]), so
    /// that no second rows × ffn buffer exists beside u. Returns u, now du. Phase peak: u, dW2,
    /// db2 and the buffers with `gemm`'s packing of one product.
    fn fc2_gelu_bwd_chunked(
        &self,
        mut u: CpuStorage,
        grad: &Tensor,
        dims: (usize, usize, usize),
    ) -> CResult<CpuStorage> {
        let (rows, ffn, out) = dims;
        let (w2, b2) = self.fc2.wants();
        let (dw, db, _) = fc2_gelu_bwd_storage(
            &mut u,
            None,
            grad,
            &self.fc2.w,
            (rows, 0, ffn, out),
            (w2, b2, false),
        )?;
        if w2 || b2 {
            self.fc2.sink_grads(dw, db)?;
        }
        Ok(u)
    }
}

/// The slices of [`FusedMlp::fc2_gelu_bwd_chunked`] and of the side MLP's f32/f64 backward
/// (`fused_mlp_side.rs`), where fc2 reads `[side; gelu(u)]` per row: u (rows × ffn, row-major,
/// turned into du), the side (rows × ds, none when ds is 0), g (rows × out), W2
/// (out × (ds + ffn)); returns (dW2, db2, dside) as `(w2, b2, side)` asks. By chunks of
/// [`DW_ROWS`] rows (the direct linear's weight-gradient chunks) and, in each, by blocks of
/// columns ([`mlp_col_blocks`]): the side's columns of dW2 (+)= g_cᵀ·side_c; for each block of
/// u's columns its h = gelu(u) in the chunk buffer, dW2's columns of the block (+)= g_cᵀ·h (in
/// the linear's blocks of dW's rows, [`dw_blocks`]), then the block's dh = g_c·W2 in the same
/// buffer and du = dh ⊙ gelu'(u) over u. The buffer is freed before dside = g·W2[:, ..ds]. Every
/// element of dW2 sums the chunks in the linear's order, and a product's depth is blocked alike
/// whatever its width (gemm-common 0.19 `cache.rs::kernel_params`: the depth block comes from
/// the depth and the CPU's L1, never from m or n), so the results are the composition's bits.
/// One exception, as for the dh rows (module docs): dside with rows ≤ 64, ds ≤ 64 and
/// out > 512 would take `gemm`'s small-size branch where the composition's dc (ds + ffn wide)
/// does not; its one caller, Flux's single-stream block, has out = ds.
#[allow(clippy::type_complexity)]
pub(super) fn fc2_gelu_bwd_direct<A: Acc + Elem<A> + GeluSlice + Send + Sync + 'static>(
    u: &mut [A],
    side: &[A],
    g: &[A],
    w2: &[A],
    (rows, ds, ffn, out): (usize, usize, usize, usize),
    (w2_wanted, b2_wanted, side_wanted): (bool, bool, bool),
) -> (Option<Vec<A>>, Option<Vec<A>>, Option<Vec<A>>) {
    let par = gemm_threads();
    let n2 = ds + ffn;
    let wmax = mlp_col_blocks(ffn).map(|b| b.1).max().unwrap_or(0);
    // dW2 first (every chunk writes or adds into it), then the chunk buffer.
    let mut dw: Option<Vec<A>> = w2_wanted.then(|| vec![A::ZERO; out * n2]);
    let db = b2_wanted.then(|| {
        let mut db = vec![A::ZERO; out];
        add_column_sums(g, out, &mut db);
        db
    });
    let mut buf: Vec<A> = vec![A::ZERO; rows.min(DW_ROWS) * wmax];
    for r0 in (0..rows).step_by(DW_ROWS) {
        let k = DW_ROWS.min(rows - r0);
        let g_c = &g[r0 * out..(r0 + k) * out];
        let u_c = &mut u[r0 * ffn..(r0 + k) * ffn];
        if let (Some(dw), true) = (dw.as_mut(), ds > 0) {
            for (o0, mb) in dw_blocks(rows, out) {
                mm_strided(
                    mb,
                    ds,
                    k,
                    (&mut dw[o0 * n2..], n2, 1),
                    (&g_c[o0..], 1, out),
                    (&side[r0 * ds..], ds, 1),
                    r0 > 0,
                    par,
                );
            }
        }
        for (j0, w) in mlp_col_blocks(ffn) {
            let b = &mut buf[..k * w];
            if let Some(dw) = dw.as_mut() {
                // h of the block, then dW2[:, ds + j0..][..w] (+)= g_cᵀ·h.
                b.par_chunks_mut(w)
                    .zip(u_c.par_chunks(ffn))
                    .for_each(|(h, ur)| h.copy_from_slice(&ur[j0..j0 + w]));
                A::gelu_over(b);
                for (o0, mb) in dw_blocks(rows, out) {
                    mm_strided(
                        mb,
                        w,
                        k,
                        (&mut dw[o0 * n2 + ds + j0..], n2, 1),
                        (&g_c[o0..], 1, out),
                        (&b[..], w, 1),
                        r0 > 0,
                        par,
                    );
                }
            }
            // dh of the block = g_c·W2[:, ds + j0..][..w], then du over u.
            mm_strided(
                k,
                w,
                out,
                (&mut b[..], w, 1),
                (g_c, out, 1),
                (&w2[ds + j0..], n2, 1),
                false,
                par,
            );
            u_c.par_chunks_mut(ffn)
                .zip(b.par_chunks(w))
                .for_each(|(ur, dh)| A::grad_over_input(&mut ur[j0..j0 + w], dh));
        }
    }
    drop(buf);
    let dside =
        (side_wanted && ds > 0).then(|| mm_fresh(rows, ds, out, (g, out, 1), (w2, n2, 1), par));
    (dw, db, dside)
}

/// [`fc2_gelu_bwd_direct`] (f32/f64) or, on bf16/f16, [`fc2_gelu_bwd_widen`] (the widened path:
/// call it only without the AVX512-BF16 kernel) on storages: u (turned into du), the side (none
/// for the plain MLP), g and W2 as tensors; returns (dW2, db2, dside) as `want` = (w2, b2,
/// side) asks, the weight gradients in W2's dtype.
#[allow(clippy::type_complexity)]
pub(super) fn fc2_gelu_bwd_storage(
    u: &mut CpuStorage,
    side: Option<&Tensor>,
    grad: &Tensor,
    w2: &Tensor,
    dims: (usize, usize, usize, usize),
    want: (bool, bool, bool),
) -> CResult<(Option<CpuStorage>, Option<CpuStorage>, Option<CpuStorage>)> {
    let n = "fused MLP backward";
    let side = side.map(|s| s.contiguous()).transpose()?;
    let mut run = |ss: Option<(&CpuStorage, &Layout)>| {
        with_cpus([w2, grad], |[(sw, lw), (sg, lg)]| {
            macro_rules! side {
                ($t:ty) => {
                    match ss {
                        Some((ss, ls)) => cpu_slice::<$t>(ss, ls, n)?,
                        None => &[],
                    }
                };
            }
            macro_rules! run {
                ($u:expr, $t:ty, $s:path) => {{
                    let (w, g) = (cpu_slice::<$t>(sw, lw, n)?, cpu_slice::<$t>(sg, lg, n)?);
                    let (dw, db, dside) = fc2_gelu_bwd_direct($u, side!($t), g, w, dims, want);
                    Ok((dw.map($s), db.map($s), dside.map($s)))
                }};
            }
            macro_rules! widen {
                ($u:expr, $t:ty, $w:ty, $s:path, $sw:path) => {{
                    let (w, g) = (cpu_slice::<$w>(sw, lw, n)?, cpu_slice::<$t>(sg, lg, n)?);
                    let (dw, db, dside) = fc2_gelu_bwd_widen($u, side!($t), g, w, dims, want);
                    Ok((dw.map($sw), db.map($sw), dside.map($s)))
                }};
            }
            use half::{bf16, f16};
            use CpuStorage as S;
            match (&mut *u, sw.dtype()) {
                (S::F32(u), _) => run!(u, f32, S::F32),
                (S::F64(u), _) => run!(u, f64, S::F64),
                (S::BF16(u), DType::BF16) => widen!(u, bf16, bf16, S::BF16, S::BF16),
                (S::BF16(u), DType::F32) => widen!(u, bf16, f32, S::BF16, S::F32),
                (S::F16(u), DType::F16) => widen!(u, f16, f16, S::F16, S::F16),
                (S::F16(u), DType::F32) => widen!(u, f16, f32, S::F16, S::F32),
                (other, wdt) => Err(err(format!(
                    "{n}: u {:?} with W2 {wdt:?} has no chunked path",
                    other.dtype()
                ))),
            }
        })
    };
    match &side {
        Some(t) => with_cpu(t, |ss, ls| run(Some((ss, ls)))),
        None => run(None),
    }
}

impl CustomOp1 for FusedMlp {
    fn name(&self) -> &'static str {
        "fused-mlp"
    }

    fn cpu_fwd(&self, sx: &CpuStorage, lx: &Layout) -> CResult<(CpuStorage, Shape)> {
        let (mut u, su) = self.fc1.forward((sx, lx))?;
        let lu = Layout::contiguous(su);
        // Kept for a backward: h beside u; otherwise h over u.
        let h = if self.keep {
            Some(gelu_fwd_storage(&u, &lu)?)
        } else {
            gelu_in_place(&mut u)?;
            None
        };
        let y = self.fc2.forward((h.as_ref().unwrap_or(&u), &lu))?;
        if let Some(h) = h {
            drop(h);
            *self
                .kept
                .lock()
                .map_err(|_| err("fused_mlp: kept u poisoned"))? = Kept::U(u);
        }
        Ok(y)
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let grad = grad.contiguous()?;
        let (rows, out) = grad.dims2()?;
        let ffn = self.fc2.w.dims2()?.1;
        let mut kept = self
            .kept
            .lock()
            .map_err(|_| err("fused_mlp: kept u poisoned"))?;
        // u, from the forward or (a second backward) recomputed from x.
        let u = match std::mem::replace(&mut *kept, Kept::Nothing) {
            Kept::U(u) => u,
            Kept::Nothing => with_cpu(x, |sx, lx| self.fc1.forward((sx, lx)))?.0,
        };
        // du = (g·W2) ⊙ gelu'(u) over u, with dW2, db2 to fc2's sink on the way: by chunks
        // (and column blocks, except on bf16 with the AVX512-BF16 kernel).
        let du = if grad.dtype() != DType::BF16 || !gemm_bf16::in_use() {
            self.fc2_gelu_bwd_chunked(u, &grad, (rows, ffn, out))?
        } else {
            self.fc2_gelu_bwd_native(u, &grad, (rows, ffn, out))?
        };
        drop(kept);
        // fc1's backward reads du, x and W1, not the output gradient: its buffer (the store's
        // sum, which candle drops only after this call) is freed here, as PyTorch frees a
        // node's incoming gradient once the last rule reading it has run. At DiT-S/2 fp32,
        // 512 rows, 768 KiB of the block backward's worst moment.
        release_whole(&grad)?;
        fc1_backward_over(&self.fc1, x, du, (rows, ffn))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::test_values::*;
    use crate::ops::{gelu_tanh, linear_sunk};
    use candle_core::Var;
    use std::sync::Arc;

    /// y, dx, dW1, db1, dW2, db2 of x (rows, inp) through (ffn, out) with gradient r of y,
    /// fused or composed of the sunk linears and the GELU.
    fn run(
        fused: bool,
        (dt, wdt): (DType, DType),
        (rows, inp, ffn, out): (usize, usize, usize, usize),
    ) -> Vec<Tensor> {
        let x = Var::from_tensor(&t(rows * inp, &[rows, inp], 1, dt)).unwrap();
        let (s1, s2) = (new_sink(), new_sink());
        let fc1 = seeded_linear((ffn, inp), 2, wdt, Some(Arc::clone(&s1)));
        let fc2 = seeded_linear((out, ffn), 4, wdt, Some(Arc::clone(&s2)));
        let r = t(rows * out, &[rows, out], 6, dt);
        let y = if fused {
            fused_mlp(x.as_tensor(), fc1, fc2).unwrap()
        } else {
            let u = linear_sunk(x.as_tensor(), &fc1.w, &fc1.b, &s1).unwrap();
            linear_sunk(&gelu_tanh(&u).unwrap(), &fc2.w, &fc2.b, &s2).unwrap()
        };
        let grads = grads_against(&y, &r);
        let dx = grads.get(x.as_tensor()).unwrap().clone();
        [vec![y, dx], take_sunk(&[&s1, &s2])].concat()
    }

    /// The fused MLP's output, dx and the four weight gradients it sinks are the composition's,
    /// bit for bit (the same kernel calls in the same order), on f64, f32, bf16 and f16 with
    /// weights in the compute dtype or f32 masters, at whole and ragged (multi-chunk) row counts,
    /// one and several column blocks ([`mlp_col_blocks`]), and at a depth `gemm` blocks in two
    /// (out 600) with a ragged 8-row last chunk.
    #[test]
    fn fused_mlp_equals_the_composition_bit_for_bit() {
        let cases = [
            (6, 8, 32, 8),
            (150, 16, 40, 12),
            (600, 16, 40, 12),
            (520, 32, 96, 600),
            // Several column blocks (ffn 300: three of 100; 272: 90, 91, 91), one with a
            // depth `gemm` blocks in two and a ragged 8-row last chunk.
            (300, 16, 300, 24),
            (520, 8, 272, 600),
            // ffn 129: one block (64 + 65 would put a 64-wide block in `gemm`'s small-size
            // branch at the 8-row last chunk, depth 600).
            (520, 8, 129, 600),
            // Enough rows for dW2's blocks to widen (`dw_blocks`: two of 304 and 296
            // instead of five of 128 or less).
            (2100, 8, 130, 600),
            // Blocks wider than 128 on the widened path (`widen_col_blocks`: two of 300).
            (1100, 8, 600, 40),
            // dx over du (`fused_mlp_dx`, f32/f64): chunks of 64, 128 and a ragged 108.
            (300, 96, 288, 40),
        ];
        let names = ["y", "dx", "dW1", "db1", "dW2", "db2"];
        assert_fused_is_composition(&names, &[1], &cases, run);
    }

    /// A second backward on the same graph recomputes u from x and gives the same dx.
    #[test]
    fn a_second_backward_gives_the_same_gradients() {
        let x = Var::from_tensor(&t(10 * 8, &[10, 8], 1, DType::F32)).unwrap();
        let l = |dims, s| seeded_linear(dims, s, DType::F32, Some(new_sink()));
        let y = fused_mlp(x.as_tensor(), l((24, 8), 2), l((8, 24), 4)).unwrap();
        assert_backward_twice_agrees(&y, &[x.as_tensor()]);
    }

    /// Tracking weights without a sink are refused (the op hands only dx to candle).
    #[test]
    fn tracking_weights_need_a_sink() {
        let x = t(4 * 8, &[4, 8], 1, DType::F32);
        let l1 = tracking(seeded_linear((16, 8), 2, DType::F32, None));
        let l2 = seeded_linear((8, 16), 4, DType::F32, None);
        let e = fused_mlp(&x, l1, l2).unwrap_err().to_string();
        assert!(e.contains("sink"), "{e}");
    }

    /// The op's heap bytes are the budget's `FUSED_MLP_OP_BYTES`, and the column blocks it
    /// allocates by (the budget's one rule) cover the hidden width in blocks of more than 64
    /// columns. Its workspace is the budget's one formula,
    /// `ditmem_budget::ditmem_cpu::ops::fused_mlp_workspace`, held to measured peaks by the
    /// agreement grid.
    #[test]
    fn op_bytes_and_column_blocks() {
        use crate::ops::fused_mlp_widen::{widen_col_blocks, WIDEN_BLOCK_SHARE};
        use ditmem_budget::ditmem_cpu::ops::{self, FUSED_MLP_OP_BYTES};
        assert_eq!(WIDEN_BLOCK_SHARE as u64, ops::WIDEN_BLOCK_SHARE);
        assert_eq!(
            32 + std::mem::size_of::<FusedMlp>() as u64,
            FUSED_MLP_OP_BYTES
        );
        assert_eq!(MLP_COLS as u64, ops::MLP_COLS);
        for ffn in [1, 64, 65, 128, 129, 130, 194, 195, 256, 300, 1536] {
            let engine: Vec<(u64, u64)> = mlp_col_blocks(ffn)
                .map(|(a, b)| (a as u64, b as u64))
                .collect();
            let budget: Vec<(u64, u64)> = ops::mlp_col_blocks(ffn as u64).collect();
            assert_eq!(engine, budget, "ffn {ffn}");
            assert_eq!(engine.iter().map(|b| b.1).sum::<u64>(), ffn as u64);
            if ffn > 64 {
                assert!(engine.iter().all(|b| b.1 > 64), "ffn {ffn}: {engine:?}");
            }
            assert!(engine.iter().all(|b| b.1 < 2 * 65), "ffn {ffn}: {engine:?}");
            for rows in [1, 128, 1100, 4096] {
                let engine: Vec<(u64, u64)> = widen_col_blocks(rows, ffn)
                    .map(|(a, b)| (a as u64, b as u64))
                    .collect();
                let budget: Vec<(u64, u64)> =
                    ops::widen_col_blocks(rows as u64, ffn as u64).collect();
                assert_eq!(engine, budget, "rows {rows}, ffn {ffn}");
                assert_eq!(engine.iter().map(|b| b.1).sum::<u64>(), ffn as u64);
                if ffn > 64 {
                    assert!(engine.iter().all(|b| b.1 > 64), "ffn {ffn}: {engine:?}");
                }
            }
        }
        assert_eq!(
            widen_col_blocks(1100, 600).collect::<Vec<_>>(),
            vec![(0, 300), (300, 300)]
        );
    }
}
