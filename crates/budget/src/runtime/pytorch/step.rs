//! The `pytorch` step timeline: the three segments simulated under PyTorch's release rule and
//! one optimizer step replayed as the peer (`bench/torch_peer/peer.py`) runs it [CK][OPT] (the
//! rule sources are listed in the folder's `mod.rs`).

use crate::events::{laid_out_microbatches, Breakdown, Event, Events, Phase, StaticBytes};
use crate::params::{ParamRole, ParamTensor};
use crate::runtime::pytorch::allocator::{Live, SegCost};
use crate::runtime::pytorch::device::for_spec;
use crate::runtime::pytorch::families::of_spec as stages;
use crate::runtime::pytorch::sharding::{block_gathers, GatherWalk};
use crate::runtime::pytorch::stages::{Data, StageCost};
use crate::sharding::{rank_states, RankStates, Scheme};
use crate::spec::{Dtype, Optimizer, OptimizerImpl, Spec, TorchDevice};

/// The implementation of `torch.optim.AdamW` a spec runs: its own, else the device's default.
pub(crate) fn optimizer_impl(spec: &Spec) -> OptimizerImpl {
    spec.recipe
        .optimizer_impl
        .unwrap_or(OptimizerImpl::default_for(for_spec(spec).device))
}

/// Bytes of AdamW's `state["step"]` tensors on the step's device [OPT]: a 0-dim fp32 tensor per
/// parameter, hosted on the CPU unless `capturable` or `fused` (`adam.py` `_init_group`: "special
/// device hosting for step"), so none on a GPU with for-loop or foreach.
pub(crate) fn step_tensors(spec: &Spec, trained_tensors: u64) -> u64 {
    let on_device =
        for_spec(spec).device == TorchDevice::Cpu || optimizer_impl(spec) == OptimizerImpl::Fused;
    if spec.recipe.optimizer == Optimizer::Sgd || !on_device {
        0
    } else {
        4 * trained_tensors
    }
}

/// Transient bytes of the optimizer step [OPT], by implementation:
/// - foreach (`_multi_tensor_adam`): `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)` is a
///   new state-sized list over every parameter at once; the rest is in place;
/// - for-loop (`_single_tensor_adam`): `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt)
///   .add_(eps)` holds the square root and the quotient of one parameter at once: twice the
///   largest tensor;
/// - fused (`_fused_adamw_`): none;
/// - SGD without momentum updates in place;
/// - bitsandbytes' 8-bit AdamW (`bnb.optim.AdamW8bit`, what `--use_8bit_adam` builds) updates
///   one parameter at a time, in place: `Optimizer8bit.step` loops over the parameters and
///   `update_step` calls `F.optimizer_update_8bit_blockwise(grad, p, state1, state2, qmap1,
///   qmap2, absmax1, absmax2, …)` (or `optimizer_update_32bit` for tensors under
///   `min_8bit_size`), a kernel that writes `p` and the state where they are; `p.data =
///   p.data.contiguous()` and `p.grad = p.grad.contiguous()` copy nothing for contiguous
///   tensors (bitsandbytes 0.50.1 `optim/optimizer.py` `Optimizer8bit.step`,
///   `Optimizer2State.update_step`): no scratch.
///
/// `state`: the dtype of AdamW's state ([`crate::spec::Recipe::state_dtype`]).
pub(crate) fn optimizer_scratch(
    trained_elems: u64,
    largest: u64,
    state: Dtype,
    optimizer: Optimizer,
    imp: OptimizerImpl,
) -> u64 {
    let sd = state.size();
    match (optimizer, imp) {
        (Optimizer::Sgd, _) | (Optimizer::AdamW8bit, _) => 0,
        (Optimizer::AdamW, OptimizerImpl::Foreach) => trained_elems * sd,
        (Optimizer::AdamW, OptimizerImpl::ForLoop) => 2 * largest * sd,
        (Optimizer::AdamW, OptimizerImpl::Fused) => 0,
    }
}

/// The transient weight a quantized base's Linear dequantizes to, once in its forward and once
/// in its backward (bitsandbytes `MatMul4Bit`: `F.dequantize_4bit(B).to(A.dtype)`; `MatMul8bitLt`
/// backward: `CB * SCB / 127`; fp8 layerwise casting: the upcast copy): the largest block
/// Linear in the compute dtype, 0 without a quantized base.
pub(crate) fn dequant_bytes(spec: &Spec, table: &[ParamTensor]) -> u64 {
    let r = &spec.recipe;
    if r.base_quant.is_none() || r.lora.is_none() {
        return 0;
    }
    table
        .iter()
        .filter(|t| t.role == ParamRole::Frozen && crate::params::quantizable(t))
        .map(|t| t.numel() * r.precision.compute_dtype().size())
        .max()
        .unwrap_or(0)
}

/// The sharded model states of the spec's rank under the `pytorch` runtime (`None`: one rank).
pub(crate) fn rank_states_of(spec: &Spec, table: &[ParamTensor]) -> Option<RankStates> {
    let rt: &dyn crate::runtime::RuntimeModel = for_spec(spec);
    rank_states(spec, table, rt.grad_dtype(spec.recipe.precision))
}

/// The tensors the device optimizer updates (elements each): the trained parameters on one
/// rank, the rank's partition or shards when sharded, none when offloaded.
pub(crate) fn optimizer_tensors(table: &[ParamTensor], rs: Option<&RankStates>) -> Vec<u64> {
    match rs {
        Some(rs) => rs.optimizer_tensors.clone(),
        None => table
            .iter()
            .filter(|t| t.role == ParamRole::Trained)
            .map(|t| t.numel())
            .collect(),
    }
}

/// Bytes of each EMA tensor the update casts (`p.detach().to(ema dtype)`), per rank.
pub(crate) fn ema_update_tensors(spec: &Spec, table: &[ParamTensor]) -> Vec<u64> {
    table
        .iter()
        .filter(|t| t.role == ParamRole::Trained)
        .map(|t| crate::sharding::ema_bytes(spec, t))
        .collect()
}

/// The label of a stage's instance: `"block 3"` for blocks, the stage's name otherwise.
/// Bytes of the CPU generator's state, `torch.get_rng_state()`: a `ByteTensor` of
/// `sizeof(CPUGeneratorImplState)` (`aten/src/ATen/CPUGeneratorImpl.cpp` `get_state`: the
/// legacy `THGeneratorState` — seed, `left`, `seeded`, `next`, the 624 × u64 Mersenne-Twister
/// state, the three cached normal doubles and their flag — then the cached float normal and its
/// flag, 8-aligned). Measured: 5,056 B (family_trace.py, `model > module::model`).
pub(crate) const CPU_RNG_STATE_BYTES: u64 = 5056;

/// Host bytes one checkpointed block holds beside its graph on the CPU, and the same again
/// while it is recomputed: `torch.utils.checkpoint(use_reentrant=False)` with the default
/// `preserve_rng_state=True` stashes `fwd_cpu_state = torch.get_rng_state()` before the block
/// runs (kept by the recompute closure of its `_CheckpointFrame`, which the block's saved-tensor
/// hooks hold until its backward has run), and the recompute runs inside
/// `torch.random.fork_rng`, which saves the current state (`cpu_rng_state =
/// torch.get_rng_state()`) to restore it after (torch 2.15 `utils/checkpoint.py`
/// `_checkpoint_without_reentrant_generator_impl`, `random.py` `fork_rng`). On a GPU both are
/// host tensors (the CUDA generator's state is a CPU `ByteTensor` too), outside the device's
/// memory. family_trace.py, sd3-bf16-lora4w-all: one 5,056 B block per checkpointed block
/// from its forward to the end of its backward, a second during block 0's recompute.
pub(crate) fn checkpoint_rng_bytes(device: TorchDevice) -> u64 {
    match device {
        TorchDevice::Cpu => CPU_RNG_STATE_BYTES,
        TorchDevice::Cuda => 0,
    }
}

fn label(sc: &StageCost, idx: Option<u32>) -> String {
    match idx {
        Some(i) => format!("{} {i}", sc.label),
        None => sc.label.to_string(),
    }
}

fn with(live: Breakdown, seg: Live) -> Breakdown {
    let mut b = live;
    b.activations += seg.activations;
    b.weight_casts += seg.weight_casts;
    b.workspace += seg.workspace;
    b.gradients += seg.gradients;
    b
}

/// Replay one optimizer step as the peer (`bench/torch_peer/peer.py`, `family_peer.py`) runs it:
/// per microbatch the data, the forward under autocast (weight copies cached until it exits)
/// stage by stage, the fp32 loss, `loss.backward()` (each stage's graph released op by op,
/// checkpointed blocks recomputed first [CK]), then `optimizer.step()` [OPT], the EMA update and
/// `zero_grad(set_to_none=True)`.
pub(crate) fn replay(
    spec: &Spec,
    table: &[ParamTensor],
    st: &StaticBytes,
    max_microbatches: u32,
) -> Vec<Event> {
    let rt = for_spec(spec);
    let stages = stages(rt, spec);
    let rs = rank_states_of(spec, table);
    let scheme = Scheme::of(spec);
    let opt = optimizer_tensors(table, rs.as_ref());
    let costs = stages.costs();
    let total_blocks: u32 = costs.iter().filter(|c| c.blocks).map(|c| c.count).sum();
    let gathers = rs.as_ref().filter(|_| scheme.gathers());
    let base = Breakdown {
        weights: st.weights,
        master_weights: st.master_weights,
        optimizer_state: st.optimizer_state + step_tensors(spec, opt.len() as u64),
        ema: st.ema,
        gradients: rs.as_ref().map_or(0, |rs| rs.grad_buffers.iter().sum()),
        ..Breakdown::default()
    };
    let mut s = Replay {
        spec,
        data: stages.data,
        rng: checkpoint_rng_bytes(rt.device),
        dq: dequant_bytes(spec, table),
        keep_grads: rs.as_ref().is_none_or(|rs| rs.keep_full_grads),
        gw: GatherWalk::new(
            gathers
                .map(|rs| block_gathers(rs, total_blocks))
                .unwrap_or_else(|| vec![0; total_blocks as usize]),
            rs.as_ref().map(|rs| rs.prefetch).unwrap_or_default(),
        ),
        reshard_fwd: !matches!(
            scheme,
            Scheme::Fsdp2 {
                reshard_after_forward: false
            }
        ),
        outside: gathers.map_or(0, |rs| rs.gathered_outside),
        bwd_buffers: rs.as_ref().map_or(0, |rs| rs.backward_buffers.iter().sum()),
        partition: rs.as_ref().map_or(0, |rs| rs.grad_partition),
        fwd_order: (0..total_blocks as usize).collect(),
        bwd_order: (0..total_blocks as usize).rev().collect(),
        total_blocks,
        costs,
        live: base,
        ev: Events::default(),
        block: 0,
        grad_out: 0,
        bcast: Vec::new(),
    };
    s.ev.push(Phase::Start, "step start".into(), None, 0, false, base);
    for mb in 0..laid_out_microbatches(spec.workload.accumulation, max_microbatches) {
        s.forward(mb);
        s.backward(mb);
    }
    s.optimizer(table, &opt, rs.as_ref(), base);
    s.ev.0
}

/// One step's replay: what every microbatch reads, and the running state (`live`, the events,
/// the gathers, the block walked).
struct Replay<'a> {
    spec: &'a Spec,
    costs: Vec<StageCost>,
    data: Data,
    /// Bytes of the RNG state a checkpointed block saves.
    rng: u64,
    /// Dequantized weight scratch inside a block.
    dq: u64,
    keep_grads: bool,
    gw: GatherWalk,
    reshard_fwd: bool,
    /// Parameters outside the blocks gathered for the whole pass (sharding.rs).
    outside: u64,
    bwd_buffers: u64,
    partition: u64,
    fwd_order: Vec<usize>,
    bwd_order: Vec<usize>,
    total_blocks: u32,
    live: Breakdown,
    ev: Events,
    /// The block the walk is at.
    block: u32,
    /// The gradient of the stream the current stage produced.
    grad_out: u64,
    /// Broadcast gradients made so far (by name), in `workspace` until the input side's
    /// backward consumes them.
    bcast: Vec<(String, u64)>,
}

/// A stage's backward inside peak: its segment's backward peak above what is live less its own
/// graph, the incoming gradient counted once.
fn back(live: &Breakdown, s: &SegCost, grad_in: u64, first: bool) -> Breakdown {
    let mut at = *live;
    at.activations -= s.kept.activations;
    at.weight_casts -= s.kept.weight_casts;
    at.workspace -= grad_in;
    let mut peak = s.bwd_peak;
    if !first {
        // The new gradient is added into the existing `.grad` and freed.
        peak.workspace += peak.gradients;
        peak.gradients = 0;
    }
    with(at, peak)
}

impl Replay<'_> {
    /// Microbatch `mb`'s forward, stage by stage; autocast exits at its end.
    fn forward(&mut self, mb: u32) {
        let r = &self.spec.recipe;
        self.live.data = self.data.kept + self.data.forward_only;
        self.live.weight_casts += self.outside;
        let mut cache = 0;
        self.block = 0;
        // Output bytes of the instance before the current one (the stream it reads).
        let mut prev_out = 0;
        for (k, sc) in self.costs.iter().enumerate() {
            let c = &sc.cost;
            let last = k + 1 == self.costs.len();
            for _ in 0..sc.count {
                let block = self.block;
                let idx = sc.blocks.then_some(block);
                let ck = sc.blocks && r.recompute.recomputes_block(block);
                let name = label(sc, idx);
                let live = &mut self.live;
                if sc.blocks {
                    for g in self.gw.before(&self.fwd_order, block as usize) {
                        live.weight_casts += self.gw.bytes(g);
                    }
                }
                if ck {
                    live.activations += self.rng;
                }
                let mut inside = with(*live, if ck { c.ckpt_peak } else { c.fwd_peak });
                if sc.blocks {
                    inside.workspace += self.dq;
                }
                let inside_name = format!("{name} (inside)");
                self.ev
                    .push(Phase::Forward, inside_name, idx, mb, true, inside);
                live.activations += c.output;
                if ck {
                    cache += c.ckpt_cache;
                    live.weight_casts += c.ckpt_cache;
                } else {
                    live.activations += c.kept.activations;
                    live.weight_casts += c.kept.weight_casts + c.cache_only;
                    cache += c.cache_only;
                    if k > 0 && !c.input_saved {
                        // Nothing saved the stream it read (a concatenation read it): freed.
                        live.activations -= prev_out;
                    }
                }
                prev_out = c.output;
                if sc.blocks && self.gw.after(block as usize, self.reshard_fwd) {
                    live.weight_casts -= self.gw.bytes(block as usize);
                }
                let done = if last { "loss".to_string() } else { name };
                self.ev.push(Phase::Forward, done, idx, mb, false, *live);
                if sc.blocks {
                    self.block += 1;
                }
            }
        }
        // Autocast exits: copies only the cache held are freed; the forward's data goes.
        self.live.weight_casts -= cache;
        self.live.data = self.data.kept;
    }

    /// Microbatch `mb`'s backward: the stages in reverse, then the backward's buffers go.
    fn backward(&mut self, mb: u32) {
        let first = mb == 0;
        self.bcast.clear();
        self.grad_out = 0;
        // The IPG buffers of a backward, and the gradient partition a sharded step keeps.
        self.live.gradients += self.bwd_buffers;
        if first {
            self.live.gradients += self.partition;
        }
        for k in (0..self.costs.len()).rev() {
            for j in (0..self.costs[k].count).rev() {
                self.backward_instance(mb, k, j);
            }
        }
        // The backward ends: its IPG buffers and the gathers outside the blocks go.
        self.live.gradients -= self.bwd_buffers;
        self.live.weight_casts -= self.outside;
        for b in self.gw.live_blocks() {
            self.live.weight_casts -= self.gw.bytes(b);
        }
        self.gw.clear();
    }

    /// The backward of instance `j` of stage `k` (a checkpointed block recomputed first).
    fn backward_instance(&mut self, mb: u32, k: usize, j: u32) {
        let first = mb == 0;
        let sc = &self.costs[k];
        let c = &sc.cost;
        let last = k + 1 == self.costs.len();
        let idx = sc.blocks.then(|| {
            self.block -= 1;
            self.block
        });
        let block = self.block;
        let ck = sc.blocks && self.spec.recipe.recompute.recomputes_block(block);
        let name = label(sc, idx);
        let live = &mut self.live;
        if sc.blocks {
            let i = self.total_blocks as usize - 1 - block as usize;
            for g in self.gw.before(&self.bwd_order, i) {
                live.weight_casts += self.gw.bytes(g);
            }
        }
        if ck {
            // Recompute under the same autocast state, with the incoming gradient alive.
            let mut at = with(*live, c.recompute_peak);
            at.workspace += self.dq + self.rng;
            let at_name = format!("{name} recompute (inside)");
            self.ev.push(Phase::Backward, at_name, idx, mb, true, at);
            live.activations += c.kept.activations;
            live.weight_casts += c.kept.weight_casts;
        }
        let mut inside = back(live, c, if last { 0 } else { self.grad_out }, first);
        if sc.blocks {
            inside.workspace += self.dq;
        }
        let inside_name = format!("{name} (inside)");
        self.ev
            .push(Phase::Backward, inside_name, idx, mb, true, inside);
        live.activations -= c.kept.activations;
        live.weight_casts -= c.kept.weight_casts;
        if ck {
            live.activations -= self.rng;
        }
        if last {
            // The loss scalar goes with its node.
            live.activations -= c.output;
        }
        if k > 0 && (ck || c.input_saved) {
            // The stream this instance read (the previous instance's output), saved by
            // its first op, goes with that node.
            live.activations -= if j > 0 {
                c.output
            } else {
                self.costs[k - 1].cost.output
            };
        }
        // The gradient of this stage's output is consumed; its inputs' are made.
        if !last {
            live.workspace -= self.grad_out;
        }
        if k > 0 {
            live.workspace += sc.stream_in_grad;
            self.grad_out = sc.stream_in_grad;
        }
        for (n, bytes) in &sc.bcast {
            if !self.bcast.iter().any(|(m, _)| m == n) {
                self.bcast.push((n.clone(), *bytes));
                live.workspace += bytes;
            }
        }
        if first && self.keep_grads {
            live.gradients += c.param_grads;
        }
        if sc.blocks && self.gw.after(block as usize, true) {
            live.weight_casts -= self.gw.bytes(block as usize);
        }
        if k == 0 {
            live.workspace -= self.bcast.iter().map(|(_, b)| b).sum::<u64>();
            live.data = 0;
        }
        self.ev.push(Phase::Backward, name, idx, mb, false, *live);
    }

    /// Optimizer step, EMA, zero_grad.
    fn optimizer(
        &mut self,
        table: &[ParamTensor],
        opt: &[u64],
        rs: Option<&RankStates>,
        base: Breakdown,
    ) {
        let r = &self.spec.recipe;
        let live = self.live;
        if table.iter().any(|t| t.role == ParamRole::Trained) {
            let trained_elems: u64 = opt.iter().sum();
            let largest = opt.iter().copied().max().unwrap_or(0);
            let imp = optimizer_impl(self.spec);
            let mut at = live;
            at.workspace +=
                optimizer_scratch(trained_elems, largest, r.state_dtype(), r.optimizer, imp);
            // DeepSpeed's fp32 gradient partition, made for the update.
            at.workspace += rs.map_or(0, |rs| rs.step_grads);
            let name = format!("{} (inside)", r.optimizer.name());
            self.ev.push(Phase::Optimizer, name, None, 0, true, at);
            if r.ema.enabled && r.ema.dtype != r.precision.param_dtype() {
                // `p.detach().to(ema dtype)` for every parameter before the foreach update.
                let mut at = live;
                at.workspace += ema_update_tensors(self.spec, table).iter().sum::<u64>();
                self.ev
                    .push(Phase::Optimizer, "ema (inside)".into(), None, 0, true, at);
            }
        }
        // zero_grad: what stays are the buffers made at construction (DDP buckets, stage 3's).
        self.live.gradients = base.gradients;
        self.ev.push(
            Phase::Optimizer,
            "step end".into(),
            None,
            0,
            false,
            self.live,
        );
    }
}
