//! The op inventory as a small dataflow graph per segment (embedder, one block, final layer).
//!
//! Each op produces one tensor; a tensor is a fresh allocation, a view of another tensor, a
//! segment input, or a parameter. From the graph the simulator derives, without any fixed
//! multiplier, what a segment keeps for backward (per the runtime's retention rule), what a
//! no-grad recompute peaks at, and what a segment's backward holds at its worst moment.
//!
//! Below every runtime: a runtime describes its segments in this form (the `ditmem-cpu` graphs
//! through `runtime::ditmem_cpu::graph::to_segment`), for the op inventory of the estimate and
//! the time model. No engine file is its twin.

use serde::Serialize;

use crate::spec::Dtype;

/// Index of a tensor in its segment.
pub(crate) type Tid = usize;

/// Where a tensor's bytes come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum TensorKind {
    /// Handed in from outside the segment (the residual stream, the conditioning vector, data).
    Input { requires_grad: bool },
    /// A model parameter, owned by the model, not by the segment.
    Param { trained: bool },
    /// A new buffer produced by an op.
    Alloc,
    /// Shares the storage of another tensor (reshape of a contiguous tensor, narrow, transpose).
    View,
}

/// What a fresh buffer counts as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum TensorRole {
    Activation,
    /// A low-precision copy of a weight made for compute.
    WeightCast,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct TensorDef {
    pub name: String,
    pub elems: u64,
    pub dtype: Dtype,
    pub kind: TensorKind,
    pub role: TensorRole,
    /// Whether a gradient flows to this tensor.
    pub requires_grad: bool,
}

impl TensorDef {
    pub(crate) fn bytes(&self) -> u64 {
        self.elems * self.dtype.size()
    }

    /// Bytes of a fresh allocation, 0 for views, inputs and parameters.
    pub(crate) fn alloc_bytes(&self) -> u64 {
        match self.kind {
            TensorKind::Alloc => self.bytes(),
            _ => 0,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct OpDef {
    pub name: String,
    pub inputs: Vec<Tid>,
    pub output: Tid,
    /// Bytes the op keeps beside its output while the graph lives (the log-sum-exp of the
    /// memory-efficient attention).
    pub extra_saved: u64,
    /// Bytes allocated and freed inside the op's forward.
    pub fwd_scratch: u64,
    /// Bytes allocated and freed inside the op's backward, beyond the gradients it produces.
    pub bwd_scratch: u64,
}

/// One segment of the step: a graph with inputs and one output.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Segment {
    pub name: String,
    pub tensors: Vec<TensorDef>,
    pub ops: Vec<OpDef>,
    pub output: Tid,
    /// Further outputs of a segment that hands on more than one stream (SD3's and Flux's image
    /// and text streams): with `output`, what the next segment reads.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub side_outputs: Vec<Tid>,
    /// The inputs that are the previous segment's outputs (the residual streams), as opposed to
    /// inputs every block reads (the conditioning vector, a text context, RoPE tables).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stream_in: Vec<Tid>,
    /// The op whose autograd node saves the segment's last saved tensor, where it is known (the
    /// `pytorch` runtime's checkpoint recompute stops there: see `runtime/pytorch/allocator.rs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_pack: Option<usize>,
}

impl Segment {
    /// Every output: `output` and the side outputs.
    pub(crate) fn outputs(&self) -> Vec<Tid> {
        let mut v = vec![self.output];
        v.extend(
            self.side_outputs
                .iter()
                .copied()
                .filter(|&t| t != self.output),
        );
        v
    }
}

impl Segment {
    pub(crate) fn new(name: impl Into<String>) -> Segment {
        Segment {
            name: name.into(),
            ..Segment::default()
        }
    }

    fn push(&mut self, t: TensorDef) -> Tid {
        self.tensors.push(t);
        self.tensors.len() - 1
    }

    pub(crate) fn input(
        &mut self,
        name: &str,
        elems: u64,
        dtype: Dtype,
        requires_grad: bool,
    ) -> Tid {
        self.push(TensorDef {
            name: name.into(),
            elems,
            dtype,
            kind: TensorKind::Input { requires_grad },
            role: TensorRole::Activation,
            requires_grad,
        })
    }

    pub(crate) fn param(&mut self, name: &str, elems: u64, dtype: Dtype, trained: bool) -> Tid {
        self.push(TensorDef {
            name: name.into(),
            elems,
            dtype,
            kind: TensorKind::Param { trained },
            role: TensorRole::Activation,
            requires_grad: trained,
        })
    }

    fn add_op(
        &mut self,
        name: &str,
        inputs: &[Tid],
        elems: u64,
        dtype: Dtype,
        kind: TensorKind,
    ) -> Tid {
        let requires_grad = inputs.iter().any(|&i| self.tensors[i].requires_grad);
        let role = if inputs.len() == 1
            && matches!(self.tensors[inputs[0]].kind, TensorKind::Param { .. })
        {
            TensorRole::WeightCast
        } else {
            TensorRole::Activation
        };
        let out = self.push(TensorDef {
            name: name.into(),
            elems,
            dtype,
            kind,
            role,
            requires_grad,
        });
        self.ops.push(OpDef {
            name: name.into(),
            inputs: inputs.to_vec(),
            output: out,
            extra_saved: 0,
            fwd_scratch: 0,
            bwd_scratch: 0,
        });
        self.output = out;
        out
    }

    /// An op that allocates its output.
    pub(crate) fn op(&mut self, name: &str, inputs: &[Tid], elems: u64, dtype: Dtype) -> Tid {
        self.add_op(name, inputs, elems, dtype, TensorKind::Alloc)
    }

    /// An op whose output shares its input's storage.
    pub(crate) fn view(&mut self, name: &str, of: Tid, elems: u64) -> Tid {
        let dtype = self.tensors[of].dtype;
        self.add_op(name, &[of], elems, dtype, TensorKind::View)
    }

    /// A dtype conversion; a no-op (the same tensor) when the dtype already matches.
    pub(crate) fn cast(&mut self, name: &str, x: Tid, to: Dtype) -> Tid {
        if self.tensors[x].dtype == to {
            x
        } else {
            let elems = self.tensors[x].elems;
            self.op(name, &[x], elems, to)
        }
    }

    pub(crate) fn dtype(&self, t: Tid) -> Dtype {
        self.tensors[t].dtype
    }

    pub(crate) fn elems(&self, t: Tid) -> u64 {
        self.tensors[t].elems
    }

    /// Attach saved bytes / scratch to the op that produced `t`.
    pub(crate) fn annotate(
        &mut self,
        t: Tid,
        extra_saved: u64,
        fwd_scratch: u64,
        bwd_scratch: u64,
    ) {
        if let Some(op) = self.ops.iter_mut().find(|o| o.output == t) {
            op.extra_saved += extra_saved;
            op.fwd_scratch += fwd_scratch;
            op.bwd_scratch += bwd_scratch;
        }
    }

    /// Index of the last op that reads each tensor (None when nothing reads it).
    fn last_use(&self) -> Vec<Option<usize>> {
        let mut last = vec![None; self.tensors.len()];
        for (k, op) in self.ops.iter().enumerate() {
            for &i in &op.inputs {
                last[i] = Some(k);
            }
        }
        last
    }

    /// The tensor whose storage `t` uses (itself unless a view).
    fn storage_of(&self, mut t: Tid) -> Tid {
        while self.tensors[t].kind == TensorKind::View {
            match self.ops.iter().find(|o| o.output == t) {
                Some(op) => t = op.inputs[0],
                None => break,
            }
        }
        t
    }
}

/// Bytes by what they are, as the simulator reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SegmentBytes {
    pub activations: u64,
    pub weight_casts: u64,
}

impl SegmentBytes {
    pub fn total(&self) -> u64 {
        self.activations + self.weight_casts
    }
}

/// What simulating one segment gives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SegmentCost {
    /// Kept after a tracked forward (the graph), excluding the output.
    pub kept: SegmentBytes,
    /// The output buffer (the next segment's input).
    pub output_bytes: u64,
    /// Highest bytes above the state before the segment during a tracked forward (output included).
    pub fwd_peak: u64,
    /// Highest bytes above the state before the segment during a no-grad forward (output included).
    pub untracked_peak: u64,
    /// Highest bytes during the segment's backward above the kept graph and the output gradient,
    /// i.e. the in-flight gradients and scratch at the worst op.
    pub bwd_transient_peak: u64,
    /// Gradient bytes of the trained parameters this segment produces (in their own dtype).
    pub param_grad_bytes: u64,
    /// Gradient bytes of the segment's inputs that require grad (returned upstream).
    pub input_grad_bytes: u64,
}

/// Simulate a segment. `keep_all` is the runtime's retention rule: true when every op output
/// stays alive with the graph (candle), false when only tensors an op's backward reads do.
pub(crate) fn simulate(
    seg: &Segment,
    keep_all: bool,
    saved: &dyn Fn(&Segment, Tid) -> bool,
) -> SegmentCost {
    let n = seg.tensors.len();
    let out_storage = seg.storage_of(seg.output);

    // A storage is retained by the tracked graph when the runtime says so for any tensor on it.
    let mut retained = vec![false; n];
    for op in &seg.ops {
        let t = op.output;
        if keep_all || saved(seg, t) {
            retained[seg.storage_of(t)] = true;
        }
    }
    let frees_at = seg.frees_at(out_storage);
    let (fwd_peak, alive) = seg.forward(&frees_at, Some(&retained));
    let (untracked_peak, _) = seg.forward(&frees_at, None);
    let mut cost = SegmentCost {
        kept: seg.kept(&alive, out_storage),
        output_bytes: seg.tensors[out_storage].alloc_bytes(),
        fwd_peak,
        untracked_peak,
        ..SegmentCost::default()
    };
    seg.backward(&mut cost);
    cost
}

impl Segment {
    /// The storages each op releases after it: each after its last reader (through its views),
    /// or right after it is made when nothing reads it; the segment output (`out_storage`) is
    /// never released here.
    fn frees_at(&self, out_storage: Tid) -> Vec<Vec<Tid>> {
        let mut storage_last = vec![None::<usize>; self.tensors.len()];
        for (t, lt) in self.last_use().iter().enumerate() {
            let s = self.storage_of(t);
            storage_last[s] = storage_last[s].max(*lt);
        }
        let mut frees_at: Vec<Vec<Tid>> = vec![Vec::new(); self.ops.len()];
        for (k, op) in self.ops.iter().enumerate() {
            let s = op.output;
            if self.tensors[s].kind == TensorKind::Alloc && s != out_storage {
                frees_at[storage_last[s].unwrap_or(k).max(k)].push(s);
            }
        }
        frees_at
    }

    /// The forward: tracked with the storages the graph `retained` (their releases skipped,
    /// each op's extra saved bytes kept), untracked with `None`. Gives the highest bytes (op
    /// scratch included) and the storages alive at the end.
    fn forward(&self, frees_at: &[Vec<Tid>], retained: Option<&[bool]>) -> (u64, Vec<bool>) {
        let mut live: u64 = 0;
        let mut peak: u64 = 0;
        let mut alive = vec![false; self.tensors.len()];
        for (k, op) in self.ops.iter().enumerate() {
            let t = &self.tensors[op.output];
            if t.kind == TensorKind::Alloc {
                live += t.bytes();
                alive[op.output] = true;
            }
            if retained.is_some() {
                live += op.extra_saved;
            }
            peak = peak.max(live + op.fwd_scratch);
            for &s in &frees_at[k] {
                if !retained.is_some_and(|r| r[s]) {
                    live -= self.tensors[s].bytes();
                    alive[s] = false;
                }
            }
        }
        (peak, alive)
    }

    /// What a tracked forward keeps: the storages still `alive` but the output, by role, and
    /// the ops' extra saved bytes.
    fn kept(&self, alive: &[bool], out_storage: Tid) -> SegmentBytes {
        let mut kept = SegmentBytes::default();
        for (s, def) in self.tensors.iter().enumerate() {
            if alive[s] && s != out_storage {
                match def.role {
                    TensorRole::Activation => kept.activations += def.bytes(),
                    TensorRole::WeightCast => kept.weight_casts += def.bytes(),
                }
            }
        }
        kept.activations += self.ops.iter().map(|o| o.extra_saved).sum::<u64>();
        kept
    }

    /// Backward: walk ops in reverse; an op turns its output's gradient into its inputs'
    /// gradients. Gradients of parameters and segment inputs stay until the segment ends. Sets
    /// the cost's transient peak and the gradients the segment leaves.
    fn backward(&self, cost: &mut SegmentCost) {
        let out = self.output;
        let mut grad_live = vec![false; self.tensors.len()];
        let mut live: u64 = 0;
        let mut peak: u64 = 0;
        for op in self.ops.iter().rev() {
            let o = op.output;
            if !self.tensors[o].requires_grad {
                continue;
            }
            let mut produced: u64 = 0;
            for &i in &op.inputs {
                if self.tensors[i].requires_grad && !grad_live[i] {
                    grad_live[i] = true;
                    produced += self.tensors[i].bytes();
                }
            }
            live += produced;
            peak = peak.max(live + op.bwd_scratch);
            // The output's gradient is consumed (the segment output's gradient is accounted by the caller).
            if o != out && grad_live[o] {
                grad_live[o] = false;
                live -= self.tensors[o].bytes();
            }
        }
        cost.bwd_transient_peak = peak;
        for (t, def) in self.tensors.iter().enumerate() {
            if !grad_live[t] {
                continue;
            }
            match def.kind {
                TensorKind::Param { trained: true } => cost.param_grad_bytes += def.bytes(),
                TensorKind::Input {
                    requires_grad: true,
                } => cost.input_grad_bytes += def.bytes(),
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain() -> Segment {
        let mut s = Segment::new("chain");
        let x = s.input("x", 100, Dtype::F32, true);
        let w = s.param("w", 10, Dtype::F32, true);
        let a = s.op("a", &[x, w], 100, Dtype::F32);
        let v = s.view("v", a, 100);
        let b = s.op("b", &[v], 50, Dtype::F32);
        s.op("c", &[b], 25, Dtype::F32);
        s
    }

    #[test]
    fn keep_all_retains_every_intermediate() {
        let s = chain();
        let c = simulate(&s, true, &|_, _| false);
        assert_eq!(c.kept.activations, (100 + 50) * 4);
        assert_eq!(c.output_bytes, 25 * 4);
        assert_eq!(c.fwd_peak, (100 + 50 + 25) * 4);
        // no-grad: a is freed after b (through its view), b after c
        assert_eq!(c.untracked_peak, (100 + 50) * 4);
        assert_eq!(c.param_grad_bytes, 40);
        assert_eq!(c.input_grad_bytes, 400);
    }

    #[test]
    fn saved_only_frees_unsaved() {
        let s = chain();
        // Only b is saved.
        let c = simulate(&s, false, &|seg, t| seg.tensors[t].name == "b");
        assert_eq!(c.kept.activations, 50 * 4);
    }

    #[test]
    fn cast_of_same_dtype_is_identity() {
        let mut s = Segment::new("x");
        let x = s.input("x", 8, Dtype::F32, false);
        assert_eq!(s.cast("c", x, Dtype::F32), x);
        let y = s.cast("c", x, Dtype::Bf16);
        assert_ne!(y, x);
        assert_eq!(s.tensors[y].bytes(), 16);
    }
}
