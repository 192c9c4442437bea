//! What the budget reads from the machine it runs on: the CPU's model name, whether the engine's
//! AVX512-BF16 kernel applies, and the threads of the engine's pool. The engine and the CLI call
//! these same functions, so the budget's workspace model follows the path the engine takes.
//!
//! Temporary: a later change moves these host values into the spec, so that a budget depends on
//! its spec alone; until then this is the one module that reads the host.

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

/// Whether the engine multiplies bf16 with its AVX512-BF16 kernel (`ditmem_engine::gemm_bf16`)
/// on this machine, rather than widening to f32: the CPU has AVX512F and AVX512-BF16, and
/// `DITMEM_BF16_GEMM` is not `widen` (which forces the widening path, for comparisons). Decided
/// once per process; the engine asks this same function, so the budget's workspace model
/// follows the path the engine takes.
pub fn bf16_dot_native() -> bool {
    static NATIVE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *NATIVE.get_or_init(|| {
        if std::env::var("DITMEM_BF16_GEMM").is_ok_and(|v| v == "widen") {
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Threads of candle's and the engine's CPU kernels (rayon's pool): `RAYON_NUM_THREADS` when
/// set, else every logical core.
pub fn cpu_threads() -> u64 {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&n| n > 0)
        .or_else(|| {
            std::thread::available_parallelism()
                .ok()
                .map(|n| n.get() as u64)
        })
        .unwrap_or(1)
}
