//! The `cpu` section of a spec ([`CpuSpec`]): the CPU the `ditmem-cpu` runtime is budgeted for,
//! its bf16 product path ([`Bf16Products`]) and `gemm`'s instruction set ([`GemmIsa`]).

use serde::{Deserialize, Serialize};

use crate::error::SpecError;
use crate::named::from_name;

/// How the `ditmem-cpu` engine multiplies bf16 matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Bf16Products {
    /// On the engine's AVX512-BF16 kernel (`vdpbf16ps`, f32 accumulation): needs a CPU with
    /// AVX512F and AVX512-BF16; makes no `gemm` product, so `gemm` keeps no packing slab.
    Kernel,
    /// Widened to f32 and multiplied by the `gemm` crate under candle (any CPU).
    Widen,
}

impl Bf16Products {
    pub const fn name(self) -> &'static str {
        match self {
            Bf16Products::Kernel => "kernel",
            Bf16Products::Widen => "widen",
        }
    }
}

/// The microkernels the `gemm` crate runs f32/f64 products on, chosen at run time from the CPU's
/// features (`gemm-common` 0.19 `gemm_def!`: `avx512f` with the workspace's `x86-v4` feature,
/// else `fma`). They set the SIMD lanes, the micro-tile and so which calls pack their operands
/// into a per-call buffer (`ditmem_budget::ditmem_cpu::gemm_pack`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GemmIsa {
    /// AVX2 + FMA: 8 f32 lanes, 16 × 6 f32 micro-tiles (`gemm_f32::microkernel::fma`).
    Avx2,
    /// AVX-512F: 16 f32 lanes, 64 × 6 f32 micro-tiles (`gemm_f32::microkernel::avx512f`).
    Avx512,
}

impl GemmIsa {
    pub const fn name(self) -> &'static str {
        match self {
            GemmIsa::Avx2 => "avx2",
            GemmIsa::Avx512 => "avx512",
        }
    }

    /// The ISA of the reference machine (AMD EPYC, Zen 4: AVX-512F), which a spec written
    /// before the field existed is taken to describe, like the rest of [`CpuSpec::REFERENCE`].
    pub const fn reference() -> GemmIsa {
        GemmIsa::Avx512
    }
}

/// The CPU that the `ditmem-cpu` runtime executes on: what the engine's allocations depend on
/// beyond the model and the recipe. The budget never reads the host: these values are part of
/// the spec, filled from the machine by the CLI (and by the engine's `host::resolve`) where the
/// spec leaves them out, and printed with every estimate, so one spec estimates the same on
/// every machine and the engine refuses a `cpu` section that does not describe its process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuSpec {
    /// Threads of the pool the step runs on (rayon's: `RAYON_NUM_THREADS`, else every logical
    /// core). Each thread that runs a `gemm` product keeps one packing slab, and the fused
    /// attention keeps one scratch per thread (at most one per head).
    pub threads: u32,
    /// How bf16 products run: the AVX512-BF16 kernel, or widened to f32 through `gemm`.
    pub bf16_products: Bf16Products,
    /// Bytes of the packing slab that the `gemm` crate allocates once per thread that runs a
    /// product (`gemm_common::gemm::L2_SLAB`): the L2 cache per core as `gemm-common` reads it
    /// (`cache.rs`: sysfs on Linux, cpuid elsewhere). 1 MiB on the AMD EPYC (Zen 4) this project
    /// measures on, 2 MiB on an Intel Xeon (Sapphire Rapids).
    pub gemm_l2_bytes: u64,
    /// The microkernels `gemm` runs f32/f64 products on ([`GemmIsa`]). A spec without the field
    /// (written before it existed) is read as the reference machine's, AVX-512.
    #[serde(default = "GemmIsa::reference")]
    pub gemm_isa: GemmIsa,
    /// The other caches `gemm` blocks its products by (`gemm_common::cache::CACHE_INFO`, read
    /// from sysfs): the L1d's bytes and ways set the depth block `kc` (above 512 it grows with
    /// a roomier L1), the L2's ways the row block `mc`, the L3's bytes and ways the column block
    /// `nc`, and with them what a product packs per call. A spec without them (written before
    /// they existed) is read as the reference machine's (Zen 4: L1d 48 KiB 12-way, L2 16-way, L3
    /// 32 MiB 16-way); on a Zen 1 (L1d 32 KiB 8-way) those overstated a depth-1024 weight
    /// gradient's packing twice over. Lines are 64 bytes on every x86-64 CPU.
    #[serde(default = "CpuSpec::reference_l1_bytes")]
    pub gemm_l1_bytes: u64,
    #[serde(default = "CpuSpec::reference_l1_ways")]
    pub gemm_l1_ways: u64,
    #[serde(default = "CpuSpec::reference_l2_ways")]
    pub gemm_l2_ways: u64,
    /// 0 where the CPU reports no L3 (`gemm` then blocks columns by the L2 alone).
    #[serde(default = "CpuSpec::reference_l3_bytes")]
    pub gemm_l3_bytes: u64,
    #[serde(default = "CpuSpec::reference_l3_ways")]
    pub gemm_l3_ways: u64,
}

impl CpuSpec {
    /// The machine the project's figures were measured on, used by the library when a spec has
    /// no `cpu` section: AMD EPYC (Zen 4) with 2 threads, AVX512-BF16, 1 MiB of L2 per core.
    pub const REFERENCE: CpuSpec = CpuSpec {
        threads: 2,
        bf16_products: Bf16Products::Kernel,
        gemm_l2_bytes: 1 << 20,
        gemm_isa: GemmIsa::Avx512,
        gemm_l1_bytes: 48 << 10,
        gemm_l1_ways: 12,
        gemm_l2_ways: 16,
        gemm_l3_bytes: 32 << 20,
        gemm_l3_ways: 16,
    };

    const fn reference_l1_bytes() -> u64 {
        Self::REFERENCE.gemm_l1_bytes
    }
    const fn reference_l1_ways() -> u64 {
        Self::REFERENCE.gemm_l1_ways
    }
    const fn reference_l2_ways() -> u64 {
        Self::REFERENCE.gemm_l2_ways
    }
    const fn reference_l3_bytes() -> u64 {
        Self::REFERENCE.gemm_l3_bytes
    }
    const fn reference_l3_ways() -> u64 {
        Self::REFERENCE.gemm_l3_ways
    }

    /// Most threads a spec may name.
    pub const MAX_THREADS: u32 = 4096;
    /// Smallest and largest `gemm` slab a spec may name (`gemm` cannot run with no L2).
    pub const GEMM_L2_RANGE: (u64, u64) = (1 << 10, 1 << 30);
    /// Smallest and largest L1d a spec may name.
    pub(crate) const GEMM_L1_RANGE: (u64, u64) = (1 << 10, 64 << 20);
    /// Largest L3 a spec may name (0: none).
    pub(crate) const GEMM_L3_MAX: u64 = 64 << 30;
    /// Ways of a cache level a spec may name.
    pub(crate) const GEMM_WAYS_RANGE: (u64, u64) = (1, 1024);

    /// Whether bf16 products run on the AVX512-BF16 kernel.
    pub const fn bf16_kernel(&self) -> bool {
        matches!(self.bf16_products, Bf16Products::Kernel)
    }

    pub(crate) fn validate(&self) -> Result<(), SpecError> {
        if self.threads == 0 || self.threads > Self::MAX_THREADS {
            return Err(SpecError::invalid(
                "cpu.threads",
                format!(
                    "{} is out of range; allowed: 1 to {}",
                    self.threads,
                    Self::MAX_THREADS
                ),
            ));
        }
        let cache = |field: &str, bytes: u64, (lo, hi): (u64, u64), what: &str| {
            if (lo..=hi).contains(&bytes) {
                Ok(())
            } else {
                let why = format!("{bytes} is out of range; allowed: {lo} to {hi} bytes ({what})");
                Err(SpecError::invalid(field, why))
            }
        };
        cache(
            "cpu.gemm_l2_bytes",
            self.gemm_l2_bytes,
            Self::GEMM_L2_RANGE,
            "the L2 cache per core",
        )?;
        cache(
            "cpu.gemm_l1_bytes",
            self.gemm_l1_bytes,
            Self::GEMM_L1_RANGE,
            "the L1 data cache per core",
        )?;
        if self.gemm_l3_bytes > Self::GEMM_L3_MAX {
            return Err(SpecError::invalid(
                "cpu.gemm_l3_bytes",
                format!(
                    "{} is out of range; allowed: 0 (no L3) to {} bytes",
                    self.gemm_l3_bytes,
                    Self::GEMM_L3_MAX
                ),
            ));
        }
        let (lo, hi) = Self::GEMM_WAYS_RANGE;
        for (field, ways) in [
            ("cpu.gemm_l1_ways", self.gemm_l1_ways),
            ("cpu.gemm_l2_ways", self.gemm_l2_ways),
            ("cpu.gemm_l3_ways", self.gemm_l3_ways),
        ] {
            if !(lo..=hi).contains(&ways) {
                return Err(SpecError::invalid(
                    field,
                    format!(
                        "{ways} is out of range; allowed: {lo} to {hi} (the cache's associativity)"
                    ),
                ));
            }
        }
        Ok(())
    }
}

from_name! {
    Bf16Products => "cpu.bf16_products", "a bf16 product path", [Bf16Products::Kernel, Bf16Products::Widen];
    GemmIsa => "cpu.gemm_isa", "a gemm kernel family", [GemmIsa::Avx2, GemmIsa::Avx512];
}
