//! The parts of a model's [`Sims`] every family assembles the same way from its own graphs:
//! a block with one input and one output, the final layer, the embed segment backpropagated
//! from the trainer's surrogate, the conditioning leaves and the embed's host scratch. Twin:
//! the engine's `trainer/family.rs` (the family schedule) and `trainer.rs` (DiT).

use crate::runtime::costs::{SegSim, Sims};
use crate::runtime::ditmem_cpu::backward::backward;
use crate::runtime::ditmem_cpu::dtypes::grad_dtype;
use crate::runtime::ditmem_cpu::graph::{
    forward_peak, kept_bytes, retained, stream_data, untracked_peak, Graph, Kind, Nid,
    STORAGE_META, TENSOR_META,
};
use crate::runtime::ditmem_cpu::ops::seed;
use crate::runtime::shape::Shape;
use crate::spec::Dtype;

/// One segment's graph seen from its roots: what it keeps (activations, weight casts, the leaf
/// and the output it holds), the backward root's own nodes, and its backward replayed through
/// candle's rules ([`backward`]) from `root`. `root_nodes`: the nodes at the graph's end made
/// for the backward call only; `held`: nodes the schedule keeps beside the root.
pub(crate) fn seg(
    g: &Graph,
    leaf: Option<Nid>,
    output: Option<Nid>,
    root: Nid,
    root_nodes: usize,
    held: &[Nid],
) -> SegSim {
    let mut roots = vec![root];
    roots.extend_from_slice(held);
    let (act, casts) = kept_bytes(g, &roots);
    let keep = retained(g, &roots);
    let kept = |x: Nid| if keep[x] { g.nodes[x].footprint() } else { 0 };
    let leaf_b = leaf.map_or(0, kept);
    let out_b = output.map_or(0, kept);
    // The backward root's own nodes exist only during backward.
    let root_b: u64 = (g.nodes.len() - root_nodes..g.nodes.len()).map(kept).sum();
    let bw = backward(g, root);
    SegSim {
        activations: act - leaf_b - out_b - root_b,
        weight_casts: casts,
        leaf: leaf_b,
        output: out_b,
        fwd_peak: 0,
        untracked_peak: 0,
        root: root_b,
        bwd_peak: bw.peak,
        bwd_released: bw.released,
        bwd_store: bw.store,
        bwd_leaf_grads: bw.leaf_grads,
        output_data: 0,
    }
}

/// A block of one input and one output: tracked on a leaf copy of its input and backpropagated
/// from one seed, and untracked on the input itself (no leaf copy; the output survives).
/// `build(track)` returns (graph, leaf, output) and is called once for each (what the engine
/// releases, `ops::release`, depends on what a backward would read).
pub(crate) fn block_sim(build: impl Fn(bool) -> (Graph, Nid, Nid)) -> SegSim {
    let (mut g, leaf, out) = build(true);
    let fwd = forward_peak(&g);
    let root = seed(&mut g, out);
    let mut s = seg(&g, Some(leaf), Some(out), root, 1, &[leaf, out]);
    s.fwd_peak = fwd;
    s.output_data = stream_data(&g, &[out]);
    let (mut ug, uleaf, uout) = build(false);
    ug.nodes[uleaf].alloc = false;
    s.untracked_peak = untracked_peak(&ug, &[uout]);
    s
}

/// A block of several stream leaves and outputs (an MMDiT's: SD3's joint block, Flux's double-
/// and single-stream ones): tracked on leaf copies of its streams and backpropagated from one
/// seed per output (`ops::backward_from_many`, [`super::ops::seeds`]), and untracked on its
/// inputs (no leaf copies; the outputs survive). `build(track)` returns (graph, leaves,
/// outputs) and is called once for each (what the engine releases depends on `track`).
pub(crate) fn blocks_sim(build: impl Fn(bool) -> (Graph, Vec<Nid>, Vec<Nid>)) -> SegSim {
    let (mut g, leaves, outs) = build(true);
    let fwd = forward_peak(&g);
    let n0 = g.nodes.len();
    let root = super::ops::seeds(&mut g, &outs).unwrap_or(n0);
    let mut held = leaves.clone();
    held.extend_from_slice(&outs);
    let mut s = seg(&g, None, None, root, g.nodes.len() - n0, &held);
    let bytes = |xs: &[Nid]| xs.iter().map(|&x| g.nodes[x].footprint()).sum::<u64>();
    let (l, o) = (bytes(&leaves), bytes(&outs));
    s.activations -= l + o;
    s.leaf = l;
    s.output = o;
    s.output_data = stream_data(&g, &outs);
    s.fwd_peak = fwd;
    let (mut ug, uleaves, uouts) = build(false);
    for l in uleaves {
        ug.nodes[l].alloc = false;
    }
    s.untracked_peak = untracked_peak(&ug, &uouts);
    s
}

/// The final layer and the loss on a leaf copy of the last block's output; the root
/// (loss·scale) exists only for the backward call.
pub(crate) fn final_sim(g: &Graph, leaf: Nid, root: Nid) -> SegSim {
    let mut s = seg(g, Some(leaf), None, root, 1, &[leaf]);
    s.fwd_peak = forward_peak(g) - g.nodes[root].footprint();
    s
}

/// What the embed segment hands on, as nodes of its graph.
pub(crate) struct EmbedOutputs<'a> {
    /// The residual streams the first block reads: the segment's output.
    pub streams: &'a [Nid],
    /// The conditioning every block reads: copied to leaves for the blocks, their gradients
    /// summed over the blocks and the final layer.
    pub conds: &'a [Nid],
    /// Other results the blocks read and nothing differentiates (Flux's RoPE tables): neither
    /// in the surrogate nor in the embed's tail.
    pub tables: &'a [Nid],
    /// The embed trains nothing ([`Shape::frozen_embed`]): the schedule drops its locals after
    /// the forward, makes no conditioning leaves or gradients and runs no embed backward.
    pub frozen: bool,
}

/// The embed segment and what goes with it.
pub(crate) struct EmbedSim {
    pub seg: SegSim,
    /// [`Sims::embed_tail`].
    pub tail: (u64, u64),
    /// [`Sims::c_leaf`].
    pub c_leaf: u64,
    /// [`Sims::cond_grad`].
    pub cond_grad: u64,
}

/// The embed segment, backpropagated from the gradients of its outputs, the streams then the
/// conditioning, by `ops::backward_from_many` (`trainer/family.rs`, "Embed segment backward";
/// [`super::ops::seeds`]). The
/// graph's bound nodes (the embed's locals) are held to the end of the backward; those that
/// are not outputs are its tail. The trainer sums the conditioning's gradients in
/// `cond_grad_dtype` (the family schedule: the gradient dtype; DiT's `trainer.rs`: the
/// accumulation dtype).
pub(crate) fn embed_sim(mut g: Graph, o: &EmbedOutputs, cond_grad_dtype: Dtype) -> EmbedSim {
    let fwd = forward_peak(&g);
    let n0 = g.nodes.len();
    let outs: Vec<Nid> = [o.streams, o.conds].concat();
    let root = super::ops::seeds(&mut g, &outs).expect("an embed has a residual stream");
    let root_nodes = g.nodes.len() - n0;
    let held = g.bound();
    let outs: Vec<Nid> = [o.streams, o.conds, o.tables].concat();
    let tail: Vec<Nid> = held.iter().copied().filter(|n| !outs.contains(n)).collect();
    let tail = kept_bytes(&g, &tail);
    let mut s = seg(&g, None, None, root, root_nodes, &held);
    let keep = retained(&g, &[&[root][..], &held].concat());
    s.output = o
        .streams
        .iter()
        .filter(|&&x| keep[x])
        .map(|&x| g.nodes[x].footprint())
        .sum();
    s.activations -= s.output;
    s.fwd_peak = fwd;
    s.output_data = stream_data(&g, o.streams);
    if o.frozen {
        s.activations -= tail.0;
        s.weight_casts -= tail.1;
        s.root = 0;
        s.bwd_peak = 0;
        s.bwd_released = 0;
        s.bwd_store = 0;
        s.bwd_leaf_grads = 0;
        return EmbedSim {
            seg: s,
            tail: (0, 0),
            c_leaf: 0,
            cond_grad: 0,
        };
    }
    let meta = TENSOR_META + STORAGE_META;
    let c_leaf = o
        .conds
        .iter()
        .map(|&c| g.elems(c) * g.dtype(c).size() + meta)
        .sum();
    let cond_grad = o
        .conds
        .iter()
        .map(|&c| g.elems(c) * cond_grad_dtype.size() + meta)
        .sum();
    EmbedSim {
        seg: s,
        tail,
        c_leaf,
        cond_grad,
    }
}

/// Transient host bytes of the embed forward beyond its graph: noisy() makes the latents on
/// the host in f64 and casts them, patchify makes a contiguous copy; the timestep features
/// are made in f64; a text encoder's states (`text_elems` a batch) come as f64 and are freed
/// once cast.
pub(crate) fn embed_scratch(sh: &Shape, freq: u64, text_elems: u64) -> u64 {
    let (ad, n_lat) = (sh.ad(), sh.latent);
    let mut scratch = n_lat * 8 + n_lat * ad.size() + n_lat * ad.size();
    scratch = scratch.max(sh.b * freq * 8);
    if sh.cd() != Dtype::F64 {
        scratch = scratch.max(text_elems * 8);
    }
    scratch
}

/// A family's [`Sims`] with every block of one kind.
pub(crate) fn sims(embed: EmbedSim, block: SegSim, final_layer: SegSim, scratch: u64) -> Sims {
    Sims {
        embed: embed.seg,
        block,
        final_layer,
        c_leaf: embed.c_leaf,
        embed_scratch: scratch,
        embed_tail: embed.tail,
        cond_grad: embed.cond_grad,
        last_block: None,
        second: None,
        dual: None,
        streams_once: true,
    }
}

/// The final layer's graph begun: a tracked leaf copy of the last block's output (b·s·D in the
/// accumulation dtype). Returns (graph, leaf).
pub(crate) fn final_leaf(sh: &Shape) -> (Graph, Nid) {
    crate::runtime::ditmem_cpu::block::stream_leaf(sh, "final leaf")
}

/// The family schedule's loss ([`family_loss`]) on the prediction `y` [`unpatchified`]. Returns
/// the root (loss·scale).
pub(crate) fn prediction_loss(
    g: &mut Graph,
    sh: &Shape,
    y: Nid,
    c_out: u64,
    names: [&str; 3],
) -> Nid {
    let (pred, lat) = unpatchified(g, sh, y, c_out, names);
    family_loss(g, pred, lat, grad_dtype(sh.precision))
}

/// The prediction `y` (b·s rows of p²·`c_out` values in the accumulation dtype) unpatchified as
/// the trainers do, and its latent channels: the reshape to patches, the permuted view, the
/// contiguous copy, the image view, the first C channels (a narrow view: ε of a learned-sigma
/// output) cast to the gradient dtype. `names`: the patch reshape, the image reshape and the
/// channels' view, as the engine names them (video adds a frame axis). Returns (prediction,
/// its elements).
pub(crate) fn unpatchified(
    g: &mut Graph,
    sh: &Shape,
    y: Nid,
    c_out: u64,
    names: [&str; 3],
) -> (Nid, u64) {
    let (ad, ld) = (sh.ad(), grad_dtype(sh.precision));
    let rows = sh.b * sh.s;
    let out_el = rows * sh.patch2 * c_out;
    let y = g.view(names[0], Kind::Reshape, y, out_el);
    let y = g.view("permute", Kind::Transpose, y, out_el);
    let img = g.op("unpatchify (contiguous)", Kind::Copy, &[y], out_el, ad);
    let img = g.view(names[1], Kind::Reshape, img, out_el);
    let lat = rows * sh.patch2 * sh.c_in;
    let pred = g.view(
        names[2],
        Kind::Narrow {
            pad_before: 0,
            pad_after: out_el - lat,
        },
        img,
        lat,
    );
    (g.cast(&format!("pred→{ld}"), pred, ld), lat)
}

/// The family schedule's loss on the prediction `pred` (`elems` values in the gradient dtype
/// `ld`; `trainer/family.rs`): one `ops::mse_loss` node keeping d = pred − target (made beside
/// the target, which goes once subtracted) and handing d back, scaled in place, as the
/// prediction's gradient; the prediction released after it (when it is its whole storage, not
/// a narrowed view: no rule reads it). Returns the root (loss·scale).
pub(crate) fn family_loss(g: &mut Graph, pred: Nid, elems: u64, ld: Dtype) -> Nid {
    let target = g.constant("target", elems, ld, true);
    // `Batch::target`: the values made in f64 on the host, cast beside them (none to cast
    // under the fp64 policy).
    if ld != Dtype::F64 {
        g.nodes[target].fwd_scratch = elems * 8 + TENSOR_META + STORAGE_META;
    }
    let loss = g.op(
        "mean((pred − target)²) (fused)",
        Kind::Custom { bwd_scratch: 0 },
        &[pred],
        1,
        ld,
    );
    // d and its tensor bookkeeping, freed when the backward hands d on as the gradient.
    let d = elems * ld.size() + TENSOR_META + STORAGE_META;
    g.nodes[loss].extra = d;
    g.nodes[loss].released_by_bwd = d;
    g.release(target);
    if g.elems(g.storage(pred)) == elems {
        g.release(pred);
    }
    g.op("loss·scale/accumulation", Kind::Affine, &[loss], 1, ld)
}
