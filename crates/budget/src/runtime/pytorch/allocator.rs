//! PyTorch's memory over one segment: the release rule of autograd's saved tensors [AG] as one
//! simulator (tracked, checkpointed and backward passes), and the CUDA caching allocator's
//! rounding [CUDA] (the rule sources are listed in the folder's `mod.rs`).

use serde::Serialize;

use crate::runtime::pytorch::rules::{CACHED, GRAD_VIEWS, LEFT_UNSAVED, MATMUL, SAVED};
use crate::segment::{Segment, TensorKind, TensorRole, Tid};

/// Bytes by kind inside one segment's simulation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Live {
    /// Saved activations (and the segment's output while it is alive).
    pub activations: u64,
    /// Autocast weight copies.
    pub weight_casts: u64,
    /// In-flight gradients and op scratch.
    pub workspace: u64,
    /// New parameter gradients (the `.grad` buffers this segment creates).
    pub gradients: u64,
}

impl Live {
    pub(crate) fn total(&self) -> u64 {
        self.activations + self.weight_casts + self.workspace + self.gradients
    }
}

/// What one segment costs under PyTorch's rules.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub(crate) struct SegCost {
    /// The output storage (the next segment's input).
    pub output: u64,
    /// Saved by the tracked graph after the forward (output and inputs excluded).
    pub kept: Live,
    /// Autocast copies that only the cache holds: alive until the forward's autocast exits.
    pub cache_only: u64,
    /// Highest bytes above the start of a tracked forward (output included).
    pub fwd_peak: Live,
    /// Highest bytes above the start of a checkpointed forward (nothing saved; weight copies
    /// held by the autocast cache), output included.
    pub ckpt_peak: Live,
    /// Highest bytes above the start of a checkpoint's recompute: the tracked forward up to the
    /// pack of the last saved tensor ([`Segment::last_pack`]), where
    /// `torch.utils.checkpoint(use_reentrant=False)` stops it (early stop, on by default:
    /// `_StopRecomputationError` once every saved tensor is recomputed, torch 2.15
    /// `utils/checkpoint.py`); the whole tracked forward where that op is not known.
    pub recompute_peak: Live,
    /// Weight copies a checkpointed forward leaves in the autocast cache.
    pub ckpt_cache: u64,
    /// Worst moment of the backward, segment-local: what is left of the graph, the incoming
    /// gradient, in-flight gradients, scratch and the new parameter gradients.
    pub bwd_peak: Live,
    /// Gradients of the segment's inputs at the end of its backward.
    pub input_grads: u64,
    /// Parameter gradients the segment creates.
    pub param_grads: u64,
    /// Whether the tracked forward saves a stream input (the first norm saves the residual):
    /// otherwise the previous segment's output is freed once this segment has read it.
    pub input_saved: bool,
}

/// Simulate one segment: forward (tracked and checkpointed) and backward with PyTorch's
/// release rule — a saved storage is freed once the earliest op reading it has run its backward
/// (a matmul marked [`LEFT_UNSAVED`] does not hold its left operand), gradients are freed once
/// consumed [AG]. A second gradient reaching a tensor is added into the first
/// (`torch/csrc/autograd/input_buffer.cpp` `accumulate`): in place (`old_var.add_(var)`) only
/// when `can_accumulate_inplace(old_var)`, otherwise out of place (`old_var + var`: the sum is
/// allocated while both live). A first gradient made by a matmul (marked [`MATMUL`] or
/// [`LEFT_UNSAVED`]) is the reshape view of its 2-D result and is summed out of place; the sum
/// is a plain tensor, so later gradients add into it in place. `bench/torch_peer` measured it:
/// `family_trace.py` on dit-fp32-lora8ff-all (the GELU output's gradients from `ff.net.2`'s
/// lora_A and base: `ViewBackward0 > aten::add` allocates 262,144 B with both alive) and the
/// two-linear probe of `runs/2026-12-06-epyc-lora-ff/` (3-D input: `aten::add` 262,144 B; 2-D
/// input: `aten::add_`, nothing allocated). `extra_grads` are tensors other than the output that
/// receive a gradient from outside (the conditioning vector c of the embed segment).
pub(crate) fn simulate(seg: &Segment, grad_in: u64, extra_grads: &[Tid]) -> SegCost {
    simulate_traced(seg, grad_in, extra_grads).0
}

/// One allocation event of a segment's simulation, by a segment-local id (see [`SegTrace`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ev {
    Alloc(u64, u64),
    Free(u64),
}

/// The allocations and frees of one segment, tensor by tensor, in the order [`simulate`] walks
/// them: what the CUDA caching allocator is replayed over (`trace.rs`). Local ids for a segment
/// of n tensors: t (< n) a tensor's storage, n + t its gradient, 2n + k the bytes op k keeps
/// beside its output, 3n + k op k's forward scratch, 4n + k its backward scratch, 5n + k the
/// gradient op k's backward makes to add into an existing one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SegTrace {
    /// Tensors in the segment.
    pub n: u64,
    pub fwd: Vec<Ev>,
    pub ckpt: Vec<Ev>,
    pub bwd: Vec<Ev>,
    /// Storages a tracked forward leaves that only the autocast cache holds.
    pub cache_only: Vec<u64>,
    /// Storages a checkpointed forward leaves (autocast-cached weight copies).
    pub ckpt_left: Vec<u64>,
    /// Gradients of trained parameters the backward makes.
    pub param_grads: Vec<u64>,
    /// Output storages (allocated by the forward, freed by the next segment's backward).
    pub outputs: Vec<u64>,
}

/// [`simulate`] with the allocation events it walks: the segment's facts, the two forwards,
/// then the backward.
pub(crate) fn simulate_traced(
    seg: &Segment,
    grad_in: u64,
    extra_grads: &[Tid],
) -> (SegCost, SegTrace) {
    let f = Facts::new(seg);
    let mut trace = SegTrace {
        n: f.nn,
        outputs: f.out_sts.iter().map(|&s| s as u64).collect(),
        ..SegTrace::default()
    };
    let mut cost = SegCost {
        output: f
            .out_sts
            .iter()
            .filter(|&&s| f.is_alloc(s))
            .map(|&s| f.bytes(s))
            .sum(),
        // An input is marked where an op saves it (it is no op's output).
        input_saved: seg
            .stream_in
            .iter()
            .any(|&t| f.saved[f.storage(t)] || seg.tensors[t].name.ends_with(SAVED)),
        ..SegCost::default()
    };
    // Forward, tracked (saved storages stay) and checkpointed (only the cache holds anything).
    f.forward(true, &mut cost, &mut trace);
    f.forward(false, &mut cost, &mut trace);
    f.backward(grad_in, extra_grads, &mut cost, &mut trace);
    (cost, trace)
}

/// What every pass over one segment reads: each tensor's storage, who saves, caches and reads it.
struct Facts<'a> {
    seg: &'a Segment,
    n: usize,
    nn: u64,
    outs: Vec<Tid>,
    /// The outputs' storages, sorted, without repeats.
    out_sts: Vec<Tid>,
    saved: Vec<bool>,
    cached: Vec<bool>,
    last_read: Vec<Option<usize>>,
    first_read: Vec<Option<usize>>,
}

/// Raise `peak` to `cur` plus `scratch` of workspace where that is higher.
fn max_live(peak: &mut Live, cur: Live, scratch: u64) {
    let mut c = cur;
    c.workspace += scratch;
    if c.total() > peak.total() {
        *peak = c;
    }
}

impl<'a> Facts<'a> {
    fn new(seg: &'a Segment) -> Self {
        let n = seg.tensors.len();
        let mut f = Facts {
            seg,
            n,
            nn: n as u64,
            outs: seg.outputs(),
            out_sts: Vec::new(),
            saved: vec![false; n],
            cached: vec![false; n],
            last_read: vec![None; n],
            first_read: vec![None; n],
        };
        let mut out_sts: Vec<Tid> = f.outs.iter().map(|&o| f.storage(o)).collect();
        out_sts.sort_unstable();
        out_sts.dedup();
        f.out_sts = out_sts;
        for (k, op) in seg.ops.iter().enumerate() {
            let t = op.output;
            if seg.tensors[t].name.ends_with(SAVED) {
                let s = f.storage(t);
                f.saved[s] = true;
            }
            if seg.tensors[t].name.ends_with(CACHED) {
                let s = f.storage(t);
                f.cached[s] = true;
            }
            // A matmul with a frozen weight keeps no reference to its left operand [AG].
            let unsaved_left = op.name.ends_with(LEFT_UNSAVED);
            for (j, &i) in op.inputs.iter().enumerate() {
                let s = f.storage(i);
                f.last_read[s] = Some(f.last_read[s].map_or(k, |l| l.max(k)));
                if !(unsaved_left && j == 0) {
                    f.first_read[s] = Some(f.first_read[s].map_or(k, |x| x.min(k)));
                }
            }
        }
        f
    }

    /// The tensor owning `t`'s storage (a view's base, followed through views).
    fn storage(&self, mut t: Tid) -> Tid {
        while self.seg.tensors[t].kind == TensorKind::View {
            match self.seg.ops.iter().find(|o| o.output == t) {
                Some(op) => t = op.inputs[0],
                None => break,
            }
        }
        t
    }

    fn is_out(&self, s: Tid) -> bool {
        self.out_sts.contains(&s)
    }

    fn is_alloc(&self, t: Tid) -> bool {
        self.seg.tensors[t].kind == TensorKind::Alloc
    }

    fn is_cast(&self, t: Tid) -> bool {
        self.seg.tensors[t].role == TensorRole::WeightCast
    }

    fn bytes(&self, t: Tid) -> u64 {
        self.seg.tensors[t].bytes()
    }

    /// Add (`sign`) or take away `t`'s bytes from its kind in `l`.
    fn add(&self, l: &mut Live, t: Tid, sign: bool) {
        let slot = if self.is_cast(t) {
            &mut l.weight_casts
        } else {
            &mut l.activations
        };
        if sign {
            *slot += self.bytes(t);
        } else {
            *slot -= self.bytes(t);
        }
    }

    /// One forward, tracked (saved storages stay) or checkpointed: its events, peak and what it
    /// leaves.
    fn forward(&self, tracked: bool, cost: &mut SegCost, trace: &mut SegTrace) {
        let (n, nn, seg) = (self.n, self.nn, self.seg);
        let mut live = Live::default();
        let mut peak = Live::default();
        let mut alive = vec![false; n];
        let mut evs = Vec::new();
        for (k, op) in seg.ops.iter().enumerate() {
            let t = op.output;
            let kk = k as u64;
            if tracked && seg.last_pack == Some(k) {
                // The node packs its saved inputs before the op allocates its output.
                cost.recompute_peak = peak;
            }
            if self.is_alloc(t) {
                self.add(&mut live, t, true);
                alive[t] = true;
                evs.push(Ev::Alloc(t as u64, self.bytes(t)));
            }
            if tracked {
                live.activations += op.extra_saved;
                if op.extra_saved > 0 {
                    evs.push(Ev::Alloc(2 * nn + kk, op.extra_saved));
                }
            }
            max_live(&mut peak, live, op.fwd_scratch);
            if op.fwd_scratch > 0 {
                evs.push(Ev::Alloc(3 * nn + kk, op.fwd_scratch));
                evs.push(Ev::Free(3 * nn + kk));
            }
            for (s, a) in alive.iter_mut().enumerate() {
                if *a && !self.is_out(s) && self.last_read[s].unwrap_or(k) <= k {
                    let keep = (tracked && self.saved[s])
                        || (self.is_cast(s) && (self.saved[s] || self.cached[s]));
                    if !keep {
                        self.add(&mut live, s, false);
                        *a = false;
                        evs.push(Ev::Free(s as u64));
                    }
                }
            }
        }
        let left = |s: Tid| alive[s] && !self.is_out(s);
        if tracked {
            trace.fwd = evs;
            trace.cache_only = (0..n)
                .filter(|&s| left(s) && self.cached[s] && !self.saved[s])
                .map(|s| s as u64)
                .collect();
            cost.fwd_peak = peak;
            if seg.last_pack.is_none_or(|k| k >= seg.ops.len()) {
                cost.recompute_peak = peak;
            }
            for s in (0..n).filter(|&s| left(s)) {
                if self.cached[s] && !self.saved[s] {
                    cost.cache_only += self.bytes(s);
                } else {
                    self.add(&mut cost.kept, s, true);
                }
            }
            cost.kept.activations += seg.ops.iter().map(|o| o.extra_saved).sum::<u64>();
        } else {
            trace.ckpt = evs;
            trace.ckpt_left = (0..n).filter(|&s| left(s)).map(|s| s as u64).collect();
            cost.ckpt_peak = peak;
            cost.ckpt_cache = (0..n).filter(|&s| left(s)).map(|s| self.bytes(s)).sum();
        }
    }

    /// The backward over the kept graph, node by node in reverse op order.
    fn backward(
        &self,
        grad_in: u64,
        extra_grads: &[Tid],
        cost: &mut SegCost,
        trace: &mut SegTrace,
    ) {
        let (n, seg) = (self.n, self.seg);
        let mut b = Bwd {
            live: cost.kept,
            peak: Live::default(),
            held: (0..n)
                .map(|s| self.is_alloc(s) && !self.is_out(s) && self.saved[s])
                .collect(),
            grad: vec![false; n],
            grad_mm_view: vec![false; n],
            pending_sum: None,
            grad_out_pending: true,
            side_grads: self.outs[1..].iter().map(|&o| self.bytes(o)).sum(),
            view_of: vec![None; n],
            views_left: vec![0; n],
            evs: Vec::new(),
        };
        b.live.workspace += grad_in;
        b.peak = b.live;
        for &o in &self.outs {
            b.grad[o] = true;
        }
        for &t in extra_grads {
            b.grad[t] = true;
        }
        for (k, op) in seg.ops.iter().enumerate().rev() {
            let o = op.output;
            if b.grad[o] && seg.tensors[o].requires_grad {
                let views = op.name.contains(GRAD_VIEWS) && !self.is_out(self.storage(o));
                self.node_input_grads(&mut b, k, views, cost, trace);
                self.consume_output_grad(&mut b, o, views, grad_in, extra_grads);
            }
            self.node_released(&mut b, k);
        }
        trace.bwd = b.evs;
        cost.bwd_peak = b.peak;
        cost.input_grads = seg
            .tensors
            .iter()
            .enumerate()
            .filter(|(t, d)| {
                b.grad[*t]
                    && matches!(
                        d.kind,
                        TensorKind::Input {
                            requires_grad: true
                        }
                    )
            })
            .map(|(_, d)| d.bytes())
            .sum();
    }

    /// Op `k`'s backward makes its inputs' gradients (new buffers, parameter gradients, or
    /// additions into existing buffers) and runs with its scratch.
    fn node_input_grads(
        &self,
        b: &mut Bwd,
        k: usize,
        views: bool,
        cost: &mut SegCost,
        trace: &mut SegTrace,
    ) {
        let (nn, seg) = (self.nn, self.seg);
        let op = &seg.ops[k];
        let o = op.output;
        let kk = k as u64;
        let is_view = seg.tensors[o].kind == TensorKind::View;
        let is_mm = op.name.ends_with(MATMUL) || op.name.ends_with(LEFT_UNSAVED);
        let mut transient = 0;
        let mut sum = 0;
        for &i in &op.inputs {
            let ti = &seg.tensors[i];
            if !ti.requires_grad {
                continue;
            }
            if views && !b.grad[i] && matches!(ti.kind, TensorKind::View | TensorKind::Alloc) {
                b.grad[i] = true;
                b.view_of[i] = Some(o);
                b.views_left[o] += 1;
                continue;
            }
            match ti.kind {
                TensorKind::Param { trained: true } => {
                    cost.param_grads += ti.bytes();
                    b.live.gradients += ti.bytes();
                    b.evs.push(Ev::Alloc(nn + i as u64, ti.bytes()));
                    trace.param_grads.push(nn + i as u64);
                }
                TensorKind::Param { .. } => {}
                _ if b.grad[i] => {
                    // Accumulated into the existing buffer; a view's slice is copied in.
                    if !is_view {
                        transient += ti.bytes();
                        if b.grad_mm_view[i] {
                            // `old_var + var`: the sum replaces the buffered view.
                            sum += ti.bytes();
                            b.grad_mm_view[i] = false;
                        }
                    }
                }
                _ => {
                    b.grad[i] = true;
                    b.grad_mm_view[i] = is_mm;
                    b.live.workspace += ti.bytes();
                    b.evs.push(Ev::Alloc(nn + i as u64, ti.bytes()));
                }
            }
        }
        max_live(&mut b.peak, b.live, transient + op.bwd_scratch);
        if sum == 0 {
            for (id, bytes) in [(5 * nn + kk, transient), (4 * nn + kk, op.bwd_scratch)] {
                if bytes > 0 {
                    b.evs.push(Ev::Alloc(id, bytes));
                    b.evs.push(Ev::Free(id));
                }
            }
        } else {
            // The new gradients and the op's scratch; the sums come once the node has
            // returned ([`Facts::node_released`]).
            b.evs.push(Ev::Alloc(5 * nn + kk, transient));
            if op.bwd_scratch > 0 {
                b.evs.push(Ev::Alloc(4 * nn + kk, op.bwd_scratch));
                b.evs.push(Ev::Free(4 * nn + kk));
            }
            b.pending_sum = Some((transient, sum));
        }
    }

    /// The gradient of output `o` is consumed by its node.
    fn consume_output_grad(&self, b: &mut Bwd, o: Tid, views: bool, grad_in: u64, extra: &[Tid]) {
        let (nn, seg) = (self.nn, self.seg);
        b.grad[o] = false;
        if views && b.views_left[o] > 0 {
            // Its slices live on as the inputs' gradients: freed with the last of them.
        } else if let Some(owner) = b.view_of[o] {
            b.views_left[owner] -= 1;
            if b.views_left[owner] == 0 {
                b.live.workspace -= self.bytes(owner);
                b.evs.push(Ev::Free(nn + owner as u64));
            }
        } else if o == seg.output && b.grad_out_pending {
            // `grad_in` holds the gradients of every output; each side output's share
            // goes with its own node.
            b.live.workspace -= grad_in - b.side_grads;
            b.grad_out_pending = false;
            b.evs.push(Ev::Free(nn + o as u64));
        } else if seg.side_outputs.contains(&o) {
            b.live.workspace -= self.bytes(o);
            b.evs.push(Ev::Free(nn + o as u64));
        } else if extra.contains(&o) {
            // An outside gradient: accounted by the caller.
        } else if !matches!(seg.tensors[o].kind, TensorKind::Input { .. }) {
            b.live.workspace -= self.bytes(o);
            b.evs.push(Ev::Free(nn + o as u64));
        }
    }

    /// After op `k`'s node returned: the saved storages it was the earliest reader of, its
    /// extras, and any out-of-place gradient sum it left pending.
    fn node_released(&self, b: &mut Bwd, k: usize) {
        let nn = self.nn;
        let op = &self.seg.ops[k];
        let kk = k as u64;
        // Saved storages whose earliest reader has run its backward are released.
        for s in 0..self.n {
            if b.held[s] && self.first_read[s].is_none_or(|f| f >= k) {
                b.held[s] = false;
                self.add(&mut b.live, s, false);
                b.evs.push(Ev::Free(s as u64));
            }
        }
        // Per-op extras (LayerNorm mean/rstd, the attention log-sum-exp) go with the op's node.
        b.live.activations = b.live.activations.saturating_sub(op.extra_saved);
        if op.extra_saved > 0 {
            b.evs.push(Ev::Free(2 * nn + kk));
        }
        // The engine adds a node's outputs into the next nodes' buffers after the node returned
        // and released its incoming gradient and saved variables (`torch/csrc/autograd/
        // engine.cpp` `evaluate_function`: `call_function`, `release_variables`, then
        // `InputBuffer::add`): an out-of-place sum lives beside the old and new gradients only.
        // The sum takes the old buffer's place (same bytes: the old id stands for it).
        if let Some((transient, sum)) = b.pending_sum.take() {
            max_live(&mut b.peak, b.live, transient + sum);
            b.evs.push(Ev::Alloc(4 * nn + kk, sum));
            b.evs.push(Ev::Free(4 * nn + kk));
            b.evs.push(Ev::Free(5 * nn + kk));
        }
    }
}

/// The backward's running state.
struct Bwd {
    live: Live,
    peak: Live,
    /// Saved storages still held by the graph.
    held: Vec<bool>,
    /// Tensors with a buffered gradient.
    grad: Vec<bool>,
    /// Whether a tensor's buffered gradient is a matmul's reshape view (summed out of place).
    grad_mm_view: Vec<bool>,
    /// An out-of-place gradient sum (transient, sum bytes) made after the node returns.
    pending_sum: Option<(u64, u64)>,
    grad_out_pending: bool,
    side_grads: u64,
    /// Gradients that are views of a concatenation's gradient ([`GRAD_VIEWS`]): the owner of
    /// each, and how many views of an owner are still unconsumed.
    view_of: Vec<Option<Tid>>,
    views_left: Vec<u32>,
    evs: Vec<Ev>,
}
