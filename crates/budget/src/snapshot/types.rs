//! The vocabulary of a memory snapshot: its limits, its error, and the types the reader fills
//! and the replay reads (re-exported by [`super`]).

use serde::Serialize;
use thiserror::Error;

/// Largest snapshot file read (bytes): a `max_entries=100_000` recording with Python and C++
/// stacks is some hundreds of MiB.
pub const MAX_SNAPSHOT_FILE_BYTES: u64 = 1 << 30;
/// Most trace events over all devices.
pub(crate) const MAX_TRACE_EVENTS: usize = 3_000_000;
/// Most segments, and most blocks over all segments.
pub(crate) const MAX_BLOCKS: usize = 3_000_000;

/// A snapshot that cannot be read; each renders as one line.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SnapshotError {
    #[error("not a Python pickle: {message}")]
    NotPickle { message: String },
    #[error("not a memory snapshot: {path}: {message}")]
    Schema { path: String, message: String },
    #[error("too large: {what} over {limit}")]
    TooLarge { what: String, limit: String },
}

impl SnapshotError {
    pub(crate) fn schema(path: impl Into<String>, message: impl Into<String>) -> SnapshotError {
        SnapshotError::Schema {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// `state` of a block in `segments`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockState {
    /// `active_allocated`: held by a tensor (counted by `memory_allocated`).
    ActiveAllocated,
    /// `active_pending_free` (`active_awaiting_free` in the docstring): freed, waiting for
    /// another stream's events.
    ActivePendingFree,
    /// `inactive`: cached, free for reuse.
    Inactive,
}

/// One block of a segment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BlockInfo {
    pub address: u64,
    pub size: u64,
    pub requested_size: u64,
    pub state: BlockState,
}

/// One segment (`cudaMalloc`, or the mapped range of an expandable segment).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SegmentInfo {
    pub device: u32,
    pub address: u64,
    pub total_size: u64,
    pub allocated_size: u64,
    pub active_size: u64,
    pub requested_size: u64,
    pub stream: u64,
    /// `segment_type == "small"`.
    pub small: bool,
    pub is_expandable: bool,
    pub blocks: Vec<BlockInfo>,
}

/// `action` of a trace entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    Alloc,
    FreeRequested,
    FreeCompleted,
    /// PyTorch 2.0's single free action.
    Free,
    SegmentAlloc,
    SegmentFree,
    SegmentMap,
    SegmentUnmap,
    Snapshot,
    Oom,
    Annotate,
}

impl Action {
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::Free => "free",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Snapshot => "snapshot",
            Action::Oom => "oom",
            Action::Annotate => "annotate",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<Action> {
        Some(match s {
            "alloc" => Action::Alloc,
            "free_requested" => Action::FreeRequested,
            "free_completed" => Action::FreeCompleted,
            "free" => Action::Free,
            "segment_alloc" => Action::SegmentAlloc,
            "segment_free" => Action::SegmentFree,
            "segment_map" => Action::SegmentMap,
            "segment_unmap" => Action::SegmentUnmap,
            "snapshot" => Action::Snapshot,
            "oom" => Action::Oom,
            "annotate" => Action::Annotate,
            _ => return None,
        })
    }
}

/// What made an allocation, read from its stack frames: the budget's categories where the
/// frames tell them apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    /// Alive before the trace begins (the model's weights and buffers, EMA, optimizer state
    /// made before recording, blocks whose alloc fell out of the ring buffer).
    BeforeTrace,
    /// The optimizer's state (`_init_group` in `torch/optim/`: `exp_avg`, `exp_avg_sq`).
    OptimizerState,
    /// Other allocations of `torch/optim/` (the step's scratch).
    OptimizerStep,
    /// Under `backward` (autograd's engine): gradients, in-flight gradients, recomputation.
    Backward,
    /// Any other Python frame: the forward (activations, weight casts, data).
    Forward,
    /// No frames recorded (`context=None`, or C++ only).
    Unknown,
}

impl Origin {
    pub fn name(self) -> &'static str {
        match self {
            Origin::BeforeTrace => "before the trace (model, state)",
            Origin::OptimizerState => "optimizer state",
            Origin::OptimizerStep => "optimizer step scratch",
            Origin::Backward => "backward (gradients, in-flight)",
            Origin::Forward => "forward (activations, casts, data)",
            Origin::Unknown => "no frames",
        }
    }

    /// The origin of an allocation from its frames (`filename`, `name`), innermost first.
    pub(crate) fn of_frames<'a>(frames: impl Iterator<Item = (&'a str, &'a str)>) -> Origin {
        let mut any = false;
        let mut optim = false;
        let mut state = false;
        let mut backward = false;
        for (file, name) in frames {
            any = true;
            let file = file.replace('\\', "/");
            if file.contains("torch/optim/") {
                optim = true;
                if name == "_init_group" {
                    state = true;
                }
            }
            if name.contains("backward") || file.contains("torch/autograd/") {
                backward = true;
            }
        }
        if state {
            Origin::OptimizerState
        } else if optim {
            Origin::OptimizerStep
        } else if backward {
            Origin::Backward
        } else if any {
            Origin::Forward
        } else {
            Origin::Unknown
        }
    }
}

/// One trace entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TraceEvent {
    pub action: Action,
    /// `addr` (for `oom`: `device_free`, the bytes CUDA reported free).
    pub addr: u64,
    pub size: u64,
    pub stream: u64,
    pub time_us: Option<i64>,
    pub origin: Origin,
    /// The innermost frame as `name (file:line)`, when there is one.
    pub frame: Option<String>,
}

/// `allocator_settings` (newer PyTorch).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct AllocatorSettings {
    /// `PYTORCH_CUDA_ALLOC_CONF` as last set.
    pub alloc_conf: Option<String>,
    pub expandable_segments: Option<bool>,
    /// `max_split_size` in bytes (PyTorch reports `SIZE_MAX` for unlimited).
    pub max_split_size: Option<u64>,
    /// `roundup_power2_divisions` per power-of-two interval from 1 MiB.
    pub roundup_power2_divisions: Vec<u64>,
}

/// A memory snapshot.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Snapshot {
    pub segments: Vec<SegmentInfo>,
    /// `device_traces`: one list per device, oldest first.
    pub device_traces: Vec<Vec<TraceEvent>>,
    pub allocator_settings: Option<AllocatorSettings>,
}
