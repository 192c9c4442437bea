//! `ditmem-budget`: the analytic side of ditmem. Pure Rust, no tensor library.
//!
//! One [`Spec`] (model + workload + recipe + runtime) describes a training step. This crate
//! counts every byte of that step: the parameters per module, what each op of each block saves for
//! backward and the workspace it allocates (the op inventory, per runtime), and a simulated timeline
//! of forward → backward → optimizer whose maximum is the peak.
//!
//! The public API is what this file exports: the spec types, [`estimate`] / [`Budget`], [`plan()`],
//! [`export()`], units, the error, the timeline and its events, the parameter table, the time
//! model's device profile, the `ditmem-cpu` rules the engine holds its kernels against
//! ([`ditmem_cpu`]) and the PyTorch device rules ([`pytorch`]). Every module but [`gpu`] (the GPU catalog) is crate-private; the twins of the engine's files live in
//! `runtime/ditmem_cpu/`. Nothing here reads the host: where the engine's allocations depend on the
//! CPU, the value is part of the spec ([`CpuSpec`]).

mod cost;
pub mod denoiser;
pub(crate) mod encoders;
mod estimate;
mod events;
mod export;
pub mod gpu;
pub mod launch;
pub mod levers;
pub mod oom;
mod params;
mod plan;
mod precision_rules;
pub mod profile;
mod runtime;
mod segment;
mod sharding;
mod snapshot;
mod timeline;

// The vocabulary (`ditmem-spec`), under the paths this crate has always used for it.
use ditmem_spec::{error, sharder, spec, units};

pub use cost::{
    block_flops, fast_dit_spec, step_time, time_error_note, BlockFlops, DeviceProfile,
    PublishedStep, StepTime, FAST_DIT_A100, GPU_BANDWIDTH_EFFICIENCY, GPU_MATMUL_EFFICIENCY,
    GPU_PASS_OVERHEAD_S, GPU_TIME_ERROR,
};
pub use error::SpecError;
pub use estimate::{estimate, Budget, Inventory, InventoryRow, Peak};
pub use events::{Breakdown, Event, Phase, StaticBytes};
pub use export::{
    block_classes, export, export_files, model_id, script_for, Command, Export, ExportOptions,
    NoScript, Script, Target, DIFFUSERS_COMMIT, DIFFUSERS_TAG,
};
pub use params::{
    bytes_of, count, param_table, Module, ModuleCount, ParamCounts, ParamRole, ParamTensor,
};
pub use plan::{
    engine_runnable, fmt_secs, microbatch_candidates, plan, plan_with, Allow, Alternative,
    Candidate, Limits, NotSearched, Plan, Progress, SearchControl, DEFAULT_HEADROOM,
    PLAN_LORA_RANK, PLAN_MAX_MICROBATCHES,
};
pub use runtime::{GenericCosts, Kept, SegSim, SegmentCosts, Shape, Sims};
pub use segment::{SegmentBytes, SegmentCost};
pub use sharding::{
    comm_volume, ddp_buckets, ds12_partition_elems, rank_states, CommVolume, Offload, RankStates,
    Scheme, Sharder, DDP_BUCKET_CAP_BYTES, DDP_FIRST_BUCKET_BYTES, DS_PERSISTENCE_THRESHOLD,
    DS_PREFETCH_BUCKET_ELEMS, DS_REDUCE_BUCKET_ELEMS,
};
pub use spec::{
    default_lora_targets, AttentionMode, BaseQuant, Bf16Products, CpuSpec, CudaSpec, Dtype,
    EmaSpec, GemmIsa, Latents, LoraDtype, LoraSpec, LoraTarget, ModelSpec, Optimizer,
    OptimizerImpl, Precision, Prediction, Recipe, Recompute, Runtime, SdpaBackend, Spec,
    TextEncoders, TokenGrid, TorchDevice, Workload, LIMITS, MAX_ACCUMULATION, MAX_CHANNELS,
    MAX_DEPTH, MAX_FRAMES, MAX_FREQ_EMBED, MAX_HIDDEN, MAX_MICROBATCH, MAX_MLP_RATIO,
    MAX_NUM_CLASSES, MAX_PATCH, MAX_RANKS, MAX_SIDE, MAX_TENSOR_ELEMS, MAX_TEXT_TOKENS, MAX_TOKENS,
    MAX_VAE_FACTOR,
};
pub use timeline::{simulate_step, Repeat, Timeline, LAID_OUT_MICROBATCHES};
pub use units::{fmt_bytes, parse_bytes};

/// The `ditmem-cpu` rules that the engine's tests and benches hold their measurements against:
/// candle's bookkeeping per tensor, the engine's fused ops and the workspace of its kernels, and
/// the graphs they make (twins of the engine's files, see `runtime/ditmem_cpu/`).
pub mod ditmem_cpu {
    pub use crate::families::flux::ditmem_cpu as flux;
    pub use crate::families::sana::ditmem_cpu as sana;
    pub use crate::runtime::ditmem_cpu::attention;
    pub use crate::runtime::ditmem_cpu::backward;
    pub use crate::runtime::ditmem_cpu::block;
    pub use crate::runtime::ditmem_cpu::cross;
    pub use crate::runtime::ditmem_cpu::dtypes::grad_dtype;
    pub use crate::runtime::ditmem_cpu::gemm_pack;
    pub use crate::runtime::ditmem_cpu::graph;
    pub use crate::runtime::ditmem_cpu::graph::{STORAGE_META, TENSOR_META};
    pub use crate::runtime::ditmem_cpu::ops;
    pub use crate::runtime::ditmem_cpu::ops::{
        fused_linear_scratch, native_attention_scratch, streaming_attention_scratch, SQUARES_CHUNK,
    };
    pub use crate::runtime::ditmem_cpu::step::{gemm_workspace_bytes, step_uses_gemm};
}

/// The `pytorch` runtime as a device and SDPA kernel, with the CUDA caching allocator's rounding
/// ([`pytorch::PyTorch::cuda_block`], [`pytorch::PyTorch::cuda_segment`]), the context bytes
/// the allocator does not count, and the caching allocator simulated over an allocation sequence
/// ([`pytorch::simulate_allocator`], [`pytorch::simulate_on_gpu`]).
pub mod pytorch {
    pub use crate::runtime::pytorch::caching_allocator::{
        allocation_size, round_size, simulate_allocator, simulate_on_gpu, AllocConf,
        AllocConfError, AllocEvent, AllocatorReport, CachingAllocator, CudaMemory, Oom,
        SequenceError, CUBLAS_WORKSPACE_ID_BASE,
    };
    pub use crate::runtime::pytorch::cuda::{CudaReport, MAX_REPLAYED_EVENTS};
    pub use crate::runtime::pytorch::device::{PyTorch, CUDA_CONTEXT_BYTES};
}

/// The model families (DiT, diffusers' DiT, PixArt, SD3, Flux, Sana, Wan): their exact parameter
/// tables, read from a diffusers `config.json` or a preset; a spec holds one in `model.diffusers`
/// ([`denoiser`]).
mod families;
pub use encoders::EncoderRun;
/// The frozen text encoders and VAE encoders of each family: parameter counts and forward rules.
pub use families::frozen;
pub use families::{
    count as count_family, from_config_json, preset as family_preset, preset_config,
    preset_names as family_preset_names, preset_source, state_bytes, Dims, Family, FamilyCounts,
    FamilyModel, FamilyTensor, Geometry, Group, GroupCount, StateBytes, TensorKind, TextEncoder,
    TrainingDefaults, MAX_CONFIG_JSON_BYTES,
};
pub use families::{DitDiffusersDims, DitDims, FluxDims, PixartDims, SanaDims, Sd3Dims, WanDims};

/// PyTorch CUDA memory snapshots (`torch.cuda.memory._dump_snapshot`): read, replayed into
/// allocated and reserved timelines, and held against a spec's `pytorch:cuda` prediction.
pub mod memory_snapshot {
    pub use crate::snapshot::{
        compare, predicted_timeline, read_snapshot, replay, Action, AllocatorSettings, BlockInfo,
        BlockSizeCount, BlockState, OomEvent, Origin, OriginBytes, Parting, Predicted, Replay,
        SegmentInfo, Snapshot, SnapshotComparison, SnapshotError, TimelinePoint, TraceEvent,
        MAX_BLOCKS, MAX_NODES, MAX_SNAPSHOT_FILE_BYTES, MAX_TRACE_EVENTS,
    };
}
