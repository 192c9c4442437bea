//! SD3 in the engine as candle nodes (twin: the engine's `families/sd3/block.rs` and
//! `families/sd3/step.rs` on the family schedule `trainer/family.rs`): the embed segment (patch
//! embedding + the cropped position table, the timestep and pooled-text MLPs, SiLU(temb),
//! `context_embedder`), the joint block over the context and image streams (the last one
//! `context_pre_only`), and the output side; then their simulation into [`Sims`] for the step
//! replay ([`crate::runtime::ditmem_cpu::step`]), which runs the last block on its own [`Sims::last_block`].

use crate::families::{Dims as FamilyDims, FamilyModel};
use crate::runtime::costs::{DualBlocks, SegSim, Sims};
use crate::runtime::ditmem_cpu::block::{
    base_weight, bound_linear, chunk, gated_released, linear_weights, module_linear, patch_embed,
    proj_out_released, reads_input, release_unless_read, timestep_features,
};
use crate::runtime::ditmem_cpu::family::{inventory, EmbedGraph, FamilyRules};
use crate::runtime::ditmem_cpu::graph::{Graph, Kind, Nid};
use crate::runtime::ditmem_cpu::ops::{concat, joint_linear, ln_modulate, slice};
use crate::runtime::ditmem_cpu::parts::stream_feed_forward;
use crate::runtime::ditmem_cpu::separate::separate_attention;
use crate::runtime::ditmem_cpu::sims;
use crate::runtime::shape::Shape;
use crate::spec::Spec;

/// Width of diffusers' `Timesteps(256)` sinusoid.
pub(crate) const SD3_FREQ: u64 = 256;

/// What an SD3 step reads beyond [`Shape`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Sd3Geo {
    /// Caption tokens T (the sequence encoders' counts summed).
    pub t: u64,
    /// Caption width (`joint_attention_dim`).
    pub width: u64,
    /// Pooled width (`pooled_projection_dim`).
    pub pooled: u64,
    /// Side of the position table.
    pub pos_side: u64,
    /// `out_channels` of the config.
    pub c_out: u64,
    /// Per-head q/k RMSNorm.
    pub qk_norm: bool,
    /// Joint blocks.
    pub layers: u64,
    /// SD3.5's dual-attention blocks (`dual_attention_layers`, ascending): `norm1` of 9·D and
    /// the image-only self-attention `attn2`.
    pub dual: Vec<u64>,
}

impl Sd3Geo {
    /// Whether block `i` is a dual-attention block.
    pub(crate) fn is_dual(&self, i: u64) -> bool {
        self.dual.binary_search(&i).is_ok()
    }
}

/// `dual_attention` of the engine (a function: its locals live until it returns): attn2 on
/// LN(x) modulated by chunks 6, 7 of `norm1`'s nine, q/k RMSNorm (`norms`: the weights'
/// copies), attention over the image tokens, `attn2.to_out.0`, and x1 + ·gate_msa2 (chunk 8).
fn dual_attention(
    g: &mut Graph,
    sh: &Shape,
    track: bool,
    (x, x1, m): (Nid, Nid, Nid),
    norms: Option<[Nid; 2]>,
) -> Nid {
    let (cd, d) = (sh.cd(), sh.d);
    let (rows, bd) = (sh.b * sh.s, sh.b * d);
    let (s6, s7) = (chunk(g, "m", m, 6, 9, bd), chunk(g, "m", m, 7, 9, bd));
    let hx2 = ln_modulate(g, "norm1 (attn2)+modulate", x, s6, s7, rows, cd);
    let q = module_linear(g, sh, "attn2.to_q", hx2, rows, d, d);
    let k = module_linear(g, sh, "attn2.to_k", hx2, rows, d, d);
    let v = module_linear(g, sh, "attn2.to_v", hx2, rows, d, d);
    if !["attn2.to_q", "attn2.to_k", "attn2.to_v"]
        .iter()
        .any(|n| reads_input(sh, track, n))
    {
        g.release(hx2);
    }
    let (qn, kn) = match norms {
        Some([wq, wk]) => {
            let dh = d / sh.heads;
            let qn = crate::families::flux::ditmem_cpu::rms_norm(g, sh, "attn2.norm_q", q, wq, dh);
            (
                qn,
                crate::families::flux::ditmem_cpu::rms_norm(g, sh, "attn2.norm_k", k, wk, dh),
            )
        }
        None => (q, k),
    };
    let o = separate_attention(g, sh, "attn2 (separate q, k, v)", [qn, kn, v], sh.s);
    // Not released: the attention's backward reads its output.
    let a = module_linear(g, sh, "attn2.to_out.0", o, rows, d, d);
    let gate = chunk(g, "m", m, 8, 9, bd);
    let out = gated_released(g, track, "x1 + attn2·gate_msa2 (fused)", x1, a, gate);
    g.hold_until(&[hx2, q, k, v, qn, kn, o, a], out);
    out
}

/// `linear_then_release` on a slice of the attention's output: the bound linear, its input
/// released unless a backward reads it.
fn linear_then_release(
    g: &mut Graph,
    sh: &Shape,
    track: bool,
    name: &str,
    x: Nid,
    rows: u64,
) -> Nid {
    let y = bound_linear(g, sh, name, x, rows, sh.d, sh.d);
    release_unless_read(g, sh, track, name, x);
    y
}

/// `sd3_block_forward`'s `joint`: q, k, v of [image; text] per sample, one joint linear
/// each where neither linear carries LoRA and no q/k norm sits between; else the two
/// linears, the norms and the concatenation, every one bound (the engine's `hold`).
fn joint_projection(
    g: &mut Graph,
    sh: &Shape,
    (hx, hc, trows): (Nid, Nid, u64),
    (la, lc): (&str, &str),
    norms: Option<[(Nid, &str); 2]>,
    name: &str,
) -> Nid {
    let d = sh.d;
    let rows = sh.b * sh.s;
    if norms.is_none() && sh.lora_rank(la).is_none() && sh.lora_rank(lc).is_none() {
        let [wa, ba] = linear_weights(g, sh, la, hx, (d, d));
        let [wc, bc] = linear_weights(g, sh, lc, hc, (d, d));
        let y = joint_linear(
            g,
            &format!("{la} ‖ {lc} → {name} (joint linear)"),
            [hx, hc],
            [wa, ba, wc, bc],
            (rows, trows, d, d),
            &sh.cpu,
        );
        return g.bind(y);
    }
    let y = bound_linear(g, sh, la, hx, rows, d, d);
    let ey = bound_linear(g, sh, lc, hc, trows, d, d);
    let (y, ey) = match norms {
        Some([(wa, na), (wc, nc)]) => {
            let dh = d / sh.heads;
            let mut n = |name: &str, x: Nid, w: Nid| {
                let y = crate::families::flux::ditmem_cpu::rms_norm(g, sh, name, x, w, dh);
                g.bind(y)
            };
            (n(na, y, wa), n(nc, ey, wc))
        }
        None => (y, ey),
    };
    let cat = concat(g, name, y, ey);
    g.release(y);
    g.release(ey);
    g.bind(cat)
}

/// The joint attention on the modulated streams (`hx`, `hc`): q, k, v by
/// [`joint_projection`] (q and k through the norms `qk`, when the block has them), hc released
/// unless a context linear's backward reads it, the attention over [image; text]. Returns its
/// output (bound).
fn joint_attention(
    g: &mut Graph,
    sh: &Shape,
    sg: &Sd3Geo,
    track: bool,
    (hx, hc): (Nid, Nid),
    qk: Option<&[Nid]>,
) -> Nid {
    let streams = (hx, hc, sh.b * sg.t);
    let nq = qk.map(|w| [(w[0], "attn.norm_q"), (w[2], "attn.norm_added_q")]);
    let nk = qk.map(|w| [(w[1], "attn.norm_k"), (w[3], "attn.norm_added_k")]);
    let qc = joint_projection(
        g,
        sh,
        streams,
        ("attn.to_q", "attn.add_q_proj"),
        nq,
        "cat q",
    );
    let kcat = joint_projection(
        g,
        sh,
        streams,
        ("attn.to_k", "attn.add_k_proj"),
        nk,
        "cat k",
    );
    let vc = joint_projection(
        g,
        sh,
        streams,
        ("attn.to_v", "attn.add_v_proj"),
        None,
        "cat v",
    );
    if !["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"]
        .iter()
        .any(|n| reads_input(sh, track, n))
    {
        g.release(hc);
    }
    let o = separate_attention(
        g,
        sh,
        "joint attention (separate q, k, v)",
        [qc, kcat, vc],
        sh.s + sg.t,
    );
    g.bind(o)
}

/// The context stream after the joint attention `o` (not in the last, `context_pre_only`
/// block): `attn.to_add_out` on the text slice, c + ·c_gate_msa, and the feed-forward on
/// chunks 3–5 of `mc`. Returns c2.
fn context_stream(
    g: &mut Graph,
    sh: &Shape,
    sg: &Sd3Geo,
    track: bool,
    (c, o, mc): (Nid, Nid, Nid),
) -> Nid {
    let (trows, bd) = (sh.b * sg.t, sh.b * sh.d);
    let oc = slice(g, "split context", o, trows * sh.d);
    g.bind(oc);
    let co = linear_then_release(g, sh, track, "attn.to_add_out", oc, trows);
    let gate = chunk(g, "mc", mc, 2, 6, bd);
    let c1 = gated_released(g, track, "c + out·c_gate_msa (fused)", c, co, gate);
    g.bind(c1);
    let (s3, s4) = (chunk(g, "mc", mc, 3, 6, bd), chunk(g, "mc", mc, 4, 6, bd));
    let gate = |g: &mut Graph| chunk(g, "mc", mc, 5, 6, bd);
    let names = [
        "norm2_context+modulate",
        "ff_context",
        "c1 + ff·c_gate_mlp (fused)",
    ];
    stream_feed_forward(g, sh, track, (c1, trows), (s3, s4), gate, names)
}

/// One joint block as `sd3_block_forward` builds it, on leaf copies of its two streams, tracked
/// or not (`track`: which buffers the engine releases, `ops::release`, depends on what a backward
/// would read); `dual`: SD3.5's dual-attention block (`attn2`). Returns the graph, the stream
/// leaves [context, image], the conditioning leaf and the outputs ([context, image], or [image]
/// for the last block). The sections in the engine's order: the q/k norm weights and the
/// modulations, [`joint_attention`], the image stream (with [`dual_attention`]), [`context_stream`].
pub(crate) fn block(
    sh: &Shape,
    sg: &Sd3Geo,
    (last, dual): (bool, bool),
    track: bool,
) -> (Graph, Vec<Nid>, Nid, Vec<Nid>) {
    let mut g = Graph::default();
    let (cd, ad) = (sh.cd(), sh.ad());
    let d = sh.d;
    let (rows, trows) = (sh.b * sh.s, sh.b * sg.t);
    let (e, c_el) = (rows * d, trows * d);
    let bd = sh.b * d;
    let c = g.var("context (leaf copy of the block input)", c_el, ad, true);
    let x = g.var("image (leaf copy of the block input)", e, ad, true);
    let se = sh.cond_leaf(&mut g, "SiLU(temb) (shared leaf)", bd, cd);
    // The q/k norm weights are cast copies made with the block's weights (alive while it runs).
    let dh = d / sh.heads;
    let norm_weight = |g: &mut Graph, n: &str| {
        let w = base_weight(g, sh, &format!("{n}.weight"), dh, cd);
        g.bind(w)
    };
    let qk: Option<Vec<Nid>> = sg.qk_norm.then(|| {
        ["norm_q", "norm_k", "norm_added_q", "norm_added_k"]
            .iter()
            .map(|n| norm_weight(&mut g, &format!("attn.{n}")))
            .collect()
    });
    // attn2's, made after them (`Trainer::sd3_block_weights`).
    let qk2 = (sg.qk_norm && dual)
        .then(|| [0, 1].map(|i| norm_weight(&mut g, ["attn2.norm_q", "attn2.norm_k"][i])));
    let ada = |g: &mut Graph, name: &str, k: u64| {
        let m = module_linear(g, sh, name, se, sh.b, k * d, d);
        let m = g.cast(&format!("{name} →{ad}"), m, ad);
        g.bind(m)
    };
    // SD35AdaLayerNormZeroX: 9 chunks (a second shift / scale / gate for attn2).
    let km = if dual { 9 } else { 6 };
    let m = ada(&mut g, "norm1.linear", km);
    let kc = if last { 2 } else { 6 };
    let mc = ada(&mut g, "norm1_context.linear", kc);
    let (s0, s1) = (
        chunk(&mut g, "m", m, 0, km, bd),
        chunk(&mut g, "m", m, 1, km, bd),
    );
    let hx = ln_modulate(&mut g, "norm1+modulate", x, s0, s1, rows, cd);
    g.bind(hx);
    let (shift, scale) = if last {
        let a = chunk(&mut g, "mc", mc, 1, kc, bd);
        (a, chunk(&mut g, "mc", mc, 0, kc, bd))
    } else {
        let a = chunk(&mut g, "mc", mc, 0, kc, bd);
        (a, chunk(&mut g, "mc", mc, 1, kc, bd))
    };
    let hc = ln_modulate(&mut g, "norm1_context+modulate", c, shift, scale, trows, cd);
    g.bind(hc);
    let o = joint_attention(&mut g, sh, sg, track, (hx, hc), qk.as_deref());

    // Image stream.
    let oi = slice(&mut g, "split image", o, e);
    g.bind(oi);
    let ao = linear_then_release(&mut g, sh, track, "attn.to_out.0", oi, rows);
    let gate = chunk(&mut g, "m", m, 2, km, bd);
    let x1 = gated_released(&mut g, track, "x + out·gate_msa (fused)", x, ao, gate);
    g.bind(x1);
    let x1 = if dual {
        let x1b = dual_attention(&mut g, sh, track, (x, x1, m), qk2);
        g.bind(x1b)
    } else {
        x1
    };
    let (s3, s4) = (
        chunk(&mut g, "m", m, 3, km, bd),
        chunk(&mut g, "m", m, 4, km, bd),
    );
    let gate = |g: &mut Graph| chunk(g, "m", m, 5, km, bd);
    let names = ["norm2+modulate", "ff", "x1 + ff·gate_mlp (fused)"];
    let x2 = stream_feed_forward(&mut g, sh, track, (x1, rows), (s3, s4), gate, names);
    if last {
        return (g, vec![c, x], se, vec![x2]);
    }
    g.bind(x2);
    let c2 = context_stream(&mut g, sh, sg, track, (c, o, mc));
    (g, vec![c, x], se, vec![c2, x2])
}

/// One block's simulation ([`sims::blocks_sim`]): tracked on leaf copies with its seeds, and
/// untracked on its inputs.
fn block_sim(sh: &Shape, sg: &Sd3Geo, kind: (bool, bool)) -> SegSim {
    sims::blocks_sim(|track| {
        let (g, leaves, _, outs) = block(sh, sg, kind, track);
        (g, leaves, outs)
    })
}

/// The embed segment as `Sd3Layout::embed` builds it: the [context, image] streams first, then
/// the conditioning SiLU(temb), in the schedule's order.
pub(crate) fn embed_graph(sh: &Shape, sg: &Sd3Geo) -> EmbedGraph {
    let (cd, ad) = (sh.cd(), sh.ad());
    let bd = sh.b * sh.d;
    let trows = sh.b * sg.t;
    let mut g = Graph::default();
    let xe = patch_embed(&mut g, sh, "pos_embed.proj", "proj.weight.flatten_from(1)");
    // The table's (M², D) → (M, M, D) view, cropped by two narrows (views) and read in place.
    let side2 = sg.pos_side * sg.pos_side;
    let pos = g.constant("pos_embed.pos_embed", side2 * sh.d, ad, false);
    let pos = g.view("reshape(M, M, D)", Kind::Reshape, pos, side2 * sh.d);
    let pos = g.view(
        "crop rows",
        Kind::Narrow {
            pad_before: 0,
            pad_after: 0,
        },
        pos,
        side2 * sh.d,
    );
    let pos = g.view(
        "crop cols",
        Kind::Narrow {
            pad_before: 0,
            pad_after: 0,
        },
        pos,
        sh.s * sh.d,
    );
    let xe = g.cast(&format!("x_embed→{ad}"), xe, ad);
    let xe = g.view("reshape(b,r,c,D)", Kind::Reshape, xe, sh.e());
    let x0 = g.broadcast_binary("+pos_embed (cropped)", Kind::Add, xe, pos, false);
    let x0 = g.view("reshape(b,s,D)", Kind::Reshape, x0, sh.e());
    let tf = timestep_features(&mut g, sh, SD3_FREQ);
    let mlp = |g: &mut Graph, name: &str, x: Nid, inp: u64| {
        let h = module_linear(g, sh, &format!("{name}.linear_1"), x, sh.b, sh.d, inp);
        let h = g.op(&format!("{name} silu"), Kind::Silu, &[h], bd, cd);
        let y = module_linear(g, sh, &format!("{name}.linear_2"), h, sh.b, sh.d, sh.d);
        g.hold_until(&[h], y);
        y
    };
    let tt = mlp(&mut g, "time_text_embed.timestep_embedder", tf, SD3_FREQ);
    let pooled = g.constant("pooled embeddings", sh.b * sg.pooled, cd, true);
    g.bind(pooled);
    let tp = mlp(&mut g, "time_text_embed.text_embedder", pooled, sg.pooled);
    let temb = g.op("temb = t + pooled", Kind::Add, &[tt, tp], bd, cd);
    let se = g.op("SiLU(temb)", Kind::Silu, &[temb], bd, cd);
    g.bind(se);
    let cap = g.constant("caption embeddings", trows * sg.width, cd, true);
    g.bind(cap);
    let c0 = module_linear(&mut g, sh, "context_embedder", cap, trows, sh.d, sg.width);
    let c0 = g.cast(&format!("context→{ad}"), c0, ad);
    let c0 = g.view("reshape(b,T,D)", Kind::Reshape, c0, trows * sh.d);
    g.bind(c0);
    g.bind(x0);
    EmbedGraph {
        graph: g,
        streams: vec![c0, x0],
        conds: vec![se],
        tables: Vec::new(),
    }
}

/// The output side and the loss on a leaf copy of the image stream. Returns (graph, leaf, root).
pub(crate) fn final_graph(sh: &Shape, sg: &Sd3Geo) -> (Graph, Nid, Nid) {
    let (cd, ad) = (sh.cd(), sh.ad());
    let rows = sh.b * sh.s;
    let bd = sh.b * sh.d;
    let (mut g, x) = sims::final_leaf(sh);
    let se = sh.cond_leaf(&mut g, "SiLU(temb) (shared leaf)", bd, cd);
    let m = module_linear(&mut g, sh, "norm_out.linear", se, sh.b, 2 * sh.d, sh.d);
    let m = g.cast(&format!("norm_out →{ad}"), m, ad);
    g.bind(m);
    let scale = chunk(&mut g, "norm_out", m, 0, 2, bd);
    g.bind(scale);
    let shift = chunk(&mut g, "norm_out", m, 1, 2, bd);
    g.bind(shift);
    let h = ln_modulate(&mut g, "norm_out+modulate", x, shift, scale, rows, cd);
    g.bind(h);
    let y = module_linear(&mut g, sh, "proj_out", h, rows, sh.patch2 * sg.c_out, sh.d);
    let y = proj_out_released(&mut g, sh, h, y, ad);
    let root = sims::prediction_loss(
        &mut g,
        sh,
        y,
        sg.c_out,
        [
            "reshape(b,r,c,p,p,C)",
            "reshape(b,C,h,w)",
            "latent channels",
        ],
    );
    (g, x, root)
}

/// Simulate SD3's segments for a spec: the embed, a joint block, the last
/// (`context_pre_only`) block, SD3.5's dual-attention blocks, the output side.
pub(crate) fn sims(spec: &Spec, sg: &Sd3Geo) -> Sims {
    let sh = Shape::new(spec);
    let top = sg.layers.saturating_sub(1);
    let last = block_sim(&sh, sg, (true, sg.is_dual(top)));
    let block = if (0..top).any(|i| !sg.is_dual(i)) {
        block_sim(&sh, sg, (false, false))
    } else {
        last
    };
    let dual = (!sg.dual.is_empty()).then(|| DualBlocks {
        block: if (0..top).any(|i| sg.is_dual(i)) {
            block_sim(&sh, sg, (false, true))
        } else {
            last
        },
        last,
    });
    let (fg, fleaf, froot) = final_graph(&sh, sg);
    let embed = embed_graph(&sh, sg).simulate(&sh);
    // The f64 caption of the batch (the pooled embedding's is smaller).
    let text = sh.b * sg.t * sg.width;
    let scratch = sims::embed_scratch(&sh, SD3_FREQ, text);
    Sims {
        last_block: Some(last),
        dual,
        ..sims::sims(embed, block, sims::final_sim(&fg, fleaf, froot), scratch)
    }
}

impl FamilyRules for Sd3Geo {
    fn sims(&self, spec: &Spec) -> Sims {
        sims(spec, self)
    }

    /// Cached text elements of one sample the batch holds in f64: the caption and the pooled
    /// embedding.
    fn text_elems(&self) -> u64 {
        self.t * self.width + self.pooled
    }

    fn inventory_segments(&self, spec: &Spec) -> [crate::segment::Segment; 3] {
        let sh = Shape::new(spec);
        let first = (self.layers == 1, self.is_dual(0));
        inventory([
            &embed_graph(&sh, self).graph,
            &block(&sh, self, first, true).0,
            &final_graph(&sh, self).0,
        ])
    }

    fn dual_blocks(&self) -> Vec<u64> {
        self.dual.clone()
    }
}

/// The registry's reader ([`crate::families::registry`]): this family's rules for a spec of it
/// (None for any other model).
pub(crate) fn rules(spec: &Spec, fm: &FamilyModel) -> Option<Box<dyn FamilyRules>> {
    let FamilyDims::Sd3(d) = &fm.dims else {
        return None;
    };
    // Caption tokens: the sequence encoders' counts summed.
    let t = crate::denoiser::text_tokens(spec, &fm.geometry())
        .iter()
        .sum();
    let grid_side = spec.token_grid().ok().map_or(0, |g| u64::from(g.rows));
    Some(Box::new(Sd3Geo {
        t,
        width: d.joint_attention_dim,
        pooled: d.pooled_projection_dim,
        pos_side: d.pos_embed_max_size.unwrap_or(grid_side),
        c_out: d.out_channels,
        qk_norm: d.qk_norm,
        layers: d.num_layers,
        dual: d.dual_attention_layers.clone(),
    }))
}
