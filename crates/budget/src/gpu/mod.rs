//! The GPUs people train on: capacity as CUDA reports it, compute capability, dtype support,
//! dense FLOP/s per dtype, memory bandwidth and the CUDA context beside the allocator — every
//! number with its source (the `catalog` module). Nothing here reads the host.

mod catalog;
mod links;

pub use catalog::{
    all, cublas_workspace_bytes, lookup, names, with_memory, CapacityBasis, DtypeSupport, Flops,
    Gpu, GpuError, CUBLAS_WORKSPACE_DEFAULT, CUBLAS_WORKSPACE_SM90_PLUS,
};
pub use links::{
    links_for, GpuLinks, Link, GPUS_PER_NODE, IB_HDR, IB_NDR, LINKS, NVLINK2, NVLINK3, NVLINK4,
    PCIE3_X16, PCIE4_X16, PCIE5_X16,
};
