//! The CPU a step runs on, as the engine sees it: the values of the spec's `cpu` section
//! ([`CpuSpec`]) read from this process the way its kernels read them.
//!
//! The budget never reads the host: its estimate is a function of the spec. Where the engine's
//! allocations depend on the CPU (the threads of its pool, the bf16 product path, the packing slab
//! the `gemm` crate keeps per thread), the value is part of the spec. The CLI fills what a spec
//! leaves out with [`detect`]; [`Trainer::new`](crate::Trainer::new) refuses, with [`check`], a
//! `cpu` section that does not describe its process and sets the bf16 path from it. So the budget
//! and the engine agree on any CPU, and a spec estimates the same on every machine.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use ditmem_budget::ditmem_cpu::gemm_pack::{self, GemmCache};
use ditmem_spec::{Bf16Products, CpuSpec, GemmIsa, Spec};

use crate::error::{EngineError, Result};

/// Environment variable that makes [`detect`] choose the widening path (`widen`) on a CPU that
/// has the AVX512-BF16 kernel, for comparisons of the two paths.
pub(crate) const BF16_PRODUCTS_VAR: &str = "DITMEM_BF16_GEMM";

/// Whether this CPU can run the engine's AVX512-BF16 kernel: AVX512F and AVX512-BF16.
pub(crate) fn bf16_kernel_supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Threads of the pool the step runs on: rayon's global pool (`RAYON_NUM_THREADS`, else every
/// logical core), which is also the parallelism candle hands `gemm`.
pub fn threads() -> u32 {
    u32::try_from(rayon::current_num_threads().max(1)).unwrap_or(u32::MAX)
}

/// Bytes of the packing slab that `gemm` allocates once per thread that runs a product: the L2
/// cache per core as `gemm-common` reads it (`cache::CACHE_INFO[1]`, which sizes
/// `gemm::L2_SLAB`). Read from that very value, so it is what `gemm` allocates.
pub fn gemm_l2_bytes() -> u64 {
    gemm_common::cache::CACHE_INFO[1].cache_bytes as u64
}

/// The microkernels `gemm` runs f32/f64 products on here, as it chooses them
/// (`gemm-common` 0.19 `gemm_def!`): AVX-512F where the CPU has it and `gemm` was built with
/// its `x86-v4` feature (this crate's default feature `gemm-avx512`), else AVX2 + FMA.
pub fn gemm_isa() -> GemmIsa {
    #[cfg(all(target_arch = "x86_64", feature = "gemm-avx512"))]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return GemmIsa::Avx512;
        }
    }
    GemmIsa::Avx2
}

/// The caches `gemm` sizes its blocks from on this CPU (`gemm_common::cache::CACHE_INFO`), in
/// the budget's terms; [`detect`] writes them into the spec (`cpu.gemm_l2_bytes`,
/// `cpu.gemm_l1_*`, `cpu.gemm_l2_ways`, `cpu.gemm_l3_*`), which `GemmCache::of` reads back.
pub fn gemm_cache() -> GemmCache {
    let level = |i: usize| {
        let c = gemm_common::cache::CACHE_INFO[i];
        gemm_pack::CacheLevel {
            bytes: c.cache_bytes as u64,
            associativity: c.associativity as u64,
            line_bytes: c.cache_line_bytes as u64,
        }
    };
    GemmCache {
        l1: level(0),
        l2: level(1),
        l3: level(2),
    }
}

/// This process's CPU: its pool's threads, the bf16 product path (the kernel where the CPU has
/// it, unless `DITMEM_BF16_GEMM=widen`) and `gemm`'s per-thread slab.
pub fn detect() -> CpuSpec {
    let widen = std::env::var(BF16_PRODUCTS_VAR).is_ok_and(|v| v == "widen");
    CpuSpec {
        threads: threads(),
        bf16_products: if bf16_kernel_supported() && !widen {
            Bf16Products::Kernel
        } else {
            Bf16Products::Widen
        },
        gemm_l2_bytes: gemm_l2_bytes(),
        gemm_isa: gemm_isa(),
        ..gemm_cache_fields()
    }
}

/// The spec's `gemm_l1_*`, `gemm_l2_ways` and `gemm_l3_*` as `gemm` reads this CPU's caches
/// ([`gemm_cache`]); the rest of the spec is the reference's.
fn gemm_cache_fields() -> CpuSpec {
    let c = gemm_cache();
    CpuSpec {
        gemm_l1_bytes: c.l1.bytes,
        gemm_l1_ways: c.l1.associativity,
        gemm_l2_ways: c.l2.associativity,
        gemm_l3_bytes: c.l3.bytes,
        gemm_l3_ways: c.l3.associativity,
        ..CpuSpec::REFERENCE
    }
}

/// The spec with its `cpu` section filled from this process where it has none (only for the
/// `ditmem-cpu` runtime, the one the section describes).
pub fn resolve(spec: &Spec) -> Spec {
    let mut s = spec.clone();
    if s.cpu.is_none() && s.runtime == ditmem_budget::Runtime::DitmemCpu {
        s.cpu = Some(detect());
    }
    s
}

/// Refuse a `cpu` section that this process cannot execute as written: another thread count
/// than its pool, another `gemm` slab, kernel family or cache geometry than this CPU's, or the
/// bf16 kernel on a CPU without it.
pub fn check(cpu: &CpuSpec) -> Result<()> {
    let (threads, l2) = (threads(), gemm_l2_bytes());
    if cpu.threads != threads {
        return Err(EngineError::bad_input(
            "cpu.threads",
            format!(
                "{} but this process's pool has {threads}; allowed: {threads} (or run with RAYON_NUM_THREADS={})",
                cpu.threads, cpu.threads
            ),
        ));
    }
    if cpu.gemm_l2_bytes != l2 {
        return Err(EngineError::bad_input(
            "cpu.gemm_l2_bytes",
            format!(
                "{} but gemm on this CPU packs into {l2} bytes per thread; allowed: {l2}",
                cpu.gemm_l2_bytes
            ),
        ));
    }
    let isa = gemm_isa();
    if cpu.gemm_isa != isa {
        return Err(EngineError::bad_input(
            "cpu.gemm_isa",
            format!(
                "{} but gemm on this CPU runs its {} kernels; allowed: {}",
                cpu.gemm_isa.name(),
                isa.name(),
                isa.name()
            ),
        ));
    }
    let host = gemm_cache_fields();
    for (field, spec, here) in [
        ("cpu.gemm_l1_bytes", cpu.gemm_l1_bytes, host.gemm_l1_bytes),
        ("cpu.gemm_l1_ways", cpu.gemm_l1_ways, host.gemm_l1_ways),
        ("cpu.gemm_l2_ways", cpu.gemm_l2_ways, host.gemm_l2_ways),
        ("cpu.gemm_l3_bytes", cpu.gemm_l3_bytes, host.gemm_l3_bytes),
        ("cpu.gemm_l3_ways", cpu.gemm_l3_ways, host.gemm_l3_ways),
    ] {
        if spec != here {
            return Err(EngineError::bad_input(
                field,
                format!(
                    "{spec} but gemm blocks its products by this CPU's {here}; allowed: {here} (or leave the cpu section out)"
                ),
            ));
        }
    }
    if cpu.bf16_kernel() && !bf16_kernel_supported() {
        return Err(EngineError::bad_input(
            "cpu.bf16_products",
            "kernel, but this CPU lacks AVX512-BF16; allowed: widen",
        ));
    }
    Ok(())
}

/// The bf16 path in force: 0 not set yet (the [`detect`]ed one), 1 the kernel, 2 widened.
static BF16_PRODUCTS: AtomicU8 = AtomicU8::new(0);

/// How this process multiplies bf16 now: as the last trainer's spec said ([`set_bf16_products`]),
/// else as [`detect`] finds (read once: the ops ask per call, and reading the environment
/// allocates, which the counting allocator would see inside a step).
pub fn bf16_products() -> Bf16Products {
    static DETECTED: OnceLock<Bf16Products> = OnceLock::new();
    match BF16_PRODUCTS.load(Ordering::Relaxed) {
        1 => Bf16Products::Kernel,
        2 => Bf16Products::Widen,
        _ => *DETECTED.get_or_init(|| detect().bf16_products),
    }
}

/// Make bf16 products take `p` from now on (a trainer sets its spec's path; [`check`] first, so
/// the kernel is only chosen where the CPU has it).
pub(crate) fn set_bf16_products(p: Bf16Products) {
    let v = match p {
        Bf16Products::Kernel => 1,
        Bf16Products::Widen => 2,
    };
    BF16_PRODUCTS.store(v, Ordering::Relaxed);
}

/// The CPU's model name (`/proc/cpuinfo`), or the architecture where that cannot be read: the
/// machine line of every report and benchmark.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// One cache level of the CPU as sysfs describes it (`/sys/devices/system/cpu/cpu0/cache`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheLevel {
    /// 1, 2, 3, …
    pub level: u8,
    /// `Data`, `Instruction` or `Unified`.
    pub kind: String,
    /// Bytes of one instance of the cache.
    pub bytes: u64,
    /// Logical CPUs that share one instance (from `shared_cpu_list`).
    pub shared_by: u32,
}

/// The caches of CPU 0 as Linux reports them (empty where sysfs cannot be read): the conditions
/// line of the benchmarks, since speed depends on them.
pub(crate) fn cache_levels() -> Vec<CacheLevel> {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    let read = |p: &std::path::Path, f: &str| {
        std::fs::read_to_string(p.join(f))
            .ok()
            .map(|s| s.trim().to_string())
    };
    let mut out: Vec<CacheLevel> = (0..16)
        .map_while(|i| {
            let p = dir.join(format!("index{i}"));
            Some((read(&p, "level")?, read(&p, "type")?, read(&p, "size")?, p))
        })
        .filter_map(|(level, kind, size, p)| {
            Some(CacheLevel {
                level: level.parse().ok()?,
                kind,
                bytes: parse_cache_size(&size)?,
                shared_by: read(&p, "shared_cpu_list").map_or(1, |l| cpu_list_len(&l)),
            })
        })
        .collect();
    out.sort_by_key(|c| (c.level, c.kind.clone()));
    out
}

/// A sysfs cache size (`48K`, `1024K`, `32M`, or plain bytes) in bytes.
fn parse_cache_size(s: &str) -> Option<u64> {
    let (num, mult) = match s.as_bytes().last()? {
        b'K' => (&s[..s.len() - 1], 1024),
        b'M' => (&s[..s.len() - 1], 1024 * 1024),
        b'G' => (&s[..s.len() - 1], 1024 * 1024 * 1024),
        _ => (s, 1),
    };
    num.parse::<u64>().ok().map(|n| n * mult)
}

/// How many CPUs a sysfs CPU list (`0`, `0-1`, `0-3,8-11`) names.
fn cpu_list_len(s: &str) -> u32 {
    s.split(',')
        .filter_map(|r| match r.split_once('-') {
            Some((a, b)) => (b.parse::<u32>().ok()? + 1).checked_sub(a.parse::<u32>().ok()?),
            None => r.parse::<u32>().ok().map(|_| 1),
        })
        .sum::<u32>()
        .max(1)
}

/// The caches in one line, e.g. `L1d 48 KiB, L1i 32 KiB, L2 1024 KiB, L3 32768 KiB (shared by
/// 2)`, or `caches unknown`.
pub fn cache_summary() -> String {
    let levels = cache_levels();
    if levels.is_empty() {
        return "caches unknown".to_string();
    }
    levels
        .iter()
        .map(|c| {
            let suffix = match c.kind.as_str() {
                "Data" => "d",
                "Instruction" => "i",
                _ => "",
            };
            let shared = if c.shared_by > 1 {
                format!(" (shared by {})", c.shared_by)
            } else {
                String::new()
            };
            format!("L{}{suffix} {} KiB{shared}", c.level, c.bytes / 1024)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detect_reads_what_the_kernels_use() {
        let cpu = detect();
        assert_eq!(cpu.threads as usize, rayon::current_num_threads());
        assert_eq!(
            cpu.gemm_l2_bytes,
            gemm_common::cache::CACHE_INFO[1].cache_bytes as u64
        );
        assert!(cpu.gemm_l2_bytes > 0);
        if cpu.bf16_kernel() {
            assert!(bf16_kernel_supported());
        }
        check(&cpu).unwrap();
    }

    #[test]
    fn check_names_the_field_that_does_not_describe_this_process() {
        let here = detect();
        let field = |c: CpuSpec| match check(&c) {
            Err(EngineError::BadInput { what, .. }) => what,
            other => panic!("{other:?}"),
        };
        let mut c = here;
        c.threads += 1;
        assert_eq!(field(c), "cpu.threads");
        let mut c = here;
        c.gemm_l2_bytes *= 2;
        assert_eq!(field(c), "cpu.gemm_l2_bytes");
        if !bf16_kernel_supported() {
            let mut c = here;
            c.bf16_products = Bf16Products::Kernel;
            assert_eq!(field(c), "cpu.bf16_products");
        }
        let mut c = here;
        c.bf16_products = Bf16Products::Widen;
        check(&c).unwrap();
    }

    #[test]
    fn resolve_fills_only_a_missing_section_of_the_engine_runtime() {
        let s = Spec::small();
        assert_eq!(resolve(&s).cpu, Some(detect()));
        let mut given = s.clone();
        given.cpu = Some(CpuSpec::REFERENCE);
        assert_eq!(resolve(&given).cpu, Some(CpuSpec::REFERENCE));
        let mut torch = s;
        torch.runtime = "pytorch:cuda".parse().unwrap();
        assert_eq!(resolve(&torch).cpu, None);
    }

    #[test]
    fn cache_sizes_and_cpu_lists_parse_as_sysfs_writes_them() {
        assert_eq!(parse_cache_size("48K"), Some(48 * 1024));
        assert_eq!(parse_cache_size("32M"), Some(32 << 20));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("x"), None);
        assert_eq!(cpu_list_len("0"), 1);
        assert_eq!(cpu_list_len("0-1"), 2);
        assert_eq!(cpu_list_len("0-3,8-11"), 8);
        // A reversed range counts nothing rather than wrapping.
        assert_eq!(cpu_list_len("3-1"), 1);
        for c in cache_levels() {
            assert!(c.bytes > 0 && c.level >= 1, "{c:?}");
        }
    }
}
