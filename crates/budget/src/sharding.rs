//! Data parallelism over `workload.ranks`: which scheme shards what (DDP, DeepSpeed ZeRO-1/2/3,
//! FSDP2), what is offloaded to host memory, and the model states one rank keeps.
//!
//! The recipe names the scheme with three fields: `zero_stage` (0 none, 1 optimizer state, 2 +
//! gradients, 3 + parameters), `sharder` (`deepspeed` | `fsdp`: who shards a stage ≥ 1) and
//! `offload` (`none` | `optimizer` | `optimizer+params`); `gradient_as_bucket_view` is DDP's
//! option. Stage 0 with several ranks is DDP.
//!
//! Sources (pinned to the versions `bench/ecosystem/setup.sh` installs; each rule names its own):
//! - **[DDP]** `torch/nn/parallel/distributed.py` (PyTorch 2.15, `_BucketCapacityConfig.create`):
//!   `bucket_cap_mb=None` → `_DEFAULT_BUCKET_CAP_MB` = 25 MiB, and then the first bucket capped
//!   at `dist._DEFAULT_FIRST_BUCKET_BYTES` = 1 MiB (`kDefaultFirstBucketBytes` in
//!   `torch/csrc/distributed/c10d/reducer.hpp`); `_compute_bucket_assignment_by_size` fills
//!   buckets in reverse parameter order. `reducer.cpp` `initialize_buckets` allocates each bucket's flat
//!   `gradients` tensor (`at::empty` of the bucket's elements) at construction; with
//!   `gradient_as_bucket_view=False` (default) a ready `param.grad` is copied into it
//!   (`mark_variable_ready_dense`) and copied back after the all-reduce: the buckets are a second
//!   copy of the gradients for the whole run. With `True`, `param.grad` is a view of the bucket:
//!   one copy, alive from construction.
//! - **[DS12]** `deepspeed/runtime/zero/stage_1_and_2.py` (DeepSpeed 0.19.8): the model runs in
//!   bf16/fp16 (`engine.py` casts the module when `bf16`/`fp16` is enabled; `get_data_types`:
//!   the gradient accumulation dtype defaults to the model's, so `DeepSpeedZeroOptimizer` runs,
//!   not `BF16_Optimizer`); the trained parameters are flattened into one group padded to
//!   `nccl_start_alignment_factor (2) × world_size` elements and split evenly; each rank keeps
//!   an fp32 copy of its partition (`single_partition_of_fp32_groups`), which the optimizer
//!   updates, so its state is on the partition. `setup_buckets` allocates
//!   `reduce_bucket_size` elements of the gradient dtype when a backward starts, a second
//!   buffer with `overlap_comm` (the exported config sets it), and `_release_ipg_buffers` frees
//!   them after it. Stage 1 keeps the full 16-bit `.grad`s; stage 2 (`partition_grads`) keeps
//!   only its partition (`grads_in_partition`) and drops the others once reduced. At `step()`
//!   the partition's gradients become one fp32 flat tensor (`single_grad_partition`), freed
//!   after the update.
//! - **[DS3]** `deepspeed/runtime/zero/stage3.py` and `partition_parameters.py`: each parameter
//!   is padded to a multiple of the world size and split (`_aligned_size`, `ds_tensor`);
//!   parameters of at most `stage3_param_persistence_threshold` (1e5) elements stay whole on
//!   every rank; a module's parameters are all-gathered before its forward and backward and
//!   released after them, with up to `stage3_prefetch_bucket_size` (5e7) elements of the next
//!   modules prefetched; `_setup_for_real_optimizer` creates the fp32 partitions, the optimizer
//!   state (eagerly, `initialize_optimizer_states`), the `reduce_bucket_size` IPG buffer and
//!   the flat 16-bit gradient partition (`grad_partitions_flat_buffer`) once.
//! - **[DSCFG]** `deepspeed/runtime/zero/config.py` defaults: `reduce_bucket_size` 5e8,
//!   `stage3_prefetch_bucket_size` 5e7, `stage3_param_persistence_threshold` 1e5,
//!   `stage3_max_live_parameters` 1e9. The exported `ds_config.json` leaves them at these
//!   defaults (accelerate fills only `"auto"` values).
//! - **[OFF]** ZeRO-Offload (`offload_optimizer.device = cpu`, stage_1_and_2.py
//!   `cpu_offload`): the fp32 partition, its gradient (`single_partition_of_fp32_groups[i]
//!   .grad`, pinned), the optimizer state and a 16-bit staging copy of the partition
//!   (`param_buffer_of_bit16_for_cpu_offload_groups`) live in host memory and the update runs on
//!   the CPU; the device keeps the 16-bit model and the IPG buffers, and reduced gradients are
//!   copied straight to the host. `offload_param` (stage 3 only) moves the 16-bit partitions to
//!   the host too: a module's parameters reach the device only while gathered.
//! - **[FSDP2]** `torch/distributed/fsdp/_fully_shard/` (PyTorch 2.15): `fully_shard` on each
//!   transformer block and on the root; parameters become dim-0 shards (`_init_sharded_param`
//!   pads dim 0 to a multiple of the world size) in their original dtype (fp32: the shards are
//!   the master weights the optimizer updates); before a block's forward and backward its
//!   parameters are all-gathered in `MixedPrecisionPolicy.param_dtype` (the compute dtype under
//!   accelerate's mixed precision) into one flat buffer, freed after the forward when
//!   `reshard_after_forward=True` (the default; `False` keeps them to the backward) and after
//!   the backward; the next block's all-gather is prefetched; the root's parameters are not
//!   resharded after forward. Unsharded gradients are reduce-scattered and accumulate into
//!   sharded fp32 gradients. `CPUOffloadPolicy` keeps the shards, their gradients and the
//!   optimizer step on the host.

use serde::Serialize;

use crate::error::SpecError;
use crate::params::{stored_bytes, ParamRole, ParamTensor};
use crate::spec::{Dtype, Optimizer, Precision, Spec};

// The recipe's names (who shards, what is offloaded) live in `sharder.rs`, which `spec.rs` reads
// without reading this file's rules back.
pub use crate::sharder::{Offload, Sharder};

/// DDP's bucket cap: `bucket_cap_mb` 25 MiB by default [DDP].
pub(crate) const DDP_BUCKET_CAP_BYTES: u64 = 25 << 20;
/// DDP's first bucket: `dist._DEFAULT_FIRST_BUCKET_BYTES` = 1 MiB [DDP].
pub(crate) const DDP_FIRST_BUCKET_BYTES: u64 = 1 << 20;
/// DeepSpeed `reduce_bucket_size` default, elements [DSCFG].
pub(crate) const DS_REDUCE_BUCKET_ELEMS: u64 = 500_000_000;
/// DeepSpeed `stage3_prefetch_bucket_size` default, elements [DSCFG].
pub(crate) const DS_PREFETCH_BUCKET_ELEMS: u64 = 50_000_000;
/// DeepSpeed `stage3_param_persistence_threshold` default, elements [DSCFG].
pub(crate) const DS_PERSISTENCE_THRESHOLD: u64 = 100_000;
/// DeepSpeed's flat-partition alignment per rank (`nccl_start_alignment_factor`) [DS12].
pub(crate) const DS_ALIGNMENT: u64 = 2;
/// IPG buffers stage 1/2 allocate per backward: 2 with `overlap_comm`, which the exported
/// `ds_config.json` sets [DS12].
pub(crate) const DS12_IPG_BUFFERS: u64 = 2;

/// The scheme a spec's recipe runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Scheme {
    /// One rank.
    Single,
    /// DDP [DDP].
    Ddp { gradient_as_bucket_view: bool },
    /// DeepSpeed ZeRO stage 1, 2 or 3 [DS12][DS3].
    Zero { stage: u8 },
    /// FSDP2 [FSDP2]: stage 3 reshards after forward, stage 2 does not.
    Fsdp2 { reshard_after_forward: bool },
}

impl Scheme {
    pub fn of(spec: &Spec) -> Scheme {
        let r = &spec.recipe;
        if spec.workload.ranks <= 1 {
            return Scheme::Single;
        }
        match (r.zero_stage, r.sharder) {
            (0, _) => Scheme::Ddp {
                gradient_as_bucket_view: r.gradient_as_bucket_view,
            },
            (z, Sharder::Deepspeed) => Scheme::Zero { stage: z },
            (z, Sharder::Fsdp) => Scheme::Fsdp2 {
                reshard_after_forward: z >= 3,
            },
        }
    }

    /// "DDP", "ZeRO-2", "FSDP2 (reshard after forward)".
    pub fn describe(&self) -> String {
        match self {
            Scheme::Single => "one rank".into(),
            Scheme::Ddp {
                gradient_as_bucket_view: false,
            } => "DDP".into(),
            Scheme::Ddp { .. } => "DDP (gradient_as_bucket_view)".into(),
            Scheme::Zero { stage } => format!("ZeRO-{stage}"),
            Scheme::Fsdp2 {
                reshard_after_forward: true,
            } => "FSDP2".into(),
            Scheme::Fsdp2 { .. } => "FSDP2 (no reshard after forward)".into(),
        }
    }

    /// Whether the module itself runs in the compute dtype (no fp32 parameters under
    /// autocast): DeepSpeed casts the module for bf16/fp16 [DS12]; FSDP2 gathers parameters in
    /// `param_dtype` [FSDP2]. Mixed precision only.
    pub(crate) fn low_precision_module(&self, precision: Precision) -> bool {
        precision.is_mixed() && matches!(self, Scheme::Zero { .. } | Scheme::Fsdp2 { .. })
    }

    /// Whether parameters are sharded and gathered per block (ZeRO-3, FSDP2).
    pub(crate) fn gathers(&self) -> bool {
        matches!(self, Scheme::Zero { stage: 3 } | Scheme::Fsdp2 { .. })
    }

    /// Whether the full gradients of a block are dropped once reduced, keeping a partition
    /// (ZeRO-2/3, FSDP2).
    pub(crate) fn shards_gradients(&self) -> bool {
        matches!(self, Scheme::Zero { stage: 2 | 3 } | Scheme::Fsdp2 { .. })
    }
}

/// DDP's bucket sizes in bytes [DDP]: gradients in reverse parameter order, the first bucket
/// closed once it holds at least 1 MiB, every later one at 25 MiB
/// (`_compute_bucket_assignment_by_size`: a bucket closes when its size reaches the limit).
pub(crate) fn ddp_buckets(grad_bytes_in_order: &[u64]) -> Vec<u64> {
    let mut out = Vec::new();
    let mut acc = 0u64;
    for &b in grad_bytes_in_order.iter().rev() {
        acc += b;
        let limit = if out.is_empty() {
            DDP_FIRST_BUCKET_BYTES
        } else {
            DDP_BUCKET_CAP_BYTES
        };
        if acc >= limit {
            out.push(acc);
            acc = 0;
        }
    }
    if acc > 0 {
        out.push(acc);
    }
    out
}

/// Elements of one rank's partition of DeepSpeed stage 1/2's flat group of `elems` elements
/// [DS12]: the group padded to `2 × ranks`, split evenly.
pub(crate) fn ds12_partition_elems(elems: u64, ranks: u64) -> u64 {
    let align = DS_ALIGNMENT * ranks;
    elems.div_ceil(align) * align / ranks
}

/// Elements of one rank's partition of a tensor under DeepSpeed stage 3 (padded to a multiple
/// of the world size) [DS3], or FSDP2 (dim 0 padded to a multiple of the world size) [FSDP2].
pub(crate) fn shard_elems(t: &ParamTensor, ranks: u64, sharder: Sharder) -> u64 {
    let n = t.numel();
    match sharder {
        Sharder::Deepspeed => n.div_ceil(ranks),
        Sharder::Fsdp => {
            let d0 = t.shape.first().copied().unwrap_or(1).max(1);
            d0.div_ceil(ranks) * (n / d0)
        }
    }
}

/// Whether DeepSpeed stage 3 keeps a parameter whole on every rank [DS3].
pub(crate) fn ds3_persistent(t: &ParamTensor) -> bool {
    t.numel() <= DS_PERSISTENCE_THRESHOLD
}

/// How far ahead a gathering scheme all-gathers the next blocks' parameters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub(crate) enum Prefetch {
    #[default]
    None,
    /// FSDP2's implicit prefetch: the next block [FSDP2].
    NextBlock,
    /// DeepSpeed stage 3: the following blocks while the bytes already prefetched are below
    /// this (`stage3_prefetch_bucket_size` in the compute dtype) [DS3].
    Bytes(u64),
}

impl Prefetch {
    /// The blocks gathered ahead of block `i` of `gathers` (in execution order): their indices.
    pub(crate) fn window(&self, gathers: &[u64], i: usize) -> std::ops::Range<usize> {
        let next = (i + 1).min(gathers.len());
        match *self {
            Prefetch::None => next..next,
            Prefetch::NextBlock => next..(i + 2).min(gathers.len()),
            Prefetch::Bytes(limit) => {
                let mut end = next;
                let mut sum = 0u64;
                while end < gathers.len() && sum < limit {
                    sum += gathers[end];
                    end += 1;
                }
                next..end
            }
        }
    }
}

/// The model states one rank keeps, by what they are (bytes), and what lives in host memory.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct RankStates {
    /// Parameters on the device between steps, one entry per buffer as it is allocated.
    pub weights: Vec<u64>,
    /// fp32 master copies on the device (mixed precision), one entry per buffer.
    pub master: Vec<u64>,
    /// Optimizer state on the device, one entry per state tensor.
    pub optimizer_state: Vec<u64>,
    /// Whether the optimizer state is created at construction (DeepSpeed stage 3) rather than
    /// lazily at the first `step()` (torch's AdamW).
    pub eager_optimizer_state: bool,
    /// Elements of each tensor the device optimizer updates (for its scratch and `step`
    /// tensors); empty when the update runs on the host.
    pub optimizer_tensors: Vec<u64>,
    /// Gradient buffers alive from construction (DDP buckets, DeepSpeed stage 3's partition,
    /// the IPG buffer of stage 3).
    pub grad_buffers: Vec<u64>,
    /// Buffers made when a backward starts and freed when it ends (stage 1/2 IPG buffers).
    pub backward_buffers: Vec<u64>,
    /// The gradient partition a sharded step keeps after reducing (made by the first backward,
    /// freed after the step): stage 2, FSDP2.
    pub grad_partition: u64,
    /// A transient of `step()`: the partition's gradients as one fp32 tensor (DeepSpeed).
    pub step_grads: u64,
    /// Whether a block's full gradients stay after its backward as `.grad` tensors of their own
    /// (DDP without bucket views, ZeRO-1): their bytes are the segments' own. Otherwise they are
    /// copied into a bucket or reduced into a partition and freed.
    pub keep_full_grads: bool,
    /// Bytes per element of the gradients the segments make.
    pub grad_elem_bytes: u64,
    /// Bytes kept in host memory (offload).
    pub host: u64,
    /// Parameters gathered per block (compute dtype) by block index, and those of the modules
    /// outside the blocks (ZeRO-3, FSDP2); empty otherwise.
    pub gathered_blocks: Vec<u64>,
    pub gathered_outside: u64,
    /// How far ahead a gathering scheme prefetches.
    pub prefetch: Prefetch,
}

impl RankStates {
    pub(crate) fn weights_bytes(&self) -> u64 {
        self.weights.iter().sum()
    }
    pub(crate) fn master_bytes(&self) -> u64 {
        self.master.iter().sum()
    }
    pub(crate) fn optimizer_state_bytes(&self) -> u64 {
        self.optimizer_state.iter().sum()
    }
}

/// AdamW's two state tensors for `elems` elements, as `precision_rules::optimizer_state_bytes` counts
/// them, split into the two tensors (m and v).
fn state_pair(elems: u64, optimizer: Optimizer, precision: Precision) -> Vec<u64> {
    let b = crate::precision_rules::optimizer_state_bytes(elems, optimizer, precision);
    if b == 0 {
        Vec::new()
    } else {
        vec![b / 2, b - b / 2]
    }
}

/// The model states of one rank under a sharded scheme (DDP, ZeRO, FSDP2): `None` for one rank.
/// `grad_dtype` is the runtime's gradient dtype for fp32 parameters (autocast).
pub(crate) fn rank_states(
    spec: &Spec,
    table: &[ParamTensor],
    grad_dtype: Dtype,
) -> Option<RankStates> {
    let scheme = Scheme::of(spec);
    if scheme == Scheme::Single {
        return None;
    }
    let rank = Rank::new(spec, table, scheme, grad_dtype);
    let mut s = RankStates {
        grad_elem_bytes: rank.gd.size(),
        keep_full_grads: !scheme.shards_gradients(),
        ..RankStates::default()
    };
    match scheme {
        Scheme::Single => unreachable!("handled above"),
        Scheme::Ddp {
            gradient_as_bucket_view,
        } => rank.ddp(&mut s, gradient_as_bucket_view),
        Scheme::Zero { stage } if stage <= 2 => rank.zero12(&mut s, stage),
        Scheme::Zero { .. } => rank.zero3(&mut s),
        Scheme::Fsdp2 { .. } => rank.fsdp2(&mut s),
    }
    Some(s)
}

/// What every scheme's rules read of the spec for one rank's states ([`rank_states`]).
struct Rank<'a> {
    spec: &'a Spec,
    table: &'a [ParamTensor],
    p: Precision,
    optimizer: Optimizer,
    /// Ranks.
    n: u64,
    offload_opt: bool,
    offload_par: bool,
    /// The dtype the module's trained parameters and gradients have on the device.
    module_dt: Dtype,
    /// The gradients' dtype.
    gd: Dtype,
    /// Bytes per element of the compute dtype (what a gathering scheme all-gathers).
    cd: u64,
    /// The trained parameters (no buffers), in table order.
    trained: Vec<&'a ParamTensor>,
}

impl<'a> Rank<'a> {
    fn new(spec: &'a Spec, table: &'a [ParamTensor], scheme: Scheme, grad_dtype: Dtype) -> Self {
        let r = &spec.recipe;
        let p = r.precision;
        let low = scheme.low_precision_module(p);
        Rank {
            spec,
            table,
            p,
            optimizer: r.optimizer,
            n: u64::from(spec.workload.ranks),
            offload_opt: r.offload != Offload::None,
            offload_par: r.offload == Offload::OptimizerAndParams,
            module_dt: if low {
                p.compute_dtype()
            } else {
                p.param_dtype()
            },
            gd: if low { p.compute_dtype() } else { grad_dtype },
            cd: p.compute_dtype().size(),
            trained: table
                .iter()
                .filter(|t| t.role == ParamRole::Trained && !t.buffer)
                .collect(),
        }
    }

    /// A tensor's bytes as stored on one rank that keeps it whole.
    fn stored(&self, t: &ParamTensor) -> u64 {
        let r = &self.spec.recipe;
        stored_bytes(t, self.p, r.lora.is_some(), r.base_quant)
    }

    /// [DDP] the model as on one rank (fp32 trained parameters are the masters of mixed
    /// precision); the buckets beside the gradients.
    fn ddp(&self, s: &mut RankStates, gradient_as_bucket_view: bool) {
        for t in self.table {
            let b = self.stored(t);
            if t.role == ParamRole::Trained && !t.buffer && self.p.is_mixed() {
                s.master.push(b);
            } else {
                s.weights.push(b);
            }
        }
        for t in &self.trained {
            s.optimizer_state
                .extend(state_pair(t.numel(), self.optimizer, self.p));
        }
        s.optimizer_tensors = self.trained.iter().map(|t| t.numel()).collect();
        let grads: Vec<u64> = self
            .trained
            .iter()
            .map(|t| t.numel() * self.gd.size())
            .collect();
        s.grad_buffers = ddp_buckets(&grads);
        // With bucket views the buckets are the gradients: nothing else stays.
        s.keep_full_grads = !gradient_as_bucket_view;
    }

    /// [DS12] the 16-bit (or fp32) module whole on every rank, the flat partition.
    fn zero12(&self, s: &mut RankStates, stage: u8) {
        for t in self.table {
            if t.role == ParamRole::Trained && !t.buffer {
                s.weights.push(t.numel() * self.module_dt.size());
            } else {
                s.weights.push(self.stored(t));
            }
        }
        let p_elems: u64 = self.trained.iter().map(|t| t.numel()).sum();
        let part = ds12_partition_elems(p_elems, self.n);
        // [OFF] on the host beside the fp32 partition: a 16-bit staging copy.
        self.fp32_partition(s, part, part * self.module_dt.size());
        s.backward_buffers =
            vec![DS_REDUCE_BUCKET_ELEMS * self.gd.size(); DS12_IPG_BUFFERS as usize];
        if stage == 2 && !self.offload_opt {
            s.grad_partition = part * self.gd.size();
        }
    }

    /// [DS3] 16-bit partitions (whole when small), fp32 partitions, eager state, the IPG
    /// buffer and the flat gradient partition.
    fn zero3(&self, s: &mut RankStates) {
        let mut part = 0u64;
        for t in self.table {
            if t.buffer {
                s.weights.push(self.stored(t));
                continue;
            }
            let sh = shard_elems(t, self.n, Sharder::Deepspeed);
            let dt = if t.role == ParamRole::Trained {
                self.module_dt
            } else {
                self.p.compute_dtype()
            };
            if !self.offload_par {
                s.weights.push(sh * dt.size());
            }
            if ds3_persistent(t) {
                s.weights.push(t.numel() * dt.size());
            }
            if t.role == ParamRole::Trained {
                part += sh;
            }
        }
        self.fp32_partition(s, part, 0);
        if !self.offload_opt {
            s.eager_optimizer_state = true;
            s.grad_buffers.push(part * self.gd.size());
        }
        if self.offload_par {
            s.host += self
                .table
                .iter()
                .filter(|t| !t.buffer)
                .map(|t| shard_elems(t, self.n, Sharder::Deepspeed) * self.module_dt.size())
                .sum::<u64>();
        }
        s.grad_buffers.push(DS_REDUCE_BUCKET_ELEMS * self.gd.size());
        gathered(self.spec, self.table, s, |t| !ds3_persistent(t), self.cd);
        s.prefetch = Prefetch::Bytes(DS_PREFETCH_BUCKET_ELEMS * self.cd);
    }

    /// DeepSpeed's fp32 side of a flat partition of `part` elements ([DS12], [DS3]): the master
    /// copy (mixed precision), the optimizer state and the step's fp32 gradients on the device;
    /// or, offloaded [OFF], the master, its fp32 gradient, the state and `host_staging` bytes
    /// on the host.
    fn fp32_partition(&self, s: &mut RankStates, part: u64, host_staging: u64) {
        let master = if self.p.is_mixed() {
            part * self.p.param_dtype().size()
        } else {
            0
        };
        let state = state_pair(part, self.optimizer, self.p);
        if self.offload_opt {
            s.host = master.max(part * 4) + part * 4 + state.iter().sum::<u64>() + host_staging;
        } else {
            if master > 0 {
                s.master.push(master);
            }
            s.optimizer_state = state;
            s.optimizer_tensors = vec![part];
            s.step_grads = part * self.p.optimizer_dtype().size();
        }
    }

    /// [FSDP2] dim-0 shards in the parameters' own dtype (fp32: the master weights).
    fn fsdp2(&self, s: &mut RankStates) {
        let lora = self.spec.recipe.lora.is_some();
        let mut trained_shards = Vec::new();
        for t in self.table {
            if t.buffer {
                s.weights.push(self.stored(t));
                continue;
            }
            let sh = shard_elems(t, self.n, Sharder::Fsdp);
            let bytes = sh * crate::params::stored_dtype(t, self.p, lora).size();
            if t.role == ParamRole::Trained {
                trained_shards.push(sh);
            }
            if self.offload_par {
                s.host += bytes;
            } else if t.role == ParamRole::Trained && self.p.is_mixed() {
                s.master.push(bytes);
            } else {
                s.weights.push(bytes);
            }
        }
        let part: u64 = trained_shards.iter().sum();
        if self.offload_par {
            // CPUOffloadPolicy: sharded gradients and the step on the host.
            for &sh in &trained_shards {
                s.host += state_pair(sh, self.optimizer, self.p).iter().sum::<u64>()
                    + sh * self.p.param_dtype().size();
            }
        } else {
            for &sh in &trained_shards {
                s.optimizer_state
                    .extend(state_pair(sh, self.optimizer, self.p));
            }
            s.optimizer_tensors = trained_shards.clone();
            // Sharded gradients in the parameters' dtype.
            s.grad_partition = part * self.p.param_dtype().size();
        }
        gathered(self.spec, self.table, s, |_| true, self.cd);
        s.prefetch = Prefetch::NextBlock;
    }
}

/// Bytes of the EMA copy of a trained tensor on one rank: whole, or a shard of it where the
/// parameters are sharded (ZeRO-3, FSDP2: the script's EMA model follows the sharded one).
pub(crate) fn ema_bytes(spec: &Spec, t: &ParamTensor) -> u64 {
    let bytes = t.numel() * spec.recipe.ema.dtype.size();
    if Scheme::of(spec).gathers() {
        bytes.div_ceil(u64::from(spec.workload.ranks))
    } else {
        bytes
    }
}

/// Per-block (and outside-the-blocks) bytes of the parameters a gathering scheme all-gathers,
/// in the compute dtype (`elem` bytes per element), for the tensors `gathers` selects.
fn gathered(
    spec: &Spec,
    table: &[ParamTensor],
    s: &mut RankStates,
    gathers: impl Fn(&ParamTensor) -> bool,
    elem: u64,
) {
    let lora = spec.recipe.lora.is_some();
    let index = global_block_index(table);
    let blocks = index.iter().flatten().max().map_or(0, |b| b + 1);
    s.gathered_blocks = vec![0; blocks];
    for (t, at) in table.iter().zip(&index) {
        if t.buffer || !gathers(t) {
            continue;
        }
        // A frozen quantized base is gathered as stored.
        let bytes = if t.role == ParamRole::Frozen && spec.recipe.base_quant.is_none() {
            t.numel() * elem
        } else if t.role == ParamRole::Frozen {
            stored_bytes(t, spec.recipe.precision, lora, spec.recipe.base_quant)
        } else {
            t.numel() * elem
        };
        match at {
            Some(b) => s.gathered_blocks[*b] += bytes,
            None => s.gathered_outside += bytes,
        }
    }
}

/// Each tensor's block numbered across the model's stacks, in the order the stacks first appear
/// in the table (the forward's: Flux's `transformer_blocks` 0–18, then
/// `single_transformer_blocks` as 19–56), as the step replay numbers the blocks; `None` outside
/// the blocks. A stack is the tensor name before `.{block}.`.
pub(crate) fn global_block_index(table: &[ParamTensor]) -> Vec<Option<usize>> {
    let stack = |t: &ParamTensor| -> Option<(String, usize)> {
        let b = t.block? as usize;
        let key = format!(".{b}.");
        let prefix = t.name.find(&key).map_or("", |i| &t.name[..i]);
        Some((prefix.to_string(), b))
    };
    // Stacks in order of appearance with their block counts.
    let mut stacks: Vec<(String, usize)> = Vec::new();
    for t in table {
        if let Some((p, b)) = stack(t) {
            match stacks.iter_mut().find(|(q, _)| *q == p) {
                Some((_, n)) => *n = (*n).max(b + 1),
                None => stacks.push((p, b + 1)),
            }
        }
    }
    table
        .iter()
        .map(|t| {
            let (p, b) = stack(t)?;
            let mut offset = 0;
            for (q, n) in &stacks {
                if *q == p {
                    return Some(offset + b);
                }
                offset += n;
            }
            None
        })
        .collect()
}

/// Bytes one rank sends per optimizer step over the link between ranks, and over PCIe to the
/// host for offload. Ring collectives move `(N − 1)/N` of the buffer per rank: an all-reduce
/// twice that (reduce-scatter + all-gather), a reduce-scatter or all-gather once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub(crate) struct CommVolume {
    /// Bytes over the link between ranks.
    pub link_bytes: f64,
    /// Bytes between device and host (offload).
    pub host_bytes: f64,
}

/// The communication of one step [DDP][DS12][DS3][FSDP2][OFF]:
/// - DDP: an all-reduce of the gradients once per step (`no_sync` inside the accumulation);
/// - ZeRO-1: a reduce-scatter of the gradients and an all-gather of the updated 16-bit
///   parameters per step;
/// - ZeRO-2: the gradients reduce-scattered after every microbatch, the all-gather per step;
/// - ZeRO-3 / FSDP2: the parameters all-gathered for each forward, each recompute and each
///   backward (FSDP2 without resharding: once per microbatch), the gradients reduce-scattered
///   after every microbatch;
/// - offload: the gradient partition to the host and the updated partition back, per step
///   (parameters too, per gather, with `optimizer+params`).
///
/// `trained` elements, `recompute_share` of the blocks recomputed.
pub(crate) fn comm_volume(spec: &Spec, trained: f64, recompute_share: f64) -> CommVolume {
    let scheme = Scheme::of(spec);
    let w = &spec.workload;
    let r = &spec.recipe;
    let n = f64::from(w.ranks);
    let acc = f64::from(w.accumulation);
    let p = r.precision;
    let frac = if w.ranks > 1 { (n - 1.0) / n } else { 0.0 };
    let low = scheme.low_precision_module(p);
    let gbytes = trained
        * if low {
            p.compute_dtype().size()
        } else {
            p.param_dtype().size()
        } as f64;
    let wbytes = trained * p.compute_dtype().size() as f64;
    let link = match scheme {
        Scheme::Single => 0.0,
        Scheme::Ddp { .. } => 2.0 * gbytes,
        Scheme::Zero { stage: 1 } => gbytes + wbytes,
        Scheme::Zero { stage: 2 } => acc * gbytes + wbytes,
        Scheme::Zero { .. }
        | Scheme::Fsdp2 {
            reshard_after_forward: true,
        } => acc * (gbytes + (2.0 + recompute_share) * wbytes),
        Scheme::Fsdp2 { .. } => acc * (gbytes + wbytes),
    } * frac;
    let part = if w.ranks > 1 { trained / n } else { 0.0 };
    let host = match r.offload {
        Offload::None => 0.0,
        // fp32 gradient partition down, 16-bit updated partition up.
        Offload::Optimizer => part * (4.0 + p.compute_dtype().size() as f64),
        Offload::OptimizerAndParams => {
            part * (4.0 + p.compute_dtype().size() as f64)
                + acc * (2.0 + recompute_share) * part * p.compute_dtype().size() as f64
        }
    };
    CommVolume {
        link_bytes: link,
        host_bytes: host,
    }
}

/// Whether the base's sharder and offload can run at ZeRO stage `z` (the planner's search skips
/// the stages that do not exist: FSDP has no stage 1; an offload needs a stage ≥ 1, parameters
/// offload under DeepSpeed stage 3).
pub(crate) fn stage_exists(base: &Spec, z: u8) -> bool {
    let mut s = base.recipe.clone();
    s.zero_stage = z;
    s.gradient_as_bucket_view &= z == 0;
    let mut spec = base.clone();
    spec.recipe = s;
    validate(&spec).is_ok()
}

/// Validate the sharding fields of a recipe against its stage and ranks (the rule is
/// [`crate::sharder::validate`], which the spec's own validation calls).
pub(crate) fn validate(spec: &Spec) -> Result<(), SpecError> {
    let r = &spec.recipe;
    crate::sharder::validate(
        r.zero_stage,
        r.sharder,
        r.offload,
        r.gradient_as_bucket_view,
    )
}

#[cfg(test)]
#[path = "sharding_tests.rs"]
mod tests;
