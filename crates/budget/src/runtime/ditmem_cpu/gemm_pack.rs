//! The heap buffer the `gemm` crate (0.19) allocates on each call to pack its operands (twin:
//! the engine's `kernels/gemm.rs`, which hands every f32/f64 product to `gemm::gemm`).
//!
//! `gemm` keeps a per-thread L2 slab for its lhs micro-panels (counted once per thread by
//! [`super::step::gemm_workspace_bytes`]), but on top of it a call allocates a `MemBuffer` when
//! it packs the rhs or pre-packs the whole lhs, and a `Vec<bool>` of `mc / MR` flags. Whether it
//! does depends on the shape, the operands' strides, the element size and the microkernels
//! ([`GemmIsa`]): `gemm-common-0.19.0/src/gemm.rs`, `gemm_basic_generic` (lines 174–490), after
//! `gemm-0.19.0/src/gemm.rs`'s `gemm` has transposed the product so that the destination is
//! column-major. The tile sizes come from `kernel_params` (`gemm-common-0.19.0/src/cache.rs`,
//! lines 514–612) or the small-size shortcut beside it; the engine's unit test
//! (`kernels/gemm.rs`) holds [`call_heap_bytes`] against the counting allocator around real calls.

use crate::spec::{CpuSpec, GemmIsa};

/// `gemm-common`'s `CACHELINE_ALIGN` on x86-64: each part of the packing buffer is rounded up
/// to it (`dyn_stack::StackReq::and`).
const ALIGN: u64 = 128;
/// Columns of every f32/f64 micro-tile, AVX2 and AVX-512 (`NR`: `microkernel_fn_array!` rows of
/// six in `gemm-f32`/`gemm-f64` `microkernel.rs`).
const NR: u64 = 6;
/// `gemm-common`'s `DEFAULT_RHS_PACKING_THRESHOLD` (x86): a unit-row-stride rhs is packed only
/// beyond this many micro-tiles of rows.
const RHS_PACKING_THRESHOLD: u64 = 128;
/// `gemm-common`'s `DEFAULT_THREADING_THRESHOLD` for f32/f64: fewer multiply-adds per block run
/// on one thread.
const THREADING_THRESHOLD: u64 = 48 * 48 * 256;

/// One level of cache as `gemm-common` reads it (`cache::CacheInfo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheLevel {
    pub bytes: u64,
    pub associativity: u64,
    pub line_bytes: u64,
}

/// The caches `gemm` sizes its blocks from (`gemm_common::cache::CACHE_INFO`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmCache {
    pub l1: CacheLevel,
    pub l2: CacheLevel,
    pub l3: CacheLevel,
}

impl GemmCache {
    /// The reference machine's caches as `gemm-common` reads them from sysfs (AMD EPYC, Zen 4:
    /// L1d 48 KiB 12-way, L2 1 MiB 16-way, L3 32 MiB 16-way, 64-byte lines).
    pub const REFERENCE: GemmCache = GemmCache {
        l1: CacheLevel {
            bytes: 48 << 10,
            associativity: 12,
            line_bytes: 64,
        },
        l2: CacheLevel {
            bytes: 1 << 20,
            associativity: 16,
            line_bytes: 64,
        },
        l3: CacheLevel {
            bytes: 32 << 20,
            associativity: 16,
            line_bytes: 64,
        },
    };

    /// The caches a spec's CPU stands for (`cpu.gemm_*`: the L2's size is the slab's), with
    /// 64-byte lines.
    pub fn of(cpu: &CpuSpec) -> GemmCache {
        let level = |bytes, associativity| CacheLevel {
            bytes,
            associativity,
            line_bytes: 64,
        };
        GemmCache {
            l1: level(cpu.gemm_l1_bytes, cpu.gemm_l1_ways),
            l2: level(cpu.gemm_l2_bytes, cpu.gemm_l2_ways),
            l3: level(cpu.gemm_l3_bytes, cpu.gemm_l3_ways),
        }
    }
}

/// The microkernel geometry of `gemm` for one ISA and element size (`gemm_def!` in
/// `gemm-common-0.19.0/src/gemm.rs`: `fma` with N = 4·multiplier lanes, `avx512f` with
/// 8·multiplier; f32's multiplier is 2, f64's 1; MR = MR_DIV_N·N with MR_DIV_N 2 on `fma` and 4
/// on `avx512f`; horizontal kernels up to 2×2 and 4×4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernel {
    /// SIMD lanes of the element type (`N`).
    pub lanes: u64,
    /// Rows of a micro-tile (`MR`).
    pub mr: u64,
    /// Rows / columns of the largest horizontal kernel (`H_M`, `H_N`).
    pub h: u64,
}

impl Kernel {
    pub fn of(isa: GemmIsa, elem: u64) -> Kernel {
        let (bytes, mr_div_n, h) = match isa {
            GemmIsa::Avx2 => (32, 2, 2),
            GemmIsa::Avx512 => (64, 4, 4),
        };
        let lanes = bytes / elem.max(1);
        Kernel {
            lanes,
            mr: mr_div_n * lanes,
            h,
        }
    }
}

/// One product as the engine hands it to `gemm` (`kernels::gemm::mm_strided`): `dst (m×n) =
/// lhs (m×k) · rhs (k×n)`, each operand's strides as (row, column), in elements of `elem` bytes;
/// `threads` is the `gemm::Parallelism` (1 for `None`, n for `Rayon(n)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmCall {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub dst: (u64, u64),
    pub lhs: (u64, u64),
    pub rhs: (u64, u64),
    pub elem: u64,
    pub threads: u64,
}

/// `gemm-common`'s (kc, mc, nc) blocking: `kernel_params`, or the shortcut of
/// `gemm_basic_generic` for m, n ≤ 64 (kc = min(k, 512), mc from the L2, nc = n in whole
/// micro-tiles), with nc = 0 (no L3) replaced as `gemm_basic_generic` does.
fn blocking(
    c: &GemmCache,
    kern: Kernel,
    (m, n, k): (u64, u64, u64),
    sz: u64,
    threads: u64,
) -> (u64, u64, u64) {
    let mr = kern.mr;
    let (kc, mc, nc) = if m <= 64 && n <= 64 {
        let kc = k.min(512);
        let alloc = c.l2.bytes / sz;
        (kc, (alloc / kc) / mr * mr, n.next_multiple_of(NR))
    } else {
        kernel_params(c, (m, n, k), mr, sz)
    };
    let nc = if nc > 0 {
        nc
    } else if threads <= 1 {
        128 * NR
    } else {
        n.next_multiple_of(NR)
    };
    (kc, mc, nc)
}

/// `gemm_common::cache::kernel_params` (cache.rs lines 514–612), line for line.
fn kernel_params(c: &GemmCache, (m, n, k): (u64, u64, u64), mr: u64, sz: u64) -> (u64, u64, u64) {
    if m == 0 || n == 0 || k == 0 {
        return (k, m, n);
    }
    let l1 = c.l1.bytes.max(32 * 1024);
    let (l2, l3) = (c.l2.bytes, c.l3.bytes);
    let l1_line = c.l1.line_bytes.max(64);
    let (l1_assoc, l2_assoc, l3_assoc) = (
        c.l1.associativity.max(2),
        c.l2.associativity.max(2),
        c.l3.associativity.max(2),
    );
    let l1_n_sets = l1 / (l1_line * l1_assoc);
    let g = gcd(mr * sz, l1_line * l1_n_sets);
    let kc_0 = (l1_line * l1_n_sets) / g;
    let c_lhs = (mr * sz) / g;
    let c_rhs = (NR * kc_0 * sz) / (l1_line * l1_n_sets);
    let kc_multiplier = l1_assoc / (c_lhs + c_rhs);
    let auto_kc = (kc_0 * kc_multiplier.next_power_of_two()).max(512).min(k);
    let k_iter = k.div_ceil(auto_kc);
    let auto_kc = k.div_ceil(k_iter);

    let rhs_micropanel_bytes = NR * auto_kc * sz;
    let rhs_l2_assoc = rhs_micropanel_bytes.div_ceil(l2 / l2_assoc);
    let lhs_l2_assoc = l2_assoc.saturating_sub(1 + rhs_l2_assoc).max(1);
    let mc_from = (lhs_l2_assoc * l2) / (l2_assoc * sz * auto_kc);
    let auto_mc = mc_from / mr * mr;
    let auto_mc = if auto_mc == 0 {
        // `gemm` would divide by zero here (an L2 too small for one micro-panel): no blocking
        // to model; one micro-tile of rows keeps the rule total.
        mr
    } else {
        let m_iter = m.div_ceil(auto_mc);
        m.div_ceil(m_iter * mr) * mr
    };
    let auto_mc = auto_mc.min(8 * mr);

    let auto_nc = if l3 == 0 {
        0
    } else {
        let rhs_macropanel_max_bytes = ((l3_assoc - 1) * l3) / l3_assoc;
        let auto_nc = (rhs_macropanel_max_bytes / (sz * auto_kc)) / NR * NR;
        if auto_nc == 0 {
            NR
        } else {
            let n_iter = n.div_ceil(auto_nc);
            n.div_ceil(n_iter * NR) * NR
        }
    };
    (auto_kc, auto_mc, auto_nc)
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Heap bytes that one `gemm::gemm` call allocates for itself (beyond the per-thread slab), all
/// alive together at its peak: the packing `MemBuffer` (rhs panel `kc·nc` elements when it packs
/// the rhs, the whole lhs `kc·⌈m/MR⌉·MR` when it pre-packs it, each part rounded up to 128
/// bytes) and the `mc / MR` flags of the calling thread, plus those of every other thread when
/// the first block is large enough to be shared out. 0 for the shortcuts that pack nothing
/// (horizontal kernels, k ≤ 2, matrix–vector products).
pub fn call_heap_bytes(isa: GemmIsa, cache: &GemmCache, c: &GemmCall) -> u64 {
    let kern = Kernel::of(isa, c.elem);
    // `gemm::gemm`: a row-major destination is handled as the transposed product.
    let (m, n, dst_cs, dst_rs, lhs_cs, lhs_rs, rhs_cs, rhs_rs) = if c.dst.1 < c.dst.0 {
        (
            c.n, c.m, c.dst.0, c.dst.1, c.rhs.0, c.rhs.1, c.lhs.0, c.lhs.1,
        )
    } else {
        (
            c.m, c.n, c.dst.1, c.dst.0, c.lhs.1, c.lhs.0, c.rhs.1, c.rhs.0,
        )
    };
    let k = c.k;
    if m == 0 || n == 0 || k == 0 {
        return 0;
    }
    let horizontal = lhs_cs == 1 && rhs_rs == 1 && m * n <= 16 * 16;
    let gemv = (n <= 1 && lhs_rs == 1 && dst_rs == 1)
        || (n <= 1 && lhs_cs == 1 && rhs_rs == 1)
        || (m <= 1 && rhs_cs == 1 && dst_cs == 1)
        || (m <= 1 && rhs_rs == 1 && lhs_cs == 1);
    if horizontal || k <= 2 || gemv {
        return 0;
    }
    let (sz, mr) = (c.elem, kern.mr);
    let (kc, mc, nc) = blocking(cache, kern, (m, n, k), sz, c.threads);
    let pack_rhs = (rhs_rs != 1 && m > 2 * mr) || (rhs_rs == 1 && m > RHS_PACKING_THRESHOLD * mr);
    let prepack_lhs = m <= 2 * mc && (m % kern.lanes != 0 || lhs_rs != 1);
    let buffer = if pack_rhs || prepack_lhs {
        let rhs = if pack_rhs { kc * NR * (nc / NR) } else { 0 };
        let lhs = if prepack_lhs {
            kc * m.next_multiple_of(mr)
        } else {
            0
        };
        (rhs * sz).next_multiple_of(ALIGN) + (lhs * sz).next_multiple_of(ALIGN)
    } else {
        0
    };
    let flags = mc / mr;
    let first_block = m * nc.min(n) * kc.min(k);
    let workers = if c.threads > 1 && first_block >= THREADING_THRESHOLD {
        c.threads - 1
    } else {
        0
    };
    buffer + flags * (1 + workers)
}

/// [`call_heap_bytes`] for a spec's CPU ([`GemmCache::of`]).
pub(crate) fn spec_call_heap_bytes(cpu: &CpuSpec, c: &GemmCall) -> u64 {
    call_heap_bytes(cpu.gemm_isa, &GemmCache::of(cpu), c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(m: u64, n: u64, k: u64, dst: (u64, u64), lhs: (u64, u64), rhs: (u64, u64)) -> GemmCall {
        GemmCall {
            m,
            n,
            k,
            dst,
            lhs,
            rhs,
            elem: 4,
            threads: 1,
        }
    }

    #[test]
    fn the_widened_layout_packs_only_rows_that_miss_the_lanes() {
        let c = GemmCache::REFERENCE;
        // Column-major everything, 128 rows: a multiple of both ISAs' lanes, nothing packed
        // beyond the flags.
        let full = call(128, 256, 64, (1, 128), (1, 128), (1, 64));
        let flags = |isa| {
            let kern = Kernel::of(isa, 4);
            blocking(&c, kern, (128, 256, 64), 4, 1).1 / kern.mr
        };
        for isa in [GemmIsa::Avx2, GemmIsa::Avx512] {
            assert_eq!(call_heap_bytes(isa, &c, &full), flags(isa));
        }
        // 72 rows: a multiple of 8 lanes but not of 16: only AVX-512 pre-packs the lhs, whole
        // 64-row tiles of k = 64 f32.
        let odd = call(72, 256, 64, (1, 72), (1, 72), (1, 64));
        let kern = Kernel::of(GemmIsa::Avx512, 4);
        let mc = blocking(&c, kern, (72, 256, 64), 4, 1).1;
        assert_eq!(
            call_heap_bytes(GemmIsa::Avx512, &c, &odd),
            64 * 128 * 4 + mc / kern.mr
        );
        let kern2 = Kernel::of(GemmIsa::Avx2, 4);
        let mc2 = blocking(&c, kern2, (72, 256, 64), 4, 1).1;
        assert_eq!(call_heap_bytes(GemmIsa::Avx2, &c, &odd), mc2 / kern2.mr);
    }

    #[test]
    fn shortcuts_allocate_nothing() {
        let c = GemmCache::REFERENCE;
        for isa in [GemmIsa::Avx2, GemmIsa::Avx512] {
            // k ≤ 2, a matrix–vector product, a 16 × 16 horizontal product.
            assert_eq!(
                call_heap_bytes(isa, &c, &call(64, 64, 2, (64, 1), (2, 1), (64, 1))),
                0
            );
            assert_eq!(
                call_heap_bytes(isa, &c, &call(64, 1, 64, (1, 64), (1, 64), (1, 64))),
                0
            );
            assert_eq!(
                call_heap_bytes(isa, &c, &call(16, 16, 64, (16, 1), (64, 1), (1, 64))),
                0
            );
        }
    }
}
