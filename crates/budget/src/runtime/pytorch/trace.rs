//! The allocation sequence of a `pytorch:cuda` step, tensor by tensor: what the CUDA caching
//! allocator (`caching_allocator.rs`) is replayed over to find reserved memory, fragmentation and
//! what `nvidia-smi` shows. It follows the step replay (`step.rs`) instance by instance, with each
//! segment's own allocations and frees (`allocator::simulate_traced`), and lays out what the
//! replay only counts:
//!
//! - the model's tensors as `model.to("cuda")` allocates them, one block per parameter and
//!   buffer, then the EMA copies;
//! - a warm-up step first: AdamW creates `exp_avg` and `exp_avg_sq` lazily at its first
//!   `step()` (`adam.py` `_init_group`), after that step's activations went back to the cache —
//!   so the measured second step starts from the cache the first one left, as a training loop
//!   does (the allocator never returns segments to the driver unless asked);
//! - gradients: made by the first microbatch's backward, added into by the others, freed by
//!   `zero_grad(set_to_none=True)`; the optimizer's scratch by implementation [OPT].
//!
//! Ids are global: every instance of a segment gets its own range.

use crate::params::{stored_bytes_in, ParamRole, ParamTensor};
use crate::precision_rules::trained_state_bytes;
use crate::runtime::pytorch::allocator::{simulate_traced, Ev, SegTrace};
use crate::runtime::pytorch::caching_allocator::AllocEvent;
use crate::runtime::pytorch::device::for_spec;
use crate::runtime::pytorch::families::of_spec as stages;
use crate::runtime::pytorch::sharding::{block_gathers, GatherWalk};
use crate::runtime::pytorch::stages::{broadcast_inputs, grad_in};
use crate::runtime::pytorch::step::{
    ema_update_tensors, optimizer_impl, optimizer_tensors, rank_states_of, step_tensors,
};
use crate::sharding::{RankStates, Scheme};
use crate::spec::{Optimizer, OptimizerImpl, Spec};

/// The sequence being written, with a fresh id range per segment instance.
struct Seq {
    events: Vec<AllocEvent>,
    next: u64,
}

impl Seq {
    fn alloc(&mut self, bytes: u64) -> u64 {
        let id = self.next;
        self.next += 1;
        self.events.push(AllocEvent::Alloc {
            id,
            bytes,
            stream: 0,
        });
        id
    }

    fn free(&mut self, id: u64) {
        self.events.push(AllocEvent::Free { id });
    }

    /// A fresh range for one instance of a segment with `n` tensors (six ids per tensor).
    fn range(&mut self, n: u64) -> u64 {
        let base = self.next;
        self.next += 6 * n.max(1);
        base
    }
}

/// One instance's local ids mapped to global ones; some locals are aliased to ids made
/// elsewhere (the incoming gradient of its outputs, made by the consumer's backward).
struct Instance {
    base: u64,
    alias: Vec<(u64, u64)>,
}

impl Instance {
    fn id(&self, local: u64) -> u64 {
        self.alias
            .iter()
            .find(|(l, _)| *l == local)
            .map_or(self.base + local, |&(_, g)| g)
    }

    fn replay(&self, seq: &mut Seq, evs: &[Ev], skip_alloc: &[u64]) {
        for e in evs {
            match *e {
                Ev::Alloc(l, b) if !skip_alloc.contains(&l) => seq.events.push(AllocEvent::Alloc {
                    id: self.id(l),
                    bytes: b,
                    stream: 0,
                }),
                Ev::Alloc(..) => {}
                Ev::Free(l) => seq.free(self.id(l)),
            }
        }
    }
}

/// Stages with their traces and what links them.
struct Traced {
    trace: SegTrace,
    count: u32,
    blocks: bool,
    input_saved: bool,
    /// Local ids of the stream inputs' gradients (n + t) and of broadcast inputs' (by name).
    stream_grads: Vec<u64>,
    bcast_grads: Vec<(String, u64)>,
    /// Local ids of the gradients of the outputs, in the order of `Segment::outputs`.
    out_grads: Vec<u64>,
    /// Local ids of the broadcast outputs the input side keeps (its extra gradients).
    extra_grad_ids: Vec<u64>,
}

/// The allocation sequence of a warm-up step and a measured step of a spec on the `pytorch`
/// runtime, on one rank of a sharded spec as `runtime/pytorch/sharding.rs` lays it out.
pub(crate) fn allocation_sequence(spec: &Spec, table: &[ParamTensor]) -> Vec<AllocEvent> {
    crate::profile::time(
        crate::profile::Phase::Sequence,
        |e: &Vec<AllocEvent>| e.len() as u64,
        || sequence(spec, table),
    )
}

fn sequence(spec: &Spec, table: &[ParamTensor]) -> Vec<AllocEvent> {
    let rt = for_spec(spec);
    let st = stages(rt, spec);
    let traced: Vec<Traced> = st
        .stages
        .iter()
        .filter(|s| s.count > 0)
        .map(|s| {
            let seg = &s.seg;
            let (cost, trace) = simulate_traced(seg, grad_in(seg), &s.extra_grads);
            let n = seg.tensors.len() as u64;
            let bcast_grads = broadcast_inputs(seg)
                .map(|t| (seg.tensors[t].name.clone(), n + t as u64))
                .collect();
            Traced {
                count: s.count,
                blocks: s.blocks,
                input_saved: cost.input_saved,
                stream_grads: seg.stream_in.iter().map(|&t| n + t as u64).collect(),
                bcast_grads,
                out_grads: seg.outputs().iter().map(|&o| n + o as u64).collect(),
                extra_grad_ids: s.extra_grads.iter().map(|&t| t as u64).collect(),
                trace,
            }
        })
        .collect();
    let mut seq = Seq {
        events: Vec::new(),
        next: 1,
    };
    let r = &spec.recipe;
    // The model on the device, then the EMA copies.
    let trained: Vec<&ParamTensor> = table
        .iter()
        .filter(|t| t.role == ParamRole::Trained)
        .collect();
    let rs = rank_states_of(spec, table);
    match &rs {
        // The rank's model states as its scheme allocates them (sharding.rs): weights, masters,
        // DeepSpeed stage 3's eager optimizer state, gradient buffers made at construction.
        Some(rs) => {
            for &b in rs.weights.iter().chain(&rs.master) {
                seq.alloc(b);
            }
            if rs.eager_optimizer_state {
                for pair in rs.optimizer_state.chunks(2) {
                    seq.alloc(step_tensors(spec, 1));
                    for &b in pair {
                        seq.alloc(b);
                    }
                }
            }
            for &b in &rs.grad_buffers {
                seq.alloc(b);
            }
        }
        None => {
            for t in table {
                seq.alloc(stored_bytes_in(t, r));
            }
        }
    }
    if r.ema.enabled {
        for b in ema_update_tensors(spec, table) {
            seq.alloc(b);
        }
    }
    // The frozen encoders the step runs; the resident ones moved to the device once.
    let encoders = crate::encoders::encoder_runs(spec);
    for e in encoders.iter().filter(|e| e.resident) {
        seq.alloc(e.weight_bytes);
    }
    let mut state: Vec<u64> = Vec::new();
    let blocks: u32 = traced.iter().filter(|t| t.blocks).map(|t| t.count).sum();
    let mut sh = Sharded::new(spec, rs.as_ref(), blocks);
    for warm in [true, false] {
        step(
            spec, &traced, &st.data, &trained, table, &encoders, &mut seq, &mut state, warm,
            &mut sh,
        );
    }
    without_empty(seq.events)
}

/// How many events of [`allocation_sequence`] load the model (its tensors, then the EMA
/// copies) before the warm-up step begins: a memory snapshot recorded from the first step on
/// starts where these end.
pub(crate) fn setup_allocations(spec: &Spec, table: &[ParamTensor]) -> usize {
    let r = &spec.recipe;
    let weights = table.iter().filter(|t| stored_bytes_in(t, r) > 0).count();
    let ema = if r.ema.enabled {
        table
            .iter()
            .filter(|t| t.role == ParamRole::Trained && t.numel() * r.ema.dtype.size() > 0)
            .count()
    } else {
        0
    };
    weights + ema
}

/// Drop zero-byte allocations and their frees (PyTorch's allocator returns no block for them).
/// Ids are numbered from 1 up by [`Seq`], so their state is kept in a vector by id: whether
/// the id is ever allocated empty, whether it is allocated now.
fn without_empty(events: Vec<AllocEvent>) -> Vec<AllocEvent> {
    const EMPTY: u8 = 1;
    const ALLOCATED: u8 = 2;
    let top = events
        .iter()
        .map(|e| match *e {
            AllocEvent::Alloc { id, .. } | AllocEvent::Free { id } => id,
        })
        .max()
        .unwrap_or(0);
    let mut state = vec![0u8; usize::try_from(top).map_or(0, |t| t.saturating_add(1))];
    for e in &events {
        if let AllocEvent::Alloc { id, bytes: 0, .. } = *e {
            state[id as usize] |= EMPTY;
        }
    }
    events
        .into_iter()
        .filter(|e| match *e {
            AllocEvent::Alloc { id, bytes, .. } => {
                let s = &mut state[id as usize];
                let keep = bytes > 0 && *s & ALLOCATED == 0;
                if keep {
                    *s |= ALLOCATED;
                }
                keep
            }
            AllocEvent::Free { id } => {
                let s = &mut state[id as usize];
                // (Never emptied: an id ever allocated empty keeps its state.)
                let keep = *s & EMPTY == 0 && *s & ALLOCATED != 0;
                if keep {
                    *s &= !ALLOCATED;
                }
                keep
            }
        })
        .collect()
}

/// A quantized base's dequantized weight, made and dropped inside a block's forward or backward.
fn dequant(seq: &mut Seq, bytes: u64) {
    if bytes > 0 {
        let id = seq.alloc(bytes);
        seq.free(id);
    }
}

/// What a sharded rank adds to the sequence (`sharding.rs`): gathers, IPG buffers, the
/// gradient partition, the optimizer's own tensors.
struct Sharded {
    rs: Option<RankStates>,
    gw: GatherWalk,
    /// The id of each block's live gather.
    gather_ids: Vec<u64>,
    reshard_fwd: bool,
    outside: u64,
    keep_grads: bool,
    blocks: usize,
}

impl Sharded {
    fn new(spec: &Spec, rs: Option<&RankStates>, blocks: u32) -> Sharded {
        let scheme = Scheme::of(spec);
        let gathers = rs.filter(|_| scheme.gathers());
        Sharded {
            gw: GatherWalk::new(
                gathers
                    .map(|rs| block_gathers(rs, blocks))
                    .unwrap_or_else(|| vec![0; blocks as usize]),
                rs.map(|rs| rs.prefetch).unwrap_or_default(),
            ),
            gather_ids: vec![0; blocks as usize],
            reshard_fwd: !matches!(
                scheme,
                Scheme::Fsdp2 {
                    reshard_after_forward: false
                }
            ),
            outside: gathers.map_or(0, |rs| rs.gathered_outside),
            keep_grads: rs.is_none_or(|rs| rs.keep_full_grads),
            rs: rs.cloned(),
            blocks: blocks as usize,
        }
    }

    /// Gather block `order[i]` and its prefetch window.
    fn before(&mut self, seq: &mut Seq, forward: bool, b: usize) {
        let order: Vec<usize> = if forward {
            (0..self.blocks).collect()
        } else {
            (0..self.blocks).rev().collect()
        };
        let i = order.iter().position(|&x| x == b).unwrap_or(0);
        for g in self.gw.before(&order, i) {
            self.gather_ids[g] = seq.alloc(self.gw.bytes(g));
        }
    }

    fn after(&mut self, seq: &mut Seq, b: usize, reshard: bool) {
        if self.gw.after(b, reshard) {
            seq.free(self.gather_ids[b]);
        }
    }

    /// The backward ended: free every gather still live.
    fn end_backward(&mut self, seq: &mut Seq) {
        for b in self.gw.live_blocks() {
            seq.free(self.gather_ids[b]);
        }
        self.gw.clear();
    }
}

/// One optimizer step: every microbatch's forward and backward, the optimizer, EMA, zero_grad.
#[allow(clippy::too_many_arguments)]
fn step(
    spec: &Spec,
    traced: &[Traced],
    data: &crate::runtime::pytorch::stages::Data,
    trained: &[&ParamTensor],
    table: &[ParamTensor],
    encoders: &[crate::encoders::EncoderRun],
    seq: &mut Seq,
    state: &mut Vec<u64>,
    warm: bool,
    sh: &mut Sharded,
) {
    let dq = crate::runtime::pytorch::step::dequant_bytes(spec, table);
    let mut param_grads: Vec<u64> = Vec::new();
    let microbatches = spec.workload.accumulation.clamp(1, 2);
    for mb in 0..microbatches {
        // Each encoder's no-grad forward (an offloaded one's weights with it), one after
        // another; what they return is the data below.
        for e in encoders {
            let id = seq.alloc(e.while_encoding());
            seq.free(id);
        }
        let kept = seq.alloc(data.kept);
        let fwd_data = seq.alloc(data.forward_only);
        let outside = seq.alloc(sh.outside);
        let mut inst = forward(spec, traced, dq, seq, sh);
        // Autocast exits; the forward's data goes.
        seq.free(fwd_data);
        backward(traced, dq, seq, sh, &mut inst, mb, &mut param_grads);
        seq.free(outside);
        sh.end_backward(seq);
        seq.free(kept);
    }
    optimizer_step(spec, table, trained, seq, state, warm, sh, param_grads);
}

/// An instance of a stage in the forward: stage, index, ids, checkpointed.
type Inst = (usize, u32, Instance, bool);

/// One microbatch's forward: one instance per block, ids kept for its backward; the copies
/// only autocast's cache held are freed when it exits.
fn forward(spec: &Spec, traced: &[Traced], dq: u64, seq: &mut Seq, sh: &mut Sharded) -> Vec<Inst> {
    let r = &spec.recipe;
    // Forward: one instance per block, ids kept for its backward.
    let mut inst: Vec<Inst> = Vec::new();
    let mut cache: Vec<u64> = Vec::new();
    let mut block = 0u32;
    let mut prev_outs: Vec<u64> = Vec::new();
    for (k, tr) in traced.iter().enumerate() {
        for j in 0..tr.count {
            let ck = tr.blocks && r.recompute.recomputes_block(block);
            if tr.blocks {
                sh.before(seq, true, block as usize);
                dequant(seq, dq);
            }
            let i = Instance {
                base: seq.range(tr.trace.n),
                alias: Vec::new(),
            };
            i.replay(seq, if ck { &tr.trace.ckpt } else { &tr.trace.fwd }, &[]);
            let left = if ck {
                &tr.trace.ckpt_left
            } else {
                &tr.trace.cache_only
            };
            cache.extend(left.iter().map(|&l| i.id(l)));
            if k > 0 && !ck && !tr.input_saved {
                for id in prev_outs.drain(..) {
                    seq.free(id);
                }
            }
            prev_outs = tr.trace.outputs.iter().map(|&l| i.id(l)).collect();
            inst.push((k, j, i, ck));
            if tr.blocks {
                let reshard = sh.reshard_fwd;
                sh.after(seq, block as usize, reshard);
                block += 1;
            }
        }
    }
    // Autocast exits.
    for id in cache {
        seq.free(id);
    }
    inst
}

/// One microbatch's backward, the instances in reverse: the loss's gradient first, the IPG
/// buffers of this backward and the step's gradient partition, each node's recompute, gradients
/// and releases (one node's replay order kept here whole; only the recompute and the buffers
/// are steps of their own).
fn backward(
    traced: &[Traced],
    dq: u64,
    seq: &mut Seq,
    sh: &mut Sharded,
    inst: &mut Vec<Inst>,
    mb: u32,
    param_grads: &mut Vec<u64>,
) {
    // The block count the forward walked to.
    let mut block = inst.iter().filter(|x| traced[x.0].blocks).count() as u32;
    let mut incoming: Vec<u64> = vec![seq.alloc(4)];
    let ipg = backward_buffers(seq, sh, mb, param_grads);
    let mut bcast: Vec<(String, u64)> = Vec::new();
    let mut outs_of: Vec<Vec<u64>> = inst
        .iter()
        .map(|(k, _, i, _)| traced[*k].trace.outputs.iter().map(|&l| i.id(l)).collect())
        .collect();
    while let Some((k, _j, fwd, ck)) = inst.pop() {
        let tr = &traced[k];
        if tr.blocks {
            block -= 1;
            sh.before(seq, false, block as usize);
            dequant(seq, dq);
        }
        let mut i = if ck { recompute(tr, seq) } else { fwd };
        i.alias = tr
            .out_grads
            .iter()
            .copied()
            .zip(incoming.iter().copied())
            .collect();
        // Broadcast inputs' gradients: the first consumer's is the accumulator.
        let mut fresh: Vec<u64> = Vec::new();
        for (name, l) in &tr.bcast_grads {
            if !bcast.iter().any(|(n, _)| n == name) {
                bcast.push((name.clone(), i.id(*l)));
            } else {
                fresh.push(i.id(*l));
            }
        }
        // The input side's broadcast outputs receive gradients from outside: never its own.
        let skip: Vec<u64> = tr.extra_grad_ids.iter().map(|&t| tr.trace.n + t).collect();
        i.replay(seq, &tr.trace.bwd, &skip);
        for id in fresh {
            seq.free(id);
        }
        // Gradients of the parameters: kept from the first microbatch, added in after.
        for &l in &tr.trace.param_grads {
            if mb == 0 && sh.keep_grads {
                param_grads.push(i.id(l));
            } else {
                seq.free(i.id(l));
            }
        }
        let idx = outs_of.len() - 1;
        outs_of.pop();
        // The stream this instance read goes with its node (if it was saved).
        if idx > 0 && (ck || tr.input_saved) {
            for id in outs_of[idx - 1].clone() {
                seq.free(id);
            }
        }
        if k == traced.len() - 1 {
            // The loss scalar.
            for &l in &tr.trace.outputs {
                seq.free(i.id(l));
            }
        }
        if tr.blocks {
            sh.after(seq, block as usize, true);
        }
        incoming = tr.stream_grads.iter().map(|&l| i.id(l)).collect();
        if k == 0 {
            for (_, id) in bcast.drain(..) {
                seq.free(id);
            }
            for id in incoming.drain(..) {
                seq.free(id);
            }
        }
    }
    for id in ipg {
        seq.free(id);
    }
}

/// The IPG buffers of one backward (returned, freed when it ends), and on the first microbatch
/// the step's gradient partition (kept with the parameter gradients).
fn backward_buffers(seq: &mut Seq, sh: &Sharded, mb: u32, param_grads: &mut Vec<u64>) -> Vec<u64> {
    let ipg: Vec<u64> = sh
        .rs
        .as_ref()
        .map(|rs| rs.backward_buffers.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|b| seq.alloc(b))
        .collect();
    if mb == 0 {
        if let Some(rs) = &sh.rs {
            param_grads.push(seq.alloc(rs.grad_partition));
        }
    }
    ipg
}

/// A checkpointed node's recompute: a tracked forward of its own, under the same autocast
/// state, whose instance the node's backward then reads.
fn recompute(tr: &Traced, seq: &mut Seq) -> Instance {
    let re = Instance {
        base: seq.range(tr.trace.n),
        alias: Vec::new(),
    };
    // The recomputed outputs are dropped (the first forward's are the ones kept).
    re.replay(seq, &tr.trace.fwd, &[]);
    // The checkpoint's autocast region ends with the recompute: copies only its cache held go.
    for &l in tr.trace.outputs.iter().chain(&tr.trace.cache_only) {
        seq.free(re.id(l));
    }
    re
}

/// optimizer.step(), EMA, then zero_grad frees the parameter gradients.
#[allow(clippy::too_many_arguments)]
fn optimizer_step(
    spec: &Spec,
    table: &[ParamTensor],
    trained: &[&ParamTensor],
    seq: &mut Seq,
    state: &mut Vec<u64>,
    warm: bool,
    sh: &mut Sharded,
    param_grads: Vec<u64>,
) {
    let r = &spec.recipe;
    // optimizer.step(): state created at the first step (at construction under DeepSpeed
    // stage 3); DeepSpeed's fp32 gradient partition; the implementation's scratch.
    let sgd = r.optimizer == Optimizer::Sgd;
    let opt = optimizer_tensors(table, sh.rs.as_ref());
    if warm && !sgd {
        // `_init_group`: step (on the device only when fused or capturable), exp_avg, exp_avg_sq.
        let step_bytes = step_tensors(spec, 1);
        match &sh.rs {
            Some(rs) if rs.eager_optimizer_state => {}
            Some(rs) => {
                for pair in rs.optimizer_state.chunks(2) {
                    if step_bytes > 0 {
                        state.push(seq.alloc(step_bytes));
                    }
                    for &b in pair {
                        state.push(seq.alloc(b));
                    }
                }
            }
            None => {
                for t in trained {
                    let b = trained_state_bytes(t.numel(), r) / 2;
                    if step_bytes > 0 {
                        state.push(seq.alloc(step_bytes));
                    }
                    // Paged: the 8-bit buffers live in managed memory, outside the allocator;
                    // their absmax tensors stay in it.
                    let b = b - paged_state_bytes(spec, t.numel()) / 2;
                    state.push(seq.alloc(b));
                    state.push(seq.alloc(b));
                }
            }
        }
    }
    let step_grads = seq.alloc(sh.rs.as_ref().map_or(0, |rs| rs.step_grads));
    if !sgd {
        let sd = r.state_dtype().size();
        match (r.optimizer, optimizer_impl(spec)) {
            (Optimizer::AdamW, OptimizerImpl::ForLoop) => {
                for &n in &opt {
                    let a = seq.alloc(n * sd);
                    let b = seq.alloc(n * sd);
                    seq.free(a);
                    seq.free(b);
                }
            }
            // In place, one parameter at a time (`step::optimizer_scratch`).
            (Optimizer::AdamW, OptimizerImpl::Fused) | (Optimizer::AdamW8bit, _) => {}
            _ => {
                let ids: Vec<u64> = opt.iter().map(|&n| seq.alloc(n * sd)).collect();
                for id in ids {
                    seq.free(id);
                }
            }
        }
    }
    seq.free(step_grads);
    if r.ema.enabled && r.ema.dtype != r.precision.param_dtype() {
        let ids: Vec<u64> = ema_update_tensors(spec, table)
            .into_iter()
            .map(|b| seq.alloc(b))
            .collect();
        for id in ids {
            seq.free(id);
        }
    }
    for id in param_grads {
        seq.free(id);
    }
}

/// Tensors below this keep their paged optimizer's state in ordinary device tensors
/// (bitsandbytes `optim/optimizer.py` `get_state_buffer`: `p.numel() < 1e5`).
pub(crate) const PAGED_MIN_NUMEL: u64 = 100_000;

/// Bytes of one trained tensor's optimizer state that a paged optimizer keeps in CUDA managed
/// memory: its two 8-bit buffers (`state1`, `state2`), when it is large enough to be paged.
pub(crate) fn paged_state_bytes(spec: &Spec, numel: u64) -> u64 {
    let r = &spec.recipe;
    if !r.paged_optimizer
        || r.optimizer != Optimizer::AdamW8bit
        || numel < PAGED_MIN_NUMEL
        || numel < crate::timeline::ADAM8BIT_MIN_SIZE
    {
        return 0;
    }
    2 * numel
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::estimate::estimate;
    use crate::runtime::pytorch::caching_allocator::{
        simulate_allocator, AllocConf, AllocatorReport,
    };
    use crate::spec::{AttentionMode, ModelSpec, Precision, Recompute};

    /// The sequence is the step timeline tensor by tensor: its peak of requested bytes is the
    /// timeline's peak, over precisions, recompute policies, attention modes, accumulation,
    /// optimizer implementations and EMA.
    #[test]
    fn the_sequence_peaks_where_the_timeline_does() {
        let mut base = Spec::default_xl();
        base.model = ModelSpec::preset("dit-s-2").unwrap();
        base.workload.batch = 8;
        base.workload.microbatch = 8;
        base.runtime = "pytorch:cuda".parse().unwrap();
        let mut specs = Vec::new();
        for p in [Precision::Fp32, Precision::Bf16Mixed, Precision::Fp16Mixed] {
            for rc in [Recompute::None, Recompute::All, Recompute::EveryK(3)] {
                for at in [AttentionMode::Materialized, AttentionMode::MemoryEfficient] {
                    let mut s = base.clone();
                    s.recipe.precision = p;
                    s.recipe.recompute = rc.clone();
                    s.recipe.attention = at;
                    specs.push(s);
                }
            }
        }
        let mut s = base.clone();
        s.workload.microbatch = 4;
        s.workload.accumulation = 2;
        specs.push(s);
        for imp in OptimizerImpl::ALL {
            let mut s = base.clone();
            s.recipe.optimizer_impl = Some(imp);
            s.recipe.ema.enabled = false;
            specs.push(s);
        }
        for s in specs {
            let (table, seq, r) = sequence_at_timeline_peak(&s);
            assert_eq!(
                left(&seq),
                state_bytes(&s, &table),
                "only the model state stays"
            );
            assert!(r.max_reserved >= r.max_allocated && r.max_allocated >= r.max_requested);
        }
    }

    /// The same over the sharded schemes: DDP (with and without bucket views), ZeRO-1/2/3 and
    /// FSDP2 (with and without resharding after forward), offload, recompute, accumulation.
    #[test]
    fn sharded_sequences_peak_where_the_timeline_does() {
        use crate::sharding::{Offload, Sharder};
        let mut base = Spec::default_xl();
        base.model = ModelSpec::preset("dit-s-2").unwrap();
        base.runtime = "pytorch:cuda".parse().unwrap();
        base.workload.ranks = 8;
        base.workload.microbatch = 4;
        base.workload.batch = 32;
        let mut specs = Vec::new();
        for view in [false, true] {
            let mut s = base.clone();
            s.recipe.gradient_as_bucket_view = view;
            specs.push(s);
        }
        for (z, sharder, offload) in [
            (1, Sharder::Deepspeed, Offload::None),
            (2, Sharder::Deepspeed, Offload::None),
            (3, Sharder::Deepspeed, Offload::None),
            (2, Sharder::Deepspeed, Offload::Optimizer),
            (3, Sharder::Deepspeed, Offload::OptimizerAndParams),
            (2, Sharder::Fsdp, Offload::None),
            (3, Sharder::Fsdp, Offload::None),
            (3, Sharder::Fsdp, Offload::OptimizerAndParams),
        ] {
            for rc in [Recompute::None, Recompute::EveryK(2)] {
                for p in [Precision::Bf16Mixed, Precision::Fp32] {
                    let mut s = base.clone();
                    s.recipe.zero_stage = z;
                    s.recipe.sharder = sharder;
                    s.recipe.offload = offload;
                    s.recipe.recompute = rc.clone();
                    s.recipe.precision = p;
                    specs.push(s);
                }
            }
        }
        let mut s = specs[4].clone();
        s.workload.microbatch = 2;
        s.workload.accumulation = 2;
        specs.push(s);
        for s in specs {
            s.validate().unwrap();
            sequence_at_timeline_peak(&s);
        }
    }

    /// The parameter table and allocation sequence of `s`, and the sequence replayed by the
    /// default caching allocator, whose peak of requested bytes must be the timeline's.
    fn sequence_at_timeline_peak(s: &Spec) -> (Vec<ParamTensor>, Vec<AllocEvent>, AllocatorReport) {
        let b = estimate(s).unwrap();
        let table = crate::denoiser::param_table(s);
        let seq = allocation_sequence(s, &table);
        let r = simulate_allocator(&seq, &AllocConf::default(), None).unwrap();
        assert_eq!(
            r.max_requested, b.peak_bytes,
            "{:?} acc {}: sequence {} vs timeline {} ({})",
            s.recipe, s.workload.accumulation, r.max_requested, b.peak_bytes, b.peak.label
        );
        (table, seq, r)
    }

    /// Requested bytes never freed.
    fn left(seq: &[AllocEvent]) -> u64 {
        let mut alive = std::collections::HashMap::new();
        for e in seq {
            match *e {
                AllocEvent::Alloc { id, bytes, .. } => {
                    alive.insert(id, bytes);
                }
                AllocEvent::Free { id } => {
                    alive.remove(&id);
                }
            }
        }
        alive.values().sum()
    }

    /// Bytes the model state holds between steps: weights, EMA, optimizer state.
    fn state_bytes(s: &Spec, table: &[ParamTensor]) -> u64 {
        let trained = table
            .iter()
            .filter(|t| t.role == ParamRole::Trained)
            .count() as u64;
        let mut total = step_tensors(s, trained);
        for t in table {
            total += stored_bytes_in(t, &s.recipe);
            if t.role == ParamRole::Trained {
                if s.recipe.ema.enabled {
                    total += t.numel() * s.recipe.ema.dtype.size();
                }
                total += trained_state_bytes(t.numel(), &s.recipe);
            }
        }
        total
    }
}
