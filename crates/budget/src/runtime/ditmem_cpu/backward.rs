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
    /// An empty heap whose tensors carry `tmeta` (wrapper) and `smeta` (storage) bookkeeping
    /// bytes.
    fn new(tmeta: u64, smeta: u64) -> Heap {
        Heap {
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
        }
    }

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
    fn view(&mut self, x: Val, detach: bool) -> Val {
        match x {
            Val::Fwd(n) => Val::Fwd(n),
            Val::Tmp(w, t) => {
                let storage = self.holds[w][0];
                let mut holds = vec![storage];
                let tracks = t && !detach;
                if tracks {
                    holds.push(w);
                }
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
    let mut r = Replay {
        g,
        h: Heap::new(tmeta, smeta),
        store: vec![None; g.nodes.len()],
        sunk_grads: 0,
    };
    // `grads.insert(self, self.ones_like()?.contiguous()?)`
    let ones = r.make(g.nodes[root].bytes(), &[]);
    r.store[root] = Some(ones);
    // The gradients the seeds take by value (`ops::backward_from`): alive from the call, each
    // freed once its seed has added it into its output's entry.
    let mut seeded: Vec<Option<Val>> = vec![None; g.nodes.len()];
    for &x in &order {
        if g.nodes[x].kind == Kind::Seed {
            seeded[x] = Some(r.make(g.nodes[g.nodes[x].inputs[1]].bytes(), &[]));
        }
    }

    for &x in &order {
        if g.nodes[x].kind == Kind::Var {
            continue;
        }
        let Some(orig) = r.store[x].take() else {
            continue;
        };
        let grad = r.h.view(orig, true);
        let locals = r.node_backward(x, grad, seeded[x]);
        for v in locals {
            r.drop_val(v);
        }
        r.drop_val(grad);
        r.drop_val(orig);
    }
    r.finish()
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

/// One replay of candle's backward: the graph it walks, the heap of its tensors, the gradient
/// store (one entry per node) and the bytes moved into the linears' gradient sinks. Each rule
/// below is one op kind's formula, its allocations in the order candle makes them.
struct Replay<'g> {
    g: &'g Graph,
    h: Heap,
    store: Vec<Option<Val>>,
    sunk_grads: u64,
}

impl Replay<'_> {
    /// The data bytes of node `n`.
    fn bytes(&self, n: Nid) -> u64 {
        self.g.nodes[n].bytes()
    }

    /// [`Heap::make`] on this replay's graph.
    fn make(&mut self, bytes: u64, inputs: &[Val]) -> Val {
        self.h.make(self.g, bytes, inputs)
    }

    fn drop_val(&mut self, v: Val) {
        self.h.drop_val(v);
    }

    /// `grads.or_insert(t)?`: the stored gradient, or fresh zeros.
    fn or_insert(&mut self, t: Nid) -> Val {
        match self.store[t] {
            Some(v) => v,
            None => self.make(self.bytes(t), &[]),
        }
    }

    /// `*s = s.add(&partial)?` (or `sub`): the new sum replaces (and may hold) the old one.
    fn add_into(&mut self, t: Nid, old: Val, partial: Val) {
        let new = self.make(self.bytes(t), &[old, partial]);
        self.drop_val(old);
        self.store[t] = Some(new);
    }

    /// `or_insert` then `add`: one contribution to `t`'s gradient.
    fn acc(&mut self, t: Nid, partial: Val) {
        let old = self.or_insert(t);
        self.add_into(t, old, partial);
    }

    /// A view of the gradient added into `t`'s (`sum`, `copy`, `reshape`, … and an uncut
    /// `narrow`).
    fn acc_view(&mut self, t: Nid, grad: Val, locals: &mut Vec<Val>) {
        let v = self.h.view(grad, false);
        self.acc(t, v);
        locals.push(v);
    }

    /// One node's backward rule on its (detached) gradient: the contributions to its inputs'
    /// gradients in the order candle makes them, one arm per op kind as candle's `backward`
    /// match reads. Returns the temporaries the rule still holds (dropped when the node is done).
    fn node_backward(&mut self, x: Nid, grad: Val, seeded: Option<Val>) -> Vec<Val> {
        let g = self.g;
        let ins = &g.nodes[x].inputs;
        let mut locals: Vec<Val> = Vec::new();
        match g.nodes[x].kind {
            Kind::Add | Kind::Sub => {
                for &i in ins {
                    self.acc(i, grad);
                }
            }
            Kind::Mul => self.product_backward(x, grad, false, &mut locals),
            Kind::Div => self.product_backward(x, grad, true, &mut locals),
            Kind::Matmul => self.matmul_backward(x, grad, &mut locals),
            Kind::Broadcast => {
                let a = ins[0];
                let s = self.make(self.bytes(a), &[grad]);
                let bv = self.h.view(s, false);
                self.acc(a, bv);
                locals.extend([s, bv]);
            }
            Kind::Seed => {
                // The gradient the seed took: added into out's entry, then freed.
                let given = seeded.unwrap_or(Val::Fwd(ins[1]));
                self.acc(ins[0], given);
                locals.push(given);
            }
            Kind::Sum | Kind::Max | Kind::Copy | Kind::Transpose | Kind::Reshape => {
                self.acc_view(ins[0], grad, &mut locals)
            }
            Kind::ToDtype | Kind::Affine | Kind::Exp | Kind::Sqr | Kind::Powf => {
                self.pointwise_backward(x, grad, &mut locals)
            }
            Kind::Silu => self.silu_backward(x, grad, &mut locals),
            Kind::Gelu => self.gelu_backward(x, grad, &mut locals),
            Kind::Narrow {
                pad_before,
                pad_after,
            } => self.narrow_backward(x, grad, (pad_before, pad_after), &mut locals),
            Kind::IndexSelect => {
                let old = self.or_insert(ins[0]);
                self.add_into(ins[0], old, grad);
            }
            Kind::Attention { bwd_scratch } => self.attention_backward(x, bwd_scratch, &mut locals),
            Kind::Custom { bwd_scratch } => self.custom_backward(x, grad, bwd_scratch),
            Kind::Var | Kind::Const => {}
        }
        locals
    }

    /// `mul` (`div` when `div`): the lhs's contribution grad·rhs (grad/rhs), then the rhs's:
    /// grad·lhs (−grad·lhs/rhs², through two temporaries).
    fn product_backward(&mut self, x: Nid, grad: Val, div: bool, locals: &mut Vec<Val>) {
        let (l, r) = (self.g.nodes[x].inputs[0], self.g.nodes[x].inputs[1]);
        let nb = self.bytes(x);
        let lg = self.make(nb, &[grad, Val::Fwd(r)]);
        self.acc(l, lg);
        let rg = if div {
            let t1 = self.make(nb, &[grad, Val::Fwd(l)]);
            let t2 = self.make(nb, &[Val::Fwd(r)]);
            let rg = self.make(nb, &[t1, t2]);
            self.drop_val(t1);
            self.drop_val(t2);
            rg
        } else {
            self.make(nb, &[grad, Val::Fwd(l)])
        };
        self.acc(r, rg);
        locals.extend([lg, rg]);
    }

    /// The one-input pointwise ops (`to_dtype`, `affine`, `exp`, `sqr`, `powf`): the input's
    /// contribution through the temporaries each formula makes, in candle's order (`exp` and
    /// `to_dtype` take the input's sum before computing theirs).
    fn pointwise_backward(&mut self, x: Nid, grad: Val, locals: &mut Vec<Val>) {
        let node = &self.g.nodes[x];
        let input = node.inputs[0];
        let (a, arg) = (self.bytes(input), Val::Fwd(input));
        match node.kind {
            Kind::ToDtype => {
                let old = self.or_insert(input);
                let conv = self.make(a, &[grad]);
                self.add_into(input, old, conv);
                locals.push(conv);
            }
            Kind::Exp => {
                let old = self.or_insert(input);
                let p = self.make(self.bytes(x), &[grad, Val::Fwd(x)]);
                self.add_into(input, old, p);
                self.drop_val(p);
            }
            Kind::Affine => {
                let ag = self.make(a, &[grad]);
                self.acc(input, ag);
                locals.push(ag);
            }
            Kind::Sqr => {
                let t1 = self.make(a, &[arg, grad]);
                let ag = self.make(a, &[t1]);
                self.drop_val(t1);
                self.acc(input, ag);
                locals.push(ag);
            }
            Kind::Powf => {
                let t1 = self.make(a, &[arg]);
                let t2 = self.make(a, &[grad, t1]);
                let ag = self.make(a, &[t2]);
                self.drop_val(t1);
                self.drop_val(t2);
                self.acc(input, ag);
                locals.push(ag);
            }
            _ => unreachable!("pointwise_backward serves one-input pointwise kinds only"),
        }
    }

    /// `matmul`: grad·rᵀ, then lᵀ·grad, each with the f32 widening of a bf16 matmul.
    fn matmul_backward(&mut self, x: Nid, grad: Val, locals: &mut Vec<Val>) {
        let g = self.g;
        let node = &g.nodes[x];
        let (l, r) = (node.inputs[0], node.inputs[1]);
        let el = |i: Nid| g.nodes[g.storage(i)].elems;
        let w = self.h.obj(
            bf16_matmul_scratch(node.dtype, node.elems + el(r), g.nodes[l].elems),
            vec![],
        );
        let lg = self.make(self.bytes(l), &[grad, Val::Fwd(r)]);
        self.h.dec(w);
        self.acc(l, lg);
        let w = self.h.obj(
            bf16_matmul_scratch(node.dtype, el(l) + node.elems, g.nodes[r].elems),
            vec![],
        );
        let rg = self.make(self.bytes(r), &[Val::Fwd(l), grad]);
        self.h.dec(w);
        self.acc(r, rg);
        locals.extend([lg, rg]);
    }

    /// The one input of an elementwise op (`silu`, `gelu`) and its gradient so far
    /// ([`Replay::or_insert`]: a zero sum made now when it has none).
    fn elementwise_input(&mut self, x: Nid) -> (Nid, Val) {
        let input = self.g.nodes[x].inputs[0];
        (input, self.or_insert(input))
    }

    /// The chain rule's last step of an elementwise op (`silu`, `gelu`): `grad · d` (in the
    /// input's size), `d` freed, the product added into the input `t`'s gradient (`old`: its sum
    /// so far, from [`Replay::or_insert`]) and freed.
    fn grad_times_derivative(&mut self, (t, old): (Nid, Val), grad: Val, d: Val) {
        let p = self.make(self.bytes(t), &[grad, d]);
        self.drop_val(d);
        self.add_into(t, old, p);
        self.drop_val(p);
    }

    /// `silu`: the derivative through sigmoid temporaries, then one product with the gradient.
    fn silu_backward(&mut self, x: Nid, grad: Val, locals: &mut Vec<Val>) {
        let me = Val::Fwd(x);
        let (input, old) = self.elementwise_input(x);
        let (a, arg) = (self.bytes(input), Val::Fwd(input));
        let t1 = self.make(a, &[arg]);
        let t2 = self.make(a, &[t1]);
        let t3 = self.make(a, &[t2]);
        self.drop_val(t2);
        let sig = self.make(a, &[t3]);
        self.drop_val(t1);
        self.drop_val(t3);
        let u1 = self.make(a, &[me]);
        let u2 = self.make(a, &[sig, u1]);
        self.drop_val(u1);
        let u3 = self.make(a, &[u2, me]);
        self.drop_val(u2);
        self.grad_times_derivative((input, old), grad, u3);
        locals.push(sig);
    }

    /// `gelu` (tanh): the derivative through about a dozen temporaries, then one product with
    /// the gradient.
    fn gelu_backward(&mut self, x: Nid, grad: Val, locals: &mut Vec<Val>) {
        let (input, old) = self.elementwise_input(x);
        let (a, arg) = (self.bytes(input), Val::Fwd(input));
        let cube = self.make(a, &[arg]);
        let t1 = self.make(a, &[cube]);
        let t2 = self.make(a, &[arg]);
        let t3 = self.make(a, &[t1, t2]);
        self.drop_val(t1);
        self.drop_val(t2);
        let tanh = self.make(a, &[t3]);
        self.drop_val(t3);
        let u1 = self.make(a, &[tanh]);
        let u2 = self.make(a, &[cube]);
        self.drop_val(cube);
        let u3 = self.make(a, &[arg]);
        let u4 = self.make(a, &[u2, u3]);
        self.drop_val(u2);
        self.drop_val(u3);
        let u5 = self.make(a, &[tanh]);
        let u6 = self.make(a, &[u5]);
        self.drop_val(u5);
        let u7 = self.make(a, &[u4, u6]);
        self.drop_val(u4);
        self.drop_val(u6);
        let u8 = self.make(a, &[u1, u7]);
        self.drop_val(u1);
        self.drop_val(u7);
        let gg = self.make(a, &[u8]);
        self.drop_val(u8);
        self.grad_times_derivative((input, old), grad, gg);
        locals.push(tanh);
    }

    /// `narrow`: the gradient zero-padded and concatenated to the input's full size (a view when
    /// nothing is cut away).
    fn narrow_backward(
        &mut self,
        x: Nid,
        grad: Val,
        (pad_before, pad_after): (u64, u64),
        locals: &mut Vec<Val>,
    ) {
        let a = self.g.nodes[x].inputs[0];
        let es = self.g.nodes[x].dtype.size();
        if pad_before + pad_after == 0 {
            return self.acc_view(a, grad, locals);
        }
        let mut parts = vec![grad];
        let mut pads = Vec::new();
        for p in [pad_before, pad_after] {
            if p > 0 {
                let z = self.make(p * es, &[]);
                pads.push(z);
                parts.push(z);
            }
        }
        let cat = self.make(self.bytes(a), &parts);
        for z in pads {
            self.drop_val(z);
        }
        self.acc(a, cat);
        locals.push(cat);
    }

    /// Flash attention: its workspace, then dq, dk, dv (fresh, detached tensors of q's size),
    /// each added into its input's gradient as it comes.
    fn attention_backward(&mut self, x: Nid, bwd_scratch: u64, locals: &mut Vec<Val>) {
        let ins = &self.g.nodes[x].inputs;
        let q = self.bytes(ins[0]);
        let s = self.make(bwd_scratch, &[]);
        self.drop_val(s);
        for &i in ins {
            let d = self.make(q, &[]);
            locals.push(d);
            self.acc(i, d);
        }
    }

    /// A fused op of the engine: workspace while it makes one fresh gradient per input that
    /// tracks, then each folded into the store, or moved to the trainer's sink for sunk weights.
    fn custom_backward(&mut self, x: Nid, grad: Val, bwd_scratch: u64) {
        let g = self.g;
        let ins = &g.nodes[x].inputs;
        // The state the op frees itself (its workspace counts that state until it is freed).
        self.h.released += g.nodes[x].released_by_bwd;
        // `c.bwd(..)` returns all gradients before candle adds any of them.
        let scratch = self.make(bwd_scratch, &[]);
        let shared = g.nodes[x].grad_is_output_grad.map(|k| ins[k]);
        let grads: Vec<(Nid, Val)> = ins
            .iter()
            .filter(|&&i| g.nodes[i].tracks || g.nodes[i].sunk)
            .map(|&i| {
                if shared == Some(i) {
                    // A handle on the output gradient: nothing new.
                    (i, self.h.share(grad))
                } else {
                    (i, self.make(self.bytes(i), &[]))
                }
            })
            .collect();
        self.drop_val(scratch);
        let sunk_input = g.nodes[x].sunk_input.map(|k| ins[k]);
        for &(i, d) in &grads {
            if sunk_input == Some(i) {
                // Added into the trainer's running sum inside the op's backward, then freed.
                self.drop_val(d);
                continue;
            }
            if g.nodes[i].sunk {
                // Moved into the sink: alive after the backward, outside the store.
                self.sunk_grads += self.bytes(i) + self.h.tmeta + self.h.smeta;
                continue;
            }
            // `if let Some(arg_grad) = arg_grad { …add(&arg_grad) }`: each gradient is dropped
            // once folded, before the next input's (candle-core `backprop.rs`, CustomOp2/3).
            self.acc(i, d);
            self.drop_val(d);
        }
    }

    /// What `backward` leaves: the store's bytes (and the sinks'), split into leaf and weight
    /// gradients.
    fn finish(&self) -> Backward {
        let (g, h) = (self.g, &self.h);
        let meta = h.tmeta + h.smeta;
        let mut out = Backward {
            peak: h.peak,
            released: h.peak_released,
            store: h.live,
            weight_grads: self.sunk_grads,
            ..Backward::default()
        };
        for (t, v) in self.store.iter().enumerate() {
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
