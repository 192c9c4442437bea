//! What a `pytorch:cuda` step shows on the device: the step's allocation sequence (`trace.rs`)
//! replayed on the simulated caching allocator (`caching_allocator.rs`) with the cuBLAS
//! workspace of the step's stream, and the CUDA context beside it — max allocated, max reserved,
//! the fragmentation at the peak, what `nvidia-smi` would show and, on a catalog GPU, whether it
//! fits.

use serde::Serialize;

use crate::error::SpecError;
use crate::gpu;
use crate::params::ParamTensor;
use crate::runtime::pytorch::caching_allocator::{
    simulate_allocator, simulate_on_gpu, AllocConf, AllocEvent, Oom, CUBLAS_WORKSPACE_ID_BASE,
};
use crate::runtime::pytorch::device::CUDA_CONTEXT_BYTES;
use crate::runtime::pytorch::trace::allocation_sequence;
use crate::spec::Spec;

/// Most allocation events replayed on the allocator (two steps of a 57-block Flux at 1024²
/// make about 40,000): bounds an estimate's time on specs near the spec's caps (depth 1,024).
pub const MAX_REPLAYED_EVENTS: usize = 300_000;

/// The device memory of a CUDA step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CudaReport {
    /// The catalog GPU, when the spec names one.
    pub gpu: Option<&'static str>,
    /// `PYTORCH_CUDA_ALLOC_CONF` as given (empty: defaults).
    pub alloc_conf: String,
    /// `torch.cuda.max_memory_allocated()` over a warm-up and a measured step (blocks, rounded).
    pub max_allocated_bytes: u64,
    /// Peak of the bytes requested (before the allocator's 512 B rounding), cuBLAS workspace
    /// included: what the step timeline's peak counts, tensor by tensor.
    pub max_requested_bytes: u64,
    /// `torch.cuda.max_memory_reserved()`: the allocator's segments.
    pub max_reserved_bytes: u64,
    /// Reserved − allocated when allocated peaks: cached bytes the peak could not use.
    pub fragmentation_at_peak_bytes: u64,
    /// The cuBLAS workspace of the step's stream (through the allocator, inside the above).
    pub cublas_workspace_bytes: u64,
    /// The CUDA context beside the allocator (the GPU's catalog figure, or a generic 500 MiB).
    pub context_bytes: u64,
    /// What `nvidia-smi` would show at the peak: context + max reserved.
    pub device_bytes: u64,
    /// `total_memory` of the GPU.
    pub capacity_bytes: Option<u64>,
    /// No allocation failed against the GPU's capacity less the context.
    pub fits: Option<bool>,
    /// Where the allocator ran out, when it did.
    pub oom: Option<Oom>,
    /// Allocations that had to release cached segments and retry (`num_alloc_retries`).
    pub alloc_retries: u64,
    /// `cudaMalloc` calls over the two steps.
    pub device_allocs: u64,
    /// Allocation events replayed.
    pub events: usize,
    /// A paged optimizer's state in CUDA managed memory, outside the allocator (and so outside
    /// allocated, reserved and `device_bytes`): on the device while there is room, paged to the
    /// host by the driver when there is not.
    pub paged_bytes: u64,
}

/// The CUDA memory of a spec on the `pytorch:cuda` runtime.
/// None when the step makes more than [`MAX_REPLAYED_EVENTS`] allocations (not replayed).
pub(crate) fn cuda_report(
    spec: &Spec,
    table: &[ParamTensor],
) -> Result<Option<CudaReport>, SpecError> {
    let events = allocation_sequence(spec, table);
    cuda_report_of(spec, table, &events)
}

/// [`cuda_report`] of `events`, which must be `allocation_sequence(spec, table)`: the planner
/// replays one sequence under two allocator settings (`alloc_conf` is not part of the sequence)
/// without building it twice.
pub(crate) fn cuda_report_of(
    spec: &Spec,
    table: &[ParamTensor],
    events: &[AllocEvent],
) -> Result<Option<CudaReport>, SpecError> {
    let cs = spec.cuda.clone().unwrap_or_default();
    let conf = AllocConf::parse(&cs.alloc_conf)
        .map_err(|e| SpecError::invalid("cuda.alloc_conf", e.to_string()))?;
    if events.len() > MAX_REPLAYED_EVENTS {
        return Ok(None);
    }
    let seq_err = |e: crate::runtime::pytorch::caching_allocator::SequenceError| {
        SpecError::invalid("runtime", format!("internal allocation sequence: {e}"))
    };
    match &cs.gpu {
        Some(name) => {
            let g = gpu::lookup(name).map_err(|e| SpecError::invalid("cuda.gpu", e.to_string()))?;
            let g = &gpu::with_memory(g, cs.gpu_memory);
            let m = simulate_on_gpu(events, g, &conf, &[0]).map_err(seq_err)?;
            Ok(Some(CudaReport {
                gpu: Some(g.name),
                alloc_conf: cs.alloc_conf,
                max_allocated_bytes: m.allocator.max_allocated,
                max_requested_bytes: m.allocator.max_requested,
                max_reserved_bytes: m.allocator.max_reserved,
                fragmentation_at_peak_bytes: m.allocator.fragmentation_at_peak,
                cublas_workspace_bytes: m.cublas_workspace_per_stream,
                context_bytes: m.context_bytes,
                device_bytes: m.device_bytes,
                capacity_bytes: Some(m.capacity_bytes),
                fits: Some(m.fits),
                oom: m.allocator.oom,
                alloc_retries: m.allocator.alloc_retries,
                device_allocs: m.allocator.device_allocs,
                events: events.len(),
                paged_bytes: paged(spec, table),
            }))
        }
        None => {
            let ws = gpu::CUBLAS_WORKSPACE_DEFAULT;
            let mut all = vec![AllocEvent::Alloc {
                id: CUBLAS_WORKSPACE_ID_BASE,
                bytes: ws,
                stream: 0,
            }];
            all.extend_from_slice(events);
            let r = simulate_allocator(&all, &conf, None).map_err(seq_err)?;
            Ok(Some(CudaReport {
                gpu: None,
                alloc_conf: cs.alloc_conf,
                max_allocated_bytes: r.max_allocated,
                max_requested_bytes: r.max_requested,
                max_reserved_bytes: r.max_reserved,
                fragmentation_at_peak_bytes: r.fragmentation_at_peak,
                cublas_workspace_bytes: ws,
                context_bytes: CUDA_CONTEXT_BYTES,
                device_bytes: CUDA_CONTEXT_BYTES + r.max_reserved,
                capacity_bytes: None,
                fits: None,
                oom: None,
                alloc_retries: r.alloc_retries,
                device_allocs: r.device_allocs,
                events: events.len(),
                paged_bytes: paged(spec, table),
            }))
        }
    }
}

/// The paged optimizer state of the trained tensors ([`super::trace::paged_state_bytes`]).
fn paged(spec: &Spec, table: &[ParamTensor]) -> u64 {
    table
        .iter()
        .filter(|t| t.role == crate::params::ParamRole::Trained)
        .map(|t| super::trace::paged_state_bytes(spec, t.numel()))
        .sum()
}
