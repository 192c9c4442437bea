//! The fused linear on bf16 with the AVX512-BF16 kernel ([`crate::kernels::gemm_bf16`]): Wᵀ
//! (or W) packed once, x and g packed by chunks of [`LINEAR_ROWS`] rows, f32 accumulators.

use rayon::prelude::*;

use crate::kernels::gemm_bf16;
use crate::kernels::scalar::Elem;
use crate::kernels::vecmath;

use super::common::{add_column_sums, read_as, GradFromF32, LinearGrads, LINEAR_ROWS};

/// bf16 forward on the AVX512-BF16 kernel: Wᵀ packed once, x packed and y accumulated in f32 by
/// chunks of [`LINEAR_ROWS`] rows (each chunk starts as b).
pub(super) fn linear_fwd_bf16<W: Elem<f32> + gemm_bf16::ToBf16>(
    x: &[half::bf16],
    w: &[W],
    b: &[W],
    rows: usize,
    inp: usize,
    out: usize,
) -> Vec<half::bf16> {
    use gemm_bf16::{pack_a, pack_b, packed_a_len, packed_b_len, View};
    // Every row is narrowed in below: no zeroing.
    let mut y: Vec<half::bf16> = Vec::with_capacity(rows * out);
    let r = LINEAR_ROWS.min(rows);
    // B = Wᵀ (in × out): B(k, j) = W[j][k].
    let mut pb = vec![0u16; packed_b_len(inp, out)];
    pack_b(
        inp,
        out,
        View {
            data: w,
            rs: 1,
            cs: inp,
        },
        &mut pb,
    );
    let mut pa = vec![0u32; packed_a_len(r, inp)];
    let mut c = vec![0f32; r * out];
    let b32: Vec<f32> = b.iter().map(|v| read_as::<half::bf16, W>(*v)).collect();
    let mut r0 = 0;
    while r0 < rows {
        let n = r.min(rows - r0);
        let xv = View {
            data: &x[r0 * inp..(r0 + n) * inp],
            rs: inp,
            cs: 1,
        };
        pack_a(n, inp, xv, &mut pa);
        c[..n * out]
            .par_chunks_mut(out)
            .for_each(|row| row.copy_from_slice(&b32));
        gemm_bf16::gemm_packed(n, out, inp, &pa, &pb, &mut c, out);
        vecmath::narrow_into_uninit(
            &c[..n * out],
            &mut y.spare_capacity_mut()[r0 * out..(r0 + n) * out],
        );
        r0 += n;
    }
    // SAFETY: the capacity is rows·out, and the chunks r0..r0 + n above cover rows 0..rows, each
    // narrowing all n·out elements of its rows into the spare capacity.
    unsafe { y.set_len(rows * out) };
    y
}

/// dx of a chunk of n rows into the f32 `c` (n × in): c = g_c·W from the chunk's gradient
/// `gc` (n × out) and W packed whole as B (`pw`), through the packed A `pa`.
pub(crate) fn dx_chunk(
    gc: &[half::bf16],
    pw: &[u16],
    (n, inp, out): (usize, usize, usize),
    pa: &mut [u32],
    c: &mut [f32],
) {
    use gemm_bf16::{gemm_packed, pack_a, View};
    let g = View {
        data: gc,
        rs: out,
        cs: 1,
    };
    pack_a(n, out, g, pa);
    c[..n * inp].fill(0.0);
    gemm_packed(n, inp, out, pa, pw, c, inp);
}

/// dW += g_cᵀ·x_c for a chunk of n rows: gc (n × out), xc (n × in), the f32 `dw32` (out × in),
/// through the packed gᵀ `pa` and packed x `pb`.
pub(crate) fn dw_chunk(
    gc: &[half::bf16],
    xc: &[half::bf16],
    (n, inp, out): (usize, usize, usize),
    (pa, pb): (&mut [u32], &mut [u16]),
    dw32: &mut [f32],
) {
    use gemm_bf16::{gemm_packed, pack_a, pack_b, View};
    let gt = View {
        data: gc,
        rs: 1,
        cs: out,
    };
    pack_a(out, n, gt, pa);
    let x = View {
        data: xc,
        rs: inp,
        cs: 1,
    };
    pack_b(n, inp, x, pb);
    gemm_packed(out, inp, n, pa, pb, dw32, inp);
}

/// bf16 backward on the AVX512-BF16 kernel, by chunks of [`LINEAR_ROWS`] rows: dx = g·W into an
/// f32 chunk, dW += gᵀ·x and db += Σ g in f32 over all chunks. The dx output, then all workspace,
/// are allocated before the first product. dW and db are returned in the weight's dtype: for an
/// f32 master weight the accumulators themselves (no copy, no rounding), for a bf16 weight a
/// narrowed copy made while the workspace is still alive (the budget counts it so).
#[allow(clippy::type_complexity)]
pub(super) fn linear_bwd_bf16<W: gemm_bf16::ToBf16 + GradFromF32>(
    x: &[half::bf16],
    w: &[W],
    g: &[half::bf16],
    (rows, inp, out): (usize, usize, usize),
    want: LinearGrads,
) -> (Option<Vec<half::bf16>>, Option<Vec<W>>, Option<Vec<W>>) {
    use gemm_bf16::{pack_b, packed_a_len, packed_b_len, View};
    // Filled chunk by chunk below: no zeroing.
    let mut dx: Option<Vec<half::bf16>> = want.x.then(|| Vec::with_capacity(rows * inp));
    let r = LINEAR_ROWS.min(rows);
    // dx: B = W (out × in) as stored; A = the g chunk; an f32 dx chunk.
    let mut gx = want.x.then(|| {
        let mut pw = vec![0u16; packed_b_len(out, inp)];
        pack_b(
            out,
            inp,
            View {
                data: w,
                rs: inp,
                cs: 1,
            },
            &mut pw,
        );
        (pw, vec![0u32; packed_a_len(r, out)], vec![0f32; r * inp])
    });
    // dW: f32 dW (out × in); A = gᵀ chunk (out × n), B = x chunk (n × in).
    let mut gw = want.w.then(|| {
        (
            vec![0f32; out * inp],
            vec![0u32; packed_a_len(out, r)],
            vec![0u16; packed_b_len(r, inp)],
        )
    });
    let mut db32: Option<Vec<f32>> = want.b.then(|| vec![0.0; out]);
    let mut r0 = 0;
    while r0 < rows {
        let n = r.min(rows - r0);
        let gc = &g[r0 * out..(r0 + n) * out];
        if let (Some(dx), Some((pw, pa, c))) = (dx.as_mut(), gx.as_mut()) {
            dx_chunk(gc, pw, (n, inp, out), pa, c);
            vecmath::narrow_into_uninit(
                &c[..n * inp],
                &mut dx.spare_capacity_mut()[r0 * inp..(r0 + n) * inp],
            );
        }
        if let Some((dw32, pa, pb)) = gw.as_mut() {
            dw_chunk(
                gc,
                &x[r0 * inp..(r0 + n) * inp],
                (n, inp, out),
                (pa, pb),
                dw32,
            );
        }
        if let Some(db32) = db32.as_mut() {
            add_column_sums(gc, out, db32);
        }
        r0 += n;
    }
    if let Some(dx) = dx.as_mut() {
        // SAFETY: the capacity is rows·inp, and the chunks r0..r0 + n above cover rows 0..rows,
        // each narrowing all n·inp elements of its rows into the spare capacity.
        unsafe { dx.set_len(rows * inp) };
    }
    // Every buffer stays alive until the gradients are out (the budget's model of the op).
    let dw = gw.map(|(dw32, pa, pb)| (W::grad_from_f32(dw32), pa, pb));
    let db = db32.map(W::grad_from_f32);
    let out = (dx, dw.map(|(d, _, _)| d), db);
    drop(gx);
    out
}
