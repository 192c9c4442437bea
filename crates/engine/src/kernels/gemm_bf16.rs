//! bf16 matrix products with f32 accumulation on x86-64 CPUs that have AVX512-BF16.
//!
//! Candle 0.11 (and the `gemm` crate under it) has no bf16 kernel: a bf16 product is widened to
//! f32 and runs at the f32 rate, plus the cost of the widening copies. `vdpbf16ps` multiplies
//! pairs of bf16 values and adds both products to an f32 lane, twice the f32 FMA rate on the
//! same execution units, which is what PyTorch (oneDNN) uses on such CPUs. This module is a small
//! Goto-style GEMM around that instruction:
//!
//! - A (m × k) is packed into micro-panels of [`MR`] rows: for each pair of k, the [`MR`] rows'
//!   two values side by side as one `u32` (the form `vdpbf16ps` broadcasts);
//! - B (k × n) is packed into panels of [`NR`] columns: for each pair of k, the [`NR`] columns'
//!   two values side by side (4 vectors of 16 pairs);
//! - the micro-kernel keeps an [`MR`] × [`NR`] f32 tile in 24 registers and adds A·B over a block
//!   of [`KC_PAIRS`] pairs to C; blocks of k walk the packed panels so a B micro-panel stays in L1.
//!
//! Products of bf16 values are exact in f32, so the result differs from a widened f32 product
//! only in the order of the f32 sums (and in denormal inputs, which `vdpbf16ps` flushes to zero).
//!
//! Whether the kernel is used is the spec's `cpu.bf16_products` ([`in_use`], set by the trainer
//! through [`crate::host`]; the budget reads the same field, so its workspace model follows the
//! path the engine takes); whether it can run, the CPU's features ([`supported`]). Packing buffers are allocated by the
//! caller; sizes: [`packed_a_len`], [`packed_b_len`].

use half::bf16;
use rayon::prelude::*;

use super::shared_ptr::SharedMut;

// The tile and the packing source live in `bf16_layout`, which the AVX-512 packing
// (`pack_bf16_avx512`) uses too: this file uses that one, and no file uses this one back.
pub(crate) use super::bf16_layout::MR;
pub use super::bf16_layout::NR;
pub(crate) use super::bf16_layout::{Src, KC_PAIRS};

/// Whether this CPU can run the kernel (AVX512F and AVX512-BF16).
pub fn supported() -> bool {
    crate::host::bf16_kernel_supported()
}

/// Whether bf16 products run on this kernel now (the path of the spec in force, see
/// [`crate::host::bf16_products`]); never where the CPU lacks it.
pub(crate) fn in_use() -> bool {
    crate::host::bf16_products() == ditmem_budget::Bf16Products::Kernel
}

/// An element packing reads as bf16: bf16 itself, or f32 rounded to nearest even (so an f32
/// master weight is packed exactly as its bf16 cast would be, without the cast copy).
pub trait ToBf16: Copy + Sync {
    fn bf16_bits(self) -> u16;
    /// The slice as a packing source of its own type (the vectorised packing reads bf16
    /// as it is and rounds f32 by 16 lanes).
    fn src(s: &[Self]) -> Src<'_>;
}

impl ToBf16 for bf16 {
    #[inline(always)]
    fn bf16_bits(self) -> u16 {
        self.to_bits()
    }
    #[inline(always)]
    fn src(s: &[bf16]) -> Src<'_> {
        Src::Bf16(s)
    }
}

impl ToBf16 for f32 {
    /// Round to nearest even, branch-free (bitwise `bf16::from_f32`; see [`super::vecmath`]).
    #[inline(always)]
    fn bf16_bits(self) -> u16 {
        super::vecmath::bf16_bits(self)
    }
    #[inline(always)]
    fn src(s: &[f32]) -> Src<'_> {
        Src::F32(s)
    }
}

/// A read-only strided matrix view: element (i, j) at `data[i·rs + j·cs]`.
#[derive(Clone, Copy)]
pub struct View<'a, T = bf16> {
    pub data: &'a [T],
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> View<'a, T> {
    /// A row-major view: rows `rs` apart, unit column stride.
    #[inline]
    pub(crate) fn rows(data: &'a [T], rs: usize) -> Self {
        View { data, rs, cs: 1 }
    }
    /// A column-major view (a row-major matrix read transposed): unit row stride, columns `cs`
    /// apart.
    #[inline]
    pub(crate) fn cols(data: &'a [T], cs: usize) -> Self {
        View { data, rs: 1, cs }
    }
}

impl<T: ToBf16> View<'_, T> {
    #[inline(always)]
    fn bits(&self, i: usize, j: usize) -> u32 {
        u32::from(self.data[i * self.rs + j * self.cs].bf16_bits())
    }
}

/// `u32`s of a packed A (m × k): whole micro-panels of [`MR`] rows × ⌈k/2⌉ pairs.
pub fn packed_a_len(m: usize, k: usize) -> usize {
    m.div_ceil(MR) * MR * k.div_ceil(2)
}

/// `u16`s of a packed B (k × n): whole panels of [`NR`] columns × ⌈k/2⌉ pairs × 2.
pub fn packed_b_len(k: usize, n: usize) -> usize {
    n.div_ceil(NR) * NR * k.div_ceil(2) * 2
}

/// Packs A (m × k) into `dst` (at least [`packed_a_len`]): micro-panel p, pair q, row r at
/// `(p·kp + q)·MR + r`, the pair's even-k value in the low half. Padding is zero. Row-major and
/// column-major views read whole rows (or columns) as slices; other strides go element-wise.
pub fn pack_a<T: ToBf16>(m: usize, k: usize, a: View<'_, T>, dst: &mut [u32]) {
    let kp = k.div_ceil(2);
    dst[..packed_a_len(m, k)]
        .par_chunks_mut(kp * MR)
        .enumerate()
        .for_each(|(p, panel)| pack_a_one(m, k, a, p, panel));
}

/// [`pack_a`] on the calling thread.
pub(crate) fn pack_a_serial<T: ToBf16>(m: usize, k: usize, a: View<'_, T>, dst: &mut [u32]) {
    let kp = k.div_ceil(2);
    for (p, panel) in dst[..packed_a_len(m, k)].chunks_mut(kp * MR).enumerate() {
        pack_a_one(m, k, a, p, panel);
    }
}

/// [`pack_b`] on the calling thread.
pub(crate) fn pack_b_serial<T: ToBf16>(k: usize, n: usize, b: View<'_, T>, dst: &mut [u16]) {
    let kp = k.div_ceil(2);
    for (p, panel) in dst[..packed_b_len(k, n)]
        .chunks_mut(kp * NR * 2)
        .enumerate()
    {
        pack_b_one(k, n, b, p, panel);
    }
}

/// Micro-panel `p` of a packed A, in the build for this CPU.
#[inline]
fn pack_a_one<T: ToBf16>(m: usize, k: usize, a: View<'_, T>, p: usize, panel: &mut [u32]) {
    #[cfg(target_arch = "x86_64")]
    if super::vecmath::avx512() {
        // SAFETY: `vecmath::avx512` is true only where the CPU has every feature this build
        // enables (avx512f, avx512bw, avx512vl, avx2, fma); the function has no other
        // precondition.
        unsafe { pack_a_panel_avx512(m, k, a, p, panel) };
        return;
    }
    pack_a_panel(m, k, a, p, panel)
}

/// Panel `p` of a packed B, in the build for this CPU.
#[inline]
fn pack_b_one<T: ToBf16>(k: usize, n: usize, b: View<'_, T>, p: usize, panel: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if super::vecmath::avx512() {
        // SAFETY: `vecmath::avx512` is true only where the CPU has every feature this build
        // enables (avx512f, avx512bw, avx512vl, avx2, fma); the function has no other
        // precondition.
        unsafe { pack_b_panel_avx512(k, n, b, p, panel) };
        return;
    }
    pack_b_panel(k, n, b, p, panel)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn pack_a_panel_avx512<T: ToBf16>(
    m: usize,
    k: usize,
    a: View<'_, T>,
    p: usize,
    panel: &mut [u32],
) {
    use super::pack_bf16_avx512 as v;
    let (kp, i0) = (k.div_ceil(2), p * MR);
    let rows = MR.min(m - i0);
    let src = T::src(a.data);
    if a.cs == 1 && rows == MR {
        // SAFETY: the CPU has this function's features; the rows' bounds are checked there.
        let q0 = unsafe { v::pack_a_rows(k, src, a.rs, i0, panel) };
        for r in 0..MR {
            for q in q0..kp {
                let hi = if 2 * q + 1 < k {
                    a.bits(i0 + r, 2 * q + 1)
                } else {
                    0
                };
                panel[q * MR + r] = a.bits(i0 + r, 2 * q) | hi << 16;
            }
        }
    } else if a.rs == 1 && a.cs != 1 {
        if rows < MR {
            panel.iter_mut().for_each(|v| *v = 0);
        }
        // SAFETY: as above.
        let q0 = unsafe { v::pack_a_cols(k, src, a.cs, (i0, rows), panel) };
        for q in q0..kp {
            for r in 0..rows {
                panel[q * MR + r] = a.bits(i0 + r, 2 * q);
            }
        }
    } else {
        pack_a_panel(m, k, a, p, panel)
    }
}

/// Micro-panel `p` of a packed A (see [`pack_a`]); one body, compiled per ISA.
#[inline(always)]
fn pack_a_panel<T: ToBf16>(m: usize, k: usize, a: View<'_, T>, p: usize, panel: &mut [u32]) {
    let kp = k.div_ceil(2);
    let i0 = p * MR;
    let rows = MR.min(m - i0);
    if rows < MR {
        panel.iter_mut().for_each(|v| *v = 0);
    }
    if a.cs == 1 {
        // Row-major: each row's pairs are adjacent.
        for r in 0..rows {
            let row = &a.data[(i0 + r) * a.rs..][..k];
            let (pairs, tail) = row.split_at(k & !1);
            for (q, pr) in pairs.chunks_exact(2).enumerate() {
                panel[q * MR + r] =
                    u32::from(pr[0].bf16_bits()) | u32::from(pr[1].bf16_bits()) << 16;
            }
            if let Some(t) = tail.first() {
                panel[(kp - 1) * MR + r] = u32::from(t.bf16_bits());
            }
        }
    } else if a.rs == 1 {
        // Column-major (a transposed row-major matrix): k rows of m values.
        for q in 0..kp {
            let lo = &a.data[2 * q * a.cs + i0..][..rows];
            let out = &mut panel[q * MR..q * MR + rows];
            if 2 * q + 1 < k {
                let hi = &a.data[(2 * q + 1) * a.cs + i0..][..rows];
                for ((o, l), h) in out.iter_mut().zip(lo).zip(hi) {
                    *o = u32::from(l.bf16_bits()) | u32::from(h.bf16_bits()) << 16;
                }
            } else {
                for (o, l) in out.iter_mut().zip(lo) {
                    *o = u32::from(l.bf16_bits());
                }
            }
        }
    } else {
        for r in 0..rows {
            for q in 0..kp {
                let lo = a.bits(i0 + r, 2 * q);
                let hi = if 2 * q + 1 < k {
                    a.bits(i0 + r, 2 * q + 1)
                } else {
                    0
                };
                panel[q * MR + r] = lo | (hi << 16);
            }
        }
    }
}

/// B (k × n) packed ([`pack_b`]) into a fresh buffer of [`packed_b_len`].
pub(crate) fn packed_b<T: ToBf16>(k: usize, n: usize, b: View<'_, T>) -> Vec<u16> {
    let mut dst = vec![0u16; packed_b_len(k, n)];
    pack_b(k, n, b, &mut dst);
    dst
}

/// Packs B (k × n) into `dst` (at least [`packed_b_len`]): panel p, pair q, column c, half e at
/// `((p·kp + q)·NR + c)·2 + e`. Padding is zero. Row-major and column-major views read slices;
/// other strides go element-wise.
pub fn pack_b<T: ToBf16>(k: usize, n: usize, b: View<'_, T>, dst: &mut [u16]) {
    let kp = k.div_ceil(2);
    dst[..packed_b_len(k, n)]
        .par_chunks_mut(kp * NR * 2)
        .enumerate()
        .for_each(|(p, panel)| pack_b_one(k, n, b, p, panel));
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn pack_b_panel_avx512<T: ToBf16>(
    k: usize,
    n: usize,
    b: View<'_, T>,
    p: usize,
    panel: &mut [u16],
) {
    use super::pack_bf16_avx512 as v;
    if b.cs != 1 && b.rs != 1 {
        return pack_b_panel(k, n, b, p, panel);
    }
    let (kp, j0) = (k.div_ceil(2), p * NR);
    let cols = NR.min(n - j0);
    let src = T::src(b.data);
    if cols < NR || k % 2 == 1 {
        panel.iter_mut().for_each(|v| *v = 0);
    }
    let put = |panel: &mut [u16], q: usize, c: usize| {
        let o = (q * NR + c) * 2;
        panel[o] = b.bits(2 * q, j0 + c) as u16;
        if 2 * q + 1 < k {
            panel[o + 1] = b.bits(2 * q + 1, j0 + c) as u16;
        }
    };
    if b.cs == 1 {
        // SAFETY: the CPU has this function's features; the bounds are checked there.
        let q0 = unsafe { v::pack_b_rows(k, src, b.rs, (j0, cols), NR, panel) };
        for q in q0..kp {
            (0..cols).for_each(|c| put(panel, q, c));
        }
    } else {
        // SAFETY: as above.
        let (c0, q0) = unsafe { v::pack_b_cols(k, src, b.cs, (j0, cols), NR, panel) };
        for c in 0..cols {
            let from = if c < c0 { q0 } else { 0 };
            (from..kp).for_each(|q| put(panel, q, c));
        }
    }
}

/// Panel `p` of a packed B (see [`pack_b`]); one body, compiled per ISA.
#[inline(always)]
fn pack_b_panel<T: ToBf16>(k: usize, n: usize, b: View<'_, T>, p: usize, panel: &mut [u16]) {
    let kp = k.div_ceil(2);
    let j0 = p * NR;
    let cols = NR.min(n - j0);
    if cols < NR || k % 2 == 1 {
        panel.iter_mut().for_each(|v| *v = 0);
    }
    if b.cs == 1 {
        // Row-major: two k rows of the panel's columns, interleaved.
        for q in 0..kp {
            let out = &mut panel[q * NR * 2..][..cols * 2];
            let lo = &b.data[2 * q * b.rs + j0..][..cols];
            if 2 * q + 1 < k {
                let hi = &b.data[(2 * q + 1) * b.rs + j0..][..cols];
                for ((o, l), h) in out.chunks_exact_mut(2).zip(lo).zip(hi) {
                    o[0] = l.bf16_bits();
                    o[1] = h.bf16_bits();
                }
            } else {
                for (o, l) in out.chunks_exact_mut(2).zip(lo) {
                    o[0] = l.bf16_bits();
                }
            }
        }
    } else if b.rs == 1 {
        // Column-major (Wᵀ of a row-major W): each column's pairs are adjacent.
        for c in 0..cols {
            let col = &b.data[(j0 + c) * b.cs..][..k];
            let (pairs, tail) = col.split_at(k & !1);
            for (q, pr) in pairs.chunks_exact(2).enumerate() {
                let o = (q * NR + c) * 2;
                panel[o] = pr[0].bf16_bits();
                panel[o + 1] = pr[1].bf16_bits();
            }
            if let Some(t) = tail.first() {
                panel[((kp - 1) * NR + c) * 2] = t.bf16_bits();
            }
        }
    } else {
        for q in 0..kp {
            for c in 0..cols {
                let o = (q * NR + c) * 2;
                panel[o] = b.bits(2 * q, j0 + c) as u16;
                panel[o + 1] = if 2 * q + 1 < k {
                    b.bits(2 * q + 1, j0 + c) as u16
                } else {
                    0
                };
            }
        }
    }
}

/// `C (m × n, row stride ldc) += A · B` from packed operands with `k` (unpadded) columns of A.
/// The work is split into one contiguous range of B panels (or of A micro-panels when there are
/// fewer panels than threads) per rayon thread; nothing is allocated.
///
/// # Panics
/// When the CPU lacks the kernel ([`supported`]) or a buffer is shorter than its shape needs (both are
/// bugs of the caller, not input errors).
pub fn gemm_packed(
    m: usize,
    n: usize,
    k: usize,
    pa: &[u32],
    pb: &[u16],
    c: &mut [f32],
    ldc: usize,
) {
    packed_product((m, n, k), (pa, pb), (c, ldc), true)
}

/// [`gemm_packed`] on the calling thread (for callers that already parallelise, such as the
/// attention's loop over heads).
pub(crate) fn gemm_packed_serial(
    m: usize,
    n: usize,
    k: usize,
    pa: &[u32],
    pb: &[u16],
    c: &mut [f32],
    ldc: usize,
) {
    packed_product((m, n, k), (pa, pb), (c, ldc), false)
}

/// The body of [`gemm_packed`] (`parallel`) and [`gemm_packed_serial`]: the checks (the kernel
/// is there, the packed operands and C are long enough for the shape; asserted), then the tiles
/// split into one task per thread, or all of them as one task on the calling thread.
fn packed_product(
    (m, n, k): (usize, usize, usize),
    (pa, pb): (&[u32], &[u16]),
    (c, ldc): (&mut [f32], usize),
    parallel: bool,
) {
    assert!(supported(), "gemm_bf16 called without AVX512-BF16");
    assert!(pa.len() >= packed_a_len(m, k) && pb.len() >= packed_b_len(k, n));
    assert!(m == 0 || n == 0 || c.len() >= (m - 1) * ldc + n);
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    let (mp, np) = (m.div_ceil(MR), n.div_ceil(NR));
    // One thread: a single task over every panel and micro-panel (np ≥ 1 picks the panels).
    let threads = if parallel {
        rayon::current_num_threads().max(1)
    } else {
        1
    };
    let dst = SharedMut(c.as_mut_ptr());
    let split_n = np >= threads || np >= mp;
    let parts = if split_n { np } else { mp }.min(threads);
    let total = if split_n { np } else { mp };
    let task = |t: usize| {
        let (lo, hi) = (total * t / parts, total * (t + 1) / parts);
        let (p_range, m_range) = if split_n {
            (lo..hi, 0..mp)
        } else {
            (0..np, lo..hi)
        };
        // SAFETY: the ranges of the tasks partition the micro-panels (or the panels), so the tiles
        // of (m_range × p_range) belong to this task alone; they lie inside c, whose length was
        // checked above against (m − 1)·ldc + n, as were the packed lengths; the CPU has
        // AVX512-BF16 (`available`, asserted above).
        unsafe { tiles(m, n, k, pa, pb, dst, ldc, p_range, m_range) };
    };
    if parallel {
        (0..parts).into_par_iter().for_each(task);
    } else {
        task(0);
    }
}

/// C += A·B over the tiles (micro-panels `m_range` × panels `p_range`), k block by k block.
///
/// # Safety
/// The tiles must lie inside C (`(m − 1)·ldc + n` elements from `dst`) and no other thread may
/// touch them during the call; `pa`, `pb` must hold packed A (m × k) and B (k × n), and the CPU
/// must have AVX512-BF16 ([`available`]).
#[allow(clippy::too_many_arguments)]
unsafe fn tiles(
    m: usize,
    n: usize,
    k: usize,
    pa: &[u32],
    pb: &[u16],
    dst: SharedMut<f32>,
    ldc: usize,
    p_range: std::ops::Range<usize>,
    m_range: std::ops::Range<usize>,
) {
    let kp = k.div_ceil(2);
    let mut q0 = 0;
    while q0 < kp {
        let kq = KC_PAIRS.min(kp - q0);
        for p in p_range.clone() {
            // Panel p's pairs q0.. : kq·NR·2 u16 from here lie inside the packed B of
            // ⌈n/NR⌉·NR·kp·2 u16 (the slice's bounds check covers the start).
            let b = &pb[(p * kp + q0) * NR * 2..];
            let cols = NR.min(n - p * NR);
            for mi in m_range.clone() {
                // Micro-panel mi's pairs q0.. : kq·MR u32 inside the packed A likewise.
                let a = &pa[(mi * kp + q0) * MR..];
                let rows = MR.min(m - mi * MR);
                // SAFETY: tile (mi, p) starts at row mi·MR, column p·NR of C, inside C by the
                // caller's contract, and this call alone touches it; `a` and `b` hold the kq
                // pairs `tile` reads (see above), and the caller checked the CPU's features.
                unsafe {
                    let ct = dst.at(mi * MR * ldc + p * NR);
                    tile(kq, a.as_ptr(), b.as_ptr(), ct, ldc, rows, cols);
                }
            }
        }
        q0 += kq;
    }
}

/// One tile: the kernel on C directly when the tile is whole, else on a padded copy.
///
/// # Safety
/// `c` must be valid for `rows` ≤ [`MR`] rows of `cols` ≤ [`NR`] columns at stride `ldc`, with
/// no other thread touching them; `a`/`b` for `kq` pairs; the CPU must have AVX512-BF16.
#[inline]
unsafe fn tile(
    kq: usize,
    a: *const u32,
    b: *const u16,
    c: *mut f32,
    ldc: usize,
    rows: usize,
    cols: usize,
) {
    if rows == MR && cols == NR {
        // SAFETY: a whole tile: `c` is valid for MR rows of NR floats at stride `ldc`, which is
        // what the kernel writes; `a`, `b` and the CPU as the caller guarantees.
        unsafe { kernel(kq, a, b, c, ldc) };
        return;
    }
    let mut t = [0f32; MR * NR];
    for r in 0..rows {
        // SAFETY: row r < rows of C holds `cols` floats at `c + r·ldc` (the caller's contract)
        // and row r of `t` holds NR ≥ cols; a stack array never overlaps C.
        unsafe { std::ptr::copy_nonoverlapping(c.add(r * ldc), t.as_mut_ptr().add(r * NR), cols) };
    }
    // SAFETY: `t` is a whole MR × NR tile at stride NR; `a`, `b` and the CPU as guaranteed.
    unsafe { kernel(kq, a, b, t.as_mut_ptr(), NR) };
    for r in 0..rows {
        // SAFETY: the copy above in reverse, with the same bounds.
        unsafe { std::ptr::copy_nonoverlapping(t.as_ptr().add(r * NR), c.add(r * ldc), cols) };
    }
}

/// The micro-kernel of this target.
///
/// # Safety
/// As for [`kernel_avx512bf16`].
#[cfg(target_arch = "x86_64")]
unsafe fn kernel(kq: usize, a: *const u32, b: *const u16, c: *mut f32, ldc: usize) {
    // SAFETY: the caller upholds the kernel's contract, the CPU's features included.
    unsafe { kernel_avx512bf16(kq, a, b, c, ldc) }
}

/// Never called: [`available`] is false off x86-64.
///
/// # Safety
/// None needed (it panics).
#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel(_: usize, _: *const u32, _: *const u16, _: *mut f32, _: usize) {
    unreachable!("supported() is false off x86-64")
}

/// C[MR × NR] += Σ_q A-pairs(q) · B-pairs(q).
///
/// # Safety
/// The CPU must have AVX512F and AVX512-BF16; `a` holds `kq·MR` u32, `b` `kq·NR·2` u16, `c` MR
/// rows of NR floats at stride `ldc`, which no other thread touches during the call.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn kernel_avx512bf16(kq: usize, a: *const u32, b: *const u16, c: *mut f32, ldc: usize) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 4]; MR];
    for q in 0..kq {
        // SAFETY: pair q < kq of the panel is NR·2 = 128 u16 from `b + q·NR·2`, inside the
        // kq·NR·2 the caller guarantees; the four unaligned loads read 32 u16 each at 0, 32, 64
        // and 96 (`loadu` needs no alignment; the CPU has AVX512F by the caller's contract).
        // `__m512i` and `__m512bh` are both 512 bits with no invalid patterns, so the transmutes
        // only rename the lanes.
        let bv: [__m512bh; 4] = unsafe {
            let bq = b.add(q * NR * 2);
            [
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(bq as *const __m512i)),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    bq.add(32) as *const __m512i
                )),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    bq.add(64) as *const __m512i
                )),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    bq.add(96) as *const __m512i
                )),
            ]
        };
        // SAFETY: pair q's MR u32 of A start at `a + q·MR`, inside the kq·MR the caller
        // guarantees.
        let aq = unsafe { a.add(q * MR) };
        for (r, row) in acc.iter_mut().enumerate() {
            // SAFETY: r < MR, so `aq + r` is one of pair q's MR values (see above); the
            // transmute renames the 512 bits of a broadcast u32 pair as 32 bf16 (any bits valid).
            let av = unsafe {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(*aq.add(r) as i32))
            };
            for (v, lane) in row.iter_mut().enumerate() {
                *lane = _mm512_dpbf16_ps(*lane, av, bv[v]);
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (v, lane) in row.iter().enumerate() {
            // SAFETY: row r < MR, floats v·16..v·16 + 16 < NR of the tile: inside the MR rows of
            // NR floats at stride `ldc` the caller guarantees, touched by no other thread;
            // `loadu`/`storeu` need no alignment.
            unsafe {
                let p = c.add(r * ldc + v * 16);
                _mm512_storeu_ps(p, _mm512_add_ps(_mm512_loadu_ps(p), *lane));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f32 values that exercise the rounding: ties to even both ways, NaNs (quieted), ±∞,
    /// denormals, the largest finite value, and ordinary values.
    fn f32_mat(len: usize, seed: u64) -> Vec<f32> {
        let special = [
            f32::from_bits(0x3F80_8000), // a tie, rounds down to even
            f32::from_bits(0x3F81_8000), // a tie, rounds up to even
            f32::from_bits(0x7FC0_0001),
            f32::from_bits(0xFF80_0001), // a signalling NaN
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::from_bits(0x0000_0001),
            f32::MAX,
            -0.0,
        ];
        let mut r = crate::rng::SplitMix64::new(seed);
        (0..len)
            .map(|i| {
                if i % 7 == 3 {
                    special[(i / 7) % special.len()]
                } else {
                    (r.uniform() * 2.0 - 1.0) as f32
                }
            })
            .collect()
    }

    /// Every packing, dispatched (the AVX-512 one on such CPUs), against the element-wise
    /// bodies, bit for bit: A row-major and column-major, B row-major and column-major, from
    /// bf16 and from f32; whole blocks of 16 pairs and of 16 columns, remainders, odd k, strides
    /// wider than the matrix, ragged last panels.
    #[test]
    fn vector_packing_is_the_elementwise_one() {
        fn check<T: ToBf16>(data: &[T], shapes: &[(usize, usize, usize)], what: &str) {
            for &(m, k, pad) in shapes {
                // A (m × k) row-major (stride k + pad) and column-major (stride m + pad).
                for (rs, cs) in [(k + pad, 1), (1, m + pad)] {
                    let a = View { data, rs, cs };
                    let mut fast = vec![u32::MAX; packed_a_len(m, k)];
                    pack_a(m, k, a, &mut fast);
                    let mut slow = vec![u32::MAX; packed_a_len(m, k)];
                    let kp = k.div_ceil(2);
                    for (p, panel) in slow.chunks_mut(kp * MR).enumerate() {
                        pack_a_panel(m, k, a, p, panel);
                    }
                    assert_eq!(fast, slow, "{what} A {m}×{k} rs {rs} cs {cs}");
                }
                // B (k × n = m) row-major (stride m + pad) and column-major (stride k + pad).
                let n = m;
                for (rs, cs) in [(n + pad, 1), (1, k + pad)] {
                    let b = View { data, rs, cs };
                    let mut fast = vec![u16::MAX; packed_b_len(k, n)];
                    pack_b(k, n, b, &mut fast);
                    let mut slow = vec![u16::MAX; packed_b_len(k, n)];
                    let kp = k.div_ceil(2);
                    for (p, panel) in slow.chunks_mut(kp * NR * 2).enumerate() {
                        pack_b_panel(k, n, b, p, panel);
                    }
                    assert_eq!(fast, slow, "{what} B {k}×{n} rs {rs} cs {cs}");
                }
            }
        }
        if !vecmath_avx512() {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        let shapes = [
            (6, 32, 0),
            (12, 64, 6),
            (13, 75, 0),
            (7, 33, 8),
            (6, 1, 1),
            (130, 66, 3),
            (64, 128, 0),
            (70, 31, 2),
        ];
        let len = 200 * 200;
        check(&mat(1, len, 5), &shapes, "bf16");
        check(&f32_mat(len, 6), &shapes, "f32");
    }

    fn vecmath_avx512() -> bool {
        super::super::vecmath::avx512()
    }

    fn mat(rows: usize, cols: usize, seed: u64) -> Vec<bf16> {
        let mut r = crate::rng::SplitMix64::new(seed);
        (0..rows * cols)
            .map(|_| bf16::from_f64(r.uniform() * 2.0 - 1.0))
            .collect()
    }

    /// The (cols × rows) row-major transpose of a (rows × cols) row-major matrix.
    fn transpose(v: &[bf16], rows: usize, cols: usize) -> Vec<bf16> {
        let mut t = vec![bf16::ZERO; rows * cols];
        for i in 0..rows {
            for j in 0..cols {
                t[j * rows + i] = v[i * cols + j];
            }
        }
        t
    }

    /// C += A·B against an f64 sum of the same bf16 values, for whole and ragged shapes and
    /// transposed views, on top of a non-zero C.
    #[test]
    fn matches_f64_on_ragged_and_strided_shapes() {
        if !supported() {
            eprintln!("skipped: no AVX512-BF16 on this CPU");
            return;
        }
        for &(m, n, k, ta, tb) in &[
            (6, 64, 128, false, false),
            (13, 70, 37, false, true),
            (1, 1, 1, true, false),
            (30, 200, 300, true, true),
            (7, 129, 2, false, false),
            (64, 32, 515, false, false),
        ] {
            let a = mat(m, k, 1);
            let b = mat(k, n, 2);
            // The same logical matrices, stored transposed when asked.
            let av = if ta { transpose(&a, m, k) } else { a.clone() };
            let bv = if tb { transpose(&b, k, n) } else { b.clone() };
            let a_view = if ta {
                View::cols(&av, m)
            } else {
                View::rows(&av, k)
            };
            let b_view = if tb {
                View::cols(&bv, k)
            } else {
                View::rows(&bv, n)
            };
            let mut pa = vec![7u32; packed_a_len(m, k)];
            let mut pb = vec![7u16; packed_b_len(k, n)];
            pack_a(m, k, a_view, &mut pa);
            pack_b(k, n, b_view, &mut pb);
            let ldc = n + 3;
            let mut c = vec![0.5f32; m * ldc];
            gemm_packed(m, n, k, &pa, &pb, &mut c, ldc);
            for i in 0..m {
                for j in 0..ldc {
                    let got = c[i * ldc + j] as f64;
                    if j >= n {
                        assert_eq!(got, 0.5, "({m},{n},{k}) wrote outside C at ({i},{j})");
                        continue;
                    }
                    let want: f64 = 0.5
                        + (0..k)
                            .map(|l| a[i * k + l].to_f64() * b[l * n + j].to_f64())
                            .sum::<f64>();
                    let tol = 1e-6 * (k as f64).sqrt() * 4.0 + 1e-6;
                    assert!(
                        (got - want).abs() <= tol,
                        "({m},{n},{k},{ta},{tb}) C[{i},{j}] = {got}, f64 {want}"
                    );
                }
            }
        }
    }

    /// Views with no unit stride take the element-wise packing path.
    #[test]
    fn packs_views_without_a_unit_stride() {
        if !supported() {
            return;
        }
        let (m, n, k) = (9, 70, 15);
        let (a, b) = (mat(m, k, 3), mat(k, n, 4));
        // Every other element of a twice-as-wide buffer.
        let spread = |v: &[bf16]| -> Vec<bf16> {
            v.iter().flat_map(|&x| [x, bf16::from_f32(99.0)]).collect()
        };
        let (sa, sb) = (spread(&a), spread(&b));
        let mut pa = vec![0u32; packed_a_len(m, k)];
        let mut pb = vec![0u16; packed_b_len(k, n)];
        pack_a(
            m,
            k,
            View {
                data: &sa,
                rs: 2 * k,
                cs: 2,
            },
            &mut pa,
        );
        pack_b(
            k,
            n,
            View {
                data: &sb,
                rs: 2 * n,
                cs: 2,
            },
            &mut pb,
        );
        let mut c = vec![0f32; m * n];
        gemm_packed(m, n, k, &pa, &pb, &mut c, n);
        let (mut pa1, mut pb1) = (pa.clone(), pb.clone());
        pack_a(m, k, View::rows(&a, k), &mut pa1);
        pack_b(k, n, View::rows(&b, n), &mut pb1);
        assert_eq!(pa, pa1);
        assert_eq!(pb, pb1);
        let want: f64 = (0..k).map(|l| a[l].to_f64() * b[l * n].to_f64()).sum();
        assert!((c[0] as f64 - want).abs() < 1e-5);
    }

    #[test]
    fn packed_sizes_round_up_to_whole_tiles() {
        assert_eq!(packed_a_len(1, 1), MR);
        assert_eq!(packed_a_len(7, 5), 2 * MR * 3);
        assert_eq!(packed_b_len(3, 65), 2 * NR * 2 * 2);
    }
}
