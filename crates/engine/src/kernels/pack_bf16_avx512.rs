//! AVX-512 packing of the bf16 GEMM's operands ([`super::gemm_bf16`]): the same layouts and the
//! same bits as the element-wise bodies there (`pack_a_panel`, `pack_b_panel`; the tests in
//! `gemm_bf16` hold them equal), 16 values per instruction instead of one.
//!
//! Why: packing was 13 % of a DiT-S/2 bf16-mixed step at 4,096 rows (perf, 2 threads, Zen 4):
//! one element at a time, with the f32 → bf16 rounding of master weights done per element. The
//! kernel itself was 52 %.
//!
//! Both layouts pair values along k: a packed `u32` holds k = 2q in its low half and 2q + 1 in
//! its high half. So a row-major A's row, or a column-major B's column, already holds its pairs
//! side by side (packing is a transpose of whole `u32`s), while a column-major A or a row-major
//! B interleaves two k rows value by value. f32 sources are rounded to nearest even exactly as
//! [`super::vecmath::bf16_bits`] does (NaN quieted), so an f32 master weight packs as its bf16
//! cast would.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::{
    __m512i, __mmask16, __mmask8, _mm256_loadu_si256, _mm256_maskz_loadu_epi16, _mm512_add_epi32,
    _mm512_and_si512, _mm512_castps_si512, _mm512_castsi256_si512, _mm512_cmpgt_epu32_mask,
    _mm512_cvtepi32_epi16, _mm512_cvtepu16_epi32, _mm512_inserti64x4, _mm512_loadu_ps,
    _mm512_loadu_si512, _mm512_mask_blend_epi32, _mm512_mask_permutexvar_epi64,
    _mm512_mask_storeu_epi32, _mm512_maskz_loadu_ps, _mm512_or_si512, _mm512_permutex2var_epi32,
    _mm512_permutex2var_epi64, _mm512_set1_epi32, _mm512_setr_epi32, _mm512_shuffle_i32x4,
    _mm512_slli_epi32, _mm512_srli_epi32, _mm512_storeu_si512, _mm512_unpackhi_epi32,
    _mm512_unpackhi_epi64, _mm512_unpacklo_epi32, _mm512_unpacklo_epi64,
};

use super::bf16_layout::{Src, MR};

/// The vector reads of a packing source.
impl Src<'_> {
    /// The bf16 bits of the 16 values from `off` (those of `mask`; the others 0), one per
    /// 32-bit lane, in the low half.
    ///
    /// # Safety
    /// The CPU must have AVX512F, AVX512BW and AVX512VL; the masked values lie inside the slice.
    #[inline(always)]
    unsafe fn bits16(&self, off: usize, mask: __mmask16) -> __m512i {
        // SAFETY: the caller's contract: the masked lanes are inside the slice, masked-off
        // lanes are not read (`maskz_loadu` suppresses their faults).
        unsafe {
            match self {
                Src::Bf16(s) => {
                    let p = s.as_ptr().add(off);
                    let v = if mask == u16::MAX {
                        _mm256_loadu_si256(p.cast())
                    } else {
                        _mm256_maskz_loadu_epi16(mask, p.cast())
                    };
                    _mm512_cvtepu16_epi32(v)
                }
                Src::F32(s) => {
                    let p = s.as_ptr().add(off);
                    let v = if mask == u16::MAX {
                        _mm512_loadu_ps(p)
                    } else {
                        _mm512_maskz_loadu_ps(mask, p)
                    };
                    round_bits(_mm512_castps_si512(v))
                }
            }
        }
    }

    /// The 16 pairs (32 values) from `off` as packed `u32`s: value `off + 2t` in the low half of
    /// lane t, `off + 2t + 1` in its high half.
    ///
    /// # Safety
    /// As for [`Src::bits16`], with all 32 values inside the slice.
    #[inline(always)]
    unsafe fn pairs16(&self, off: usize) -> __m512i {
        // SAFETY: the caller's contract; 32 bf16 are one 64-byte load.
        unsafe {
            match self {
                Src::Bf16(s) => _mm512_loadu_si512(s.as_ptr().add(off).cast()),
                Src::F32(_) => {
                    let lo = _mm512_cvtepi32_epi16(self.bits16(off, u16::MAX));
                    let hi = _mm512_cvtepi32_epi16(self.bits16(off + 16, u16::MAX));
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
                }
            }
        }
    }

    /// Pairs of two k rows `stride` apart, value by value: lane t holds the value at
    /// `off + t` in its low half and the one at `off + stride + t` in its high half (the lanes
    /// of `mask`; the others 0).
    ///
    /// # Safety
    /// As for [`Src::bits16`], for both rows' masked values.
    #[inline(always)]
    unsafe fn pair16(&self, off: usize, stride: usize, mask: __mmask16) -> __m512i {
        // SAFETY: the caller's contract.
        unsafe {
            let l = self.bits16(off, mask);
            let h = self.bits16(off + stride, mask);
            _mm512_or_si512(l, _mm512_slli_epi32::<16>(h))
        }
    }
}

/// f32 bits → bf16 bits (low half of each lane), round to nearest even, NaN quieted: the lanes
/// of [`super::vecmath::bf16_bits`].
#[inline(always)]
unsafe fn round_bits(u: __m512i) -> __m512i {
    // SAFETY: register-only AVX512F operations; the caller's target has AVX512F.
    unsafe {
        let one = _mm512_set1_epi32(1);
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(u), one);
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(
            u,
            _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd),
        ));
        let abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFF_FFFF));
        let nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7F80_0000));
        let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(u), _mm512_set1_epi32(0x40));
        _mm512_mask_blend_epi32(nan, rounded, quiet)
    }
}

/// The first `n` lanes.
fn lanes(n: usize) -> __mmask16 {
    if n >= 16 {
        u16::MAX
    } else {
        (1u16 << n) - 1
    }
}

/// The merge of [`pack_a_rows`]: output 64-bit unit o of a group of eight pairs (three units
/// per pair: rows 0-1, 2-3, 4-5) is pair o / 3 of interleaving o % 3. `MERGE_AB` picks it from
/// the first two interleavings (index q or 8 + q), `MERGE_C` with `MERGE_C_MASK` from the
/// third; row j of each is the j-th output vector's eight units.
const MERGE_AB: [[i64; 8]; 3] = merge_table(true);
const MERGE_C: [[i64; 8]; 3] = merge_table(false);
const MERGE_C_MASK: [__mmask8; 3] = {
    let mut m = [0u8; 3];
    let mut o = 0;
    while o < 24 {
        if o % 3 == 2 {
            m[o / 8] |= 1 << (o % 8);
        }
        o += 1;
    }
    m
};

const fn merge_table(ab: bool) -> [[i64; 8]; 3] {
    let mut t = [[0i64; 8]; 3];
    let mut o = 0;
    while o < 24 {
        let second = ab && o % 3 == 1;
        t[o / 8][o % 8] = (o / 3 + if second { 8 } else { 0 }) as i64;
        o += 1;
    }
    t
}

/// A whole micro-panel of a row-major A ([`MR`] rows from row `i0`, row stride `rs`, k values
/// each): each row's pairs are its packed `u32`s, so the panel is the transpose of [`MR`] rows
/// × pairs into pairs × [`MR`] rows. By blocks of 16 pairs: one 16-pair read per row, the rows
/// interleaved by twos (as 64-bit units), the three interleavings merged into each pair's six
/// `u32`s by 64-bit permutes, six stores. The pairs past the last whole block and an odd k's
/// last value are returned for the element-wise body: the index of the first pair not packed.
///
/// # Safety
/// The CPU must have AVX512F, AVX512BW and AVX512VL; rows `i0..i0 + MR` of k values at stride
/// `rs` lie inside `a`; `panel` holds ⌈k/2⌉·[`MR`] `u32`s.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(crate) unsafe fn pack_a_rows(
    k: usize,
    a: Src<'_>,
    rs: usize,
    i0: usize,
    panel: &mut [u32],
) -> usize {
    let full = k / 2;
    assert!(panel.len() >= k.div_ceil(2) * MR && (i0 + MR - 1) * rs + k <= a.len());
    // Pair t of the first (low) or last (high) eight of a block from the first or second row:
    // the interleavings of two rows.
    let lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    let hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    let load = |t: &[i64; 8]| {
        // SAFETY: a table row is eight i64, the 64 bytes read; `loadu` needs no alignment.
        unsafe { _mm512_loadu_si512(t.as_ptr().cast()) }
    };
    let ab: [__m512i; 3] = std::array::from_fn(|j| load(&MERGE_AB[j]));
    let cidx: [__m512i; 3] = std::array::from_fn(|j| load(&MERGE_C[j]));
    let mut q0 = 0;
    while q0 + 16 <= full {
        // SAFETY: pairs q0..q0 + 16 are values 2·q0..2·q0 + 32 ≤ k of each row, inside `a`
        // (the caller's contract).
        let r: [__m512i; MR] =
            std::array::from_fn(|i| unsafe { a.pairs16((i0 + i) * rs + 2 * q0) });
        for (half, idx) in [lo, hi].into_iter().enumerate() {
            let p01 = _mm512_permutex2var_epi32(r[0], idx, r[1]);
            let p23 = _mm512_permutex2var_epi32(r[2], idx, r[3]);
            let p45 = _mm512_permutex2var_epi32(r[4], idx, r[5]);
            for j in 0..3 {
                let t = _mm512_permutex2var_epi64(p01, ab[j], p23);
                let v = _mm512_mask_permutexvar_epi64(t, MERGE_C_MASK[j], cidx[j], p45);
                // SAFETY: pairs q0 + 8·half .. + 8 are MR·8 = 48 u32 from (q0 + 8·half)·MR,
                // the j-th 16 of them here, below (q0 + 16)·MR ≤ ⌈k/2⌉·MR ≤ panel.len().
                unsafe {
                    _mm512_storeu_si512(
                        panel.as_mut_ptr().add((q0 + 8 * half) * MR + 16 * j).cast(),
                        v,
                    )
                };
            }
        }
        q0 += 16;
    }
    q0
}

/// A micro-panel of a column-major A (k rows of the stored matrix, each holding the panel's
/// rows at `i0..i0 + rows`, stride `cs` between k rows): pair q interleaves k rows 2q and
/// 2q + 1, `rows` ≤ [`MR`] values each, by masked 16-lane reads and a masked store. Returns the
/// first pair not packed (an odd k's last value is left to the element-wise body).
///
/// # Safety
/// The CPU must have AVX512F, AVX512BW and AVX512VL; the values read lie inside `a`; `panel`
/// holds ⌈k/2⌉·[`MR`] `u32`s.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(crate) unsafe fn pack_a_cols(
    k: usize,
    a: Src<'_>,
    cs: usize,
    (i0, rows): (usize, usize),
    panel: &mut [u32],
) -> usize {
    let full = k / 2;
    assert!(rows <= MR && panel.len() >= k.div_ceil(2) * MR);
    assert!(full == 0 || (2 * full - 1) * cs + i0 + rows <= a.len());
    let m = lanes(rows);
    for q in 0..full {
        // SAFETY: values i0..i0 + rows of k rows 2q and 2q + 1 < k lie inside `a` (the
        // caller's contract); only the masked lanes are read and stored; pair q's MR u32 start
        // at q·MR < ⌈k/2⌉·MR.
        unsafe {
            let v = a.pair16(2 * q * cs + i0, cs, m);
            _mm512_mask_storeu_epi32(panel.as_mut_ptr().add(q * MR).cast(), m, v);
        }
    }
    full
}

/// A panel of a row-major B (k rows, stride `rs`; the panel's `cols` ≤ NR columns from `j0`):
/// pair q, column c is `u16`s 2c, 2c + 1 of row q (k rows 2q and 2q + 1 interleaved), 16
/// columns per read. Returns the first pair not packed (an odd k's last row is left to the
/// element-wise body).
///
/// # Safety
/// The CPU must have AVX512F, AVX512BW and AVX512VL; the values read lie inside `b`; `panel`
/// holds ⌈k/2⌉·NR pairs of `u16`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(crate) unsafe fn pack_b_rows(
    k: usize,
    b: Src<'_>,
    rs: usize,
    (j0, cols): (usize, usize),
    nr: usize,
    panel: &mut [u16],
) -> usize {
    let full = k / 2;
    assert!(cols <= nr && panel.len() >= k.div_ceil(2) * nr * 2);
    assert!(full == 0 || (2 * full - 1) * rs + j0 + cols <= b.len());
    for q in 0..full {
        let mut c = 0;
        while c < cols {
            let m = lanes(cols - c);
            // SAFETY: columns j0 + c.. of k rows 2q and 2q + 1 < k lie inside `b` (the
            // caller's contract), only the masked lanes read and stored; pair q, column c is
            // u32 q·nr + c of the panel, below ⌈k/2⌉·nr.
            unsafe {
                let v = b.pair16(2 * q * rs + j0 + c, rs, m);
                _mm512_mask_storeu_epi32(
                    panel.as_mut_ptr().cast::<u32>().add(q * nr + c).cast(),
                    m,
                    v,
                );
            }
            c += 16;
        }
    }
    full
}

/// A panel of a column-major B (column c's k values contiguous from `(j0 + c)·cs`): column c's
/// pairs are its packed `u32`s, so blocks of 16 columns × 16 pairs are transposed (16 reads,
/// the 16 × 16 `u32` transpose, 16 stores). Returns (whole columns packed, pairs packed): the
/// rest (columns past the last block of 16, pairs past the last block of 16, an odd k's last
/// value) is left to the element-wise body.
///
/// # Safety
/// The CPU must have AVX512F, AVX512BW and AVX512VL; columns `j0..j0 + cols` of k values at
/// stride `cs` lie inside `b`; `panel` holds ⌈k/2⌉·nr pairs of `u16`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(crate) unsafe fn pack_b_cols(
    k: usize,
    b: Src<'_>,
    cs: usize,
    (j0, cols): (usize, usize),
    nr: usize,
    panel: &mut [u16],
) -> (usize, usize) {
    let (full, cb) = ((k / 2) & !15, cols & !15);
    assert!(cols == 0 || (j0 + cols - 1) * cs + k <= b.len());
    assert!(panel.len() >= k.div_ceil(2) * nr * 2);
    let out = panel.as_mut_ptr().cast::<u32>();
    for c0 in (0..cb).step_by(16) {
        for q0 in (0..full).step_by(16) {
            // SAFETY: pairs q0..q0 + 16 of columns c0..c0 + 16 are values 2·q0..2·q0 + 32 ≤ k
            // of columns inside `b` (the caller's contract).
            let r: [__m512i; 16] =
                std::array::from_fn(|i| unsafe { b.pairs16((j0 + c0 + i) * cs + 2 * q0) });
            // SAFETY: the CPU has this function's features.
            let t = unsafe { transpose16(r) };
            for (i, v) in t.into_iter().enumerate() {
                // SAFETY: pair q0 + i, columns c0..c0 + 16 are u32 (q0 + i)·nr + c0.. + 16 of
                // the panel, below ⌈k/2⌉·nr.
                unsafe { _mm512_storeu_si512(out.add((q0 + i) * nr + c0).cast(), v) };
            }
        }
    }
    (cb, full)
}

/// The transpose of a 16 × 16 matrix of `u32`s held as 16 rows.
#[inline(always)]
unsafe fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
    // SAFETY: register-only AVX512F operations; the caller's target has AVX512F.
    unsafe {
        // 2 × 2 blocks of u32, then of u64, then 128-bit lanes twice.
        let mut a = [r[0]; 16];
        for i in 0..8 {
            a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        let mut b = [r[0]; 16];
        for i in 0..4 {
            b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
            b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
            b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
            b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
        }
        // b[4g + j] holds, in each 128-bit lane L, column 4L + j of rows 4g..4g + 4.
        let mut c = [r[0]; 16];
        for j in 0..4 {
            // Lanes 0, 1 of rows 0-3 and 4-7; 2, 3 likewise; then 8-15.
            let (x0, x1) = (b[j], b[4 + j]);
            let (x2, x3) = (b[8 + j], b[12 + j]);
            let lo01 = _mm512_shuffle_i32x4::<0b01_00_01_00>(x0, x1); // L0 L1 of x0, L0 L1 of x1
            let hi01 = _mm512_shuffle_i32x4::<0b11_10_11_10>(x0, x1); // L2 L3 of x0, of x1
            let lo23 = _mm512_shuffle_i32x4::<0b01_00_01_00>(x2, x3);
            let hi23 = _mm512_shuffle_i32x4::<0b11_10_11_10>(x2, x3);
            // Output row 4L + j: lane L of x0, x1, x2, x3.
            c[j] = _mm512_shuffle_i32x4::<0b10_00_10_00>(lo01, lo23);
            c[4 + j] = _mm512_shuffle_i32x4::<0b11_01_11_01>(lo01, lo23);
            c[8 + j] = _mm512_shuffle_i32x4::<0b10_00_10_00>(hi01, hi23);
            c[12 + j] = _mm512_shuffle_i32x4::<0b11_01_11_01>(hi01, hi23);
        }
        c
    }
}
