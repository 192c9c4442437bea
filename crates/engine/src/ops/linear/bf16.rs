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
    use gemm_bf16::{pack_a, packed_a_len, packed_b, View};
    // Every row is narrowed in below: no zeroing.
    let mut y: Vec<half::bf16> = Vec::with_capacity(rows * out);
    let r = LINEAR_ROWS.min(rows);
    // B = Wᵀ (in × out): B(k, j) = W[j][k].
    let pb = packed_b(inp, out, View::cols(w, inp));
    let mut pa = vec![0u32; packed_a_len(r, inp)];
    let mut c = vec![0f32; r * out];
    let b32: Vec<f32> = b.iter().map(|v| read_as::<half::bf16, W>(*v)).collect();
    let mut r0 = 0;
    while r0 < rows {
        let n = r.min(rows - r0);
        let xv = View::rows(&x[r0 * inp..(r0 + n) * inp], inp);
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
    pack_g(gc, (n, out), pa);
    c[..n * inp].fill(0.0);
    gemm_bf16::gemm_packed(n, inp, out, pa, pw, c, inp);
}

/// Packs a chunk of the output gradient (n × out, row-major) as the dx product's A.
fn pack_g(gc: &[half::bf16], (n, out): (usize, usize), pa: &mut [u32]) {
    gemm_bf16::pack_a(n, out, gemm_bf16::View::rows(gc, out), pa);
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
    let gt = View::cols(gc, out);
    pack_a(out, n, gt, pa);
    let x = View::rows(xc, inp);
    pack_b(n, inp, x, pb);
    gemm_packed(out, inp, n, pa, pb, dw32, inp);
}

/// Columns of W per packed panel of the dx product for `rows` rows and `inp` columns: the
/// budget's one rule (`ditmem_budget::ditmem_cpu::ops::bf16_dx_panel_cols`, which its scratch
/// formula counts with): panels of two of the kernel's column panels (128) when the rows fit
/// one chunk, else W whole. By panels two threads still split each call, and the packed W of a
/// panel is out × 128 bf16 instead of the whole out × in: at 2 rows (a DiT-S/2 block's adaLN
/// linear, 2,304 × 384) 590 KB instead of 1.77 MB, alive beside every weight gradient of the
/// block. Each dx element sums over the same k blocks in the same order either way
/// (`gemm_packed`), so the result is bit for bit the whole-W product's. By panels over several
/// chunks each chunk of g would be packed once per panel (3× for a DiT-S/2 qkv or fc1 dx, +40 %
/// of the block backward's packing at 4,096 rows), while W whole is small beside those rows'
/// activations.
pub(crate) fn dx_panel_cols(rows: usize, inp: usize) -> usize {
    ditmem_budget::ditmem_cpu::ops::bf16_dx_panel_cols(rows as u64, inp as u64) as usize
}

/// bf16 backward on the AVX512-BF16 kernel: dx = g·W by panels of W ([`dx_panel_cols`]), each
/// packed once and run over g by chunks of [`LINEAR_ROWS`] rows into an f32 chunk; then
/// dW += gᵀ·x and db += Σ g in f32 by the same chunks. The dx output, then all workspace, are
/// allocated before the first product. dW and db are returned in the weight's dtype: for an f32
/// master weight the accumulators themselves (no copy, no rounding), for a bf16 weight a
/// narrowed copy made while the workspace is still alive (the budget counts it so).
#[allow(clippy::type_complexity)]
pub(super) fn linear_bwd_bf16<W: gemm_bf16::ToBf16 + GradFromF32>(
    x: &[half::bf16],
    w: &[W],
    g: &[half::bf16],
    (rows, inp, out): (usize, usize, usize),
    want: LinearGrads,
) -> (Option<Vec<half::bf16>>, Option<Vec<W>>, Option<Vec<W>>) {
    use gemm_bf16::{gemm_packed, pack_b, packed_a_len, packed_b_len, View};
    // Filled panel by panel and chunk by chunk below: no zeroing.
    let mut dx: Option<Vec<half::bf16>> = want.x.then(|| Vec::with_capacity(rows * inp));
    let r = LINEAR_ROWS.min(rows);
    // dx: B = a panel of W (out × pc) as stored; A = the g chunk; an f32 chunk of the panel.
    let pc = dx_panel_cols(rows, inp);
    let mut gx = want.x.then(|| {
        (
            vec![0u16; packed_b_len(out, pc)],
            vec![0u32; packed_a_len(r, out)],
            vec![0f32; r * pc],
        )
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
    if let (Some(dx), Some((pw, pa, c))) = (dx.as_mut(), gx.as_mut()) {
        let spare = &mut dx.spare_capacity_mut()[..rows * inp];
        // One chunk: g is packed once for every panel.
        let once = rows <= r;
        if once {
            pack_g(g, (rows, out), pa);
        }
        let mut j0 = 0;
        while j0 < inp {
            let cols = pc.min(inp - j0);
            pack_b(out, cols, View::rows(&w[j0..], inp), pw);
            let mut r0 = 0;
            while r0 < rows {
                let n = r.min(rows - r0);
                if !once {
                    pack_g(&g[r0 * out..(r0 + n) * out], (n, out), pa);
                }
                c[..n * pc].fill(0.0);
                gemm_packed(n, cols, out, pa, pw, c, pc);
                vecmath::narrow_block_into_uninit(
                    &c[..n * pc],
                    pc,
                    &mut spare[r0 * inp + j0..(r0 + n - 1) * inp + j0 + cols],
                    inp,
                    cols,
                );
                r0 += n;
            }
            j0 += cols;
        }
    }
    let mut r0 = 0;
    while r0 < rows {
        let n = r.min(rows - r0);
        let gc = &g[r0 * out..(r0 + n) * out];
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
        // SAFETY: the capacity is rows·inp, and the panels j0..j0 + cols × chunks r0..r0 + n
        // above cover every column of every row, each narrowing its n × cols block into the
        // spare capacity.
        unsafe { dx.set_len(rows * inp) };
    }
    // Every buffer stays alive until the gradients are out (the budget's model of the op).
    let dw = gw.map(|(dw32, pa, pb)| (W::grad_from_f32(dw32), pa, pb));
    let db = db32.map(W::grad_from_f32);
    let out = (dx, dw.map(|(d, _, _)| d), db);
    drop(gx);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::gemm_bf16::{packed_a_len, packed_b, View};

    /// dx by panels of W is bit for bit the product with W packed whole, on shapes with one
    /// chunk and several, whole and ragged panels (columns 64, 128, 300: one panel, one, three
    /// with a 44-column last one).
    #[test]
    fn dx_by_panels_is_the_whole_w_product() {
        if !gemm_bf16::supported() {
            return;
        }
        let mut rng = crate::rng::SplitMix64::new(11);
        let mut v = |n: usize| -> Vec<half::bf16> {
            (0..n)
                .map(|_| half::bf16::from_f64(rng.uniform() - 0.5))
                .collect()
        };
        for (rows, inp, out) in [(2, 300, 130), (300, 128, 70), (131, 64, 257), (7, 300, 1)] {
            let (x, w, g) = (v(rows * inp), v(out * inp), v(rows * out));
            let want = LinearGrads {
                x: true,
                w: false,
                b: false,
            };
            let (dx, _, _) = linear_bwd_bf16(&x, &w, &g, (rows, inp, out), want);
            let dx = dx.unwrap();
            let pw = packed_b(out, inp, View::rows(&w, inp));
            let r = LINEAR_ROWS.min(rows);
            let mut pa = vec![0u32; packed_a_len(r, out)];
            let mut c = vec![0f32; r * inp];
            let mut r0 = 0;
            while r0 < rows {
                let n = r.min(rows - r0);
                dx_chunk(
                    &g[r0 * out..(r0 + n) * out],
                    &pw,
                    (n, inp, out),
                    &mut pa,
                    &mut c,
                );
                for (i, (a, b)) in dx[r0 * inp..(r0 + n) * inp].iter().zip(&c).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        half::bf16::from_f32(*b).to_bits(),
                        "{rows}x{inp}x{out}: row {} column {}",
                        r0 + i / inp,
                        i % inp
                    );
                }
                r0 += n;
            }
        }
    }
}
