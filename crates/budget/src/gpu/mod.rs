//! The GPUs people train on: capacity as CUDA reports it, compute capability, dtype support,
//! dense FLOP/s per dtype, memory bandwidth and the CUDA context beside the allocator — every
//! number with its source (the `catalog` module). Nothing here reads the host.

mod catalog;
mod links;

pub(crate) use catalog::CUBLAS_WORKSPACE_DEFAULT;
pub use catalog::{
    all, cublas_workspace_bytes, lookup, names, with_memory, CapacityBasis, DtypeSupport, Gpu,
};
pub(crate) use links::GPUS_PER_NODE;
pub(crate) use links::IB_NDR;
pub(crate) use links::PCIE4_X16;
pub use links::{links_for, GpuLinks, Link};
