//! The budget's rule for the `gemm` crate's per-call packing allocation
//! (`ditmem_budget::ditmem_cpu::gemm_pack::call_heap_bytes`) held against the counting allocator
//! around real products, on this host's kernels and caches. One test in its own binary, so no
//! other test allocates while it counts.

use ditmem_budget::ditmem_cpu::gemm_pack::{call_heap_bytes, GemmCache, GemmCall};
use ditmem_budget::GemmIsa;
use ditmem_engine::kernels::gemm::mm_strided_f32;
use ditmem_engine::CountingAlloc;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc::new();

/// Heap bytes one single-threaded product allocates at its peak, beyond what was live before.
fn measured(c: &GemmCall) -> u64 {
    let (m, n, k) = (c.m as usize, c.n as usize, c.k as usize);
    let extent = |rows: usize, cols: usize, (rs, cs): (u64, u64)| {
        (rows - 1) * rs as usize + (cols - 1) * cs as usize + 1
    };
    let mut dst = vec![0.0f32; extent(m, n, c.dst)];
    let lhs = vec![1.0f32; extent(m, k, c.lhs)];
    let rhs = vec![1.0f32; extent(k, n, c.rhs)];
    let s = |(rs, cs): (u64, u64)| (rs as usize, cs as usize);
    let (d, l, r) = (s(c.dst), s(c.lhs), s(c.rhs));
    ALLOC.reset_peak();
    let before = ALLOC.live();
    mm_strided_f32(
        m,
        n,
        k,
        (&mut dst, d.0, d.1),
        (&lhs, l.0, l.1),
        (&rhs, r.0, r.1),
        1,
    );
    ALLOC.peak() - before
}

/// f32, single-threaded, as the engine's callers lay their operands out: the widened linear's
/// column-major products (rows a multiple of 16, of 8 but not 16, and of neither), the
/// attention's per-head products (q·kᵀ reads k transposed), the direct linear's row-major
/// product, a depth above 512 (blocked `kc`) and small shapes (the m, n ≤ 64 shortcut).
#[test]
fn the_rule_is_what_gemm_allocates_on_this_host() {
    let call = |m, n, k, dst, lhs, rhs| GemmCall {
        m,
        n,
        k,
        dst,
        lhs,
        rhs,
        elem: 4,
        threads: 1,
    };
    let cm = |m: u64, n: u64, k: u64| call(m, n, k, (1, m), (1, m), (1, k));
    let (s, dh) = (256, 64);
    let shapes = [
        cm(128, 256, 64),
        cm(72, 256, 64),
        cm(24, 48, 64),
        cm(100, 384, 96),
        cm(256, 1152, 24),
        cm(40, 300, 1100),
        // q·kᵀ, P·v, Pᵀ·dO of one head, and a ragged key block.
        call(s, s, dh, (s, 1), (dh, 1), (1, dh)),
        call(s, dh, s, (dh, 1), (s, 1), (dh, 1)),
        call(s, dh, s, (dh, 1), (1, s), (dh, 1)),
        call(s, 72, dh, (72, 1), (dh, 1), (1, dh)),
        call(72, dh, s, (dh, 1), (1, 72), (dh, 1)),
        // x·Wᵀ row-major (the direct linear).
        call(200, 256, 64, (256, 1), (64, 1), (1, 64)),
        call(8, 64, 64, (64, 1), (64, 1), (1, 64)),
    ];
    let isa = ditmem_engine::host::gemm_isa();
    let cache: GemmCache = ditmem_engine::host::gemm_cache();
    // Warm up: `gemm` reads the caches and allocates this thread's L2 slab on its first call.
    measured(&cm(128, 128, 128));
    let mut packed = 0;
    for c in &shapes {
        let rule = call_heap_bytes(isa, &cache, c);
        // The least of three: another thread of the harness can only add to the count.
        let m = (0..3).map(|_| measured(c)).min().unwrap_or(0);
        assert_eq!(m, rule, "{isa:?} {c:?}");
        if rule > 64 {
            packed += 1;
        }
    }
    assert!(
        packed >= 4,
        "the shapes exercise the packing: {packed} pack"
    );
    // The rule on the other ISA differs where the rows miss 16 lanes but not 8.
    let other = match isa {
        GemmIsa::Avx512 => GemmIsa::Avx2,
        GemmIsa::Avx2 => GemmIsa::Avx512,
    };
    let odd = cm(72, 256, 64);
    let big = |isa| call_heap_bytes(isa, &cache, &odd) > 1024;
    assert_ne!(big(isa), big(other), "m = 72 packs on AVX-512 only");
}
