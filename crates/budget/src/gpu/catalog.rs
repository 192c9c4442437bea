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

use serde::Serialize;
use thiserror::Error;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const T: f64 = 1e12;

/// cuBLAS workspace per (handle, stream) by default: `:4096:2:16:8` = 2 × 4 MiB + 8 × 16 KiB =
/// 8,519,680 B (8.125 MiB) (`aten/src/ATen/cuda/CublasHandlePool.cpp`,
/// `parseChosenWorkspaceSize`).
pub const CUBLAS_WORKSPACE_DEFAULT: u64 = 4096 * 1024 * 2 + 16 * 1024 * 8;
/// cuBLAS workspace on Hopper and Blackwell: `4096 * 8 * 1024` = 32 MiB (same function: compute
/// capability major 9, 10, 11 or 12 in current PyTorch; PyTorch 2.1–2.6 applied it to sm90 only).
pub const CUBLAS_WORKSPACE_SM90_PLUS: u64 = 4096 * 8 * 1024;

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
    pub const fn for_cc(major: u32, minor: u32) -> DtypeSupport {
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

    /// Dense FLOP/s for a compute dtype name (`fp32`, `tf32`, `bf16`, `fp16`, `fp8`).
    pub fn flops_for(&self, dtype: &str) -> Option<f64> {
        match dtype {
            "fp32" => Some(self.flops.fp32),
            "tf32" => self.flops.tf32,
            "bf16" => self.flops.bf16,
            "fp16" => self.flops.fp16,
            "fp8" => self.flops.fp8,
            _ => None,
        }
    }
}

/// A GPU name that is not in the catalog.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("unknown GPU '{name}': allowed are {allowed}")]
pub struct GpuError {
    pub name: String,
    pub allowed: String,
}

/// Context with CUDA lazy loading (CUDA ≥ 11.7, the default since PyTorch 2.x wheels): about
/// 300 MB (pytorch/pytorch#107667). An order of magnitude, not measured on each card.
const CTX_LAZY: u64 = 300 * MIB;
const CTX_LAZY_SRC: &str = "community estimate: ~300 MB with CUDA lazy loading (pytorch/pytorch#107667); not measured on this card";
/// A100-SXM4-40GB: what a training process held outside PyTorch's allocator in a published OOM
/// message (huggingface/diffusers#10120: "Process … has 39.55 GiB memory in use. Of the
/// allocated memory 38.05 GiB is allocated by PyTorch, and 1021.72 MiB is reserved by PyTorch
/// but unallocated": 39.55 GiB − 38.05 GiB − 1021.72 MiB = 514 MiB, each figure ±0.005 GiB),
/// with bitsandbytes' kernels loaded (train_dreambooth_sd3.py --use_8bit_adam).
const CTX_A100_40: u64 = 514 * MIB;
const CTX_A100_40_SRC: &str = "published measurement: 514 MiB outside PyTorch's allocator (39.55 GiB in use − 38.05 GiB allocated − 1,021.72 MiB reserved-unallocated) in a train_dreambooth_sd3.py run with bitsandbytes (huggingface/diffusers#10120)";
/// RTX 3090, torch 2.7.1+cu128: 256 MiB (invoke-ai/InvokeAI#9413).
const CTX_3090: u64 = 256 * MIB;
const CTX_3090_SRC: &str =
    "community measurement: 256 MiB on an RTX 3090, torch 2.7.1+cu128 (invoke-ai/InvokeAI#9413)";

static CATALOG: [Gpu; 15] = [
    Gpu {
        name: "h200",
        aliases: &["h200-sxm", "h200-141gb"],
        product: "NVIDIA H200 SXM 141GB",
        capacity_basis: CapacityBasis::Reported {
            mib: 143_156,
            source: "_CudaDeviceProperties(name='NVIDIA H200', total_memory=143156MB) in a public vLLM run log",
        },
        compute_capability: (9, 0),
        // [H200]: FP32 67 TF; TF32 989, BF16/FP16 1,979, FP8 3,958 TF with sparsity → halved.
        flops: Flops {
            fp32: 67.0 * T,
            tf32: Some(494.5 * T),
            bf16: Some(989.5 * T),
            fp16: Some(989.5 * T),
            fp8: Some(1979.0 * T),
        },
        bandwidth: 4.8e12,
        context_bytes: CTX_LAZY,
        context_source: CTX_LAZY_SRC,
        source: "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM)",
        note: "tensor figures: the sheet's sparsity figures halved",
    },
    Gpu {
        name: "h100-sxm",
        aliases: &["h100", "h100-80gb", "h100-sxm5", "h100-80gb-sxm", "h100-80gb-hbm3"],
        product: "NVIDIA H100 80GB HBM3 (SXM5)",
        capacity_basis: CapacityBasis::Reported {
            mib: 81_090,
            source: "_CudaDeviceProperties(name='NVIDIA H100 80GB HBM3', total_memory=81090MB) in a public training write-up (81,082–81,090 MB across drivers)",
        },
        compute_capability: (9, 0),
        // [H100] SXM: FP32 67; TF32 989, BF16/FP16 1,979, FP8 3,958 with sparsity → halved.
        flops: Flops {
            fp32: 67.0 * T,
            tf32: Some(494.5 * T),
            bf16: Some(989.5 * T),
            fp16: Some(989.5 * T),
            fp8: Some(1979.0 * T),
        },
        bandwidth: 3.35e12,
        context_bytes: CTX_LAZY,
        context_source: CTX_LAZY_SRC,
        source: "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM)",
        note: "tensor figures: the sheet's sparsity figures halved",
    },
    Gpu {
        name: "h100-pcie",
        aliases: &["h100-80gb-pcie"],
        product: "NVIDIA H100 PCIe 80GB",
        capacity_basis: CapacityBasis::Derived {
            mib: 81_090,
            source: "derived: marketing 80 GiB (81,920 MiB) less 830 MiB, the reserve of the H100 SXM's same 80 GB HBM (81,920 − 81,090 MiB reported); no printed total_memory of an H100 PCIe found",
        },
        compute_capability: (9, 0),
        // [H100] PCIe: FP32 51; TF32 756, BF16/FP16 1,513, FP8 3,026 with sparsity → halved.
        flops: Flops {
            fp32: 51.0 * T,
            tf32: Some(378.0 * T),
            bf16: Some(756.5 * T),
            fp16: Some(756.5 * T),
            fp8: Some(1513.0 * T),
        },
        bandwidth: 2.0e12,
        context_bytes: CTX_LAZY,
        context_source: CTX_LAZY_SRC,
        source: "NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe)",
        note: "tensor figures: sparsity figures halved",
    },
    Gpu {
        name: "a100-80gb",
        aliases: &["a100-80gb-sxm", "a100-sxm4-80gb", "a100-80"],
        product: "NVIDIA A100-SXM4-80GB",
        capacity_basis: CapacityBasis::Reported {
            mib: 81_147,
            source: "OOM messages 'GPU 0; 79.25 GiB total capacity' (github.com/levihsu/OOTDiffusion/issues/235) and 'GPU 2 has a total capacity of 79.25 GiB' on 4 A100 80GB (github.com/wbfwonderful/Vad-R1/issues/11): 79.245 GiB, the lower edge",
        },
        compute_capability: (8, 0),
        // [A100]: FP32 19.5; TF32 156, BF16/FP16 312 dense (sheet gives dense and sparse).
        flops: Flops {
            fp32: 19.5 * T,
            tf32: Some(156.0 * T),
            bf16: Some(312.0 * T),
            fp16: Some(312.0 * T),
            fp8: None,
        },
        bandwidth: 2.039e12,
        context_bytes: CTX_LAZY,
        context_source: CTX_LAZY_SRC,
        source: "NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM)",
        note: "no FP8 on sm80",
    },
    Gpu {
        name: "a100-40gb",
        aliases: &["a100", "a100-40gb-sxm", "a100-sxm4-40gb", "a100-40"],
        product: "NVIDIA A100-SXM4-40GB",
        capacity_basis: CapacityBasis::Reported {
            mib: 40_443,
            source: "OOM message 'GPU 0 has a total capacity of 39.50 GiB' on one A100 (github.com/TianheWu/CoSeR/issues/10): 39.495 GiB, the lower edge; another reports 39.59 GiB (github.com/raoyongming/DenseCLIP/issues/52), the smaller is kept",
        },
        compute_capability: (8, 0),
        flops: Flops {
            fp32: 19.5 * T,
            tf32: Some(156.0 * T),
            bf16: Some(312.0 * T),
            fp16: Some(312.0 * T),
            fp8: None,
        },
        bandwidth: 1.555e12,
        context_bytes: CTX_A100_40,
        context_source: CTX_A100_40_SRC,
        source: "NVIDIA A100 Tensor Core GPU datasheet (A100 40GB SXM)",
        note: "no FP8 on sm80",
    },
    Gpu {
        name: "l40s",
        aliases: &["l40s-48gb"],
        product: "NVIDIA L40S",
        capacity_basis: CapacityBasis::Reported {
            mib: 45_589,
            source: "_CudaDeviceProperties(name='NVIDIA L40S', total_memory=45589MB) in a public notebook",
        },
        compute_capability: (8, 9),
        // [L40S]: FP32 91.6; TF32 183, BF16/FP16 362.05, FP8 733 dense (366/733/1,466 sparse).
        flops: Flops {
            fp32: 91.6 * T,
            tf32: Some(183.0 * T),
            bf16: Some(362.05 * T),
            fp16: Some(362.05 * T),
            fp8: Some(733.0 * T),
        },
        bandwidth: 864e9,
        context_bytes: CTX_LAZY,
        context_source: CTX_LAZY_SRC,
        source: "NVIDIA L40S datasheet",
        note: "tensor figures: dense column",
    },
    Gpu {
        name: "a10g",
        aliases: &["a10", "a10g-24gb"],
        product: "NVIDIA A10G (AWS G5)",
        capacity_basis: CapacityBasis::Reported {
            mib: 22_587,
            source: "_CudaDeviceProperties(name='NVIDIA A10G', total_memory=22587MB) in a public issue",
        },
        compute_capability: (8, 6),
        // [A10]: FP32 31.2; TF32 62.5, BF16/FP16 125 dense (125/250/250 sparse).
        flops: Flops {
            fp32: 31.2 * T,
            tf32: Some(62.5 * T),
            bf16: Some(125.0 * T),
            fp16: Some(125.0 * T),
            fp8: None,
        },
        bandwidth: 600e9,
        context_bytes: CTX_LAZY,
        context_source: CTX_LAZY_SRC,
        source: "NVIDIA A10 Tensor Core GPU datasheet (A10G: AWS variant, no NVIDIA sheet of its own)",
        note: "compute figures are the A10's; the A10G's clocks differ slightly",
    },
    Gpu {
        name: "l4",
        aliases: &["l4-24gb"],
        product: "NVIDIA L4",
        capacity_basis: CapacityBasis::Derived {
            mib: 22_587,
            source: "derived: marketing 24 GiB (24,576 MiB) less 1,989 MiB, the reserve of the A10G's same 24 GB GDDR6 with ECC (24,576 − 22,587 MiB reported); nvidia-smi shows 23,034 MiB on an L4 (github.com/modal-labs/modal-client/pull/2797), total_memory is below it; no printed total_memory of an L4 found",
        },
        compute_capability: (8, 9),
        // [L4]: FP32 30.3; TF32 120, BF16/FP16 242, FP8 485 with sparsity → halved.
        flops: Flops {
            fp32: 30.3 * T,
            tf32: Some(60.0 * T),
            bf16: Some(121.0 * T),
            fp16: Some(121.0 * T),
            fp8: Some(242.5 * T),
        },
        bandwidth: 300e9,
        context_bytes: CTX_LAZY,
        context_source: CTX_LAZY_SRC,
        source: "NVIDIA L4 Tensor Core GPU datasheet",
        note: "tensor figures: sparsity figures halved",
    },
    Gpu {
        name: "rtx-4090",
        aliases: &["4090", "rtx4090", "geforce-rtx-4090"],
        product: "NVIDIA GeForce RTX 4090",
        capacity_basis: CapacityBasis::Reported {
            mib: 24_563,
            source: "_CudaDeviceProperties(name='NVIDIA GeForce RTX 4090', total_memory=24563MB) in a public report",
        },
        compute_capability: (8, 9),
        // [ADA]: FP32 82.6; TF32 82.6, FP16/BF16 with FP32 accumulate 165.2 dense.
        flops: Flops {
            fp32: 82.6 * T,
            tf32: Some(82.6 * T),
            bf16: Some(165.2 * T),
            fp16: Some(165.2 * T),
            fp8: None,
        },
        bandwidth: 1008e9,
        context_bytes: CTX_LAZY,
        context_source: CTX_LAZY_SRC,
        source: "NVIDIA Ada GPU Architecture whitepaper (GeForce RTX 4090)",
        note: "FP16/BF16: the FP32-accumulate column (GeForce halves it); FP8 runs on sm89 but its figure was not checked in this step",
    },
    Gpu {
        name: "rtx-3090",
        aliases: &["3090", "rtx3090", "geforce-rtx-3090"],
        product: "NVIDIA GeForce RTX 3090",
        capacity_basis: CapacityBasis::Reported {
            mib: 24_268,
            source: "_CudaDeviceProperties(name='GeForce RTX 3090', total_memory=24268MB) in several public READMEs (24,259 MB in another)",
        },
        compute_capability: (8, 6),
        // [GA102]: FP32 35.6; TF32 35.6, FP16/BF16 with FP32 accumulate 71 dense.
        flops: Flops {
            fp32: 35.6 * T,
            tf32: Some(35.6 * T),
            bf16: Some(71.0 * T),
            fp16: Some(71.0 * T),
            fp8: None,
        },
        bandwidth: 936e9,
        context_bytes: CTX_3090,
        context_source: CTX_3090_SRC,
        source: "NVIDIA Ampere GA102 GPU Architecture whitepaper (GeForce RTX 3090)",
        note: "FP16/BF16: the FP32-accumulate column (GeForce halves it)",
    },
    Gpu {
        name: "rtx-5090",
        aliases: &["5090", "rtx5090", "geforce-rtx-5090"],
        product: "NVIDIA GeForce RTX 5090",
        capacity_basis: CapacityBasis::Reported {
            mib: 32_118,
            source: "OOM message 'GPU 0 has a total capacity of 31.37 GiB' on an RTX 5090 (github.com/Wan-Video/Wan2.1/issues/465): 31.365 GiB, the lower edge",
        },
        compute_capability: (12, 0),
        // [RTXBW]: FP32 104.8; TF32 104.8, FP16/BF16 with FP32 accumulate 209.5 dense.
        flops: Flops {
            fp32: 104.8 * T,
            tf32: Some(104.8 * T),
            bf16: Some(209.5 * T),
            fp16: Some(209.5 * T),
            fp8: None,
        },
        bandwidth: 1792e9,
        context_bytes: CTX_LAZY,
        context_source: CTX_LAZY_SRC,
        source: "NVIDIA RTX Blackwell GPU Architecture whitepaper (GeForce RTX 5090)",
        note: "FP8/FP4 figures not checked in this step",
    },
    Gpu {
        name: "rtx-a6000",
        aliases: &["a6000"],
        product: "NVIDIA RTX A6000",
        capacity_basis: CapacityBasis::Derived {
            mib: 48_536,
            source: "derived: marketing 48 GiB (49,152 MiB) less 616 MiB, twice the reserve of the RTX 3090's 24 GB on the same GA102 (24,576 − 24,268 MiB reported), the reserve taken as proportional to the memory; no printed total_memory of an RTX A6000 found",
        },
        compute_capability: (8, 6),
        // [GA102]: FP32 38.7; TF32 77.4, FP16/BF16 154.8 dense (full-rate FP32 accumulate).
        flops: Flops {
            fp32: 38.7 * T,
            tf32: Some(77.4 * T),
            bf16: Some(154.8 * T),
            fp16: Some(154.8 * T),
            fp8: None,
        },
        bandwidth: 768e9,
        context_bytes: CTX_LAZY,
        context_source: CTX_LAZY_SRC,
        source: "NVIDIA Ampere GA102 GPU Architecture whitepaper (RTX A6000)",
        note: "capacity derived (see capacity_basis)",
    },
    Gpu {
        name: "t4",
        aliases: &["tesla-t4", "t4-16gb"],
        product: "Tesla T4",
        capacity_basis: CapacityBasis::Reported {
            mib: 15_102,
            source: "_CudaDeviceProperties(name='Tesla T4', total_memory=15102MB) in public reports (15,079–15,109 MB across drivers)",
        },
        compute_capability: (7, 5),
        // [T4]: FP32 8.1; mixed precision FP16/FP32 65. No BF16 and no TF32 on sm75.
        flops: Flops {
            fp32: 8.1 * T,
            tf32: None,
            bf16: None,
            fp16: Some(65.0 * T),
            fp8: None,
        },
        bandwidth: 320e9,
        context_bytes: CTX_LAZY,
        context_source: CTX_LAZY_SRC,
        source: "NVIDIA T4 Tensor Core GPU datasheet",
        note: "no bf16 (sm < 80): plans keep fp16 with loss scaling",
    },
    Gpu {
        name: "v100-16gb",
        aliases: &["v100", "v100-sxm2-16gb", "tesla-v100"],
        product: "Tesla V100-SXM2-16GB",
        capacity_basis: CapacityBasis::Reported {
            mib: 16_144,
            source: "OOM message 'GPU 3 has a total capacty of 15.77 GiB' on a server of 8 Tesla V100 (github.com/meta-llama/llama/issues/918): 15.765 GiB, the lower edge",
        },
        compute_capability: (7, 0),
        // [V100] SXM2: FP32 15.7; tensor (FP16) 125. No BF16 and no TF32 on sm70.
        flops: Flops {
            fp32: 15.7 * T,
            tf32: None,
            bf16: None,
            fp16: Some(125.0 * T),
            fp8: None,
        },
        bandwidth: 900e9,
        context_bytes: CTX_LAZY,
        context_source: CTX_LAZY_SRC,
        source: "NVIDIA V100 Tensor Core GPU datasheet (V100 SXM2)",
        note: "no bf16 (sm < 80)",
    },
    Gpu {
        name: "v100-32gb",
        aliases: &["v100-sxm2-32gb", "v100-32"],
        product: "Tesla V100-SXM2-32GB",
        capacity_basis: CapacityBasis::Reported {
            mib: 32_497,
            source: "OOM message 'GPU 0; 31.74 GiB total capacity' on a V100 32GB (github.com/liucongg/ChatGLM-Finetuning/issues/73): 31.735 GiB, the lower edge",
        },
        compute_capability: (7, 0),
        flops: Flops {
            fp32: 15.7 * T,
            tf32: None,
            bf16: None,
            fp16: Some(125.0 * T),
            fp8: None,
        },
        bandwidth: 900e9,
        context_bytes: CTX_LAZY,
        context_source: CTX_LAZY_SRC,
        source: "NVIDIA V100 Tensor Core GPU datasheet (V100 SXM2)",
        note: "no bf16 (sm < 80)",
    },
];

/// Every GPU of the catalog, in table order.
pub fn all() -> &'static [Gpu] {
    &CATALOG
}

/// The canonical names, comma-separated (for errors and `--help`).
pub fn names() -> String {
    CATALOG
        .iter()
        .map(|g| g.name)
        .collect::<Vec<_>>()
        .join(", ")
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
    CATALOG
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
}
