//! fc2's and the GELU's backward of the fused MLP ([`super::fused_mlp`]) on bf16 with the
//! AVX512-BF16 kernel ([`crate::kernels::gemm_bf16`]), by chunks of [`LINEAR_ROWS`] rows: per
//! chunk dh_c = g_c·W2 (an f32 chunk narrowed to bf16), h_c = gelu(u_c) for dW2 += g_cᵀ·h_c and
//! db2 += Σ g_c, then du_c = dh_c ⊙ gelu'(u_c) written over u_c. Budget twin: the AVX512-BF16
//! branch of `ditmem_budget::ditmem_cpu::ops::fused_mlp_workspace`.
//!
//! Why: over the whole rows this backward made dh = g·W2 beside u, two rows × ffn buffers at
//! once (u then became h for dW2 and dh became du): at DiT-S/2 bf16, 4,096 rows × ffn 1,536, a
//! second 12 MiB beside u in the MLP's backward, the block's worst moment under recompute. By
//! chunks nothing rows-wide is made beside u, which becomes du.
//!
//! Numerics: the linear's bf16 backward's own chunk steps (`linear::dx_chunk` for dh,
//! `linear::dw_chunk` and its column sums for dW2 and db2 with x = gelu(u)), and the
//! GELU's per-element maps: the same bits as the whole-rows order.

use half::bf16;

use super::gelu::GeluSlice;
use super::linear::{add_column_sums, dw_chunk, dx_chunk, GradFromF32, LINEAR_ROWS};
use crate::kernels::gemm_bf16::{packed_a_len, packed_b, packed_b_len, ToBf16, View};
use crate::kernels::vecmath;

/// u (rows × ffn, fc1's output) becomes du = (g·W2) ⊙ gelu'(u) in place; returns dW2 and db2
/// (when wanted) in W2's dtype. g: the output gradient (rows × out); W2: (out × ffn).
#[allow(clippy::type_complexity)]
pub(super) fn fc2_gelu_bwd_bf16<W: ToBf16 + GradFromF32>(
    u: &mut [bf16],
    w2: &[W],
    g: &[bf16],
    (rows, ffn, out): (usize, usize, usize),
    (want_w, want_b): (bool, bool),
) -> (Option<Vec<W>>, Option<Vec<W>>) {
    debug_assert!(u.len() == rows * ffn && g.len() == rows * out && w2.len() == out * ffn);
    let r = LINEAR_ROWS.min(rows);
    // dh: B = W2 (out × ffn) as stored; A = the g chunk; an f32 chunk, then its bf16 narrowing.
    let pw = packed_b(out, ffn, View::rows(w2, ffn));
    let mut pa = vec![0u32; packed_a_len(r, out)];
    let mut c = vec![0f32; r * ffn];
    let mut dh = vec![bf16::ZERO; r * ffn];
    // dW2: a bf16 h chunk; f32 dW2 (out × ffn); A = gᵀ chunk (out × n), B = h chunk (n × ffn).
    let mut gw = want_w.then(|| {
        (
            vec![bf16::ZERO; r * ffn],
            vec![0f32; out * ffn],
            vec![0u32; packed_a_len(out, r)],
            vec![0u16; packed_b_len(r, ffn)],
        )
    });
    let mut db32: Option<Vec<f32>> = want_b.then(|| vec![0.0; out]);
    let mut r0 = 0;
    while r0 < rows {
        let n = r.min(rows - r0);
        let gc = &g[r0 * out..(r0 + n) * out];
        let uc = &mut u[r0 * ffn..(r0 + n) * ffn];
        dx_chunk(gc, &pw, (n, ffn, out), &mut pa, &mut c);
        vecmath::narrow_into(&c[..n * ffn], &mut dh[..n * ffn]);
        if let Some((h, dw32, pga, pbh)) = gw.as_mut() {
            let h = &mut h[..n * ffn];
            h.copy_from_slice(uc);
            <bf16 as GeluSlice>::gelu_over(h);
            dw_chunk(gc, h, (n, ffn, out), (pga, pbh), dw32);
        }
        if let Some(db32) = db32.as_mut() {
            add_column_sums(gc, out, db32);
        }
        // du_c = dh_c ⊙ gelu'(u_c), over u_c.
        <bf16 as GeluSlice>::grad_over_input(uc, &dh[..n * ffn]);
        r0 += n;
    }
    // Every buffer stays alive until the gradients are out (the budget's model of the op).
    let dw = gw.map(|(h, dw32, pga, pbh)| (W::grad_from_f32(dw32), h, pga, pbh));
    let db = db32.map(W::grad_from_f32);
    let grads = (dw.map(|(d, _, _, _)| d), db);
    drop((pw, pa, c, dh));
    grads
}
