//! Candle's backward replayed on a [`Graph`] (candle-core 0.11 `src/backprop.rs`): each rule's
//! allocations in the order candle's code makes them, with the references that keep temporaries
//! alive in the gradient store counted by a small heap model.

use crate::runtime::ditmem_cpu::graph::{
    bf16_matmul_scratch, Graph, Kind, Nid, STORAGE_META, TENSOR_META,
};

/// What a replay of candle's backward gives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Backward {
    /// Bytes held by the gradient store and backward temporaries at the backward's worst
    /// moment: where they, less the forward bytes freed by then ([`Backward::released`]), are
    /// highest.
    pub peak: u64,
    /// Forward bytes (activations the ops own, `Node::released_by_bwd`) freed by the backward
    /// before its worst moment.
    pub released: u64,
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
    /// `live` at the worst moment: where `live − released` is highest.
    peak: u64,
    /// Forward bytes the ops have freed so far, and at the worst moment.
    released: u64,
    peak_released: u64,
    /// The highest `live − released` so far.
    net_peak: u64,
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
        let net = self.live.saturating_sub(self.released);
        if net > self.net_peak {
            self.net_peak = net;
            self.peak = self.live;
            self.peak_released = self.released;
        }
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

    /// Another handle on `v` (an `Arc` clone of its tensor): no bytes, one more reference.
    fn share(&mut self, v: Val) -> Val {
        if let Val::Tmp(w, _) = v {
            self.refs[w] += 1;
        }
        v
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
pub(crate) fn backward_with(g: &Graph, root: Nid, meta: bool) -> Backward {
    let (tmeta, smeta) = if meta {
        (TENSOR_META, STORAGE_META)
    } else {
        (0, 0)
    };
    let order = post_order(g, root);
    let mut h = Heap {
        bytes: Vec::new(),
        refs: Vec::new(),
        holds: Vec::new(),
        live: 0,
        peak: 0,
        released: 0,
        peak_released: 0,
        net_peak: 0,
        tmeta,
        smeta,
    };
    let mut store: Vec<Option<Val>> = vec![None; g.nodes.len()];
    let mut sunk_grads = 0u64;
    // `grads.insert(self, self.ones_like()?.contiguous()?)`
    store[root] = Some(h.make(g, g.nodes[root].bytes(), &[]));
    // The gradients the seeds take by value (`ops::backward_from`): alive from the call, each
    // freed once its seed has added it into its output's entry.
    let mut seeded: Vec<Option<Val>> = vec![None; g.nodes.len()];
    for &x in &order {
        if g.nodes[x].kind == Kind::Seed {
            seeded[x] = Some(h.make(g, g.nodes[g.nodes[x].inputs[1]].bytes(), &[]));
        }
    }

    for &x in &order {
        if g.nodes[x].kind == Kind::Var {
            continue;
        }
        let Some(orig) = store[x].take() else {
            continue;
        };
        let grad = h.view(g, orig, true);
        let locals = node_backward(&mut h, g, &mut store, x, grad, seeded[x], &mut sunk_grads);
        for v in locals {
            h.drop_val(v);
        }
        h.drop_val(grad);
        h.drop_val(orig);
    }
    finish(g, &h, &store, sunk_grads)
}

/// The nodes `backward` visits: reverse depth-first post-order from the root (lhs before rhs),
/// only those on a path to a variable.
fn post_order(g: &Graph, root: Nid) -> Vec<Nid> {
    let mut seen: Vec<Option<bool>> = vec![None; g.nodes.len()];
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
    order
}

/// `grads.or_insert(t)?`: the stored gradient, or fresh zeros.
fn or_insert(h: &mut Heap, g: &Graph, store: &[Option<Val>], t: Nid) -> Val {
    match store[t] {
        Some(v) => v,
        None => h.make(g, g.nodes[t].bytes(), &[]),
    }
}

/// `*s = s.add(&partial)?` (or `sub`): the new sum replaces (and may hold) the old one.
fn add_into(h: &mut Heap, g: &Graph, store: &mut [Option<Val>], t: Nid, old: Val, partial: Val) {
    let new = h.make(g, g.nodes[t].bytes(), &[old, partial]);
    h.drop_val(old);
    store[t] = Some(new);
}

/// `or_insert` then `add`: one contribution to `t`'s gradient.
fn acc(h: &mut Heap, g: &Graph, store: &mut [Option<Val>], t: Nid, partial: Val) {
    let old = or_insert(h, g, store, t);
    add_into(h, g, store, t, old, partial);
}

/// The one input of an elementwise op (`silu`, `gelu`) and its gradient so far ([`or_insert`]:
/// a zero sum made now when it has none).
fn elementwise_input(h: &mut Heap, g: &Graph, store: &[Option<Val>], x: Nid) -> (Nid, Val) {
    let input = g.nodes[x].inputs[0];
    (input, or_insert(h, g, store, input))
}

/// The chain rule's last step of an elementwise op (`silu`, `gelu`): `grad · d` (in the
/// input's size), `d` freed, the product added into the input `t`'s gradient (`old`: its sum so
/// far, from [`or_insert`]) and freed.
fn grad_times_derivative(
    h: &mut Heap,
    g: &Graph,
    store: &mut [Option<Val>],
    (t, old): (Nid, Val),
    grad: Val,
    d: Val,
) {
    let p = h.make(g, g.nodes[t].bytes(), &[grad, d]);
    h.drop_val(d);
    add_into(h, g, store, t, old, p);
    h.drop_val(p);
}

/// One node's backward rule on its (detached) gradient: the contributions to its inputs'
/// gradients in the order candle makes them. Returns the temporaries the rule still holds
/// (dropped when the node is done).
// Over 100 lines on purpose: one arm per op kind as candle's `backward` match reads; the long
// rules are functions of their own, the short ones stay beside it.
fn node_backward(
    h: &mut Heap,
    g: &Graph,
    store: &mut [Option<Val>],
    x: Nid,
    grad: Val,
    seeded: Option<Val>,
    sunk_grads: &mut u64,
) -> Vec<Val> {
    let node = &g.nodes[x];
    let bytes = |x: Nid| g.nodes[x].bytes();
    let ins = node.inputs.clone();
    let nb = bytes(x);
    let me = Val::Fwd(x);
    let mut locals: Vec<Val> = Vec::new();
    match node.kind {
        Kind::Add | Kind::Sub => {
            for &i in &ins {
                acc(h, g, store, i, grad);
            }
        }
        Kind::Mul => {
            let lg = h.make(g, nb, &[grad, Val::Fwd(ins[1])]);
            acc(h, g, store, ins[0], lg);
            let rg = h.make(g, nb, &[grad, Val::Fwd(ins[0])]);
            acc(h, g, store, ins[1], rg);
            locals.extend([lg, rg]);
        }
        Kind::Div => {
            let lg = h.make(g, nb, &[grad, Val::Fwd(ins[1])]);
            acc(h, g, store, ins[0], lg);
            let t1 = h.make(g, nb, &[grad, Val::Fwd(ins[0])]);
            let t2 = h.make(g, nb, &[Val::Fwd(ins[1])]);
            let rg = h.make(g, nb, &[t1, t2]);
            h.drop_val(t1);
            h.drop_val(t2);
            acc(h, g, store, ins[1], rg);
            locals.extend([lg, rg]);
        }
        Kind::Matmul => matmul_backward(h, g, store, x, grad, &mut locals),
        Kind::Broadcast => {
            let a = ins[0];
            let s = h.make(g, bytes(a), &[grad]);
            let bv = h.view(g, s, false);
            acc(h, g, store, a, bv);
            locals.extend([s, bv]);
        }
        Kind::Seed => {
            // The gradient the seed took: added into out's entry, then freed.
            let given = seeded.unwrap_or(Val::Fwd(ins[1]));
            acc(h, g, store, ins[0], given);
            locals.push(given);
        }
        Kind::Sum | Kind::Max | Kind::Copy | Kind::Transpose | Kind::Reshape => {
            let v = h.view(g, grad, false);
            acc(h, g, store, ins[0], v);
            locals.push(v);
        }
        Kind::ToDtype => {
            let a = ins[0];
            let old = or_insert(h, g, store, a);
            let conv = h.make(g, bytes(a), &[grad]);
            add_into(h, g, store, a, old, conv);
            locals.push(conv);
        }
        Kind::Affine => {
            let ag = h.make(g, bytes(ins[0]), &[grad]);
            acc(h, g, store, ins[0], ag);
            locals.push(ag);
        }
        Kind::Exp => {
            let old = or_insert(h, g, store, ins[0]);
            let p = h.make(g, nb, &[grad, me]);
            add_into(h, g, store, ins[0], old, p);
            h.drop_val(p);
        }
        Kind::Sqr => {
            let a = bytes(ins[0]);
            let t1 = h.make(g, a, &[Val::Fwd(ins[0]), grad]);
            let ag = h.make(g, a, &[t1]);
            h.drop_val(t1);
            acc(h, g, store, ins[0], ag);
            locals.push(ag);
        }
        Kind::Powf => {
            let a = bytes(ins[0]);
            let t1 = h.make(g, a, &[Val::Fwd(ins[0])]);
            let t2 = h.make(g, a, &[grad, t1]);
            let ag = h.make(g, a, &[t2]);
            h.drop_val(t1);
            h.drop_val(t2);
            acc(h, g, store, ins[0], ag);
            locals.push(ag);
        }
        Kind::Silu => silu_backward(h, g, store, x, grad, &mut locals),
        Kind::Gelu => gelu_backward(h, g, store, x, grad, &mut locals),
        Kind::Narrow {
            pad_before,
            pad_after,
        } => narrow_backward(h, g, store, x, grad, (pad_before, pad_after), &mut locals),
        Kind::IndexSelect => {
            let a = ins[0];
            let old = or_insert(h, g, store, a);
            add_into(h, g, store, a, old, grad);
        }
        Kind::Attention { bwd_scratch } => {
            let q = bytes(ins[0]);
            let s = h.make(g, bwd_scratch, &[]);
            h.drop_val(s);
            // dq, dk, dv come back detached (fresh tensors).
            for &i in &ins {
                let d = h.make(g, q, &[]);
                locals.push(d);
                acc(h, g, store, i, d);
            }
        }
        Kind::Custom { bwd_scratch } => {
            custom_backward(h, g, store, (x, grad), bwd_scratch, sunk_grads)
        }
        Kind::Var | Kind::Const => {}
    }
    locals
}

/// `matmul`: grad·rᵀ, then lᵀ·grad, each with the f32 widening of a bf16 matmul.
fn matmul_backward(
    h: &mut Heap,
    g: &Graph,
    store: &mut [Option<Val>],
    x: Nid,
    grad: Val,
    locals: &mut Vec<Val>,
) {
    let node = &g.nodes[x];
    let ins = &node.inputs;
    let bytes = |x: Nid| g.nodes[x].bytes();
    let (l, r) = (ins[0], ins[1]);
    let el = |i: Nid| g.nodes[g.storage(i)].elems;
    // grad·rᵀ, then lᵀ·grad, each with the f32 widening of a bf16 matmul.
    let w = h.obj(
        bf16_matmul_scratch(node.dtype, node.elems + el(r), g.nodes[l].elems),
        vec![],
    );
    let lg = h.make(g, bytes(l), &[grad, Val::Fwd(r)]);
    h.dec(w);
    acc(h, g, store, l, lg);
    let w = h.obj(
        bf16_matmul_scratch(node.dtype, el(l) + node.elems, g.nodes[r].elems),
        vec![],
    );
    let rg = h.make(g, bytes(r), &[Val::Fwd(l), grad]);
    h.dec(w);
    acc(h, g, store, r, rg);
    locals.extend([lg, rg]);
}

/// `silu`: the derivative through sigmoid temporaries, then one product with the gradient.
fn silu_backward(
    h: &mut Heap,
    g: &Graph,
    store: &mut [Option<Val>],
    x: Nid,
    grad: Val,
    locals: &mut Vec<Val>,
) {
    let me = Val::Fwd(x);
    let (input, old) = elementwise_input(h, g, store, x);
    let (a, arg) = (g.nodes[input].bytes(), Val::Fwd(input));
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
    grad_times_derivative(h, g, store, (input, old), grad, u3);
    locals.push(sig);
}

/// `gelu` (tanh): the derivative through about a dozen temporaries, then one product with the
/// gradient.
fn gelu_backward(
    h: &mut Heap,
    g: &Graph,
    store: &mut [Option<Val>],
    x: Nid,
    grad: Val,
    locals: &mut Vec<Val>,
) {
    let (input, old) = elementwise_input(h, g, store, x);
    let (a, arg) = (g.nodes[input].bytes(), Val::Fwd(input));
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
    grad_times_derivative(h, g, store, (input, old), grad, gg);
    locals.push(tanh);
}

/// `narrow`: the gradient zero-padded and concatenated to the input's full size (a view when
/// nothing is cut away).
fn narrow_backward(
    h: &mut Heap,
    g: &Graph,
    store: &mut [Option<Val>],
    x: Nid,
    grad: Val,
    (pad_before, pad_after): (u64, u64),
    locals: &mut Vec<Val>,
) {
    let ins = &g.nodes[x].inputs;
    let bytes = |x: Nid| g.nodes[x].bytes();
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
        acc(h, g, store, a, cat);
        locals.push(cat);
    } else {
        let v = h.view(g, grad, false);
        acc(h, g, store, a, v);
        locals.push(v);
    }
}

/// A fused op of the engine: workspace while it makes one fresh gradient per input that
/// tracks, then each folded into the store, or moved to the trainer's sink for sunk weights.
fn custom_backward(
    h: &mut Heap,
    g: &Graph,
    store: &mut [Option<Val>],
    (x, grad): (Nid, Val),
    bwd_scratch: u64,
    sunk_grads: &mut u64,
) {
    let ins = &g.nodes[x].inputs;
    let bytes = |x: Nid| g.nodes[x].bytes();
    // The state the op frees itself (its workspace counts that state until it is freed).
    h.released += g.nodes[x].released_by_bwd;
    // `c.bwd(..)` returns all gradients before candle adds any of them.
    let scratch = h.make(g, bwd_scratch, &[]);
    let shared = g.nodes[x].grad_is_output_grad.map(|k| ins[k]);
    let grads: Vec<(Nid, Val)> = ins
        .iter()
        .filter(|&&i| g.nodes[i].tracks || g.nodes[i].sunk)
        .map(|&i| {
            if shared == Some(i) {
                // A handle on the output gradient: nothing new.
                (i, h.share(grad))
            } else {
                (i, h.make(g, bytes(i), &[]))
            }
        })
        .collect();
    h.drop_val(scratch);
    let sunk_input = g.nodes[x].sunk_input.map(|k| ins[k]);
    for &(i, d) in &grads {
        if sunk_input == Some(i) {
            // Added into the trainer's running sum inside the op's backward, then freed.
            h.drop_val(d);
            continue;
        }
        if g.nodes[i].sunk {
            // Moved into the sink: alive after the backward, outside the store.
            *sunk_grads += bytes(i) + h.tmeta + h.smeta;
            continue;
        }
        // `if let Some(arg_grad) = arg_grad { …add(&arg_grad) }`: each gradient is dropped once
        // folded, before the next input's (candle-core `backprop.rs`, CustomOp2/CustomOp3).
        acc(h, g, store, i, d);
        h.drop_val(d);
    }
}

/// What `backward` leaves: the store's bytes (and the sinks'), split into leaf and weight
/// gradients.
fn finish(g: &Graph, h: &Heap, store: &[Option<Val>], sunk_grads: u64) -> Backward {
    let meta = h.tmeta + h.smeta;
    let mut out = Backward {
        peak: h.peak,
        released: h.peak_released,
        store: h.live,
        weight_grads: sunk_grads,
        ..Backward::default()
    };
    for (t, v) in store.iter().enumerate() {
        if v.is_some() && g.nodes[t].kind == Kind::Var {
            if g.nodes[t].alloc {
                out.leaf_grads += g.nodes[t].bytes() + meta;
            } else {
                out.weight_grads += g.nodes[t].bytes() + meta;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::Dtype;

    /// A graph begun with a tracked f32 leaf `a` of 10 values.
    fn leaf_a() -> (Graph, Nid) {
        let mut g = Graph::default();
        let a = g.var("a", 10, Dtype::F32, true);
        (g, a)
    }

    /// The backward of the sum of `x` (an f32 root of one value).
    fn backward_of_sum(mut g: Graph, x: Nid) -> Backward {
        let r = g.op("sum", Kind::Sum, &[x], 1, Dtype::F32);
        backward_with(&g, r, false)
    }

    #[test]
    fn add_of_two_leaves_keeps_their_grads() {
        let (mut g, a) = leaf_a();
        let b = g.var("b", 10, Dtype::F32, true);
        let s = g.op("a+b", Kind::Add, &[a, b], 10, Dtype::F32);
        let bw = backward_of_sum(g, s);
        assert_eq!(bw.leaf_grads, 80);
        // ones(4) + zeros(40) + sum(40) at the worst moment of the sum's backward, then the
        // add's own gradient (40) with two zero+sum pairs.
        assert_eq!(bw.store, 80);
        assert!(bw.peak >= 40 + 80);
    }

    #[test]
    fn untracked_inputs_leave_gradients_in_the_store() {
        let (mut g, a) = leaf_a();
        let k = g.constant("k", 10, Dtype::F32, false);
        let m = g.op("a·k", Kind::Mul, &[a, k], 10, Dtype::F32);
        let bw = backward_of_sum(g, m);
        // k's gradient enters the store and stays, and since it is computed from the tracked `a`
        // it holds its history: zeros, the product grad·a and the (detached) upstream gradient.
        // With a's own gradient that is five 40-byte tensors.
        assert_eq!(bw.store, 200);
        assert_eq!(bw.leaf_grads, 40);
    }

    /// Three custom ops in a chain a → f → l → m; l keeps 1,000 bytes of its own state and,
    /// when it frees them as its backward starts, every later moment stands on that many fewer
    /// forward bytes. Each moment holds the op's gradient (40), its workspace and its input's
    /// gradient (40): m 980, l 1,580, f 1,280.
    #[test]
    fn state_an_op_frees_lowers_its_moment_and_those_after_it() {
        let build = |release: u64| {
            let (mut g, a) = leaf_a();
            let f = g.op(
                "f",
                Kind::Custom { bwd_scratch: 1200 },
                &[a],
                10,
                Dtype::F32,
            );
            let l = g.op(
                "l",
                Kind::Custom { bwd_scratch: 1500 },
                &[f],
                10,
                Dtype::F32,
            );
            g.nodes[l].extra = 1000;
            g.nodes[l].released_by_bwd = release;
            let m = g.op("m", Kind::Custom { bwd_scratch: 900 }, &[l], 10, Dtype::F32);
            backward_of_sum(g, m)
        };
        let kept = build(0);
        assert_eq!((kept.peak, kept.released), (1580, 0), "l's moment");
        // Freed: l's moment is 580 net, f's 280; m's (980, before the release) is the worst.
        let freed = build(1000);
        assert_eq!((freed.peak, freed.released), (980, 0), "m's moment");
        // A small release leaves l's moment the worst, 100 bytes fewer of it net.
        let small = build(100);
        assert_eq!((small.peak, small.released), (1580, 100), "l's moment");
        assert_eq!(
            kept.store, freed.store,
            "the release leaves the store as it was"
        );
    }
}
