//! Candle's node graph: one [`Node`] per tensor of a tracked graph, in creation order, with what
//! candle keeps of it ([`Node::footprint`]), and the forward analyses over a graph — what it owns,
//! what stays alive while roots are held, the peak of a tracked and of a no-grad forward — plus
//! the graph as a generic `Segment` for the op inventory and the time model.

use crate::segment::{OpDef, Segment, TensorDef, TensorKind, TensorRole};
use crate::spec::Dtype;

/// Index of a node.
pub(crate) type Nid = usize;

/// Candle operation kinds that differ in what backward allocates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kind {
    /// A tensor made outside the graph (data, a detached tensor, a frozen weight).
    Const,
    /// A `Var`: a leaf that tracks gradients (trained weights, block-input leaf copies).
    Var,
    Add,
    Sub,
    Mul,
    Div,
    Matmul,
    /// `broadcast_as` (a view); backward sums the gradient back.
    Broadcast,
    /// `sum_keepdim` / `sum_all`.
    Sum,
    /// `max_keepdim`.
    Max,
    /// `to_dtype` to another dtype.
    ToDtype,
    /// `contiguous()` of a strided tensor.
    Copy,
    Affine,
    Exp,
    Sqr,
    Powf,
    Silu,
    Gelu,
    /// `narrow` (a view); `pad_before` / `pad_after` are the zero-pad elements its backward makes.
    Narrow {
        pad_before: u64,
        pad_after: u64,
    },
    /// `reshape`: a view of a contiguous tensor, a copy of a strided one.
    Reshape,
    Transpose,
    /// `index_select` of embedding rows.
    IndexSelect,
    /// A custom attention op: backward returns dq, dk, dv plus `scratch` bytes of workspace.
    Attention {
        bwd_scratch: u64,
    },
    /// The engine's gradient seed (`ops::backward_from`): a one-element node on input 0 whose
    /// backward hands input 1 (the known gradient of input 0, alive outside the graph) to it as
    /// is; candle folds it into the store with `or_insert` + `add`.
    Seed,
    /// A fused op of the engine (`ditmem_engine::ops`): its output is a fresh buffer, what it
    /// saves beyond its inputs is the node's `extra`, and its backward allocates `bwd_scratch`
    /// bytes of workspace alive while it makes one fresh, untracked gradient per input that
    /// tracks (in that input's size), then frees the workspace; candle then folds each gradient
    /// into the store with `or_insert` + `add`, except the gradients of sunk weights
    /// ([`Node::sunk`]), which the op moves to the trainer's sink. Nothing computed in the
    /// backward tracks, so no temporaries chain into the store.
    Custom {
        bwd_scratch: u64,
    },
}

/// One tensor of a graph.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub name: String,
    pub kind: Kind,
    pub inputs: Vec<Nid>,
    pub elems: u64,
    pub dtype: Dtype,
    /// Owns a buffer (false for views and for tensors owned outside the graph).
    pub alloc: bool,
    /// Has a backprop op or is a variable (candle's `track_op`).
    pub tracks: bool,
    /// Bytes held beside the output while the node lives (the log-sum-exp of an attention op).
    pub extra: u64,
    /// Of `extra`: bytes the op's backward frees as it starts (state the op owns and needs no
    /// more, e.g. the fused MLP's u): from then on they are no longer live, though candle's
    /// graph, which holds the op, lives on.
    pub released_by_bwd: u64,
    /// Transient bytes of the node's forward (attention workspace).
    pub fwd_scratch: u64,
    /// A low-precision weight copy rather than an activation.
    pub weight_cast: bool,
    /// Bound to a local variable of the engine's function that builds it: alive until that
    /// function returns even when nothing else reads it.
    pub bound: bool,
    /// Held by a local of a nested function until the node with this index exists (that
    /// function's result), even when nothing reads it after its last use.
    pub held_until: Option<Nid>,
    /// A trained weight that goes into a fused linear untracked, its gradient handed by the op's
    /// backward to a sink the trainer empties (`ditmem_engine::ops::GradSink`), never to
    /// candle's store: no `zeros_like` + `add` for it. Such a node is a `Var` that does not
    /// track.
    pub sunk: bool,
    /// The input (its index among `inputs`) whose gradient the op's backward adds in place into
    /// a running sum the trainer owns (`ditmem_engine::ops::InputSink`: the text context of the
    /// k and v projections, fused or not), never into candle's store: made beside the other
    /// gradients and freed.
    pub sunk_input: Option<usize>,
    /// The input (its index among `inputs`) whose gradient the op's backward hands on as its own
    /// output gradient, the same tensor (a handle, no copy): the gated residual's dx = g.
    pub grad_is_output_grad: Option<usize>,
    /// Its buffer is freed once the node with this index exists (`ditmem_engine::ops::release`:
    /// no backward reads its values); the node, its `Tensor_` and storage stay.
    pub released_at: Option<Nid>,
}

impl Node {
    pub fn bytes(&self) -> u64 {
        self.elems * self.dtype.size()
    }

    /// Heap bytes the node takes while alive once its graph is built: its buffer (unless
    /// released) and candle's bookkeeping (a fresh tensor is a `Tensor_` and a storage; a view
    /// only a `Tensor_`). Nodes owned outside the graph (weights, the shared conditioning leaf,
    /// inputs) take nothing here.
    pub(crate) fn footprint(&self) -> u64 {
        self.created_footprint() - self.released_bytes()
    }

    /// The buffer bytes a release frees (0 when the node is not released).
    pub(crate) fn released_bytes(&self) -> u64 {
        if self.released_at.is_some() && self.alloc {
            self.bytes()
        } else {
            0
        }
    }

    /// [`Node::footprint`] as the node is made, before any release.
    pub(crate) fn created_footprint(&self) -> u64 {
        match self.kind {
            // A sunk weight enters its linear as a detached handle on the weight's storage.
            Kind::Var if self.sunk => TENSOR_META,
            Kind::Var | Kind::Const if !self.alloc => 0,
            _ if self.alloc => self.bytes() + TENSOR_META + STORAGE_META,
            _ => TENSOR_META,
        }
    }
}

/// Heap bytes of a candle `Tensor_` (its `Arc`, layout vectors for a rank-3 shape): measured with
/// the counting allocator as 184 + 8·rank bytes per tensor (`crates/engine/tests/tensor_meta.rs`).
pub const TENSOR_META: u64 = 208;
/// Heap bytes of a candle storage beside its buffer (`Arc<RwLock<Storage>>`): 56 bytes, measured
/// the same way.
pub const STORAGE_META: u64 = 56;

/// A graph of candle nodes in creation order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Graph {
    pub nodes: Vec<Node>,
}

impl Graph {
    fn push(
        &mut self,
        name: &str,
        kind: Kind,
        inputs: &[Nid],
        elems: u64,
        dtype: Dtype,
        alloc: bool,
    ) -> Nid {
        let tracks = match kind {
            Kind::Var => true,
            Kind::Const => false,
            _ => inputs.iter().any(|&i| self.nodes[i].tracks),
        };
        let weight_cast = kind == Kind::ToDtype
            && inputs
                .first()
                .is_some_and(|&i| self.nodes[i].kind == Kind::Var && self.nodes[i].weight_cast);
        let fwd_scratch = if kind == Kind::Matmul {
            bf16_matmul_scratch(
                dtype,
                inputs
                    .iter()
                    .map(|&i| self.nodes[self.storage(i)].elems)
                    .sum(),
                elems,
            )
        } else {
            0
        };
        self.nodes.push(Node {
            name: name.into(),
            kind,
            inputs: inputs.to_vec(),
            elems,
            dtype,
            alloc,
            tracks,
            extra: 0,
            released_by_bwd: 0,
            fwd_scratch,
            weight_cast,
            bound: false,
            held_until: None,
            sunk: false,
            sunk_input: None,
            grad_is_output_grad: None,
            released_at: None,
        });
        self.nodes.len() - 1
    }

    /// `ops::release(x)` in the engine, right after the last node made so far: `x`'s buffer
    /// (its storage's) leaves the live bytes; its node stays for the backward, which must not
    /// read its values.
    pub fn release(&mut self, x: Nid) {
        let s = self.storage(x);
        debug_assert!(
            self.nodes[s].alloc,
            "release of a buffer the graph does not own"
        );
        self.nodes[s].released_at = Some(self.nodes.len() - 1);
    }

    /// The nodes whose buffers are released once node `k` exists, for each `k`.
    fn releases(&self) -> Vec<Vec<Nid>> {
        let mut at = vec![Vec::new(); self.nodes.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            if let Some(k) = n.released_at {
                at[k].push(i);
            }
        }
        at
    }

    /// A tensor made outside the graph; `owned` when the graph's lifetime decides its memory.
    pub(crate) fn constant(&mut self, name: &str, elems: u64, dtype: Dtype, owned: bool) -> Nid {
        self.push(name, Kind::Const, &[], elems, dtype, owned)
    }

    /// A variable. `owned` for leaf copies the segment makes; false for model weights.
    pub fn var(&mut self, name: &str, elems: u64, dtype: Dtype, owned: bool) -> Nid {
        let id = self.push(name, Kind::Var, &[], elems, dtype, owned);
        // Weights (not owned) are what a cast of them copies.
        self.nodes[id].weight_cast = !owned;
        id
    }

    /// A weight as the engine hands it to a block: the variable itself, or its cast copy.
    pub fn weight(
        &mut self,
        name: &str,
        elems: u64,
        stored: Dtype,
        trained: bool,
        cd: Dtype,
    ) -> Nid {
        let w = if trained {
            self.var(name, elems, stored, false)
        } else {
            self.constant(name, elems, stored, false)
        };
        self.cast(&format!("{name}→{cd}"), w, cd)
    }

    pub fn op(&mut self, name: &str, kind: Kind, inputs: &[Nid], elems: u64, dtype: Dtype) -> Nid {
        self.push(name, kind, inputs, elems, dtype, true)
    }

    /// A custom op (`Kind::Custom`) of one fresh output of `elems` in `dtype`, with its workspace
    /// (`fwd`, `bwd`), that, tracked, keeps `kept` bytes for its backward, which frees them
    /// (`released_by_bwd`), beside its boxed op (`op_bytes`): the engine's fused MLPs and Sana's
    /// Mix-FFN, keeping their hidden activation.
    pub(crate) fn keeping_op(
        &mut self,
        name: &str,
        inputs: &[Nid],
        (elems, dtype): (u64, Dtype),
        (fwd, bwd): (u64, u64),
        (kept, op_bytes): (u64, u64),
    ) -> Nid {
        let y = self.op(
            name,
            Kind::Custom { bwd_scratch: bwd },
            inputs,
            elems,
            dtype,
        );
        if self.nodes[y].tracks {
            self.nodes[y].extra = kept + op_bytes;
            self.nodes[y].released_by_bwd = kept;
        }
        self.nodes[y].fwd_scratch = fwd;
        y
    }

    pub fn view(&mut self, name: &str, kind: Kind, of: Nid, elems: u64) -> Nid {
        let dtype = self.nodes[of].dtype;
        self.push(name, kind, &[of], elems, dtype, false)
    }

    pub fn cast(&mut self, name: &str, x: Nid, to: Dtype) -> Nid {
        if self.nodes[x].dtype == to {
            x
        } else {
            let e = self.nodes[x].elems;
            self.op(name, Kind::ToDtype, &[x], e, to)
        }
    }

    pub fn elems(&self, x: Nid) -> u64 {
        self.nodes[x].elems
    }

    pub fn dtype(&self, x: Nid) -> Dtype {
        self.nodes[x].dtype
    }

    /// A binary op where `small` is broadcast to `big`'s shape (`broadcast_mul` & co.).
    pub(crate) fn broadcast_binary(
        &mut self,
        name: &str,
        kind: Kind,
        big: Nid,
        small: Nid,
        small_first: bool,
    ) -> Nid {
        let e = self.elems(big);
        let bv = self.view(&format!("{name} broadcast"), Kind::Broadcast, small, e);
        let dt = self.dtype(big);
        let inputs = if small_first { [bv, big] } else { [big, bv] };
        self.op(name, kind, &inputs, e, dt)
    }

    /// `mean_keepdim`: a sum and a scale (candle-core `Tensor::mean_keepdim`).
    pub fn mean(&mut self, name: &str, x: Nid, out: u64) -> Nid {
        let dt = self.dtype(x);
        let s = self.op(&format!("{name} sum"), Kind::Sum, &[x], out, dt);
        self.op(&format!("{name} /n"), Kind::Affine, &[s], out, dt)
    }

    /// The node's storage owner (follows views).
    /// Mark a node as held by a local variable of the engine's code; returns it.
    pub(crate) fn bind(&mut self, x: Nid) -> Nid {
        self.nodes[x].bound = true;
        x
    }

    /// Mark nodes as held by a nested function's locals until `end` (its result) is made.
    pub(crate) fn hold_until(&mut self, xs: &[Nid], end: Nid) {
        for &x in xs {
            self.nodes[x].held_until = Some(end);
        }
    }

    /// Nodes held by local variables.
    pub fn bound(&self) -> Vec<Nid> {
        (0..self.nodes.len())
            .filter(|&i| self.nodes[i].bound)
            .collect()
    }

    pub fn storage(&self, mut x: Nid) -> Nid {
        while !self.nodes[x].alloc
            && !self.nodes[x].inputs.is_empty()
            && is_view(self.nodes[x].kind)
        {
            x = self.nodes[x].inputs[0];
        }
        x
    }
}

/// Transient bytes of a bf16 matmul on CPU: candle 0.11 has no bf16 gemm kernel, so it widens
/// both operands' whole storages to f32, multiplies in f32 and narrows the result back
/// (`CpuStorage::matmul`): three f32 buffers alive beside the bf16 output. `inputs` counts the
/// elements of both operands' storages.
pub(crate) fn bf16_matmul_scratch(dtype: Dtype, inputs: u64, out: u64) -> u64 {
    if dtype == Dtype::Bf16 {
        4 * (inputs + out)
    } else {
        0
    }
}

pub(crate) fn is_view(k: Kind) -> bool {
    matches!(
        k,
        Kind::Broadcast | Kind::Narrow { .. } | Kind::Reshape | Kind::Transpose
    )
}

/// The graph as a generic `Segment` (for the op inventory and the time model).
pub(crate) fn to_segment(g: &Graph, name: &str) -> Segment {
    let mut seg = Segment::new(name);
    for (i, n) in g.nodes.iter().enumerate() {
        let kind = match n.kind {
            Kind::Var => TensorKind::Param { trained: true },
            Kind::Const if n.alloc => TensorKind::Alloc,
            Kind::Const => TensorKind::Input {
                requires_grad: false,
            },
            _ if n.alloc => TensorKind::Alloc,
            _ => TensorKind::View,
        };
        seg.tensors.push(TensorDef {
            name: n.name.clone(),
            elems: n.elems,
            dtype: n.dtype,
            kind,
            role: if n.weight_cast {
                TensorRole::WeightCast
            } else {
                TensorRole::Activation
            },
            requires_grad: n.tracks || n.sunk,
        });
        if !matches!(n.kind, Kind::Var | Kind::Const) || n.alloc {
            seg.ops.push(OpDef {
                name: n.name.clone(),
                inputs: n.inputs.clone(),
                output: i,
                extra_saved: n.extra,
                fwd_scratch: n.fwd_scratch,
                bwd_scratch: match n.kind {
                    Kind::Attention { bwd_scratch } | Kind::Custom { bwd_scratch } => bwd_scratch,
                    _ => 0,
                },
            });
        }
        seg.output = i;
    }
    seg
}

/// Data bytes `ops::release_whole` frees of the streams `xs`: each stream's buffer when the
/// stream is its whole storage (a view of a larger buffer stays).
pub(crate) fn stream_data(g: &Graph, xs: &[Nid]) -> u64 {
    xs.iter()
        .map(|&x| {
            let s = g.storage(x);
            if g.nodes[s].alloc && g.nodes[s].elems == g.nodes[x].elems {
                g.nodes[s].bytes()
            } else {
                0
            }
        })
        .sum()
}

/// Bytes of the buffers a graph owns (what stays alive while its root lives).
pub(crate) fn owned_bytes(g: &Graph) -> (u64, u64) {
    split_bytes(g.nodes.iter())
}

/// Bytes (activations, weight casts) of `nodes`: a weight's cast copy counts as a cast, any
/// other buffer and every node's extra state as activations.
fn split_bytes<'a>(nodes: impl Iterator<Item = &'a Node>) -> (u64, u64) {
    let mut act = 0;
    let mut casts = 0;
    for n in nodes {
        if n.weight_cast && n.alloc {
            casts += n.footprint();
        } else {
            act += n.footprint();
        }
        act += n.extra;
    }
    (act, casts)
}

/// Nodes alive while `roots` are held: a tracked node's op holds its inputs; an untracked view
/// holds only the storage it shares; any other untracked node holds nothing.
pub(crate) fn retained(g: &Graph, roots: &[Nid]) -> Vec<bool> {
    let mut keep = vec![false; g.nodes.len()];
    let mut stack = roots.to_vec();
    while let Some(x) = stack.pop() {
        if keep[x] {
            continue;
        }
        keep[x] = true;
        let node = &g.nodes[x];
        if node.tracks && !matches!(node.kind, Kind::Var | Kind::Const) {
            stack.extend(node.inputs.iter().copied());
        } else if is_view(node.kind) {
            stack.extend(node.inputs.first().copied());
        }
    }
    keep
}

/// Bytes (activations, weight casts) of the nodes alive while `roots` are held.
pub fn kept_bytes(g: &Graph, roots: &[Nid]) -> (u64, u64) {
    let keep = retained(g, roots);
    split_bytes(g.nodes.iter().zip(keep).filter(|(_, k)| *k).map(|(n, _)| n))
}

/// Highest bytes while the graph is built, above what existed before (everything is kept).
pub(crate) fn forward_peak(g: &Graph) -> u64 {
    let releases = g.releases();
    let mut live = 0u64;
    let mut peak = 0u64;
    for (k, n) in g.nodes.iter().enumerate() {
        live += n.created_footprint() + n.extra;
        peak = peak.max(live + n.fwd_scratch);
        for &r in &releases[k] {
            live -= g.nodes[r].released_bytes();
        }
    }
    peak
}

/// Highest bytes of a no-grad forward (each buffer freed after its last reader), above what
/// existed before, with the outputs in `keep` never freed.
pub(crate) fn untracked_peak(g: &Graph, keep: &[Nid]) -> u64 {
    let n = g.nodes.len();
    let mut last = vec![0usize; n];
    for (k, node) in g.nodes.iter().enumerate() {
        last[k] = last[k].max(k);
        for &i in &node.inputs {
            let s = g.storage(i);
            last[s] = last[s].max(k);
        }
        if node.bound {
            let s = g.storage(k);
            last[k] = n - 1;
            last[s] = n - 1;
        } else if let Some(end) = node.held_until {
            let s = g.storage(k);
            last[k] = last[k].max(end);
            last[s] = last[s].max(end);
        }
    }
    let mut frees: Vec<Vec<Nid>> = vec![Vec::new(); n];
    for (k, node) in g.nodes.iter().enumerate() {
        if node.footprint() > 0 && !keep.contains(&k) {
            frees[last[k]].push(k);
        }
    }
    // A released buffer leaves at its release, the rest of the node at its last reader.
    let releases = g.releases();
    let (mut live, mut peak) = (0u64, 0u64);
    for (k, node) in g.nodes.iter().enumerate() {
        live += node.created_footprint();
        peak = peak.max(live + node.fwd_scratch);
        for &r in &releases[k] {
            if !keep.contains(&r) {
                live -= g.nodes[r].released_bytes();
            }
        }
        for &f in &frees[k] {
            live -= g.nodes[f].footprint();
        }
    }
    peak
}
