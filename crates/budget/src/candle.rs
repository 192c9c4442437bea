//! The ditmem engine's memory, op by op, as candle 0.11 executes it.
//!
//! The engine (crate `ditmem-engine`) builds every block from candle ops and, for the heavy parts
//! (linears, LayerNorm + modulate, GELU, attention, the gated residuals), its own fused custom ops
//! (`ditmem_engine::ops`, [`Kind::Custom`] here) that keep only what their backward needs and
//! return fresh untracked gradients. Candle keeps
//! every node of a tracked graph alive until the graph's root is dropped, makes a node for each
//! view (`narrow`, `t`, `reshape`, `broadcast_as`), and its `backward` (candle-core
//! `src/backprop.rs`) visits the nodes in reverse depth-first post-order, allocating for each
//! input gradient a `zeros_like` plus an `add` (or `sub`) per contribution, and op-specific
//! temporaries (a `narrow` pads with zeros and concatenates to its input's full size, `gelu`
//! evaluates its derivative through about a dozen temporaries, …). A gradient reaching a tensor
//! that does not track gradients still enters the gradient store and stays there until the store
//! is dropped.
//!
//! This module rebuilds the engine's graphs node for node ([`Graph`]), and replays candle's
//! backward on them ([`backward`]) with each rule's allocations in the order the code makes them,
//! so that the budget's timeline for the `ditmem-cpu` runtime can be held against the counting
//! allocator to the byte. The rules cite the candle source they follow.

use crate::spec::{AttentionMode, Dtype, LoraTarget, Precision};

/// Index of a node.
pub type Nid = usize;

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
}

impl Node {
    pub fn bytes(&self) -> u64 {
        self.elems * self.dtype.size()
    }

    /// Heap bytes the node takes while alive: its buffer and candle's bookkeeping (a fresh
    /// tensor is a `Tensor_` and a storage; a view only a `Tensor_`). Nodes owned outside the
    /// graph (weights, the shared conditioning leaf, inputs) take nothing here.
    pub fn footprint(&self) -> u64 {
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
            fwd_scratch,
            weight_cast,
            bound: false,
            held_until: None,
            sunk: false,
        });
        self.nodes.len() - 1
    }

    /// A tensor made outside the graph; `owned` when the graph's lifetime decides its memory.
    pub fn constant(&mut self, name: &str, elems: u64, dtype: Dtype, owned: bool) -> Nid {
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

    fn elems(&self, x: Nid) -> u64 {
        self.nodes[x].elems
    }

    fn dtype(&self, x: Nid) -> Dtype {
        self.nodes[x].dtype
    }

    /// A binary op where `small` is broadcast to `big`'s shape (`broadcast_mul` & co.).
    pub fn broadcast_binary(
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
    pub fn bind(&mut self, x: Nid) -> Nid {
        self.nodes[x].bound = true;
        x
    }

    /// Mark nodes as held by a nested function's locals until `end` (its result) is made.
    pub fn hold_until(&mut self, xs: &[Nid], end: Nid) {
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
pub fn bf16_matmul_scratch(dtype: Dtype, inputs: u64, out: u64) -> u64 {
    if dtype == Dtype::Bf16 {
        4 * (inputs + out)
    } else {
        0
    }
}

fn is_view(k: Kind) -> bool {
    matches!(
        k,
        Kind::Broadcast | Kind::Narrow { .. } | Kind::Reshape | Kind::Transpose
    )
}

/// The graph as a generic [`crate::graph::Segment`] (for the op inventory and the time model).
pub fn to_segment(g: &Graph, name: &str) -> crate::graph::Segment {
    use crate::graph::{OpDef, Segment, TensorDef, TensorKind, TensorRole};
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

/// Bytes of the buffers a graph owns (what stays alive while its root lives).
pub fn owned_bytes(g: &Graph) -> (u64, u64) {
    let mut act = 0;
    let mut casts = 0;
    for n in &g.nodes {
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
pub fn retained(g: &Graph, roots: &[Nid]) -> Vec<bool> {
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
    let mut act = 0;
    let mut casts = 0;
    for (n, k) in g.nodes.iter().zip(keep) {
        if !k {
            continue;
        }
        if n.weight_cast && n.alloc {
            casts += n.footprint();
        } else {
            act += n.footprint();
        }
        act += n.extra;
    }
    (act, casts)
}

/// Highest bytes while the graph is built, above what existed before (everything is kept).
pub fn forward_peak(g: &Graph) -> u64 {
    let mut live = 0u64;
    let mut peak = 0u64;
    for n in &g.nodes {
        live += n.footprint() + n.extra;
        peak = peak.max(live + n.fwd_scratch);
    }
    peak
}

/// Highest bytes of a no-grad forward (each buffer freed after its last reader), above what
/// existed before, with the outputs in `keep` never freed.
pub fn untracked_peak(g: &Graph, keep: &[Nid]) -> u64 {
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
    let (mut live, mut peak) = (0u64, 0u64);
    for (k, node) in g.nodes.iter().enumerate() {
        live += node.footprint();
        peak = peak.max(live + node.fwd_scratch);
        for &f in &frees[k] {
            live -= g.nodes[f].footprint();
        }
    }
    peak
}

/// What a replay of candle's backward gives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Backward {
    /// Highest bytes held by the gradient store and backward temporaries at any moment.
    pub peak: u64,
    /// Bytes left in the gradient store, and in the linears' gradient sinks, when `backward`
    /// returns.
    pub store: u64,
    /// Of `store`: gradients of owned variables (block-input leaves).
    pub leaf_grads: u64,
    /// Of `store`: gradients of model weights (in the store or in a sink).
    pub weight_grads: u64,
}

/// A tensor handle during the replay: a forward node (alive anyway, tracked or not) or a
/// temporary made by the backward formulas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Val {
    Fwd(Nid),
    /// A wrapper object of the heap and whether it tracks (has a backprop op).
    Tmp(usize, bool),
}

/// Reference-counted model of candle tensors made during backward. A tensor is a wrapper (the
/// `Tensor_`: its op holds its inputs when it tracks) around a storage (the bytes). Detaching
/// makes a new wrapper on the same storage; views too.
struct Heap {
    bytes: Vec<u64>,
    refs: Vec<u32>,
    holds: Vec<Vec<usize>>,
    live: u64,
    peak: u64,
    /// Bookkeeping bytes of a `Tensor_` and of a storage.
    tmeta: u64,
    smeta: u64,
}

impl Heap {
    fn obj(&mut self, bytes: u64, holds: Vec<usize>) -> usize {
        for &h in &holds {
            self.refs[h] += 1;
        }
        self.bytes.push(bytes);
        self.refs.push(1);
        self.holds.push(holds);
        self.live += bytes;
        self.peak = self.peak.max(self.live);
        self.bytes.len() - 1
    }

    fn dec(&mut self, id: usize) {
        let mut stack = vec![id];
        while let Some(i) = stack.pop() {
            self.refs[i] -= 1;
            if self.refs[i] == 0 {
                self.live -= self.bytes[i];
                stack.extend(std::mem::take(&mut self.holds[i]));
            }
        }
    }

    /// A fresh tensor of `bytes` computed from `inputs`; it tracks when any input tracks, and
    /// then its op holds the temporaries among its inputs.
    fn make(&mut self, g: &Graph, bytes: u64, inputs: &[Val]) -> Val {
        let tracks = inputs.iter().any(|v| match v {
            Val::Fwd(n) => g.nodes[*n].tracks,
            Val::Tmp(_, t) => *t,
        });
        let storage = self.obj(bytes + self.smeta, vec![]);
        let mut holds = vec![storage];
        if tracks {
            holds.extend(inputs.iter().filter_map(|v| match v {
                Val::Tmp(w, _) => Some(*w),
                Val::Fwd(_) => None,
            }));
        }
        let w = self.obj(self.tmeta, holds);
        self.dec(storage);
        Val::Tmp(w, tracks)
    }

    /// A view (or detached copy when `detach`) of `x`: a new wrapper on the same storage.
    fn view(&mut self, g: &Graph, x: Val, detach: bool) -> Val {
        match x {
            Val::Fwd(n) => Val::Fwd(n),
            Val::Tmp(w, t) => {
                let storage = self.holds[w][0];
                let mut holds = vec![storage];
                let tracks = t && !detach;
                if tracks {
                    holds.push(w);
                }
                let _ = g;
                Val::Tmp(self.obj(self.tmeta, holds), tracks)
            }
        }
    }

    fn drop_val(&mut self, v: Val) {
        if let Val::Tmp(w, _) = v {
            self.dec(w);
        }
    }
}

/// Replays `root.backward()` (candle-core 0.11 `src/backprop.rs`): nodes in reverse DFS
/// post-order from the root (lhs before rhs); each removes its gradient from the store, detaches
/// it, and adds its inputs' contributions through `or_insert` (zeros) and `add`. Results computed
/// from tracked forward tensors track too, so a stored gradient sum holds the temporaries it was
/// made from until the store drops it: the heap below counts those references.
pub fn backward(g: &Graph, root: Nid) -> Backward {
    backward_with(g, root, true)
}

/// [`backward`], optionally without candle's per-tensor bookkeeping (data bytes only).
pub fn backward_with(g: &Graph, root: Nid, meta: bool) -> Backward {
    let (tmeta, smeta) = if meta {
        (TENSOR_META, STORAGE_META)
    } else {
        (0, 0)
    };
    let n = g.nodes.len();
    let mut seen: Vec<Option<bool>> = vec![None; n];
    let mut order: Vec<Nid> = Vec::new();
    fn walk(g: &Graph, x: Nid, seen: &mut Vec<Option<bool>>, order: &mut Vec<Nid>) -> bool {
        if let Some(t) = seen[x] {
            return t;
        }
        let node = &g.nodes[x];
        let mut track = node.kind == Kind::Var;
        if node.kind != Kind::Var && node.kind != Kind::Const && node.tracks {
            for &i in &node.inputs {
                track |= walk(g, i, seen, order);
            }
        }
        seen[x] = Some(track);
        if track {
            order.push(x);
        }
        track
    }
    walk(g, root, &mut seen, &mut order);
    order.reverse();

    let bytes = |x: Nid| g.nodes[x].bytes();
    let mut h = Heap {
        bytes: Vec::new(),
        refs: Vec::new(),
        holds: Vec::new(),
        live: 0,
        peak: 0,
        tmeta,
        smeta,
    };
    let mut store: Vec<Option<Val>> = vec![None; n];
    let mut sunk_grads = 0u64;
    // `grads.insert(self, self.ones_like()?.contiguous()?)`
    store[root] = Some(h.make(g, bytes(root), &[]));

    // `grads.or_insert(t)?`: the stored gradient, or fresh zeros.
    fn or_insert(h: &mut Heap, g: &Graph, store: &[Option<Val>], t: Nid) -> Val {
        match store[t] {
            Some(v) => v,
            None => h.make(g, g.nodes[t].bytes(), &[]),
        }
    }
    // `*s = s.add(&partial)?` (or `sub`): the new sum replaces (and may hold) the old one.
    fn add_into(
        h: &mut Heap,
        g: &Graph,
        store: &mut [Option<Val>],
        t: Nid,
        old: Val,
        partial: Val,
    ) {
        let new = h.make(g, g.nodes[t].bytes(), &[old, partial]);
        h.drop_val(old);
        store[t] = Some(new);
    }
    fn acc(h: &mut Heap, g: &Graph, store: &mut [Option<Val>], t: Nid, partial: Val) {
        let old = or_insert(h, g, store, t);
        add_into(h, g, store, t, old, partial);
    }

    for &x in &order {
        let node = &g.nodes[x];
        if node.kind == Kind::Var {
            continue;
        }
        let Some(orig) = store[x].take() else {
            continue;
        };
        let grad = h.view(g, orig, true);
        let ins = node.inputs.clone();
        let nb = bytes(x);
        let me = Val::Fwd(x);
        let mut locals: Vec<Val> = Vec::new();
        match node.kind {
            Kind::Add | Kind::Sub => {
                for &i in &ins {
                    acc(&mut h, g, &mut store, i, grad);
                }
            }
            Kind::Mul => {
                let lg = h.make(g, nb, &[grad, Val::Fwd(ins[1])]);
                acc(&mut h, g, &mut store, ins[0], lg);
                let rg = h.make(g, nb, &[grad, Val::Fwd(ins[0])]);
                acc(&mut h, g, &mut store, ins[1], rg);
                locals.extend([lg, rg]);
            }
            Kind::Div => {
                let lg = h.make(g, nb, &[grad, Val::Fwd(ins[1])]);
                acc(&mut h, g, &mut store, ins[0], lg);
                let t1 = h.make(g, nb, &[grad, Val::Fwd(ins[0])]);
                let t2 = h.make(g, nb, &[Val::Fwd(ins[1])]);
                let rg = h.make(g, nb, &[t1, t2]);
                h.drop_val(t1);
                h.drop_val(t2);
                acc(&mut h, g, &mut store, ins[1], rg);
                locals.extend([lg, rg]);
            }
            Kind::Matmul => {
                let (l, r) = (ins[0], ins[1]);
                let el = |i: Nid| g.nodes[g.storage(i)].elems;
                // grad·rᵀ, then lᵀ·grad, each with the f32 widening of a bf16 matmul.
                let w = h.obj(
                    bf16_matmul_scratch(node.dtype, node.elems + el(r), g.nodes[l].elems),
                    vec![],
                );
                let lg = h.make(g, bytes(l), &[grad, Val::Fwd(r)]);
                h.dec(w);
                acc(&mut h, g, &mut store, l, lg);
                let w = h.obj(
                    bf16_matmul_scratch(node.dtype, el(l) + node.elems, g.nodes[r].elems),
                    vec![],
                );
                let rg = h.make(g, bytes(r), &[Val::Fwd(l), grad]);
                h.dec(w);
                acc(&mut h, g, &mut store, r, rg);
                locals.extend([lg, rg]);
            }
            Kind::Broadcast => {
                let a = ins[0];
                let s = h.make(g, bytes(a), &[grad]);
                let bv = h.view(g, s, false);
                acc(&mut h, g, &mut store, a, bv);
                locals.extend([s, bv]);
            }
            Kind::Seed => {
                acc(&mut h, g, &mut store, ins[0], Val::Fwd(ins[1]));
            }
            Kind::Sum | Kind::Max | Kind::Copy | Kind::Transpose | Kind::Reshape => {
                let v = h.view(g, grad, false);
                acc(&mut h, g, &mut store, ins[0], v);
                locals.push(v);
            }
            Kind::ToDtype => {
                let a = ins[0];
                let old = or_insert(&mut h, g, &store, a);
                let conv = h.make(g, bytes(a), &[grad]);
                add_into(&mut h, g, &mut store, a, old, conv);
                locals.push(conv);
            }
            Kind::Affine => {
                let ag = h.make(g, bytes(ins[0]), &[grad]);
                acc(&mut h, g, &mut store, ins[0], ag);
                locals.push(ag);
            }
            Kind::Exp => {
                let old = or_insert(&mut h, g, &store, ins[0]);
                let p = h.make(g, nb, &[grad, me]);
                add_into(&mut h, g, &mut store, ins[0], old, p);
                h.drop_val(p);
            }
            Kind::Sqr => {
                let a = bytes(ins[0]);
                let t1 = h.make(g, a, &[Val::Fwd(ins[0]), grad]);
                let ag = h.make(g, a, &[t1]);
                h.drop_val(t1);
                acc(&mut h, g, &mut store, ins[0], ag);
                locals.push(ag);
            }
            Kind::Powf => {
                let a = bytes(ins[0]);
                let t1 = h.make(g, a, &[Val::Fwd(ins[0])]);
                let t2 = h.make(g, a, &[grad, t1]);
                let ag = h.make(g, a, &[t2]);
                h.drop_val(t1);
                h.drop_val(t2);
                acc(&mut h, g, &mut store, ins[0], ag);
                locals.push(ag);
            }
            Kind::Silu => {
                let a = bytes(ins[0]);
                let arg = Val::Fwd(ins[0]);
                let old = or_insert(&mut h, g, &store, ins[0]);
                let t1 = h.make(g, a, &[arg]);
                let t2 = h.make(g, a, &[t1]);
                let t3 = h.make(g, a, &[t2]);
                h.drop_val(t2);
                let sig = h.make(g, a, &[t3]);
                h.drop_val(t1);
                h.drop_val(t3);
                let u1 = h.make(g, a, &[me]);
                let u2 = h.make(g, a, &[sig, u1]);
                h.drop_val(u1);
                let u3 = h.make(g, a, &[u2, me]);
                h.drop_val(u2);
                let p = h.make(g, a, &[grad, u3]);
                h.drop_val(u3);
                add_into(&mut h, g, &mut store, ins[0], old, p);
                h.drop_val(p);
                locals.push(sig);
            }
            Kind::Gelu => {
                let a = bytes(ins[0]);
                let arg = Val::Fwd(ins[0]);
                let old = or_insert(&mut h, g, &store, ins[0]);
                let cube = h.make(g, a, &[arg]);
                let t1 = h.make(g, a, &[cube]);
                let t2 = h.make(g, a, &[arg]);
                let t3 = h.make(g, a, &[t1, t2]);
                h.drop_val(t1);
                h.drop_val(t2);
                let tanh = h.make(g, a, &[t3]);
                h.drop_val(t3);
                let u1 = h.make(g, a, &[tanh]);
                let u2 = h.make(g, a, &[cube]);
                h.drop_val(cube);
                let u3 = h.make(g, a, &[arg]);
                let u4 = h.make(g, a, &[u2, u3]);
                h.drop_val(u2);
                h.drop_val(u3);
                let u5 = h.make(g, a, &[tanh]);
                let u6 = h.make(g, a, &[u5]);
                h.drop_val(u5);
                let u7 = h.make(g, a, &[u4, u6]);
                h.drop_val(u4);
                h.drop_val(u6);
                let u8 = h.make(g, a, &[u1, u7]);
                h.drop_val(u1);
                h.drop_val(u7);
                let gg = h.make(g, a, &[u8]);
                h.drop_val(u8);
                let p = h.make(g, a, &[grad, gg]);
                h.drop_val(gg);
                add_into(&mut h, g, &mut store, ins[0], old, p);
                h.drop_val(p);
                locals.push(tanh);
            }
            Kind::Narrow {
                pad_before,
                pad_after,
            } => {
                let a = ins[0];
                let es = g.nodes[x].dtype.size();
                if pad_before + pad_after > 0 {
                    let mut parts = vec![grad];
                    let mut pads = Vec::new();
                    for p in [pad_before, pad_after] {
                        if p > 0 {
                            let z = h.make(g, p * es, &[]);
                            pads.push(z);
                            parts.push(z);
                        }
                    }
                    let cat = h.make(g, bytes(a), &parts);
                    for z in pads {
                        h.drop_val(z);
                    }
                    acc(&mut h, g, &mut store, a, cat);
                    locals.push(cat);
                } else {
                    let v = h.view(g, grad, false);
                    acc(&mut h, g, &mut store, a, v);
                    locals.push(v);
                }
            }
            Kind::IndexSelect => {
                let a = ins[0];
                let old = or_insert(&mut h, g, &store, a);
                add_into(&mut h, g, &mut store, a, old, grad);
            }
            Kind::Attention { bwd_scratch } => {
                let q = bytes(ins[0]);
                let s = h.make(g, bwd_scratch, &[]);
                h.drop_val(s);
                // dq, dk, dv come back detached (fresh tensors).
                for &i in &ins {
                    let d = h.make(g, q, &[]);
                    locals.push(d);
                    acc(&mut h, g, &mut store, i, d);
                }
            }
            Kind::Custom { bwd_scratch } => {
                // `c.bwd(..)` returns all gradients before candle adds any of them.
                let scratch = h.make(g, bwd_scratch, &[]);
                let grads: Vec<(Nid, Val)> = ins
                    .iter()
                    .filter(|&&i| g.nodes[i].tracks || g.nodes[i].sunk)
                    .map(|&i| (i, h.make(g, bytes(i), &[])))
                    .collect();
                h.drop_val(scratch);
                for &(i, d) in &grads {
                    if g.nodes[i].sunk {
                        // Moved into the sink: alive after the backward, outside the store.
                        sunk_grads += bytes(i) + tmeta + smeta;
                        continue;
                    }
                    acc(&mut h, g, &mut store, i, d);
                    locals.push(d);
                }
            }
            Kind::Var | Kind::Const => {}
        }
        for v in locals {
            h.drop_val(v);
        }
        h.drop_val(grad);
        h.drop_val(orig);
    }

    let mut out = Backward {
        peak: h.peak,
        store: h.live,
        weight_grads: sunk_grads,
        ..Backward::default()
    };
    for (t, v) in store.iter().enumerate() {
        if v.is_some() && g.nodes[t].kind == Kind::Var {
            if g.nodes[t].alloc {
                out.leaf_grads += bytes(t) + tmeta + smeta;
            } else {
                out.weight_grads += bytes(t) + tmeta + smeta;
            }
        }
    }
    out
}

/// Shapes and dtypes one block of the engine works with.
#[derive(Debug, Clone)]
pub struct BlockShape {
    pub b: u64,
    pub s: u64,
    pub d: u64,
    pub heads: u64,
    pub mlp: u64,
    pub precision: Precision,
    pub attention: AttentionMode,
    pub attention_only: bool,
    pub lora: Option<(u64, Vec<LoraTarget>)>,
    pub attn_dropout: bool,
    pub mlp_dropout: bool,
}

impl BlockShape {
    fn cd(&self) -> Dtype {
        self.precision.compute_dtype()
    }
    fn ad(&self) -> Dtype {
        self.precision.accum_dtype()
    }
    fn e(&self) -> u64 {
        self.b * self.s * self.d
    }
    fn lora_for(&self, t: LoraTarget) -> Option<u64> {
        self.lora
            .as_ref()
            .filter(|(_, ts)| ts.contains(&t))
            .map(|(r, _)| *r)
    }
    /// Dtype weights are stored in (trained masters, or a frozen LoRA base in the compute dtype).
    fn weight_dtype(&self) -> Dtype {
        if self.lora.is_some() {
            self.cd()
        } else {
            self.precision.param_dtype()
        }
    }
}

/// Rows per chunk of the engine's low-precision (bf16/f16) linear (`ops::LINEAR_ROWS`).
pub const LINEAR_ROWS: u64 = 128;

/// Rows / columns of the engine's AVX512-BF16 micro-kernel tile (`gemm_bf16::{MR, NR}`): packed
/// operands are padded to whole tiles.
pub const BF16_KERNEL_TILE: (u64, u64) = (6, 64);

/// Bytes of a packed bf16 A operand (m × k): whole tiles of rows × ⌈k/2⌉ pairs of u16.
fn packed_a_bytes(m: u64, k: u64) -> u64 {
    4 * m.div_ceil(BF16_KERNEL_TILE.0) * BF16_KERNEL_TILE.0 * k.div_ceil(2)
}

/// Bytes of a packed bf16 B operand (k × n): whole tiles of columns × ⌈k/2⌉ pairs of u16.
fn packed_b_bytes(k: u64, n: u64) -> u64 {
    4 * n.div_ceil(BF16_KERNEL_TILE.1) * BF16_KERNEL_TILE.1 * k.div_ceil(2)
}

/// Workspace bytes (forward, backward) of the engine's fused linear (`ops::linear_*_scratch`)
/// in compute dtype `cd` for the inputs that track (`(x, w, b)`), on the AVX512-BF16 kernel when
/// `native` (see [`bf16_dot_native`]), else widened: nothing on f32/f64. `master`: W and b are
/// the f32 master weights, read rounded to `cd` (mixed precision without cast copies). Kernel:
/// forward packed Wᵀ, a packed x chunk, an f32 y chunk and an f32 b; backward for dx packed W, a
/// packed g chunk and an f32 dx chunk, for dW an f32 dW (the gradient itself when `master`), a
/// packed gᵀ chunk and a packed x chunk, for db an f32 db (likewise). Widened (all f32): forward W, b and a chunk of x and y; backward a chunk of g, and for dx
/// Wᵀ, a second (column-major) g chunk and a dx chunk, for dW an f32 dW and an x chunk, for db an
/// f32 db.
pub fn fused_linear_scratch(
    cd: Dtype,
    (rows, inp, out): (u64, u64, u64),
    (tx, tw, tb): (bool, bool, bool),
    native: bool,
    master: bool,
) -> (u64, u64) {
    let r = LINEAR_ROWS.min(rows);
    match cd {
        Dtype::Bf16 if native => {
            let fwd = packed_b_bytes(inp, out) + packed_a_bytes(r, inp) + 4 * (r * out + out);
            let mut bwd = 0;
            if tx {
                bwd += packed_b_bytes(out, inp) + packed_a_bytes(r, out) + 4 * r * inp;
            }
            let acc = if master { 0 } else { 4 };
            if tw {
                bwd += acc * out * inp + packed_a_bytes(out, r) + packed_b_bytes(r, inp);
            }
            if tb {
                bwd += acc * out;
            }
            (fwd, bwd)
        }
        Dtype::Bf16 | Dtype::F16 => {
            let mut b = r * out;
            if tx {
                b += out * inp + r * out + r * inp;
            }
            if tw {
                b += out * inp + r * inp;
            }
            if tb {
                b += out;
            }
            (4 * (out * inp + out + r * (inp + out)), 4 * b)
        }
        _ => (0, 0),
    }
}

/// `ops::linear` of the engine: `x·Wᵀ + b` as one node with a fresh (rows, out) output and
/// nothing saved beyond its inputs; its workspace is [`fused_linear_scratch`]. The gradients it
/// returns are those of the inputs that track. Its widened f32 buffers are laid out so that
/// `gemm` packs nothing (its per-call packing buffers are not in this model).
pub fn fused_linear(
    g: &mut Graph,
    name: &str,
    ins: [Nid; 3],
    rows: u64,
    inp: u64,
    out: u64,
) -> Nid {
    let cd = g.dtype(ins[0]);
    let wants = |i: Nid| g.nodes[i].tracks || g.nodes[i].sunk;
    let tracks = (wants(ins[0]), wants(ins[1]), wants(ins[2]));
    let master = g.dtype(ins[1]) == Dtype::F32 && matches!(cd, Dtype::Bf16 | Dtype::F16);
    let (fwd, bwd) = fused_linear_scratch(cd, (rows, inp, out), tracks, bf16_dot_native(), master);
    let y = g.op(
        name,
        Kind::Custom { bwd_scratch: bwd },
        &ins,
        rows * out,
        cd,
    );
    g.nodes[y].fwd_scratch = fwd;
    y
}

/// `LinearW::forward`: `x·Wᵀ + b` on a 2-D input, plus `(x·Aᵀ)·Bᵀ` with LoRA.
#[allow(clippy::too_many_arguments)]
pub fn linear(
    g: &mut Graph,
    sh: &BlockShape,
    name: &str,
    x: Nid,
    rows: u64,
    out: u64,
    inp: u64,
    target: Option<LoraTarget>,
) -> Nid {
    let cd = sh.cd();
    let trained = sh.lora.is_none();
    // The fused linear reads f32 master weights directly under bf16/f16 compute (rounding as it
    // packs or widens them), so a linear's weight and bias are never cast copies.
    let wd = sh.weight_dtype();
    let w = g.weight(&format!("{name}.weight"), out * inp, wd, trained, wd);
    let bias = g.weight(&format!("{name}.bias"), out, wd, trained, wd);
    // `LinearW::forward`: trained weights go to a gradient sink when the input tracks.
    if trained && g.nodes[x].tracks {
        for t in [w, bias] {
            g.nodes[t].tracks = false;
            g.nodes[t].sunk = true;
        }
    }
    let y = fused_linear(g, &format!("{name} x·Wᵀ+b"), [x, w, bias], rows, inp, out);
    match target.and_then(|t| sh.lora_for(t)) {
        Some(r) => {
            let pd = sh.precision.param_dtype();
            let a = g.weight(&format!("{name}.lora_a"), r * inp, pd, true, cd);
            let bm = g.weight(&format!("{name}.lora_b"), out * r, pd, true, cd);
            for t in [a, bm] {
                if g.nodes[t].kind == Kind::ToDtype {
                    g.bind(t);
                }
            }
            let at = g.view(&format!("{name}.lora_aᵀ"), Kind::Transpose, a, r * inp);
            let xa = g.op(
                &format!("{name} x·Aᵀ"),
                Kind::Matmul,
                &[x, at],
                rows * r,
                cd,
            );
            let bt = g.view(&format!("{name}.lora_bᵀ"), Kind::Transpose, bm, out * r);
            let xab = g.op(
                &format!("{name} ·Bᵀ"),
                Kind::Matmul,
                &[xa, bt],
                rows * out,
                cd,
            );
            g.op(
                &format!("{name} +lora"),
                Kind::Add,
                &[y, xab],
                rows * out,
                cd,
            )
        }
        None => y,
    }
}

/// `layer_norm` of the engine: mean, x − mean, (x − mean)², var, +eps, ^−½, product.
pub fn layer_norm(g: &mut Graph, name: &str, x: Nid, rows: u64) -> Nid {
    let ad = g.dtype(x);
    let mean = g.mean(&format!("{name} mean"), x, rows);
    let xc = g.broadcast_binary(&format!("{name} x−mean"), Kind::Sub, x, mean, false);
    let e = g.elems(x);
    let sq = g.op(&format!("{name} (x−mean)²"), Kind::Sqr, &[xc], e, ad);
    let var = g.mean(&format!("{name} var"), sq, rows);
    let ve = g.op(&format!("{name} var+eps"), Kind::Affine, &[var], rows, ad);
    let rstd = g.op(&format!("{name} ^−½"), Kind::Powf, &[ve], rows, ad);
    g.broadcast_binary(&format!("{name} out"), Kind::Mul, xc, rstd, false)
}

/// `modulate`: x·(1 + scale) + shift, scale and shift (b, D) broadcast over tokens.
pub fn modulate(g: &mut Graph, name: &str, x: Nid, shift: Nid, scale: Nid, bd: u64) -> Nid {
    let ad = g.dtype(x);
    let su = g.view(&format!("{name} scale.unsqueeze"), Kind::Reshape, scale, bd);
    let one = g.op(&format!("{name} 1+scale"), Kind::Affine, &[su], bd, ad);
    let m = g.broadcast_binary(&format!("{name} ·(1+scale)"), Kind::Mul, x, one, false);
    let sh = g.view(&format!("{name} shift.unsqueeze"), Kind::Reshape, shift, bd);
    g.broadcast_binary(&format!("{name} +shift"), Kind::Add, m, sh, false)
}

/// `ops::ln_modulate` of the engine: LayerNorm fused with the adaLN modulation, written in the
/// compute dtype. One fresh output; the op keeps (mean, rstd) per row in the accumulation type
/// (f64 under fp64, else f32) beside it. Its inputs are x and the shift/scale chunks themselves.
pub fn ln_modulate(
    g: &mut Graph,
    name: &str,
    x: Nid,
    shift: Nid,
    scale: Nid,
    rows: u64,
    out: Dtype,
) -> Nid {
    let acc = if g.dtype(x) == Dtype::F64 { 8 } else { 4 };
    let e = g.elems(x);
    let y = g.op(
        name,
        Kind::Custom { bwd_scratch: 0 },
        &[x, shift, scale],
        e,
        out,
    );
    g.nodes[y].extra = 2 * rows * acc;
    y
}

/// `ops::gelu_tanh` of the engine: one fresh output, saves nothing beyond its input.
pub fn gelu(g: &mut Graph, name: &str, x: Nid) -> Nid {
    let (e, dt) = (g.elems(x), g.dtype(x));
    g.op(name, Kind::Custom { bwd_scratch: 0 }, &[x], e, dt)
}

/// `ops::gated_residual` of the engine: `x + y·gate` as one fresh node in x's dtype, reading y
/// in the compute dtype; saves nothing beyond its inputs.
pub fn gated_residual(g: &mut Graph, name: &str, x: Nid, y: Nid, gate: Nid) -> Nid {
    let (e, dt) = (g.elems(x), g.dtype(x));
    g.op(name, Kind::Custom { bwd_scratch: 0 }, &[x, y, gate], e, dt)
}

/// adaLN: `linear(silu(c)→cd)→ad` chunked into `k` narrow views of (b, D).
pub fn ada_ln(
    g: &mut Graph,
    sh: &BlockShape,
    name: &str,
    c: Nid,
    k: u64,
    target: Option<LoraTarget>,
) -> Vec<Nid> {
    let (cd, ad) = (sh.cd(), sh.ad());
    let bd = sh.b * sh.d;
    let silu = g.op(&format!("{name} silu(c)"), Kind::Silu, &[c], bd, ad);
    let sc = g.cast(&format!("{name} silu→{cd}"), silu, cd);
    let m = linear(g, sh, name, sc, sh.b, k * sh.d, sh.d, target);
    let m = g.cast(&format!("{name} →{ad}"), m, ad);
    g.bind(m);
    (0..k)
        .map(|i| {
            g.view(
                &format!("{name} chunk {i}"),
                Kind::Narrow {
                    pad_before: i * bd,
                    pad_after: (k - 1 - i) * bd,
                },
                m,
                bd,
            )
        })
        .collect()
}

/// Bytes of the materialized attention core for one block (its rebuild in backward).
fn materialized_core(sh: &BlockShape) -> Graph {
    let mut g = Graph::default();
    let cd = sh.cd();
    let e = sh.e();
    let q = g.var("q", e, cd, true);
    let k = g.var("k", e, cd, true);
    let v = g.var("v", e, cd, true);
    let plain = BlockShape {
        attention: AttentionMode::Materialized,
        attention_only: false,
        ..sh.clone()
    };
    attention(&mut g, &plain, q, k, v);
    g
}

/// Query rows per chunk of the engine's memory-efficient attention kernel (one at a time).
pub const ATTN_ROWS: u64 = 1;
/// Keys per block of the engine's memory-efficient attention kernel.
pub const ATTN_KEY_BLOCK: u64 = 64;

/// The attention core on q, k, v of shape (b, a, s, dh).
pub fn attention(g: &mut Graph, sh: &BlockShape, q: Nid, k: Nid, v: Nid) -> Nid {
    let (cd, ad) = (sh.cd(), sh.ad());
    let e = sh.e();
    let a_el = sh.b * sh.heads * sh.s * sh.s;
    let rows = sh.b * sh.heads * sh.s;
    if sh.attention_only && sh.attention == AttentionMode::Materialized {
        // Forward runs the materialized core without tracking on q, k, v themselves, then
        // copies its result into the op's output.
        let mut core = materialized_core(sh);
        for i in 0..3 {
            core.nodes[i].alloc = false;
        }
        let last = core.nodes.len() - 1;
        let fwd = untracked_peak(&core, &[last]);
        let o = g.op(
            "attn core (recomputed in backward)",
            Kind::Attention { bwd_scratch: 0 },
            &[q, k, v],
            e,
            cd,
        );
        g.nodes[o].fwd_scratch = fwd;
        // Backward rebuilds the core on leaf copies of q, k, v, roots it at sum(o · grad_o)
        // and backprops through it; the gradients come back detached.
        let mut core = materialized_core(sh);
        let out = core.nodes.len() - 1;
        let root = surrogate(&mut core, out);
        let (act, _) = owned_bytes(&core);
        let bwd = backward(&core, root);
        if let Kind::Attention { bwd_scratch } = &mut g.nodes[o].kind {
            *bwd_scratch = act + bwd.peak;
        }
        return o;
    }
    if sh.attention == AttentionMode::MemoryEfficient {
        let acc = if sh.precision == Precision::Fp64 {
            Dtype::F64
        } else {
            Dtype::F32
        };
        let dh = sh.d / sh.heads;
        // Per (batch, head): f32 copies of k and v; backward adds dk, dv accumulators.
        let per_head = sh.s * dh * acc.size();
        let o = g.op(
            "attn core (memory-efficient)",
            Kind::Attention {
                bwd_scratch: 4 * per_head,
            },
            &[q, k, v],
            e,
            cd,
        );
        g.nodes[o].extra = rows * acc.size();
        g.nodes[o].fwd_scratch = 2 * per_head;
        return o;
    }
    let kt = g.view("kᵀ", Kind::Transpose, k, e);
    let scores = g.op("scores q·kᵀ", Kind::Matmul, &[q, kt], a_el, cd);
    let s32 = g.cast(&format!("scores→{ad}"), scores, ad);
    // The row max is detached: a constant the subtraction keeps alive.
    let max = g.constant("softmax row max (detached)", rows, ad, true);
    let sub = g.broadcast_binary("softmax x−max", Kind::Sub, s32, max, false);
    let exp = g.op("softmax exp", Kind::Exp, &[sub], a_el, ad);
    let sum = g.op("softmax row sum", Kind::Sum, &[exp], rows, ad);
    let p = g.broadcast_binary("softmax P", Kind::Div, exp, sum, false);
    let mut pc = g.cast(&format!("P→{cd}"), p, cd);
    if sh.attn_dropout {
        let mask = g.constant("attn dropout mask", a_el, cd, true);
        pc = g.op("P·mask", Kind::Mul, &[pc, mask], a_el, cd);
    }
    let o = g.op("P·v", Kind::Matmul, &[pc, v], e, cd);
    // `attention_materialized` binds scores, max, exp, the row sum and P to locals: without
    // tracking they all live until it returns.
    g.hold_until(&[s32, max, exp, sum, pc], o);
    o
}

/// Threads of candle's and the engine's CPU kernels (rayon's pool): `RAYON_NUM_THREADS` when
/// set, else every logical core.
/// The CPU's model name (`/proc/cpuinfo`), or the architecture where that cannot be read: the
/// machine line of every report and benchmark.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// Whether the engine multiplies bf16 with its AVX512-BF16 kernel (`ditmem_engine::gemm_bf16`)
/// on this machine, rather than widening to f32: the CPU has AVX512F and AVX512-BF16, and
/// `DITMEM_BF16_GEMM` is not `widen` (which forces the widening path, for comparisons). Decided
/// once per process; the engine asks this same function, so the budget's workspace model
/// follows the path the engine takes.
pub fn bf16_dot_native() -> bool {
    static NATIVE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *NATIVE.get_or_init(|| {
        if std::env::var("DITMEM_BF16_GEMM").is_ok_and(|v| v == "widen") {
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

pub fn cpu_threads() -> u64 {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&n| n > 0)
        .or_else(|| {
            std::thread::available_parallelism()
                .ok()
                .map(|n| n.get() as u64)
        })
        .unwrap_or(1)
}

/// Keys per block of the engine's streaming attention kernel (`ops::ATTN_KEY_BLOCK`).
pub const FUSED_ATTN_KEY_BLOCK: u64 = 128;

/// Bytes of one thread's scratch (forward, backward) of the engine's streaming bf16 attention on
/// the AVX512-BF16 kernel with key blocks of `kb` (`attn_bf16::streaming_scratch_bytes`).
/// Forward: f32 output accumulator, a block of scores, row max and sum; packed q, a packed block
/// of P, a packed B (a block of kᵀ or v). Backward: f32 dq, dk, dv, blocks of P and dP, the row
/// deltas; packed q and dO, a packed A of a block (Pᵀ, dS or dSᵀ), a packed B (a block of kᵀ,
/// vᵀ or k, or all of dO or q).
pub fn streaming_attention_scratch(s: u64, dh: u64, kb: u64) -> (u64, u64) {
    let a_qd = packed_a_bytes(s, dh);
    let a_blk = packed_a_bytes(s, kb).max(packed_a_bytes(kb, s));
    let b_fwd = packed_b_bytes(dh, kb).max(packed_b_bytes(kb, dh));
    let b_bwd = b_fwd.max(packed_b_bytes(s, dh));
    (
        4 * (s * dh + s * kb + 2 * s) + a_qd + packed_a_bytes(s, kb) + b_fwd,
        4 * (3 * s * dh + 2 * s * kb + s) + 2 * a_qd + a_blk + b_bwd,
    )
}

/// Bytes of one thread's scratch (forward, backward) of the engine's bf16 attention on the
/// AVX512-BF16 kernel (`attn_bf16::native_scratch_bytes`): f32 buffers (forward the head's
/// output and S; backward dq, dk, dv, P and dP) and the packed operands of every product of a
/// head (A up to s × max(s, d_h); B d_h × s or s × d_h).
pub fn native_attention_scratch(s: u64, dh: u64) -> (u64, u64) {
    let packed = packed_a_bytes(s, s.max(dh)) + packed_b_bytes(dh, s).max(packed_b_bytes(s, dh));
    (
        4 * (s * dh + s * s) + packed,
        4 * (3 * s * dh + 2 * s * s) + packed,
    )
}

/// `ops::qkv_attention` of the engine: attention read in place from the (b·s, 3D) qkv
/// projection, written as (b·s, D). One fresh output. What it keeps (the node's `extra`): P
/// (b·a·s², compute dtype) when materialized, the log-sum-exp (b·a·s, accumulation type) when
/// memory-efficient, nothing under attention-only recompute. Forward and backward work on one
/// scratch of accumulation-type buffers per thread (at most one thread per head), allocated up
/// front; the backward returns one fresh (b·s, 3D) gradient.
pub fn fused_attention(g: &mut Graph, sh: &BlockShape, qkv: Nid) -> Nid {
    let cd = sh.cd();
    let acc = if sh.precision == Precision::Fp64 {
        8
    } else {
        4
    };
    let (s, dh) = (sh.s, sh.d / sh.heads);
    let nh = sh.b * sh.heads;
    let kb = FUSED_ATTN_KEY_BLOCK.min(s);
    let nt = cpu_threads().clamp(1, nh.max(1));
    // Elements per head: see `ops::AttnGeom::{fwd_scratch, bwd_scratch}`.
    // bf16 runs on the AVX512-BF16 kernel where the CPU has it (`attn_bf16::applies`), in every
    // mode: its own scratch, in bytes.
    let native = cd == Dtype::Bf16 && bf16_dot_native();
    let (name, extra, fwd, bwd) = if sh.attention == AttentionMode::MemoryEfficient {
        (
            "attention (fused, streaming; keeps lse)",
            nh * s * acc,
            4 * s * dh + s * kb + 2 * s,
            7 * s * dh + 2 * s * kb + s,
        )
    } else if sh.attention_only {
        (
            "attention (fused; P recomputed in backward)",
            0,
            4 * s * dh + s * s,
            7 * s * dh + 2 * s * s,
        )
    } else {
        (
            "attention (fused; keeps P)",
            nh * s * s * cd.size(),
            4 * s * dh + s * s,
            7 * s * dh + 2 * s * s,
        )
    };
    let (fwd_bytes, bwd_bytes) = if native && sh.attention == AttentionMode::MemoryEfficient {
        streaming_attention_scratch(s, dh, kb)
    } else if native {
        native_attention_scratch(s, dh)
    } else {
        (fwd * acc, bwd * acc)
    };
    let o = g.op(
        name,
        Kind::Custom {
            bwd_scratch: nt * bwd_bytes,
        },
        &[qkv],
        sh.e(),
        cd,
    );
    g.nodes[o].extra = extra;
    g.nodes[o].fwd_scratch = nt * fwd_bytes;
    o
}

/// One DiT block as `block_forward` builds it, on a leaf copy of its input.
/// Returns the graph and (input leaf, c, output).
pub fn block(sh: &BlockShape) -> (Graph, Nid, Nid, Nid) {
    let mut g = Graph::default();
    let (cd, ad) = (sh.cd(), sh.ad());
    let (e, d) = (sh.e(), sh.d);
    let rows = sh.b * sh.s;
    let bd = sh.b * d;
    let x = g.var("x (leaf copy of the block input)", e, ad, true);
    let c = g.var("c (shared leaf)", bd, ad, false);
    let m = ada_ln(
        &mut g,
        sh,
        "adaLN_modulation.1",
        c,
        6,
        Some(LoraTarget::Adaln),
    );

    // Written as (b·s, D) rows: no reshape before the linears.
    let h = ln_modulate(&mut g, "norm1+modulate1", x, m[0], m[1], rows, cd);
    g.bind(h);
    let h2d = h;
    let qkv = linear(
        &mut g,
        sh,
        "attn.qkv",
        h2d,
        rows,
        3 * d,
        d,
        Some(LoraTarget::Qkv),
    );
    let o2 = fused_attention(&mut g, sh, qkv);
    g.bind(o2);
    let p = linear(
        &mut g,
        sh,
        "attn.proj",
        o2,
        rows,
        d,
        d,
        Some(LoraTarget::Proj),
    );
    let x1 = gated_residual(&mut g, "x + proj·gate_msa (fused)", x, p, m[2]);
    g.bind(x1);

    let h2 = ln_modulate(&mut g, "norm2+modulate2", x1, m[3], m[4], rows, cd);
    g.bind(h2);
    let f1 = linear(
        &mut g,
        sh,
        "mlp.fc1",
        h2,
        rows,
        sh.mlp,
        d,
        Some(LoraTarget::Fc1),
    );
    g.bind(f1);
    let mut act = gelu(&mut g, "gelu(tanh) (fused)", f1);
    g.bind(act);
    if sh.mlp_dropout {
        let mask = g.constant("mlp dropout mask", rows * sh.mlp, cd, true);
        act = g.op("gelu·mask", Kind::Mul, &[act, mask], rows * sh.mlp, cd);
        g.bind(act);
    }
    let f2 = linear(
        &mut g,
        sh,
        "mlp.fc2",
        act,
        rows,
        d,
        sh.mlp,
        Some(LoraTarget::Fc2),
    );
    let out = gated_residual(&mut g, "x1 + fc2·gate_mlp (fused)", x1, f2, m[5]);
    (g, x, c, out)
}

/// The root the engine backpropagates a block from (`ops::backward_from(out, grad_out)`),
/// appended to a graph: returns the root.
pub fn seed(g: &mut Graph, out: Nid) -> Nid {
    let (e, dt) = (g.elems(out), g.dtype(out));
    let go = g.constant("grad_out", e, dt, false);
    g.op("grad seed", Kind::Seed, &[out, go], 1, dt)
}

/// The composed root `sum(out · grad_out)` appended to a graph (the composed attention core
/// still backpropagates from it): returns the root.
pub fn surrogate(g: &mut Graph, out: Nid) -> Nid {
    let (e, dt) = (g.elems(out), g.dtype(out));
    let go = g.constant("grad_out", e, dt, false);
    let m = g.op("out·grad_out", Kind::Mul, &[out, go], e, dt);
    g.op("sum", Kind::Sum, &[m], 1, dt)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(p: Precision) -> BlockShape {
        BlockShape {
            b: 2,
            s: 16,
            d: 32,
            heads: 4,
            mlp: 128,
            precision: p,
            attention: AttentionMode::Materialized,
            attention_only: false,
            lora: None,
            attn_dropout: false,
            mlp_dropout: false,
        }
    }

    #[test]
    fn add_of_two_leaves_keeps_their_grads() {
        let mut g = Graph::default();
        let a = g.var("a", 10, Dtype::F32, true);
        let b = g.var("b", 10, Dtype::F32, true);
        let s = g.op("a+b", Kind::Add, &[a, b], 10, Dtype::F32);
        let r = g.op("sum", Kind::Sum, &[s], 1, Dtype::F32);
        let bw = backward_with(&g, r, false);
        assert_eq!(bw.leaf_grads, 80);
        // ones(4) + zeros(40) + sum(40) at the worst moment of the sum's backward, then the
        // add's own gradient (40) with two zero+sum pairs.
        assert_eq!(bw.store, 80);
        assert!(bw.peak >= 40 + 80);
    }

    #[test]
    fn untracked_inputs_leave_gradients_in_the_store() {
        let mut g = Graph::default();
        let a = g.var("a", 10, Dtype::F32, true);
        let k = g.constant("k", 10, Dtype::F32, false);
        let m = g.op("a·k", Kind::Mul, &[a, k], 10, Dtype::F32);
        let r = g.op("sum", Kind::Sum, &[m], 1, Dtype::F32);
        let bw = backward_with(&g, r, false);
        // k's gradient enters the store and stays, and since it is computed from the tracked `a`
        // it holds its history: zeros, the product grad·a and the (detached) upstream gradient.
        // With a's own gradient that is five 40-byte tensors.
        assert_eq!(bw.store, 200);
        assert_eq!(bw.leaf_grads, 40);
    }

    #[test]
    fn block_keeps_more_in_materialized_mode() {
        let mut sh = shape(Precision::Fp32);
        let (g, ..) = block(&sh);
        let mat = owned_bytes(&g).0;
        sh.attention = AttentionMode::MemoryEfficient;
        let (g2, ..) = block(&sh);
        let eff = owned_bytes(&g2).0;
        assert!(mat > eff);
        let a = 2 * 4 * 16 * 16 * 4;
        // The fused attention keeps P (f32) where the streaming one keeps the log-sum-exp.
        let lse = 2 * 4 * 16 * 4;
        assert_eq!(mat - eff, a - lse);
    }

    #[test]
    fn block_weight_gradients_go_to_sinks_not_the_store() {
        for p in [Precision::Fp32, Precision::Bf16Mixed] {
            let sh = shape(p);
            let (mut g, _leaf, c, out) = block(&sh);
            let weights: Vec<Nid> = (0..g.nodes.len())
                .filter(|&i| {
                    let n = &g.nodes[i];
                    n.kind == Kind::Var
                        && (n.name.ends_with(".weight") || n.name.ends_with(".bias"))
                })
                .collect();
            // Every trained linear weight and bias of a block (5 linears) is sunk.
            assert_eq!(weights.len(), 10);
            assert!(weights
                .iter()
                .all(|&i| g.nodes[i].sunk && !g.nodes[i].tracks));
            let root = surrogate(&mut g, out);
            let bw = backward_with(&g, root, false);
            let expected: u64 = weights.iter().map(|&i| g.nodes[i].bytes()).sum();
            // The shared conditioning leaf c is a variable the graph does not own: its gradient
            // is the only other one counted with the weights'.
            assert_eq!(bw.weight_grads, expected + g.nodes[c].bytes(), "{p:?}");
            // The store (plus sinks) at the end holds the weight grads and the leaves' grads
            // (x and c, the leaf copies) and nothing chained to them.
            assert!(bw.store >= expected + bw.leaf_grads);
        }
    }

    #[test]
    fn mixed_precision_makes_no_weight_casts() {
        // The fused linears read the f32 master weights directly: no bf16 copies in the graph.
        let (g, ..) = block(&shape(Precision::Bf16Mixed));
        let (_, casts) = owned_bytes(&g);
        assert_eq!(casts, 0);
        let (g32, ..) = block(&shape(Precision::Fp32));
        let (_, casts32) = owned_bytes(&g32);
        assert_eq!(casts32, 0);
    }
}
