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

// A `pub` item the crate root does not export would read as API and is not: it must say
// `pub(crate)` (issue 45: public items only where another crate can use them).
#![warn(unreachable_pub)]

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

pub use cost::{block_flops, step_time, time_error_note, DeviceProfile, StepTime, GPU_TIME_ERROR};
pub use error::SpecError;
pub use estimate::{estimate, Budget, Inventory, InventoryRow, Peak};
pub use events::{Breakdown, Event, Phase};
pub use export::{export, export_files, Command, Export, ExportOptions, Target};
pub use params::{count, param_table, Module, ParamRole};
pub use plan::{
    engine_runnable, fmt_secs, plan, plan_with, Allow, Candidate, Limits, Plan, Progress,
    SearchControl, DEFAULT_HEADROOM, PLAN_MAX_MICROBATCHES,
};
pub use runtime::{Kept, SegSim, Shape, Sims};
pub use sharding::{Offload, Scheme, Sharder};
pub use spec::{
    default_lora_targets, AttentionMode, BaseQuant, Bf16Products, CpuSpec, CudaSpec, Dtype,
    EmaSpec, GemmIsa, Latents, LoraDtype, LoraSpec, LoraTarget, ModelSpec, Optimizer,
    OptimizerImpl, Precision, Prediction, Recipe, Recompute, Runtime, SdpaBackend, Spec,
    TextEncoders, TokenGrid, TorchDevice, Workload, LIMITS, MAX_ACCUMULATION, MAX_CHANNELS,
    MAX_DEPTH, MAX_FRAMES, MAX_FREQ_EMBED, MAX_HIDDEN, MAX_MICROBATCH, MAX_MLP_RATIO,
    MAX_NUM_CLASSES, MAX_PATCH, MAX_RANKS, MAX_SIDE, MAX_TENSOR_ELEMS, MAX_TEXT_TOKENS, MAX_TOKENS,
    MAX_VAE_FACTOR,
};
pub use timeline::{Repeat, Timeline};
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
    pub use crate::runtime::ditmem_cpu::ops::SQUARES_CHUNK;
    pub use crate::runtime::ditmem_cpu::step::{
        gemm_workspace_bytes, not_executed, step_uses_gemm, NotExecuted,
    };
}

/// The `pytorch` runtime as a device and SDPA kernel ([`pytorch::PyTorch`]), its
/// `PYTORCH_CUDA_ALLOC_CONF` settings ([`pytorch::AllocConf`]) and what the simulated caching
/// allocator reports of a step on a card ([`pytorch::CudaReport`]).
pub mod pytorch {
    pub use crate::runtime::pytorch::caching_allocator::{AllocConf, AllocConfError, Oom};
    pub use crate::runtime::pytorch::cuda::{CudaReport, MAX_REPLAYED_EVENTS};
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
    preset_names as family_preset_names, preset_source, state_bytes, unknown_preset, Dims, Family,
    FamilyCounts, FamilyModel, FamilyTensor, Geometry, GroupCount, StateBytes, TensorKind,
    TextEncoder, MAX_CONFIG_JSON_BYTES,
};
pub use families::{DitDiffusersDims, FluxDims, PixartDims, SanaDims, Sd3Dims, WanDims};

/// PyTorch CUDA memory snapshots (`torch.cuda.memory._dump_snapshot`): read, replayed into
/// allocated and reserved timelines, and held against a spec's `pytorch:cuda` prediction.
pub mod memory_snapshot {
    pub use crate::snapshot::{
        compare, predicted_timeline, read_snapshot, replay, Action, AllocatorSettings, Origin,
        Predicted, Replay, Snapshot, SnapshotComparison, SnapshotError, TimelinePoint,
        MAX_SNAPSHOT_FILE_BYTES,
    };
}
