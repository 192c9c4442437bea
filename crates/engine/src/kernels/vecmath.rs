//! Vectorised f32 elementwise maps for the fused ops' kernels.
//!
//! The kernels of [`crate::ops`] accumulate bf16/f16/f32 storage in f32. Written as one closure
//! per element behind a rayon iterator, they ran libm's scalar `expf` and `half`'s branchy
//! conversions one element at a time: on DiT-S/2 at 256², batch 2, bf16-mixed (AMD EPYC, 2
//! threads, release) the GELU took 35 ms forward and 40 ms backward per step, longer than the
//! fc1 product it follows; through these maps it takes 3 ms and 6 ms (per-op timer, same runs). Here a map runs over blocks of [`LANE_BLOCK`]
//! elements: widen the block to f32, apply the function, narrow it back, with every step written
//! branch-free so that LLVM vectorises it. The same body is compiled for AVX-512 and AVX2 + FMA
//! and picked once per process from the CPU's flags (the binary stays portable; the scalar build
//! is the fallback).
//!
//! [`exp`] is a range-reduced polynomial (Cody–Waite split of ln 2, degree-7 Taylor on
//! |r| ≤ ln2/2) accurate to about 1 ulp over the clamped domain; it never returns inf or NaN for a
//! finite input (it clamps at ±87.3/88.3), which the GELU and its derivative need (their
//! `x / (1 + e^…)` form is exact in both limits). The bf16 conversions round to nearest even
//! and keep NaNs quiet, bit for bit as `half::bf16::from_f32` (tested).

use std::mem::MaybeUninit;
use std::sync::OnceLock;

use rayon::prelude::*;

/// Elements widened to f32 at a time (a stack buffer; 1 KiB).
pub(crate) const LANE_BLOCK: usize = 256;

/// Elements per rayon work item.
const PAR_ITEM: usize = 1 << 14;

/// e^x in f32 (see the module docs for the method and its domain).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that n·LN2_HI is exact for |n| < 2^9.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // 1.5·2^23: adding it rounds to the nearest integer (ties to even) in the low mantissa bits.
    const SHIFTER: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.3);
    let t = x * LOG2E + SHIFTER;
    let n = t - SHIFTER;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    // Degree-7 Taylor polynomial of e^r, Horner form.
    let mut p = 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    // n sits in the low mantissa bits of t; n + 127 ∈ [1, 254] after the clamp.
    let ni = t.to_bits().wrapping_sub(SHIFTER.to_bits()) as i32;
    let scale = f32::from_bits(((ni + 127) as u32) << 23);
    p * scale
}

/// f32 → bf16 bits, round to nearest even, NaN kept quiet (as `half::bf16::from_f32`).
#[inline(always)]
pub(crate) fn bf16_bits(f: f32) -> u16 {
    let u = f.to_bits();
    let rounded = u.wrapping_add(0x7FFF + ((u >> 16) & 1)) >> 16;
    let nan = (u & 0x7FFF_FFFF) > 0x7F80_0000;
    (if nan { (u >> 16) | 0x40 } else { rounded }) as u16
}

/// A storage element the maps widen to f32 and narrow back.
pub(crate) trait Lanes: Copy + Send + Sync + 'static {
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(src: &[f32], dst: &mut [MaybeUninit<Self>]);
}

impl Lanes for f32 {
    #[inline(always)]
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [MaybeUninit<f32>]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            d.write(s);
        }
    }
}

impl Lanes for half::bf16 {
    #[inline(always)]
    fn widen(src: &[half::bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(u32::from(s.to_bits()) << 16);
        }
    }
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [MaybeUninit<half::bf16>]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            d.write(half::bf16::from_bits(bf16_bits(s)));
        }
    }
}

impl Lanes for half::f16 {
    #[inline(always)]
    fn widen(src: &[half::f16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = s.to_f32();
        }
    }
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [MaybeUninit<half::f16>]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            d.write(half::f16::from_f32(s));
        }
    }
}

/// The level of the engine's vector kernels, lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Isa {
    Scalar,
    Avx2,
    Avx512,
}

/// Environment variable that caps the level of the engine's own vector kernels below what the
/// CPU has: `avx2` (no AVX-512 builds) or `scalar` (the portable bodies). With a `gemm` built
/// without `x86-v4` (`--no-default-features`) and `DITMEM_BF16_GEMM=widen` it makes an AVX-512
/// machine run the engine as an AVX2-only CPU would (issue 20's sweep on AVX2 kernels), and lets
/// the tests reach the AVX2 and scalar bodies there. Other values leave the detected level.
pub(crate) const VECTOR_ISA_VAR: &str = "DITMEM_VECTOR_ISA";

fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let cap = match std::env::var(VECTOR_ISA_VAR).as_deref() {
            Ok("scalar") => Isa::Scalar,
            Ok("avx2") => Isa::Avx2,
            _ => Isa::Avx512,
        };
        detected_isa().min(cap)
    })
}

/// The highest level this CPU runs.
fn detected_isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        // Every feature the AVX-512 builds enable (`#[target_feature]` below), so that
        // calling them is sound wherever this says so.
        if std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl")
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
        {
            return Isa::Avx512;
        }
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            return Isa::Avx2;
        }
    }
    Isa::Scalar
}

/// The level the engine's vector kernels run at here: `avx512`, `avx2` or `scalar`
/// (the CPU's, capped by [`VECTOR_ISA_VAR`]).
pub fn level() -> &'static str {
    match isa() {
        Isa::Avx512 => "avx512",
        Isa::Avx2 => "avx2",
        Isa::Scalar => "scalar",
    }
}

/// Whether this CPU runs the AVX-512 builds of the kernels (decided once per process): it has
/// AVX512F, AVX512BW, AVX512VL, AVX2 and FMA, the features those builds are compiled with.
pub(crate) fn avx512() -> bool {
    isa() == Isa::Avx512
}

/// One contiguous run: `out[i] = f(x[i])` (and `f(x[i], y[i])` for two inputs), by blocks.
#[inline(always)]
fn run1<T: Lanes, F: Fn(f32) -> f32>(x: &[T], out: &mut [MaybeUninit<T>], f: &F) {
    let mut buf = [0f32; LANE_BLOCK];
    for (xs, os) in x.chunks(LANE_BLOCK).zip(out.chunks_mut(LANE_BLOCK)) {
        let b = &mut buf[..xs.len()];
        T::widen(xs, b);
        for v in b.iter_mut() {
            *v = f(*v);
        }
        T::narrow(b, os);
    }
}

#[inline(always)]
fn run2<T: Lanes, F: Fn(f32, f32) -> f32>(x: &[T], y: &[T], out: &mut [MaybeUninit<T>], f: &F) {
    let mut bx = [0f32; LANE_BLOCK];
    let mut by = [0f32; LANE_BLOCK];
    for ((xs, ys), os) in x
        .chunks(LANE_BLOCK)
        .zip(y.chunks(LANE_BLOCK))
        .zip(out.chunks_mut(LANE_BLOCK))
    {
        let n = xs.len();
        T::widen(xs, &mut bx[..n]);
        T::widen(ys, &mut by[..n]);
        for (a, &b) in bx[..n].iter_mut().zip(&by[..n]) {
            *a = f(*a, b);
        }
        T::narrow(&bx[..n], os);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn run1_avx512<T: Lanes, F: Fn(f32) -> f32>(x: &[T], out: &mut [MaybeUninit<T>], f: &F) {
    run1(x, out, f)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run1_avx2<T: Lanes, F: Fn(f32) -> f32>(x: &[T], out: &mut [MaybeUninit<T>], f: &F) {
    run1(x, out, f)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn run2_avx512<T: Lanes, F: Fn(f32, f32) -> f32>(
    x: &[T],
    y: &[T],
    out: &mut [MaybeUninit<T>],
    f: &F,
) {
    run2(x, y, out, f)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run2_avx2<T: Lanes, F: Fn(f32, f32) -> f32>(
    x: &[T],
    y: &[T],
    out: &mut [MaybeUninit<T>],
    f: &F,
) {
    run2(x, y, out, f)
}

fn dispatch1<T: Lanes, F: Fn(f32) -> f32>(x: &[T], out: &mut [MaybeUninit<T>], f: &F) {
    match isa() {
        // SAFETY: `isa` returned Avx512 only after detecting every feature this build enables
        // (avx512f, avx512bw, avx512vl, avx2, fma); the function has no other precondition.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { run1_avx512(x, out, f) },
        // SAFETY: `isa` returned Avx2 only after detecting avx2 and fma, the features this
        // build enables; the function has no other precondition.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { run1_avx2(x, out, f) },
        _ => run1(x, out, f),
    }
}

fn dispatch2<T: Lanes, F: Fn(f32, f32) -> f32>(
    x: &[T],
    y: &[T],
    out: &mut [MaybeUninit<T>],
    f: &F,
) {
    match isa() {
        // SAFETY: `isa` returned Avx512 only after detecting every feature this build enables
        // (avx512f, avx512bw, avx512vl, avx2, fma); the function has no other precondition.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { run2_avx512(x, y, out, f) },
        // SAFETY: `isa` returned Avx2 only after detecting avx2 and fma, the features this
        // build enables; the function has no other precondition.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { run2_avx2(x, y, out, f) },
        _ => run2(x, y, out, f),
    }
}

/// One contiguous run in place: `x[i] = f(x[i], y[i])` (y absent: `f(x[i], 0)`), by blocks:
/// the per-element arithmetic of [`run1`] / [`run2`], so the same bits as the fresh-buffer maps.
#[inline(always)]
fn run_in_place<T: Lanes, F: Fn(f32, f32) -> f32>(x: &mut [T], y: Option<&[T]>, f: &F) {
    let mut a = [0f32; LANE_BLOCK];
    let mut b = [0f32; LANE_BLOCK];
    for (bi, blk) in x.chunks_mut(LANE_BLOCK).enumerate() {
        let n = blk.len();
        T::widen(blk, &mut a[..n]);
        if let Some(y) = y {
            T::widen(&y[bi * LANE_BLOCK..bi * LANE_BLOCK + n], &mut b[..n]);
        }
        for (v, w) in a[..n].iter_mut().zip(&b[..n]) {
            *v = f(*v, *w);
        }
        // SAFETY: `MaybeUninit<T>` has T's size and alignment, so the exclusive borrow of `blk`
        // is a valid `[MaybeUninit<T>]` of the same length; the narrowing writes only
        // initialised values (T is `Copy`), which keeps `blk` valid.
        let out: &mut [MaybeUninit<T>] =
            unsafe { std::slice::from_raw_parts_mut(blk.as_mut_ptr().cast(), n) };
        T::narrow(&a[..n], out);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn run_in_place_avx512<T: Lanes, F: Fn(f32, f32) -> f32>(
    x: &mut [T],
    y: Option<&[T]>,
    f: &F,
) {
    run_in_place(x, y, f)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_in_place_avx2<T: Lanes, F: Fn(f32, f32) -> f32>(x: &mut [T], y: Option<&[T]>, f: &F) {
    run_in_place(x, y, f)
}

fn dispatch_in_place<T: Lanes, F: Fn(f32, f32) -> f32>(x: &mut [T], y: Option<&[T]>, f: &F) {
    match isa() {
        // SAFETY: `isa` returned Avx512 only after detecting every feature this build enables
        // (avx512f, avx512bw, avx512vl, avx2, fma); the function has no other precondition.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { run_in_place_avx512(x, y, f) },
        // SAFETY: `isa` returned Avx2 only after detecting avx2 and fma, the features this
        // build enables; the function has no other precondition.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { run_in_place_avx2(x, y, f) },
        _ => run_in_place(x, y, f),
    }
}

/// `x[i] = f(x[i], y[i])` in place for every i (y absent: `f(x[i], 0)`), computed in f32, in
/// parallel, in the build for this CPU: the bits of [`map1`] / [`map2`] without a fresh buffer.
/// Where y is given it must have x's length (checked: `None` otherwise, x untouched).
pub(crate) fn map_in_place<T: Lanes, F: Fn(f32, f32) -> f32 + Sync>(
    x: &mut [T],
    y: Option<&[T]>,
    f: F,
) -> Option<()> {
    match y {
        Some(y) if y.len() != x.len() => None,
        Some(y) => {
            x.par_chunks_mut(PAR_ITEM)
                .zip(y.par_chunks(PAR_ITEM))
                .for_each(|(xs, ys)| dispatch_in_place(xs, Some(ys), &f));
            Some(())
        }
        None => {
            x.par_chunks_mut(PAR_ITEM)
                .for_each(|xs| dispatch_in_place(xs, None, &f));
            Some(())
        }
    }
}

/// A fresh buffer with f applied to every element of x, computed in f32, in parallel.
pub(crate) fn map1<T: Lanes, F: Fn(f32) -> f32 + Sync>(x: &[T], f: F) -> Vec<T> {
    let mut out: Vec<T> = Vec::with_capacity(x.len());
    out.spare_capacity_mut()[..x.len()]
        .par_chunks_mut(PAR_ITEM)
        .zip(x.par_chunks(PAR_ITEM))
        .for_each(|(o, xs)| dispatch1(xs, o, &f));
    // SAFETY: the capacity is x.len(), and the chunks of `spare_capacity_mut()[..x.len()]` cover
    // it exactly, each element written by `dispatch1` (every map writes its whole output).
    unsafe { out.set_len(x.len()) };
    out
}

/// A fresh buffer with `f(x[i], y[i])` for every i, computed in f32, in parallel.
/// `x` and `y` must have the same length (checked).
pub(crate) fn map2<T: Lanes, F: Fn(f32, f32) -> f32 + Sync>(
    x: &[T],
    y: &[T],
    f: F,
) -> Option<Vec<T>> {
    if x.len() != y.len() {
        return None;
    }
    let mut out: Vec<T> = Vec::with_capacity(x.len());
    out.spare_capacity_mut()[..x.len()]
        .par_chunks_mut(PAR_ITEM)
        .zip(x.par_chunks(PAR_ITEM).zip(y.par_chunks(PAR_ITEM)))
        .for_each(|(o, (xs, ys))| dispatch2(xs, ys, o, &f));
    // SAFETY: the capacity is x.len(), and the chunks of `spare_capacity_mut()[..x.len()]` cover
    // it exactly, each element written by `dispatch2`.
    unsafe { out.set_len(x.len()) };
    Some(out)
}

/// Rounds `src` into `dst` (same length) element by element, in parallel.
pub(crate) fn narrow_into<T: Lanes>(src: &[f32], dst: &mut [T]) {
    // SAFETY: `MaybeUninit<T>` has T's size and alignment, so the exclusive borrow of `dst` is
    // a valid `[MaybeUninit<T>]` of the same length for the same lifetime; the narrowing writes
    // only initialised values (T is `Copy`, so nothing is dropped), which keeps `dst` valid.
    let dst: &mut [MaybeUninit<T>] =
        unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast(), dst.len()) };
    narrow_into_uninit(src, dst)
}

/// [`narrow_into`] into not yet initialised elements (a vector's spare capacity), so a buffer
/// the narrowing fills whole needs no zeroing first.
pub(crate) fn narrow_into_uninit<T: Lanes>(src: &[f32], dst: &mut [MaybeUninit<T>]) {
    assert_eq!(src.len(), dst.len(), "narrow_into: lengths differ");
    dst.par_chunks_mut(PAR_ITEM)
        .zip(src.par_chunks(PAR_ITEM))
        .for_each(|(o, s)| dispatch_narrow(s, o));
}

/// Rounds the first `cols` columns of each row of `src` (row stride `lds`) into the first `cols`
/// of each row of `dst` (row stride `ldd`), rows in parallel: a column block of a wider matrix
/// (the bf16 linear's dx by panels of W). `dst` may be not yet initialised.
pub(crate) fn narrow_block_into_uninit<T: Lanes>(
    src: &[f32],
    lds: usize,
    dst: &mut [MaybeUninit<T>],
    ldd: usize,
    cols: usize,
) {
    assert!(
        cols <= lds && cols <= ldd,
        "narrow_block: a row is wider than its stride"
    );
    dst.par_chunks_mut(ldd)
        .zip(src.par_chunks(lds))
        .for_each(|(o, s)| dispatch_narrow(&s[..cols], &mut o[..cols]));
}

/// [`narrow_into_uninit`] on the calling thread (for callers that already run in parallel, such
/// as the attention's loop over heads).
pub(crate) fn narrow_serial<T: Lanes>(src: &[f32], dst: &mut [MaybeUninit<T>]) {
    assert_eq!(src.len(), dst.len(), "narrow_serial: lengths differ");
    dispatch_narrow(src, dst)
}

#[inline(always)]
fn run_narrow<T: Lanes>(src: &[f32], dst: &mut [MaybeUninit<T>]) {
    T::narrow(src, dst)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn run_narrow_avx512<T: Lanes>(src: &[f32], dst: &mut [MaybeUninit<T>]) {
    run_narrow(src, dst)
}

fn dispatch_narrow<T: Lanes>(src: &[f32], dst: &mut [MaybeUninit<T>]) {
    match isa() {
        // SAFETY: `isa` returned Avx512 only after detecting every feature this build enables
        // (avx512f, avx512bw, avx512vl, avx2, fma); the function has no other precondition.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { run_narrow_avx512(src, dst) },
        _ => run_narrow(src, dst),
    }
}

/// Lanes of the row reductions: partial maxima and sums are kept per lane, so the loops
/// vectorise without reassociating anything LLVM must keep in order.
const RED: usize = 16;

/// max over a row (NEG_INFINITY for an empty row).
#[inline(always)]
fn row_max(row: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; RED];
    let mut chunks = row.chunks_exact(RED);
    for c in &mut chunks {
        for (a, &b) in m.iter_mut().zip(c) {
            *a = if b > *a { b } else { *a };
        }
    }
    let mut best = f32::NEG_INFINITY;
    for &v in m.iter().chain(chunks.remainder()) {
        if v > best {
            best = v;
        }
    }
    best
}

/// `row[j] = e^(row[j] − m)`; returns Σ row (accumulated per lane, then across lanes).
#[inline(always)]
fn exp_sub_sum(row: &mut [f32], m: f32) -> f32 {
    let mut acc = [0f32; RED];
    let mut chunks = row.chunks_exact_mut(RED);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c.iter_mut()) {
            *v = exp(*v - m);
            *a += *v;
        }
    }
    let mut z = 0.0;
    for v in chunks.into_remainder() {
        *v = exp(*v - m);
        z += *v;
    }
    acc.iter().sum::<f32>() + z
}

#[inline(always)]
fn softmax_body(x: &mut [f32], n: usize) {
    for row in x.chunks_mut(n) {
        let m = row_max(row);
        let inv = 1.0 / exp_sub_sum(row, m);
        for v in row.iter_mut() {
            *v *= inv;
        }
    }
}

#[inline(always)]
fn exp_rows_body(x: &mut [f32], n: usize, sub: &[f32]) {
    for (row, &m) in x.chunks_mut(n).zip(sub) {
        for v in row.iter_mut() {
            *v = exp(*v - m);
        }
    }
}

/// Σ a·b, accumulated per lane, then across lanes.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; RED];
    let (ca, cb) = (a.chunks_exact(RED), b.chunks_exact(RED));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for ((s, &u), &v) in acc.iter_mut().zip(x).zip(y) {
            *s += u * v;
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(u, v)| u * v).sum();
    acc.iter().sum::<f32>() + tail
}

#[inline(always)]
fn softmax_grad_body(p: &[f32], dp: &mut [f32], n: usize) {
    for (pr, dr) in p.chunks(n).zip(dp.chunks_mut(n)) {
        let delta = dot(pr, dr);
        for (a, b) in pr.iter().zip(dr.iter_mut()) {
            *b = *a * (*b - delta);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn softmax_grad_avx512(p: &[f32], dp: &mut [f32], n: usize) {
    softmax_grad_body(p, dp, n)
}

/// The softmax's backward on rows of `n`, on the calling thread: with P and dP of the same
/// rows, dP becomes dS = P∘(dP − Σ_j P·dP) row by row (the row sums accumulated per lane).
pub(crate) fn softmax_grad_rows(p: &[f32], dp: &mut [f32], n: usize) {
    assert_eq!(p.len(), dp.len(), "softmax_grad_rows: lengths differ");
    if n == 0 {
        return;
    }
    match isa() {
        // SAFETY: `isa` returned Avx512 only after detecting every feature this build enables
        // (avx512f, avx512bw, avx512vl, avx2, fma); the function has no other precondition.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { softmax_grad_avx512(p, dp, n) },
        _ => softmax_grad_body(p, dp, n),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn softmax_avx512(x: &mut [f32], n: usize) {
    softmax_body(x, n)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_avx2(x: &mut [f32], n: usize) {
    softmax_body(x, n)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn exp_rows_avx512(x: &mut [f32], n: usize, sub: &[f32]) {
    exp_rows_body(x, n, sub)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn row_max_avx512(row: &[f32]) -> f32 {
    row_max(row)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn exp_sub_sum_avx512(row: &mut [f32], m: f32) -> f32 {
    exp_sub_sum(row, m)
}

/// Softmax of each row of `n` values of `x`, in place, on the calling thread.
pub(crate) fn softmax_rows(x: &mut [f32], n: usize) {
    if n == 0 {
        return;
    }
    if crate::mutation::active(crate::mutation::Mutation::SoftmaxNoMax) {
        for row in x.chunks_mut(n) {
            let inv = 1.0 / exp_sub_sum_of(row, 0.0);
            row.iter_mut().for_each(|v| *v *= inv);
        }
        return;
    }
    match isa() {
        // SAFETY: `isa` returned Avx512 only after detecting every feature this build enables
        // (avx512f, avx512bw, avx512vl, avx2, fma); the function has no other precondition.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { softmax_avx512(x, n) },
        // SAFETY: `isa` returned Avx2 only after detecting avx2 and fma, the features this
        // build enables; the function has no other precondition.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { softmax_avx2(x, n) },
        _ => softmax_body(x, n),
    }
}

/// Row i of `x` (rows of `n`) becomes `e^(x − sub[i])`, in place, on the calling thread.
pub(crate) fn exp_rows(x: &mut [f32], n: usize, sub: &[f32]) {
    if n == 0 {
        return;
    }
    match isa() {
        // SAFETY: `isa` returned Avx512 only after detecting every feature this build enables
        // (avx512f, avx512bw, avx512vl, avx2, fma); the function has no other precondition.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { exp_rows_avx512(x, n, sub) },
        _ => exp_rows_body(x, n, sub),
    }
}

/// The row's maximum (NEG_INFINITY when empty).
pub(crate) fn max_of(row: &[f32]) -> f32 {
    match isa() {
        // SAFETY: `isa` returned Avx512 only after detecting every feature this build enables
        // (avx512f, avx512bw, avx512vl, avx2, fma); the function has no other precondition.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { row_max_avx512(row) },
        _ => row_max(row),
    }
}

/// `row[j] = e^(row[j] − m)` in place; returns their sum.
pub(crate) fn exp_sub_sum_of(row: &mut [f32], m: f32) -> f32 {
    match isa() {
        // SAFETY: `isa` returned Avx512 only after detecting every feature this build enables
        // (avx512f, avx512bw, avx512vl, avx2, fma); the function has no other precondition.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { exp_sub_sum_avx512(row, m) },
        _ => exp_sub_sum(row, m),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// dS = P∘(dP − Σ P·dP) per row against the f64 formula, on rows shorter than, equal to
    /// and longer than the lanes (the remainder must count).
    #[test]
    fn softmax_grad_rows_is_the_formula() {
        let mut r = crate::rng::SplitMix64::new(5);
        for n in [1usize, 15, 16, 17, 256, 300] {
            let rows = 3;
            let p: Vec<f32> = (0..rows * n).map(|_| r.uniform() as f32).collect();
            let dp: Vec<f32> = (0..rows * n).map(|_| r.uniform() as f32 - 0.5).collect();
            let mut got = dp.clone();
            softmax_grad_rows(&p, &mut got, n);
            for i in 0..rows {
                let (pr, dr) = (&p[i * n..(i + 1) * n], &dp[i * n..(i + 1) * n]);
                let delta: f64 = pr.iter().zip(dr).map(|(a, b)| *a as f64 * *b as f64).sum();
                for j in 0..n {
                    let want = pr[j] as f64 * (dr[j] as f64 - delta);
                    let g = got[i * n + j] as f64;
                    assert!(
                        (g - want).abs() <= 1e-5 * (1.0 + delta.abs()),
                        "n {n} row {i} col {j}: {g} vs {want}"
                    );
                }
            }
        }
    }

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_two_ulps_of_libm_over_its_domain() {
        let mut worst = 0;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (a, b) = (exp(x), x.exp());
            worst = worst.max(ulps(a, b));
            x += 0.0137;
        }
        for x in [0.0f32, -0.0, 1e-8, -1e-8, 0.5, -0.5, 1.0, -1.0, 10.0, -10.0] {
            worst = worst.max(ulps(exp(x), x.exp()));
        }
        assert!(worst <= 2, "worst {worst} ulps");
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn exp_saturates_instead_of_overflowing() {
        assert!(exp(1e30).is_finite() && exp(1e30) > 1e38);
        assert!(exp(f32::INFINITY).is_finite());
        let tiny = exp(-1e30);
        assert!((0.0..1e-37).contains(&tiny));
        assert!((0.0..1e-37).contains(&exp(f32::NEG_INFINITY)));
    }

    #[test]
    fn bf16_rounding_is_bitwise_that_of_half() {
        let mut vals: Vec<f32> = vec![
            0.0,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            1e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0x7F80_0001),
            f32::from_bits(0xFF80_1234),
            f32::from_bits(0x3F80_8000),
            f32::from_bits(0x3F81_8000),
            f32::from_bits(0x3F80_8001),
            f32::from_bits(0x7F7F_FFFF),
        ];
        let mut s = 0x1234_5678u32;
        for _ in 0..100_000 {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            vals.push(f32::from_bits(s));
        }
        for v in vals {
            assert_eq!(
                bf16_bits(v),
                half::bf16::from_f32(v).to_bits(),
                "{v:e} ({:#x})",
                v.to_bits()
            );
        }
    }

    #[test]
    fn maps_cover_every_element_for_all_storage_types_and_ragged_lengths() {
        for n in [0usize, 1, 255, 256, 257, PAR_ITEM + 3, 3 * PAR_ITEM] {
            let x32: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 4.0).collect();
            let y32: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let r = map1(&x32, |v| v * 2.0 + 1.0);
            assert!(r.iter().zip(&x32).all(|(a, b)| *a == b * 2.0 + 1.0));
            let r = map2(&x32, &y32, |a, b| a * b).unwrap();
            assert!(r
                .iter()
                .zip(x32.iter().zip(&y32))
                .all(|(o, (a, b))| *o == a * b));
            let xb: Vec<half::bf16> = x32.iter().map(|&v| half::bf16::from_f32(v)).collect();
            let r = map1(&xb, |v| v + 0.5);
            for (o, i) in r.iter().zip(&xb) {
                assert_eq!(*o, half::bf16::from_f32(i.to_f32() + 0.5));
            }
            let xh: Vec<half::f16> = x32.iter().map(|&v| half::f16::from_f32(v)).collect();
            let yh: Vec<half::f16> = y32.iter().map(|&v| half::f16::from_f32(v)).collect();
            let r = map2(&xh, &yh, |a, b| a - b).unwrap();
            for (o, (a, b)) in r.iter().zip(xh.iter().zip(&yh)) {
                assert_eq!(*o, half::f16::from_f32(a.to_f32() - b.to_f32()));
            }
        }
        assert!(map2(&[1f32, 2.0], &[1f32], |a, _| a).is_none());
    }

    #[test]
    fn softmax_rows_match_the_f64_definition() {
        for n in [1usize, 5, 16, 37, 256] {
            let rows = 3;
            let x: Vec<f32> = (0..rows * n)
                .map(|i| ((i * 7919) % 113) as f32 * 0.21 - 11.0)
                .collect();
            let mut y = x.clone();
            softmax_rows(&mut y, n);
            for (r, (xr, yr)) in x.chunks(n).zip(y.chunks(n)).enumerate() {
                let m = xr
                    .iter()
                    .fold(f64::NEG_INFINITY, |a, &b| a.max(f64::from(b)));
                let z: f64 = xr.iter().map(|&v| (f64::from(v) - m).exp()).sum();
                for (&a, &b) in xr.iter().zip(yr) {
                    let want = (f64::from(a) - m).exp() / z;
                    assert!(
                        (f64::from(b) - want).abs() <= 1e-6 * want + 1e-12,
                        "row {r} n {n}"
                    );
                }
            }
            let mut e = x.clone();
            let subs: Vec<f32> = x.chunks(n).map(max_of).collect();
            exp_rows(&mut e, n, &subs);
            let mut e2: Vec<f32> = x.clone();
            let sums: Vec<f32> = e2
                .chunks_mut(n)
                .zip(&subs)
                .map(|(r, &m)| exp_sub_sum_of(r, m))
                .collect();
            assert_eq!(e, e2);
            for (row, z) in e.chunks(n).zip(sums) {
                assert!((row.iter().sum::<f32>() - z).abs() <= 1e-5 * z);
            }
        }
    }
}
