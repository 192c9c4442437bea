//! The GPUs people train on: capacity as CUDA reports it, compute capability, dtype support,
//! dense FLOP/s per dtype, memory bandwidth and the CUDA context beside the allocator — every
//! number with its source (the `catalog` module). Nothing here reads the host.

mod catalog;

pub use catalog::{
    all, cublas_workspace_bytes, lookup, names, CapacityBasis, DtypeSupport, Flops, Gpu, GpuError,
    CUBLAS_WORKSPACE_DEFAULT, CUBLAS_WORKSPACE_SM90_PLUS,
};
