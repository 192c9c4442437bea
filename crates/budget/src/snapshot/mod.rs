//! PyTorch CUDA memory snapshots (`torch.cuda.memory._dump_snapshot`): read one, replay its
//! trace into allocated and reserved timelines, and hold it against the `pytorch:cuda`
//! prediction of a spec.
//!
//! - `pickle.rs`: the pickle, decoded into a tree of Python values whose shared parts stay shared
//!   (bounded by the file: one node per opcode at most);
//! - `read.rs`: the snapshot's keys (`segments`, `device_traces`, `allocator_settings`) into
//!   [`Snapshot`];
//! - `replay.rs`: the trace of one device into timelines, peaks and what is alive at the peak;
//! - `predict.rs`: the spec's allocation sequence on the simulated caching allocator, event by
//!   event, and where the measured and predicted timelines part.
//!
//! The keys follow `torch/csrc/cuda/memory_snapshot.cpp` (`_memory_snapshot_pickled`) and the
//! `_snapshot` docstring of `torch/cuda/memory.py`; the replay follows `DeviceCachingAllocator`'s
//! counters (`free` lowers `allocated_bytes` and records `free_requested`; `free_block` records
//! `free_completed`), and `torch/cuda/_memory_viz.py`'s rule that blocks allocated before the
//! trace begins (the ring buffer keeps the last `max_entries` events) are counted from the state.

mod pickle;
mod predict;
mod read;
mod replay;
mod types;

pub use predict::{compare, predicted_timeline, Predicted, SnapshotComparison};
pub use read::read_snapshot;
pub use replay::{replay, Replay, TimelinePoint};
// The snapshot's vocabulary (its types, limits and error) is `types.rs`, which every file here
// reads and which reads none of them back (`crates/cli/tests/no_import_cycles.rs`).
pub use types::*;

#[cfg(test)]
mod tests;
