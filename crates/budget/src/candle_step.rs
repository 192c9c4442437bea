//! The `ditmem-cpu` step timeline: a replay of `ditmem-engine`'s `Trainer::step` over the candle
//! graphs of [`crate::candle`].
//!
//! The replay follows the engine's code path: the microbatch slice of the batch, the embed
//! segment (kept to the end of backward), each block on a leaf copy of its input (stored) or on
//! its input without tracking (recomputed), the final layer on a leaf copy, then backward through
//! the final layer's loss and each block from its output gradient (the seed of
//! `ops::backward_from`), the gradient buffers (moved out of the gradient store, or out of the
//! linears' gradient sinks, on the first microbatch, summed on later ones), and the optimizer
//! step: the gradient norm, AdamW's temporaries, the EMA update. Every event is a point
//! the engine's recorder marks (`inside: false`) or the worst moment between two marks.

use serde::Serialize;

use crate::candle::{
    self, backward, forward_peak, kept_bytes, untracked_peak, BlockShape, Graph, Kind, Nid,
};
use crate::params::{ParamRole, ParamTensor};
use crate::runtime::Dims;
use crate::spec::{Dtype, Optimizer, Precision, Spec};
use crate::timeline::{Breakdown, Event, Events, Phase, StaticBytes};

/// Gradient buffers of the engine: fp32, fp64 under the fp64 policy (also under bf16-pure).
pub fn grad_dtype(p: Precision) -> Dtype {
    if p == Precision::Fp64 {
        Dtype::F64
    } else {
        Dtype::F32
    }
}

/// Packing buffers the `gemm` crate under candle keeps per thread after the first matmuls: about
/// 1 MiB per thread of the pool (the step runs on a pool worker, so every thread that calls or
/// helps a matmul is one), measured with the counting allocator on this project's 2-core machines
/// (1,048,574 B per thread with 1, 2 and 4 threads). They are sized from the CPU's caches, so
/// other machines differ a little; `ditmem compare` reports the measured value beside this one.
/// None when the step makes no `gemm` product (see [`step_uses_gemm`]).
pub fn gemm_workspace_bytes(threads: u64) -> u64 {
    const PER_THREAD: u64 = 1_048_576;
    threads.max(1) * PER_THREAD
}

/// Whether a step of `spec` multiplies through candle's `gemm` crate: f32/f64 products, bf16 or
/// f16 products widened to f32 (no AVX512-BF16 kernel, or f16), and LoRA adapters (composed
/// candle matmuls). bf16 linears and attention on the engine's kernel make none.
pub fn step_uses_gemm(spec: &Spec) -> bool {
    let bf16_native =
        spec.recipe.precision.compute_dtype() == Dtype::Bf16 && candle::bf16_dot_native();
    !bf16_native || spec.recipe.lora.is_some()
}

/// The results of simulating one segment's graph.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SegSim {
    /// Activations the tracked graph owns, leaves and output excluded.
    pub activations: u64,
    /// Weight casts the tracked graph owns.
    pub weight_casts: u64,
    /// The leaf copy the segment runs on (0 for the embed segment).
    pub leaf: u64,
    /// The output buffer.
    pub output: u64,
    /// Highest bytes while building the tracked graph (leaf and output included).
    pub fwd_peak: u64,
    /// Highest bytes of a no-grad forward on the input (blocks only; output included).
    pub untracked_peak: u64,
    /// The backward root's own buffers during backward.
    pub root: u64,
    /// Candle backward replay.
    pub bwd_peak: u64,
    pub bwd_store: u64,
    pub bwd_leaf_grads: u64,
}

/// The three segments of the engine under a spec.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Sims {
    pub embed: SegSim,
    pub block: SegSim,
    pub final_layer: SegSim,
    /// The conditioning leaf shared by blocks and final layer (b·D).
    pub c_leaf: u64,
    /// Transient bytes of the embed forward beyond its graph (host f64 latents, the noisy
    /// latents and their patchified copy).
    pub embed_scratch: u64,
    /// What the embed's locals still hold after its backward, until `microbatch` returns
    /// (activations, weight casts).
    pub embed_tail: (u64, u64),
}

pub fn shape(d: &Dims) -> BlockShape {
    BlockShape {
        b: d.b,
        s: d.s,
        d: d.d,
        heads: d.heads,
        mlp: d.mlp,
        precision: d.precision,
        attention: d.attention,
        attention_only: d.attention_only,
        lora: d.lora.clone(),
        attn_dropout: d.attn_dropout,
        mlp_dropout: d.mlp_dropout,
    }
}

/// The embed segment: patch embedding + pos table, timestep MLP, label rows, c = t + y.
/// Returns (graph, x0, c).
pub fn embed_graph(dims: &Dims) -> (Graph, Nid, Nid) {
    let sh = shape(dims);
    let (cd, ad) = (sh.precision.compute_dtype(), sh.precision.accum_dtype());
    let p2 = dims.patch2;
    let rows = sh.b * sh.s;
    let n = rows * p2 * dims.c_in;
    let bd = sh.b * sh.d;
    let mut g = Graph::default();
    // Patchified latents in the compute dtype (made without tracking, kept by the matmul).
    // Locals of `Trainer::microbatch` stay alive to its end (they matter when nothing tracks,
    // as under LoRA with a frozen embedder): the patches, timestep features, t1, t_emb, y_emb,
    // c and x0 are bound.
    let xp = g.constant("patches", n, cd, true);
    g.bind(xp);
    let xe = candle::linear(
        &mut g,
        &sh,
        "x_embedder.proj",
        xp,
        rows,
        sh.d,
        dims.c_in * p2,
        None,
    );
    let xe = g.cast(&format!("x_embedder→{ad}"), xe, ad);
    let xe = g.view("reshape(b,s,D)", Kind::Reshape, xe, sh.e_elems());
    let pos = g.constant("pos_embed", sh.s * sh.d, ad, false);
    let x0 = g.broadcast_binary("+pos_embed", Kind::Add, xe, pos, false);
    let f = dims.freq;
    let tf = g.constant("timestep features", sh.b * f, ad, true);
    let tf = g.cast(&format!("t_freq→{cd}"), tf, cd);
    g.bind(tf);
    let h = candle::linear(&mut g, &sh, "t_embedder.mlp.0", tf, sh.b, sh.d, f, None);
    let h = g.op("t silu", Kind::Silu, &[h], bd, cd);
    g.bind(h);
    let te = candle::linear(&mut g, &sh, "t_embedder.mlp.2", h, sh.b, sh.d, sh.d, None);
    let te = g.cast(&format!("t_emb→{ad}"), te, ad);
    g.bind(te);
    let rows_k = dims.label_rows;
    let table_dt = if sh.lora.is_some() {
        cd
    } else {
        sh.precision.param_dtype()
    };
    let table = if sh.lora.is_some() {
        g.constant(
            "y_embedder.embedding_table.weight",
            rows_k * sh.d,
            table_dt,
            false,
        )
    } else {
        g.var(
            "y_embedder.embedding_table.weight",
            rows_k * sh.d,
            table_dt,
            false,
        )
    };
    // The label ids (u32, one per sample; 4 bytes each like an f32).
    let ids = g.constant("label ids", sh.b, Dtype::F32, true);
    g.bind(ids);
    let y = g.op("label rows", Kind::IndexSelect, &[table, ids], bd, table_dt);
    let y = g.cast(&format!("y_emb→{ad}"), y, ad);
    g.bind(y);
    let c = g.op("c = t_emb + y_emb", Kind::Add, &[te, y], bd, ad);
    g.bind(c);
    g.bind(x0);
    (g, x0, c)
}

/// The final layer and the loss on a leaf copy of the last block's output.
/// Returns (graph, leaf, root).
pub fn final_graph(dims: &Dims) -> (Graph, Nid, Nid) {
    let sh = shape(dims);
    let (cd, ad) = (sh.precision.compute_dtype(), sh.precision.accum_dtype());
    let ld = grad_dtype(sh.precision);
    let p2 = dims.patch2;
    let rows = sh.b * sh.s;
    let e = sh.e_elems();
    let bd = sh.b * sh.d;
    let mut g = Graph::default();
    let x = g.var("final leaf", e, ad, true);
    let c = g.var("c (shared leaf)", bd, ad, false);
    let md = candle::ada_ln(&mut g, &sh, "final_layer.adaLN_modulation.1", c, 2, None);
    let h = candle::ln_modulate(&mut g, "final norm+modulate", x, md[0], md[1], rows, cd);
    let out_el = rows * p2 * dims.c_out;
    let y = candle::linear(
        &mut g,
        &sh,
        "final_layer.linear",
        h,
        rows,
        p2 * dims.c_out,
        sh.d,
        None,
    );
    let y = g.cast(&format!("prediction→{ad}"), y, ad);
    let y = g.view("reshape(b,r,c,p,p,C)", Kind::Reshape, y, out_el);
    let y = g.view("permute", Kind::Transpose, y, out_el);
    let img = g.op("unpatchify (contiguous)", Kind::Copy, &[y], out_el, ad);
    let img = g.view("reshape(b,C,h,w)", Kind::Reshape, img, out_el);
    let lat = rows * p2 * dims.c_in;
    let pred = g.view(
        "ε channels",
        Kind::Narrow {
            pad_before: 0,
            pad_after: out_el - lat,
        },
        img,
        lat,
    );
    let pred = g.cast(&format!("pred→{ld}"), pred, ld);
    let target = g.constant("target", lat, ld, true);
    let diff = g.op("pred − target", Kind::Sub, &[pred, target], lat, ld);
    let sq = g.op("(pred − target)²", Kind::Sqr, &[diff], lat, ld);
    let s = g.op("sum", Kind::Sum, &[sq], 1, ld);
    let loss = g.op("mean (loss)", Kind::Affine, &[s], 1, ld);
    let root = g.op("loss·scale/accumulation", Kind::Affine, &[loss], 1, ld);
    (g, x, root)
}

impl BlockShape {
    /// b·s·D.
    pub fn e_elems(&self) -> u64 {
        self.b * self.s * self.d
    }
}

fn seg(
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
    let keep = candle::retained(g, &roots);
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
        bwd_store: bw.store,
        bwd_leaf_grads: bw.leaf_grads,
    }
}

/// Simulate the engine's three segments for a spec.
pub fn sims(spec: &Spec) -> Sims {
    let dims = Dims::new(spec);
    let sh = shape(&dims);
    let m = &spec.model;
    let ad = sh.precision.accum_dtype();
    let cd = sh.precision.compute_dtype();

    // Block: tracked on a leaf copy, plus the seed it is backpropagated from.
    let (mut bg, leaf, _c, out) = candle::block(&sh);
    let fwd = forward_peak(&bg);
    let root = candle::seed(&mut bg, out);
    let mut block = seg(&bg, Some(leaf), Some(out), root, 1, &[leaf, out]);
    block.fwd_peak = fwd;
    // No-grad forward on the input itself (no leaf copy); the output survives.
    let (mut ug, uleaf, _, uout) = candle::block(&sh);
    ug.nodes[uleaf].alloc = false;
    block.untracked_peak = untracked_peak(&ug, &[uout]);

    // Final layer + loss.
    let (fg, fleaf, froot) = final_graph(&dims);
    // The root (loss·scale) exists only for the backward call.
    let mut final_layer = seg(&fg, Some(fleaf), None, froot, 1, &[fleaf]);
    final_layer.fwd_peak = forward_peak(&fg) - fg.nodes[froot].footprint();

    // Embed: its surrogate is x0·gx + c·gc summed.
    let (mut eg, x0, c) = embed_graph(&dims);
    let fwd = forward_peak(&eg);
    let e = eg.nodes[x0].elems;
    let bd = sh.b * sh.d;
    let gx = eg.constant("grad x0", e, ad, false);
    let gc = eg.constant("grad c", bd, ad, false);
    let m1 = eg.op("x0·gx", Kind::Mul, &[x0, gx], e, ad);
    let s1 = eg.op("sum", Kind::Sum, &[m1], 1, ad);
    let m2 = eg.op("c·gc", Kind::Mul, &[c, gc], bd, ad);
    let s2 = eg.op("sum", Kind::Sum, &[m2], 1, ad);
    let r = eg.op("+", Kind::Add, &[s1, s2], 1, ad);
    let held = eg.bound();
    let tail: Vec<Nid> = held
        .iter()
        .copied()
        .filter(|&n| n != x0 && n != c)
        .collect();
    let embed_tail = kept_bytes(&eg, &tail);
    let mut embed = seg(&eg, None, Some(x0), r, 5, &held);
    embed.fwd_peak = fwd;

    let n_lat = sh.b * sh.s * u64::from(m.patch) * u64::from(m.patch) * u64::from(m.in_channels);
    // noisy(): host f64 tensor then its cast; patchify's contiguous copy; the cast to cd.
    let _ = cd;
    let mut scratch = n_lat * 8 + n_lat * ad.size() + n_lat * ad.size();
    // timestep features: f64 then the accumulation dtype.
    scratch = scratch.max(sh.b * u64::from(m.freq_embed) * 8);
    Sims {
        embed,
        block,
        final_layer,
        c_leaf: bd * ad.size() + candle::TENSOR_META + candle::STORAGE_META,
        embed_scratch: scratch,
        embed_tail,
    }
}

/// Elements per partial sum of the engine's gradient norm (`ops::SQUARES_CHUNK`).
pub const SQUARES_CHUNK: u64 = 1 << 16;

/// Bytes of one trained tensor's optimizer update temporaries in the engine (`optim.rs`).
fn optimizer_peak(elems: u64, p: Precision, opt: Optimizer, scaled: bool) -> u64 {
    let sd = p.optimizer_dtype().size();
    let pd = p.param_dtype().size();
    let gd = grad_dtype(p).size();
    let cast_in = if pd != sd { elems * sd } else { 0 };
    let unscale = if scaled { elems * sd } else { 0 };
    let g_cast = if gd != sd { elems * sd } else { 0 };
    match opt {
        // The engine's AdamW updates m, v and the weight in place in one pass (`optim.rs`,
        // a candle in-place op): only a gradient cast, when the gradient dtype
        // differs from the state's, allocates.
        Optimizer::AdamW | Optimizer::AdamW8bit => g_cast,
        Optimizer::Sgd => {
            g_cast + unscale + cast_in + 2 * elems * sd + if pd != sd { elems * pd } else { 0 }
        }
    }
}

/// Replay one optimizer step of the engine.
pub fn replay(
    spec: &Spec,
    table: &[ParamTensor],
    st: &StaticBytes,
    sims: &Sims,
    max_microbatches: u32,
) -> Vec<Event> {
    let r = &spec.recipe;
    let w = &spec.workload;
    let p = r.precision;
    let ad = p.accum_dtype();
    let gd = grad_dtype(p).size();
    let sh = shape(&Dims::new(spec));
    let depth = spec.model.depth;
    // One residual-stream tensor with candle's bookkeeping.
    let e = sh.e_elems() * ad.size() + candle::TENSOR_META + candle::STORAGE_META;
    let lat_per_sample = u64::from(spec.model.in_channels)
        * (spec.tokens().unwrap_or(0))
        * u64::from(spec.model.patch)
        * u64::from(spec.model.patch);
    // A Batch: latents and noise in f64, timesteps and labels u32, label-drop flags.
    let batch_bytes = |n: u64| n * (2 * lat_per_sample * 8 + 4 + 4 + 1);
    let per_step = u64::from(w.microbatch) * u64::from(w.accumulation);

    // A landed gradient is a tensor of its own: its buffer (`gradients`) and candle's
    // bookkeeping for it (`runtime`), returned as (buffer bytes, bookkeeping bytes).
    let grads_of = |f: &dyn Fn(&ParamTensor) -> bool| -> (u64, u64) {
        table
            .iter()
            .filter(|t| t.role == ParamRole::Trained && f(t))
            .fold((0, 0), |(b, m), t| {
                (
                    b + t.numel() * gd,
                    m + candle::TENSOR_META + candle::STORAGE_META,
                )
            })
    };
    let largest_of = |f: &dyn Fn(&ParamTensor) -> bool| -> u64 {
        table
            .iter()
            .filter(|t| t.role == ParamRole::Trained && f(t))
            .map(|t| t.numel() * gd)
            .max()
            .unwrap_or(0)
    };
    let block_grads = grads_of(&|t| t.block == Some(0));
    let block_largest = largest_of(&|t| t.block == Some(0));
    let final_grads = grads_of(&|t| t.name.starts_with("final_layer"));
    let final_largest = largest_of(&|t| t.name.starts_with("final_layer"));
    let embed_grads = grads_of(&|t| t.block.is_none() && !t.name.starts_with("final_layer"));
    let embed_largest = largest_of(&|t| t.block.is_none() && !t.name.starts_with("final_layer"));

    let base = Breakdown {
        weights: st.weights,
        master_weights: st.master_weights,
        optimizer_state: st.optimizer_state,
        ema: st.ema,
        data: batch_bytes(per_step),
        runtime: if step_uses_gemm(spec) {
            gemm_workspace_bytes(candle::cpu_threads())
        } else {
            0
        },
        ..Breakdown::default()
    };
    let mut ev = Events::default();
    ev.push(Phase::Start, "step start".into(), None, 0, false, base);
    let mut live = base;
    let tag = |mb: u32, what: String| {
        if w.accumulation > 1 {
            format!("microbatch {mb}: {what}")
        } else {
            what
        }
    };
    let bd = sh.b * sh.d * ad.size() + candle::TENSOR_META + candle::STORAGE_META;
    let recomputed = |i: u32| r.recompute.recomputes_block(i);

    for mb in 0..w.accumulation.min(max_microbatches.max(1)) {
        let first = mb == 0;
        live.data += batch_bytes(u64::from(w.microbatch));

        // Embed.
        let es = &sims.embed;
        let mut inside = live;
        inside.data += sims.embed_scratch;
        inside.activations += es.fwd_peak;
        ev.push(
            Phase::Forward,
            tag(mb, "embed (inside)".into()),
            None,
            mb,
            true,
            inside,
        );
        live.activations += es.activations + es.output + sims.c_leaf;
        live.weight_casts += es.weight_casts;
        ev.push(
            Phase::Forward,
            tag(mb, "embed".into()),
            None,
            mb,
            false,
            live,
        );

        // Blocks.
        let bs = &sims.block;
        let block_kept = bs.activations + bs.leaf + bs.output;
        for i in 0..depth {
            let mut inside = live;
            if recomputed(i) {
                inside.activations += bs.untracked_peak;
                live.activations += bs.output;
            } else {
                inside.activations += bs.fwd_peak;
                live.activations += block_kept;
                live.weight_casts += bs.weight_casts;
                if i > 0 && recomputed(i - 1) {
                    // The recomputed block's output was only this block's input: copied, freed.
                    live.activations -= e;
                }
            }
            ev.push(
                Phase::Forward,
                tag(mb, format!("block {i} (inside)")),
                Some(i),
                mb,
                true,
                inside,
            );
            ev.push(
                Phase::Forward,
                tag(mb, format!("block {i}")),
                Some(i),
                mb,
                false,
                live,
            );
        }

        // Final layer + loss.
        let fs = &sims.final_layer;
        let mut inside = live;
        inside.activations += fs.fwd_peak;
        live.activations += fs.activations + fs.leaf;
        live.weight_casts += fs.weight_casts;
        if depth > 0 && recomputed(depth - 1) {
            live.activations -= e;
        }
        ev.push(
            Phase::Forward,
            tag(mb, "final (inside)".into()),
            None,
            mb,
            true,
            inside,
        );
        ev.push(
            Phase::Forward,
            tag(mb, "final".into()),
            None,
            mb,
            false,
            live,
        );

        // Backward of the loss.
        let mut inside = live;
        inside.workspace += fs.root + fs.bwd_peak;
        ev.push(
            Phase::Backward,
            tag(mb, "final (inside)".into()),
            None,
            mb,
            true,
            inside,
        );
        // Store left: leaf grad (gx), c grad, weight grads, other leftovers.
        // Weights stored in another dtype than the gradient buffers (bf16-pure): the first
        // microbatch's gradients are cast into new buffers while the store still holds the
        // originals, instead of being moved.
        let cast_on_landing = p.param_dtype() != grad_dtype(p);
        // Lands a segment's gradients in the buffers; returns the extra transient of the moment
        // worth an event (summing into existing buffers, or the first casts), if any.
        let land = |live: &mut Breakdown, (grads, meta): (u64, u64), largest: u64| -> Option<u64> {
            if first {
                live.gradients += grads;
                live.runtime += meta;
                cast_on_landing.then_some(0)
            } else {
                Some(largest)
            }
        };
        live.workspace += fs.bwd_store;
        live.activations -= fs.activations + fs.leaf;
        live.weight_casts -= fs.weight_casts;
        if let Some(t) = land(&mut live, final_grads, final_largest) {
            let mut inside = live;
            inside.workspace += t;
            ev.push(
                Phase::Backward,
                tag(mb, "final grads (inside)".into()),
                None,
                mb,
                true,
                inside,
            );
        }
        // drop(grads): what remains is gx (the leaf's grad) and gc.
        live.workspace -= fs.bwd_store;
        live.workspace += fs.bwd_leaf_grads + bd;
        ev.push(
            Phase::Backward,
            tag(mb, "final".into()),
            None,
            mb,
            false,
            live,
        );
        let mut gx_bytes = fs.bwd_leaf_grads;

        for i in (0..depth).rev() {
            let mut inside = live;
            if recomputed(i) {
                // Leaf copy of the saved input; the input is freed unless the previous block's
                // stored output (or x0) still holds it.
                live.activations += bs.leaf;
                let input_held = i == 0 || !recomputed(i - 1);
                if !input_held {
                    live.activations -= e;
                }
                inside = live;
                inside.activations += bs.fwd_peak - bs.leaf;
                ev.push(
                    Phase::Backward,
                    tag(mb, format!("block {i} recompute (inside)")),
                    Some(i),
                    mb,
                    true,
                    inside,
                );
                live.activations += bs.activations + bs.output;
                live.weight_casts += bs.weight_casts;
                inside = live;
            }
            inside.workspace += bs.root + bs.bwd_peak;
            ev.push(
                Phase::Backward,
                tag(mb, format!("block {i} (inside)")),
                Some(i),
                mb,
                true,
                inside,
            );
            // After backward: the store; drop(out) frees the graph and the output.
            live.workspace += bs.bwd_store;
            live.activations -= bs.activations + bs.output;
            live.weight_casts -= bs.weight_casts;
            if let Some(t) = land(&mut live, block_grads, block_largest) {
                let mut inside = live;
                inside.workspace += t;
                ev.push(
                    Phase::Backward,
                    tag(mb, format!("block {i} grads (inside)")),
                    Some(i),
                    mb,
                    true,
                    inside,
                );
            }
            // gx replaced by the leaf's grad; drop(grads); drop(leaf).
            live.workspace -= bs.bwd_store;
            live.workspace -= gx_bytes;
            live.workspace += bs.bwd_leaf_grads;
            gx_bytes = bs.bwd_leaf_grads;
            live.activations -= bs.leaf;
            ev.push(
                Phase::Backward,
                tag(mb, format!("block {i}")),
                Some(i),
                mb,
                false,
                live,
            );
        }

        // Embed backward.
        let mut inside = live;
        inside.workspace += es.root + es.bwd_peak;
        ev.push(
            Phase::Backward,
            tag(mb, "embed (inside)".into()),
            None,
            mb,
            true,
            inside,
        );
        live.workspace += es.bwd_store;
        if let Some(t) = land(&mut live, embed_grads, embed_largest) {
            let mut inside = live;
            inside.workspace += t;
            ev.push(
                Phase::Backward,
                tag(mb, "embed grads (inside)".into()),
                None,
                mb,
                true,
                inside,
            );
        }
        // x0, c, gx and gc are dropped; the other locals of `microbatch` (patches, timestep
        // features, t_emb, y_emb and what they still hold) and the microbatch slice live until
        // the function returns, just after this mark.
        live.workspace -= es.bwd_store + gx_bytes + bd;
        live.activations -= es.activations + es.output + sims.c_leaf;
        live.weight_casts -= es.weight_casts;
        live.activations += sims.embed_tail.0;
        live.weight_casts += sims.embed_tail.1;
        ev.push(
            Phase::Backward,
            tag(mb, "embed".into()),
            None,
            mb,
            false,
            live,
        );
        live.activations -= sims.embed_tail.0;
        live.weight_casts -= sims.embed_tail.1;
        live.data -= batch_bytes(u64::from(w.microbatch));
    }

    // Optimizer: gradient norm, the update, the EMA.
    let trained: Vec<u64> = table
        .iter()
        .filter(|t| t.role == ParamRole::Trained)
        .map(ParamTensor::numel)
        .collect();
    let largest = trained.iter().copied().max().unwrap_or(0);
    if largest > 0 {
        // `ops::sum_squares`: one f64 partial sum per chunk of the largest gradient.
        let mut inside = live;
        inside.workspace += largest.div_ceil(SQUARES_CHUNK) * 8;
        ev.push(
            Phase::Optimizer,
            "gradient norm (inside)".into(),
            None,
            0,
            true,
            inside,
        );
        let scaled = p == Precision::Fp16Mixed;
        let mut inside = live;
        inside.workspace += optimizer_peak(largest, p, r.optimizer, scaled);
        ev.push(
            Phase::Optimizer,
            format!("{} (inside)", r.optimizer.name()),
            None,
            0,
            true,
            inside,
        );
        // The EMA update runs in place (`optim.rs`): no moment of its own.
    }
    live.gradients = 0;
    live.runtime = base.runtime;
    ev.push(Phase::Optimizer, "optimizer".into(), None, 0, false, live);
    ev.0
}
