//! The GPU catalog.
//!
//! Sources (named again on every entry, in its `source` field):
//! - **[H200]** NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column).
//! - **[H100]** NVIDIA H100 Tensor Core GPU datasheet (H100 SXM and H100 PCIe columns).
//! - **[A100]** NVIDIA A100 Tensor Core GPU datasheet (A100 40GB / 80GB SXM columns).
//! - **[L40S]** NVIDIA L40S datasheet. **[L4]** NVIDIA L4 Tensor Core GPU datasheet.
//! - **[A10]** NVIDIA A10 Tensor Core GPU datasheet (the A10G is AWS's variant of the A10;
//!   NVIDIA publishes no sheet of its own for it, so its compute figures are the A10's).
//! - **[ADA]** NVIDIA Ada GPU Architecture whitepaper, appendix table (GeForce RTX 4090).
//! - **[GA102]** NVIDIA Ampere GA102 GPU Architecture whitepaper, appendix table (RTX 3090,
//!   RTX A6000).
//! - **[RTXBW]** NVIDIA RTX Blackwell GPU Architecture whitepaper, appendix table (RTX 5090).
//! - **[T4]** NVIDIA T4 Tensor Core GPU datasheet. **[V100]** NVIDIA V100 Tensor Core GPU
//!   datasheet (SXM2 column).
//! - **[CC]** NVIDIA CUDA GPUs compute capability list (developer.nvidia.com/cuda-gpus).
//!
//! FLOP/s are **dense** (the datasheets' sparsity figures halved where a sheet gives only those,
//! which the entry says); GeForce tensor figures are the "with FP32 accumulate" column, which is
//! what PyTorch's matmuls use. `None` means the card has no such path or the figure was not
//! checked against its source in this step (the entry's note says which).
//!
//! Capacity is `torch.cuda.get_device_properties(i).total_memory` (= `cudaDeviceProp.
//! totalGlobalMem`). Where a printed `_CudaDeviceProperties(... total_memory=NMB ...)` was found in
//! a public report, the capacity is `N × 2^20` B ([`CapacityBasis::Reported`]; the repr floors to
//! whole MiB and the figure moves by tens of MiB with the driver: a T4 prints 15,079–15,109 MB).
//! An OOM message's "total capacity of X GiB" (two decimals) counts as a report too: the capacity
//! is the lower edge of its rounding, `⌈(X − 0.005) × 1024⌉` MiB. Where no report was found the
//! capacity is the marketing figure less a stated reserve taken from a card of the same memory
//! and class that has a report ([`CapacityBasis::Derived`], marked as such): CUDA reports a few
//! hundred MiB less than the board's memory (the H100 SXM's "80 GB" reports 81,090 MiB of
//! 81,920), and ECC on GDDR6 data-centre cards withholds more. `--gpu-memory SIZE` replaces the
//! catalog's figure by what the user's own `torch.cuda.get_device_properties(0).total_memory`
//! prints.

use serde::{Deserialize, Serialize};
use thiserror::Error;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const T: f64 = 1e12;

/// cuBLAS workspace per (handle, stream) by default: `:4096:2:16:8` = 2 × 4 MiB + 8 × 16 KiB =
/// 8,519,680 B (8.125 MiB) (`aten/src/ATen/cuda/CublasHandlePool.cpp`,
/// `parseChosenWorkspaceSize`).
pub(crate) const CUBLAS_WORKSPACE_DEFAULT: u64 = 4096 * 1024 * 2 + 16 * 1024 * 8;
/// cuBLAS workspace on Hopper and Blackwell: `4096 * 8 * 1024` = 32 MiB (same function: compute
/// capability major 9, 10, 11 or 12 in current PyTorch; PyTorch 2.1–2.6 applied it to sm90 only).
pub(crate) const CUBLAS_WORKSPACE_SM90_PLUS: u64 = 4096 * 8 * 1024;

/// The default cuBLAS workspace for a compute capability (`parseChosenWorkspaceSize` with
/// `CUBLAS_WORKSPACE_CONFIG` unset). It goes through the caching allocator (`getNewWorkspace`),
/// one per (handle, stream).
pub fn cublas_workspace_bytes(cc: (u32, u32)) -> u64 {
    if matches!(cc.0, 9..=12) {
        CUBLAS_WORKSPACE_SM90_PLUS
    } else {
        CUBLAS_WORKSPACE_DEFAULT
    }
}

/// Where a capacity figure comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum CapacityBasis {
    /// `total_memory` as printed by `torch.cuda.get_device_properties` in a public report.
    Reported { mib: u64, source: &'static str },
    /// The marketing figure (GB) read as GiB: an upper bound of what CUDA reports. No catalog
    /// entry uses it any more (every card has a reported or a derived figure).
    Marketing { gb: u64 },
    /// No printed `total_memory` found: the marketing figure less a stated, sourced reserve (what
    /// CUDA withholds on a card of the same memory and class), marked as derived.
    Derived { mib: u64, source: &'static str },
}

/// Which dtypes the tensor cores (and PyTorch's autocast) run natively.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DtypeSupport {
    /// bf16 needs sm ≥ 80 (Ampere); T4 and V100 keep fp16 with loss scaling.
    pub bf16: bool,
    /// TF32 tensor cores: sm ≥ 80.
    pub tf32: bool,
    /// fp16 tensor cores: sm ≥ 70.
    pub fp16: bool,
    /// FP8 (e4m3/e5m2) tensor cores: sm ≥ 89 (Ada, Hopper, Blackwell).
    pub fp8: bool,
}

impl DtypeSupport {
    /// Support from the compute capability (\[CC\] and the architecture whitepapers).
    pub(crate) const fn for_cc(major: u32, minor: u32) -> DtypeSupport {
        let sm = major * 10 + minor;
        DtypeSupport {
            bf16: sm >= 80,
            tf32: sm >= 80,
            fp16: sm >= 70,
            fp8: sm >= 89,
        }
    }
}

/// Dense FLOP/s per dtype (tensor cores where present; `fp32` is the non-tensor FP32 rate).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Flops {
    pub fp32: f64,
    pub tf32: Option<f64>,
    pub bf16: Option<f64>,
    pub fp16: Option<f64>,
    pub fp8: Option<f64>,
}

/// One GPU of the catalog.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Gpu {
    /// Canonical name (`ditmem gpus`, `--gpu`).
    pub name: &'static str,
    /// Other spellings accepted (case-insensitive).
    pub aliases: &'static [&'static str],
    /// The product as NVIDIA names it.
    pub product: &'static str,
    /// Where the capacity comes from, with its figure ([`Gpu::capacity_bytes`]).
    pub capacity_basis: CapacityBasis,
    /// Compute capability (major, minor) \[CC\].
    pub compute_capability: (u32, u32),
    pub flops: Flops,
    /// Peak memory bandwidth, bytes/s.
    pub bandwidth: f64,
    /// Bytes of the CUDA context (driver, kernels loaded lazily, cuBLAS/cuDNN handles) that
    /// `nvidia-smi` shows beside the allocator's reserved memory.
    pub context_bytes: u64,
    /// Where the context figure comes from (community measurements, not this project's).
    pub context_source: &'static str,
    /// Datasheet / whitepaper of the compute and bandwidth figures.
    pub source: &'static str,
    /// What the figures leave out or derive.
    pub note: &'static str,
}

/// `gpu` with its capacity replaced by `total_memory` bytes as the user's torch prints it
/// (`--gpu-memory`), floored to whole MiB; `None`: the catalog's.
pub fn with_memory(gpu: &Gpu, total_memory: Option<u64>) -> Gpu {
    let mut g = *gpu;
    if let Some(b) = total_memory {
        g.capacity_basis = CapacityBasis::Reported {
            mib: b / MIB,
            source: "--gpu-memory: total_memory as the user's own torch prints it",
        };
    }
    g
}

impl Gpu {
    /// `total_memory` as CUDA reports it, bytes: the reported MiB, or the derived figure (the
    /// marketing figure less a stated reserve).
    pub const fn capacity_bytes(&self) -> u64 {
        match self.capacity_basis {
            CapacityBasis::Reported { mib, .. } => mib * MIB,
            CapacityBasis::Marketing { gb } => gb * GIB,
            CapacityBasis::Derived { mib, .. } => mib * MIB,
        }
    }

    /// The dtypes its tensor cores run, from the compute capability.
    pub const fn dtypes(&self) -> DtypeSupport {
        DtypeSupport::for_cc(self.compute_capability.0, self.compute_capability.1)
    }

    /// The default cuBLAS workspace per stream on this card.
    pub fn cublas_workspace_bytes(&self) -> u64 {
        cublas_workspace_bytes(self.compute_capability)
    }

    /// What a training process can give the caching allocator: the capacity less the context.
    pub fn allocator_bytes(&self) -> u64 {
        self.capacity_bytes().saturating_sub(self.context_bytes)
    }
}

/// A GPU name that is not in the catalog.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("unknown GPU '{name}': allowed are {allowed}")]
pub struct GpuError {
    pub name: String,
    pub allowed: String,
}

/// The catalog's data: one `[[gpu]]` row a card, each with its datasheet (`source`) and the source
/// of its capacity and context, in `catalog.toml` beside this file.
const CATALOG_TOML: &str = include_str!("catalog.toml");

/// A row of `catalog.toml` as written (TFLOP/s, MiB, a named context).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Row {
    name: String,
    aliases: Vec<String>,
    product: String,
    capacity_basis: BasisKind,
    capacity_mib: u64,
    capacity_source: String,
    compute_capability: (u32, u32),
    tflops: Tflops,
    bandwidth: f64,
    context: String,
    source: String,
    note: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum BasisKind {
    Reported,
    Derived,
}

/// Dense TFLOP/s as the sheets print them; a missing dtype is a path the card lacks (or a figure
/// not checked, which the row's note says).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Tflops {
    fp32: f64,
    tf32: Option<f64>,
    bf16: Option<f64>,
    fp16: Option<f64>,
    fp8: Option<f64>,
}

/// A `[context.NAME]` table: the CUDA context's MiB and where the figure comes from.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Context {
    mib: u64,
    source: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CatalogFile {
    context: std::collections::BTreeMap<String, Context>,
    gpu: Vec<Row>,
}

/// `catalog.toml` read into [`Gpu`]s, or what is wrong with it. The strings live as long as the
/// process (the catalog is read once, [`all`]).
fn parse_catalog(text: &str) -> Result<Vec<Gpu>, String> {
    let file: CatalogFile = toml::from_str(text).map_err(|e| e.to_string())?;
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    let tera = |t: Option<f64>| t.map(|v| v * T);
    file.gpu
        .into_iter()
        .map(|r| {
            let ctx = file
                .context
                .get(&r.context)
                .ok_or_else(|| format!("{}: unknown context '{}'", r.name, r.context))?;
            let (mib, source) = (r.capacity_mib, leak(r.capacity_source));
            let aliases: Vec<&'static str> = r.aliases.into_iter().map(leak).collect();
            Ok(Gpu {
                name: leak(r.name),
                aliases: Box::leak(aliases.into_boxed_slice()),
                product: leak(r.product),
                capacity_basis: match r.capacity_basis {
                    BasisKind::Reported => CapacityBasis::Reported { mib, source },
                    BasisKind::Derived => CapacityBasis::Derived { mib, source },
                },
                compute_capability: r.compute_capability,
                flops: Flops {
                    fp32: r.tflops.fp32 * T,
                    tf32: tera(r.tflops.tf32),
                    bf16: tera(r.tflops.bf16),
                    fp16: tera(r.tflops.fp16),
                    fp8: tera(r.tflops.fp8),
                },
                bandwidth: r.bandwidth,
                context_bytes: ctx.mib * MIB,
                context_source: leak(ctx.source.clone()),
                source: leak(r.source),
                note: leak(r.note),
            })
        })
        .collect()
}

/// Every GPU of the catalog, in table order.
pub fn all() -> &'static [Gpu] {
    static CATALOG: std::sync::OnceLock<Vec<Gpu>> = std::sync::OnceLock::new();
    // The file is compiled in and a test parses it (`catalog_toml_reads_as_before`): an error
    // here is a build that skipped its tests, not bad input.
    CATALOG.get_or_init(|| {
        parse_catalog(CATALOG_TOML).unwrap_or_else(|e| panic!("gpu/catalog.toml: {e}"))
    })
}

/// The canonical names, comma-separated (for errors and `--help`).
pub fn names() -> String {
    all().iter().map(|g| g.name).collect::<Vec<_>>().join(", ")
}

/// Normalise a name: lower case, `_` and spaces as `-`, an `nvidia-` or `tesla-` prefix dropped,
/// so that what `torch.cuda.get_device_name()` and `nvidia-smi` print names the card ("NVIDIA
/// H100 80GB HBM3", "NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-16GB", "Tesla T4").
fn normalise(name: &str) -> String {
    let mut n: String = name
        .trim()
        .chars()
        .map(|c| match c {
            '_' | ' ' => '-',
            c => c.to_ascii_lowercase(),
        })
        .collect();
    for prefix in ["nvidia-", "tesla-"] {
        if let Some(rest) = n.strip_prefix(prefix) {
            n = rest.to_string();
        }
    }
    n
}

/// The GPU a name or alias names (case-insensitive).
pub fn lookup(name: &str) -> Result<&'static Gpu, GpuError> {
    let n = normalise(name);
    all()
        .iter()
        .find(|g| g.name == n || g.aliases.contains(&n.as_str()))
        .ok_or_else(|| GpuError {
            name: name.chars().take(60).collect(),
            allowed: names(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_aliases_parse_case_insensitively() {
        assert_eq!(lookup("H100").unwrap().name, "h100-sxm");
        assert_eq!(lookup("h100-sxm").unwrap().name, "h100-sxm");
        assert_eq!(lookup("H100_PCIe").unwrap().name, "h100-pcie");
        assert_eq!(lookup("a100-80gb").unwrap().name, "a100-80gb");
        assert_eq!(lookup("A100").unwrap().name, "a100-40gb");
        assert_eq!(lookup("4090").unwrap().name, "rtx-4090");
        assert_eq!(lookup("RTX 3090").unwrap().name, "rtx-3090");
        assert_eq!(lookup("nvidia-h200").unwrap().name, "h200");
        assert_eq!(lookup("Tesla-T4").unwrap().name, "t4");
    }

    #[test]
    fn the_names_torch_prints_name_their_cards() {
        // torch.cuda.get_device_name(0) on each card (also nvidia-smi's name column).
        for (printed, card) in [
            ("NVIDIA H100 80GB HBM3", "h100-sxm"),
            ("NVIDIA H100 PCIe", "h100-pcie"),
            ("NVIDIA H200", "h200"),
            ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
            ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
            ("NVIDIA GeForce RTX 4090", "rtx-4090"),
            ("NVIDIA GeForce RTX 3090", "rtx-3090"),
            ("NVIDIA RTX A6000", "rtx-a6000"),
            ("NVIDIA L40S", "l40s"),
            ("NVIDIA A10G", "a10g"),
            ("NVIDIA L4", "l4"),
            ("Tesla T4", "t4"),
            ("Tesla V100-SXM2-16GB", "v100-16gb"),
            ("Tesla V100-SXM2-32GB", "v100-32gb"),
        ] {
            assert_eq!(lookup(printed).map(|g| g.name), Ok(card), "{printed}");
        }
    }

    #[test]
    fn unknown_name_lists_the_allowed_ones() {
        let e = lookup("h800").unwrap_err();
        assert_eq!(e.name, "h800");
        let line = e.to_string();
        assert!(line.starts_with("unknown GPU 'h800': allowed are h200, h100-sxm"));
        for g in all() {
            assert!(line.contains(g.name), "{} missing from {line}", g.name);
        }
    }

    #[test]
    fn names_and_aliases_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for g in all() {
            assert!(seen.insert(g.name), "{}", g.name);
            for a in g.aliases {
                assert!(seen.insert(*a), "{a}");
                assert_eq!(lookup(a).unwrap().name, g.name);
            }
        }
    }

    #[test]
    fn bf16_only_from_sm80() {
        for g in all() {
            let sm = g.compute_capability.0 * 10 + g.compute_capability.1;
            assert_eq!(g.dtypes().bf16, sm >= 80, "{}", g.name);
            assert_eq!(g.flops.bf16.is_some(), g.dtypes().bf16, "{}", g.name);
            assert_eq!(g.flops.tf32.is_some(), g.dtypes().tf32, "{}", g.name);
            // A figure is never given for a path the card lacks.
            assert!(g.flops.fp8.is_none() || g.dtypes().fp8, "{}", g.name);
        }
        assert!(!lookup("t4").unwrap().dtypes().bf16);
        assert!(!lookup("v100").unwrap().dtypes().bf16);
        assert!(lookup("a10g").unwrap().dtypes().bf16);
    }

    #[test]
    fn every_entry_is_sourced_and_plausible() {
        for g in all() {
            assert!(!g.source.is_empty() && !g.context_source.is_empty());
            // Dense tensor rates exceed the FP32 rate; bandwidth between 100 GB/s and 10 TB/s.
            for f in [g.flops.tf32, g.flops.bf16, g.flops.fp16]
                .into_iter()
                .flatten()
            {
                assert!(f >= g.flops.fp32, "{}", g.name);
            }
            assert!((1e11..1e13).contains(&g.bandwidth), "{}", g.name);
            assert!(g.allocator_bytes() < g.capacity_bytes());
        }
        // CUDA reports less than the board's memory: 81,090 MiB of the H100's 80 GiB.
        assert!(lookup("h100").unwrap().capacity_bytes() < 80 * GIB);
    }

    #[test]
    fn every_capacity_is_reported_or_derived_with_its_source() {
        for g in all() {
            match g.capacity_basis {
                CapacityBasis::Reported { source, .. } => assert!(source.len() > 20, "{}", g.name),
                CapacityBasis::Derived { source, .. } => {
                    assert!(source.starts_with("derived:"), "{}", g.name)
                }
                CapacityBasis::Marketing { .. } => panic!("{}: marketing figure as GiB", g.name),
            }
        }
        // The published OOM messages the issue quotes (A100-40GB 39.39–39.59 GiB, A100-80GB
        // 79.15–79.25 GiB): the catalog is at or below them.
        assert!(lookup("a100-40gb").unwrap().capacity_bytes() <= 40_540 * MIB);
        assert!(lookup("a100-80gb").unwrap().capacity_bytes() <= 81_152 * MIB);
    }

    #[test]
    fn cublas_workspace_follows_the_compute_capability() {
        assert_eq!(CUBLAS_WORKSPACE_DEFAULT, 8_519_680);
        assert_eq!(CUBLAS_WORKSPACE_SM90_PLUS, 32 * MIB);
        assert_eq!(lookup("h100").unwrap().cublas_workspace_bytes(), 32 * MIB);
        assert_eq!(
            lookup("rtx-5090").unwrap().cublas_workspace_bytes(),
            32 * MIB
        );
        assert_eq!(lookup("a100").unwrap().cublas_workspace_bytes(), 8_519_680);
        assert_eq!(lookup("l40s").unwrap().cublas_workspace_bytes(), 8_519_680);
    }

    #[test]
    fn catalog_toml_reads_as_before() {
        // catalog_before.json: `serde_json` of the catalog when it was written as Rust literals
        // (main at d2dc2e0); every entry, figure and source must read back the same.
        let before: serde_json::Value =
            serde_json::from_str(include_str!("catalog_before.json")).unwrap();
        assert_eq!(serde_json::to_value(all()).unwrap(), before);
        assert_eq!(all().len(), 15);
    }

    #[test]
    fn a_bad_catalog_row_is_an_error_not_a_panic() {
        let row = CATALOG_TOML.replace("context = \"rtx-3090\"", "context = \"nope\"");
        assert!(parse_catalog(&row)
            .unwrap_err()
            .contains("unknown context 'nope'"));
        let extra = CATALOG_TOML.replace("bandwidth = 4.8e12", "bandwidth = 4.8e12\nbw = 1");
        assert!(parse_catalog(&extra).is_err());
    }
}
