//! PyTorch's CUDA caching allocator, simulated over a sequence of allocations and frees.
//!
//! Follows `c10/cuda/CUDACachingAllocator.cpp` (`DeviceCachingAllocator`, read at pytorch/pytorch
//! 001074d2) and the `PYTORCH_CUDA_ALLOC_CONF` parser of `c10/core/AllocatorConfig.cpp` (read at
//! 065861fb); each rule below names the function it follows. Besides the 512 B rounding
//! ([`round_size`]) and the segment sizes ([`allocation_size`]), this module has pools, blocks, splitting, merging, the oversize rules, the retry path and
//! expandable segments.
//!
//! What is left out, and why it does not change the counters for one process on one device:
//! CUDA graph private pools, cross-stream `record_stream` events (a block is free when its free
//! event arrives), memory fractions and the garbage collector (which runs only with
//! `set_per_process_memory_fraction`). Addresses are modelled as (segment creation order, offset),
//! which orders blocks as `BlockComparatorSize` does for a device that hands out increasing
//! addresses. With expandable segments, the best-fit search does not use the "expandable size" of
//! a free block that ends the mapped range, and on a failed map only the free pages at the end of
//! a segment are unmapped (holes in the middle are not): both can only report more reserved
//! bytes than PyTorch, never fewer.

use std::collections::HashMap;

use serde::Serialize;

mod arena;
mod conf;
mod policy;

use arena::replay_once;
pub(crate) use arena::CachingAllocator;
pub(crate) use conf::round_size;
pub(crate) use conf::AllocEvent;
pub(crate) use conf::AllocatorReport;
pub(crate) use conf::SequenceError;
pub(crate) use conf::MIN_BLOCK_SIZE;
pub(crate) use conf::SMALL_SIZE;
pub use conf::{AllocConf, AllocConfError, Oom};

/// Replay a sequence on a fresh allocator; stops at the first allocation that fails against
/// `capacity` (bytes the allocator may reserve), which the report's `oom` names.
pub(crate) fn simulate_allocator(
    events: &[AllocEvent],
    conf: &AllocConf,
    capacity: Option<u64>,
) -> Result<AllocatorReport, SequenceError> {
    crate::profile::time(
        crate::profile::Phase::Replay,
        |_| events.len() as u64,
        || replay_once(&[events], conf, capacity),
    )
}

/// Replays already made in this process, by what decides them: the events (a 128-bit
/// fingerprint and their count), the settings and the capacity. The planner and `estimate`'s
/// levers build the same sequence for many candidates (a lever that changes the step time but
/// no allocation, the plain and the expandable-segments check of one candidate): a replay is a
/// pure function of these, so a repeated one is answered from here. Bounded: emptied when full.
type ReplayKey = (u64, u64, usize, String, Option<u64>);
static REPLAYS: std::sync::Mutex<Option<HashMap<ReplayKey, ReplayOutcome>>> =
    std::sync::Mutex::new(None);
type ReplayOutcome = Result<AllocatorReport, SequenceError>;
const MAX_CACHED_REPLAYS: usize = 4096;

/// Two 64-bit lanes of a multiply-fold hash (wyhash's `mum`) over every field of every event.
fn fingerprint(parts: &[&[AllocEvent]]) -> (u64, u64) {
    fn mum(a: u64, b: u64) -> u64 {
        let r = u128::from(a) * u128::from(b);
        (r as u64) ^ ((r >> 64) as u64)
    }
    let (mut h1, mut h2) = (0x243F_6A88_85A3_08D3_u64, 0x1319_8A2E_0370_7344_u64);
    let mut word = |w: u64| {
        h1 = mum(h1 ^ w, 0xA076_1D64_78BD_642F);
        h2 = mum(h2 ^ w.rotate_left(29), 0xE703_7ED1_A0B4_28DB);
    };
    for e in parts.iter().flat_map(|p| p.iter()) {
        match *e {
            AllocEvent::Alloc { id, bytes, stream } => {
                word(id);
                word(bytes);
                word(u64::from(stream) | 1 << 40);
            }
            AllocEvent::Free { id } => {
                word(id);
                word(2 << 40);
            }
        }
    }
    (h1, h2)
}

/// [`replay_once`], or the same replay's outcome made earlier in this process.
fn replay(
    parts: &[&[AllocEvent]],
    conf: &AllocConf,
    capacity: Option<u64>,
) -> Result<AllocatorReport, SequenceError> {
    let (h1, h2) = fingerprint(parts);
    let len = parts.iter().map(|p| p.len()).sum();
    let key: ReplayKey = (h1, h2, len, format!("{conf:?}"), capacity);
    let cached = REPLAYS
        .lock()
        .ok()
        .and_then(|m| m.as_ref().and_then(|m| m.get(&key).cloned()));
    if let Some(r) = cached {
        return r;
    }
    let r = replay_once(parts, conf, capacity);
    if let Ok(mut m) = REPLAYS.lock() {
        let m = m.get_or_insert_with(HashMap::default);
        if m.len() >= MAX_CACHED_REPLAYS {
            m.clear();
        }
        m.insert(key, r.clone());
    }
    r
}

/// One training process on one catalog GPU: the allocator over a sequence with the cuBLAS
/// workspaces allocated first, and the CUDA context beside it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct CudaMemory {
    pub gpu: &'static str,
    pub allocator: AllocatorReport,
    /// cuBLAS workspace bytes per stream (through the allocator, so inside allocated/reserved).
    pub cublas_workspace_per_stream: u64,
    pub streams: u32,
    /// CUDA context bytes (the catalog's figure, with its source there).
    pub context_bytes: u64,
    /// What `nvidia-smi` would show at the peak: context + max reserved.
    pub device_bytes: u64,
    /// `total_memory` of the card.
    pub capacity_bytes: u64,
    /// No allocation failed against capacity − context.
    pub fits: bool,
}

/// Ids the cuBLAS workspaces take in [`simulate_on_gpu`] (above any id a sequence should use).
pub(crate) const CUBLAS_WORKSPACE_ID_BASE: u64 = u64::MAX - 1024;

/// Replay `events` on `gpu`: one cuBLAS workspace per stream in `streams` is allocated first
/// (`getNewWorkspace` → the caching allocator, `CublasHandlePool.cpp`; PyTorch allocates it at
/// the first matmul of a (handle, stream) and keeps it), the allocator may reserve the capacity
/// less the context, and the device total adds the context to the reserved peak.
pub(crate) fn simulate_on_gpu(
    events: &[AllocEvent],
    gpu: &crate::gpu::Gpu,
    conf: &AllocConf,
    streams: &[u32],
) -> Result<CudaMemory, SequenceError> {
    let ws = gpu.cublas_workspace_bytes();
    let workspaces: Vec<AllocEvent> = streams
        .iter()
        .enumerate()
        .map(|(k, &stream)| AllocEvent::Alloc {
            id: CUBLAS_WORKSPACE_ID_BASE + k as u64,
            bytes: ws,
            stream,
        })
        .collect();
    // The workspaces, then the sequence (events are numbered over both), without copying it.
    let allocator = crate::profile::time(
        crate::profile::Phase::Replay,
        |_| events.len() as u64,
        || replay(&[&workspaces, events], conf, Some(gpu.allocator_bytes())),
    )?;
    Ok(CudaMemory {
        gpu: gpu.name,
        allocator,
        cublas_workspace_per_stream: ws,
        streams: streams.len() as u32,
        context_bytes: gpu.context_bytes,
        device_bytes: gpu.context_bytes + allocator.max_reserved,
        capacity_bytes: gpu.capacity_bytes(),
        fits: allocator.oom.is_none(),
    })
}

#[cfg(test)]
#[path = "caching_allocator_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "caching_allocator_reference.rs"]
mod reference;
