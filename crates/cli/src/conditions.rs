//! The conditions of a measurement: without them a figure cannot be compared.

use ditmem_budget::Spec;
use serde::Serialize;

/// Where and how a run happened.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct Conditions {
    pub device: String,
    pub cpu_model: String,
    /// Logical cores the process may use.
    pub cores: usize,
    /// Threads candle's CPU kernels use.
    pub threads: usize,
    pub build_profile: &'static str,
    pub candle_version: &'static str,
    pub ditmem_version: &'static str,
    pub git_revision: &'static str,
    pub model: String,
    pub tokens: u64,
    pub batch: u32,
    pub microbatch: u32,
    pub accumulation: u32,
    pub ranks: u32,
    pub precision: String,
    pub optimizer: String,
    pub attention: String,
    pub recompute: String,
    pub lora_rank: Option<u32>,
    pub ema: bool,
    pub warmup_steps: u32,
    pub measured_steps: u32,
    pub memory_counter: &'static str,
    /// How bf16 matrix products run: the engine's AVX512-BF16 kernel, or widened to f32 (CPUs
    /// without it, or `DITMEM_BF16_GEMM=widen`): the spec's `cpu.bf16_products`, which the
    /// budget reads too.
    pub bf16_products: &'static str,
    /// Bytes of the packing slab `gemm` keeps per thread on this CPU (its L2 per core): the
    /// spec's `cpu.gemm_l2_bytes`.
    pub gemm_l2_bytes: u64,
    /// Spin rounds of candle's barrier-pool workers before they park
    /// (`CANDLE_BARRIER_POOL_SPIN_LIMIT`; the binary sets 1000 unless it is set).
    pub candle_barrier_spin: u32,
    /// The malloc policy the binary set before its threads started (`ditmem_engine::malloc`):
    /// it decides how far the resident set stands above the live bytes measured.
    pub malloc: &'static str,
}

impl Conditions {
    pub(crate) fn capture(spec: &Spec, warmup: u32, steps: u32) -> Conditions {
        let cpu = ditmem_engine::host::resolve(spec).cpu();
        let w = &spec.workload;
        let r = &spec.recipe;
        Conditions {
            device: "cpu".into(),
            cpu_model: ditmem_engine::host::cpu_model(),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            threads: candle_core::utils::get_num_threads(),
            build_profile: if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            },
            candle_version: env!("DITMEM_CANDLE_VERSION"),
            ditmem_version: env!("CARGO_PKG_VERSION"),
            git_revision: env!("DITMEM_GIT_REV"),
            model: spec.model.name.clone(),
            tokens: spec.tokens().unwrap_or(0),
            batch: w.batch,
            microbatch: w.microbatch,
            accumulation: w.accumulation,
            ranks: w.ranks,
            precision: r.precision.to_string(),
            optimizer: r.optimizer.name().into(),
            attention: r.attention.name().into(),
            recompute: r.recompute.to_string(),
            lora_rank: r.lora.as_ref().map(|l| l.rank),
            ema: r.ema.enabled,
            warmup_steps: warmup,
            measured_steps: steps,
            memory_counter: "counting global allocator (exact live heap bytes)",
            bf16_products: if cpu.bf16_kernel() {
                "AVX512-BF16 kernel"
            } else {
                "widened to f32"
            },
            gemm_l2_bytes: cpu.gemm_l2_bytes,
            candle_barrier_spin: ditmem_engine::threads::barrier_spin(),
            malloc: ditmem_engine::malloc::policy().describe(),
        }
    }

    /// One line for tables.
    pub(crate) fn line(&self) -> String {
        format!(
            "{} ({} cores, {} threads), {} build, candle {}, ditmem {} @ {}, bf16 products: {}, \
             gemm slab {} per thread, candle barrier spin {}, malloc: {}",
            self.cpu_model,
            self.cores,
            self.threads,
            self.build_profile,
            self.candle_version,
            self.ditmem_version,
            self.git_revision,
            self.bf16_products,
            ditmem_budget::fmt_bytes(self.gemm_l2_bytes),
            self.candle_barrier_spin,
            self.malloc
        )
    }
}

/// Available memory of the machine (MemAvailable), when it can be read.
pub(crate) fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
