//! The f32/f64 products of the fused ops, through the `gemm` crate: `mm` (single-threaded,
//! for the attention's loop over heads), `mm_strided` (any strides; the widened
//! linear lays its f32 scratch out so that `gemm` packs nothing) and `mm_fresh` (a product
//! written straight into new, unzeroed memory). bf16 products have their own kernel,
//! [`super::gemm_bf16`].
//!
//! `gemm` is built with its `x86-v4` feature (this crate's default feature `gemm-avx512`), so on a CPU with AVX512F
//! its f32/f64 microkernels run on zmm registers; without the feature it stops at AVX2+FMA, which
//! held a DiT-S/2 fp32 step to half an AVX-512 core's rate (issue 20). Which kernel runs is chosen
//! at run time from the CPU's features, so the build still runs on AVX2-only CPUs.

use super::scalar::Acc;

/// Allocate now, on every thread of the pool, the packing slab `gemm` keeps per thread
/// (`gemm_common::gemm::L2_SLAB`, the L2 size per core), which `gemm` would otherwise allocate
/// on a thread's first product. Which threads take part in the products of a step depends on
/// scheduling: under outside load a thread may first multiply in a measured step rather than in
/// the warm-up, and the step would then measure 1 MiB more than the budget's steady state (seen
/// as a rare +1 MiB in the agreement grid). The budget counts one slab per thread
/// (`ditmem_budget::ditmem_cpu::gemm_workspace_bytes`); the trainer calls this when the step
/// multiplies through `gemm` (`step_uses_gemm`).
pub fn allocate_slabs() {
    rayon::broadcast(|_| gemm_common::gemm::L2_SLAB.with(|_| {}));
}

/// `gemm`'s parallelism for a product that runs alone: rayon's pool, or none on one thread.
pub(crate) fn gemm_threads() -> gemm::Parallelism {
    parallelism(rayon::current_num_threads())
}

/// `gemm`'s parallelism on `threads` threads: none on one (or none asked).
fn parallelism(threads: usize) -> gemm::Parallelism {
    match threads {
        0 | 1 => gemm::Parallelism::None,
        n => gemm::Parallelism::Rayon(n),
    }
}

/// `dst (m×n) = lhs (m×k) · rhs (k×n)` (+ dst when `acc`), with explicit (row, column) strides,
/// single-threaded (the callers parallelise over heads).
pub(crate) fn mm<A: 'static + Acc>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [A],
    lhs: (&[A], usize, usize),
    rhs: (&[A], usize, usize),
    acc: bool,
) {
    mm_strided(m, n, k, (dst, n, 1), lhs, rhs, acc, gemm::Parallelism::None)
}

/// A fresh row-major `m × n` product `lhs · rhs` (f32/f64, through `gemm`), written straight into
/// new memory: `gemm` overwrites the destination without reading it, so it is not zeroed first.
pub(crate) fn mm_fresh<A: 'static + Acc>(
    m: usize,
    n: usize,
    k: usize,
    lhs: (&[A], usize, usize),
    rhs: (&[A], usize, usize),
    par: gemm::Parallelism,
) -> Vec<A> {
    if k == 0 || m == 0 || n == 0 {
        return vec![A::ZERO; m * n];
    }
    let mut out: Vec<A> = Vec::with_capacity(m * n);
    // SAFETY: the spare capacity holds m·n elements, exactly the m × n destination at row
    // stride n; the operands' strides stay inside their slices (callers pass row-major buffers
    // or their transposes); with `acc` false `gemm` writes every element of the destination and
    // reads none, so after the call all m·n elements are initialised and `set_len` is sound.
    unsafe {
        gemm_raw(
            (m, n, k),
            (out.spare_capacity_mut().as_mut_ptr().cast::<A>(), n, 1),
            lhs,
            rhs,
            false,
            par,
        );
        out.set_len(m * n);
    }
    out
}

/// `lhs · rhs` (m × n, row-major at row stride n) written into `v`'s spare capacity from element
/// `at` on, without reading or zeroing it (`gemm` overwrites a destination it does not
/// accumulate into); `v`'s length is left as it is, for the caller to set once every element is
/// written. Nothing is written when m, n or k is 0.
///
/// # Safety
/// The operands' strides must stay inside their slices (as for [`mm_strided`]).
pub(crate) unsafe fn mm_into_spare<A: 'static + Acc>(
    v: &mut Vec<A>,
    (m, n, k): (usize, usize, usize),
    at: usize,
    lhs: (&[A], usize, usize),
    rhs: (&[A], usize, usize),
    par: gemm::Parallelism,
) {
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    assert!(
        v.capacity() >= at + m * n,
        "mm_into_spare: the destination's capacity is too small"
    );
    // SAFETY: the capacity holds elements at..at + m·n (asserted), the m × n destination at row
    // stride n; the caller keeps the operands' strides inside their slices; with `acc` false
    // `gemm` only writes the destination.
    unsafe {
        gemm_raw(
            (m, n, k),
            (v.as_mut_ptr().add(at), n, 1),
            lhs,
            rhs,
            false,
            par,
        )
    }
}

/// The general product: every operand as (slice, row stride, column stride).
///
/// `gemm` allocates packing buffers per call unless the destination is column-major, the lhs is
/// column-major with a row count that fills its SIMD lanes (8 f32 on AVX2, 16 on AVX-512), and
/// the rhs is column-major with at most 128 microkernel rows of destination (`gemm-common`
/// `gemm_basic_generic`). The widened linear lays out its own f32 scratch that way, so its
/// products allocate nothing but where a chunk's rows miss the lanes; the budget's rule for what
/// a call allocates is `ditmem_budget::ditmem_cpu::gemm_pack::call_heap_bytes`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn mm_strided<A: 'static + Acc>(
    m: usize,
    n: usize,
    k: usize,
    dst: (&mut [A], usize, usize),
    lhs: (&[A], usize, usize),
    rhs: (&[A], usize, usize),
    acc: bool,
    par: gemm::Parallelism,
) {
    let (dst, dst_rs, dst_cs) = dst;
    debug_assert!(dst.len() >= m * n);
    // SAFETY: `dst` is an exclusive borrow valid for the call, and the strides keep every
    // (i, j) of the m × n product inside it and the operands inside theirs (callers pass
    // row-major buffers or their transposes with the matching extents).
    unsafe {
        gemm_raw(
            (m, n, k),
            (dst.as_mut_ptr(), dst_rs, dst_cs),
            lhs,
            rhs,
            acc,
            par,
        )
    }
}

/// [`mm_strided`] on f32, for callers outside the crate: the test that holds the budget's rule
/// for `gemm`'s per-call packing (`ditmem_budget::ditmem_cpu::gemm_pack`) against the counting
/// allocator around real products. `threads`: 1 for `gemm::Parallelism::None`.
#[allow(clippy::too_many_arguments)]
pub fn mm_strided_f32(
    m: usize,
    n: usize,
    k: usize,
    dst: (&mut [f32], usize, usize),
    lhs: (&[f32], usize, usize),
    rhs: (&[f32], usize, usize),
    threads: usize,
) {
    let par = parallelism(threads);
    mm_strided(m, n, k, dst, lhs, rhs, false, par)
}

/// `dst = lhs·rhs` (`+ dst` when `acc`) through `gemm`, the destination as (pointer, row
/// stride, column stride), the operands as (slice, row stride, column stride).
///
/// # Safety
/// The destination must be valid for writes (and reads when `acc`) at every (i, j) of the
/// m × n product under its strides; the operands' strides must stay inside their slices.
unsafe fn gemm_raw<A: 'static + Acc>(
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs, dst_cs): (*mut A, usize, usize),
    lhs: (&[A], usize, usize),
    rhs: (&[A], usize, usize),
    acc: bool,
    par: gemm::Parallelism,
) {
    // SAFETY: the caller guarantees the destination is valid under its strides for the whole
    // m × n product (reads too when `acc`) and that the operands' strides stay inside their
    // slices, which are borrowed for the call: what `gemm::gemm` requires of its pointers.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            dst_cs as isize,
            dst_rs as isize,
            acc,
            lhs.0.as_ptr(),
            lhs.2 as isize,
            lhs.1 as isize,
            rhs.0.as_ptr(),
            rhs.2 as isize,
            rhs.1 as isize,
            <A as Acc>::from_f64(1.0),
            <A as Acc>::from_f64(1.0),
            false,
            false,
            false,
            par,
        )
    }
}
