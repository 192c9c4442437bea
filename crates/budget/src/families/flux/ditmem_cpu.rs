//! Flux in the engine as candle nodes (twin: the engine's `families/flux/block.rs`,
//! `families/flux/step.rs` and the ops `ops/norm_rope.rs`, `ops/tokens.rs`): the embed
//! segment (`x_embedder`, `context_embedder`, `time_text_embed`, the RoPE tables), the
//! double-stream block on [image, text], the single-stream block on the joint stream (the first
//! one joins the two streams itself), and the output side on the image tokens; then their
//! simulation into [`Sims`] for the step replay ([`crate::runtime::ditmem_cpu::step`]): the double-stream blocks are
//! `Sims::block`, the single-stream ones [`SecondBlocks`].

use crate::families::{Dims as FamilyDims, FamilyModel};
use crate::runtime::costs::{SecondBlocks, Sims};
use crate::runtime::ditmem_cpu::block::{
    base_weight, bound_linear, chunks, gated_released, linear_weights, module_linear,
    release_unless_read,
};
use crate::runtime::ditmem_cpu::dtypes::{acc_bytes, acc_dtype, grad_dtype};
use crate::runtime::ditmem_cpu::family::{inventory, EmbedGraph, FamilyRules};
use crate::runtime::ditmem_cpu::graph::{Graph, Kind, Nid};
use crate::runtime::ditmem_cpu::ops::{
    concat, fused_mlp_side, gelu, joint_linear, ln_modulate, norm_rope_bwd_elems, slice,
};
use crate::runtime::ditmem_cpu::parts::{modulation_linear, stream_feed_forward};
use crate::runtime::ditmem_cpu::separate::separate_attention;
use crate::runtime::ditmem_cpu::sims;
use crate::runtime::shape::Shape;
use crate::spec::{Precision, Spec};

/// Width of diffusers' `Timesteps(256)` sinusoid.
pub const FLUX_FREQ: u64 = 256;

/// What a Flux step reads beyond [`Shape`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FluxGeo {
    /// T5 tokens T in the sequence.
    pub t: u64,
    /// T5 width (`joint_attention_dim`).
    pub width: u64,
    /// Pooled CLIP width.
    pub pooled: u64,
    pub guidance: bool,
    /// Double-stream blocks (the single-stream ones follow).
    pub double: u64,
    pub single: u64,
    /// Head width.
    pub dh: u64,
}

/// `ops::rms_norm`: one fresh output in x's dtype, nothing kept; its backward recomputes one
/// rstd per (row, head) (accumulation type) as workspace.
pub fn rms_norm(g: &mut Graph, sh: &Shape, name: &str, x: Nid, w: Nid, dh: u64) -> Nid {
    let (e, dt) = (g.elems(x), g.dtype(x));
    let groups = e / dh.max(1);
    g.op(
        name,
        Kind::Custom {
            bwd_scratch: groups * acc_bytes(sh.precision),
        },
        &[x, w],
        e,
        dt,
    )
}

/// `ops::norm_rope` / `ops::joint_norm_rope`: the q/k RMSNorm (one weight, or the text and the
/// image stream's) and the RoPE as one node: one fresh output in x's dtype, nothing kept, no
/// forward workspace; its backward holds [`norm_rope_bwd_elems`] (the un-rotated gradient in
/// x's dtype, one rstd per (row, head) in the accumulation type) while it makes dx and the
/// weights' gradients. The tables are not graph inputs.
pub fn norm_rope(g: &mut Graph, sh: &Shape, name: &str, x: Nid, ws: &[Nid], dh: u64) -> Nid {
    let (e, dt) = (g.elems(x), g.dtype(x));
    let (x_elems, acc_elems) = norm_rope_bwd_elems(e, dh);
    let mut inputs = vec![x];
    inputs.extend_from_slice(ws);
    g.op(
        name,
        Kind::Custom {
            bwd_scratch: x_elems * dt.size() + acc_elems * acc_bytes(sh.precision),
        },
        &inputs,
        e,
        dt,
    )
}

/// `modulation`: `linear(st)` cast to the accumulation dtype (the function's local, dropped at
/// its return; the views keep it), `k` narrow views (bound by the caller's Vec).
fn modulation(g: &mut Graph, sh: &Shape, name: &str, st: Nid, k: u64) -> Vec<Nid> {
    let m = modulation_linear(g, sh, name, st, k);
    chunks(g, name, m, k, sh.b * sh.d)
}

/// A q/k RMSNorm weight (d_h), read as stored (a frozen base's in the compute dtype).
fn norm_weight(g: &mut Graph, sh: &Shape, name: &str, dh: u64) -> Nid {
    let wd = sh.weight_dtype();
    base_weight(g, sh, &format!("{name}.weight"), dh, wd)
}

/// The double-stream block's joint q, k and v over [text; image] from the modulated streams
/// (`hx`, `hc` of `rs` and `rt` rows), as `double_forward` makes them. Returns them bound.
fn joint_qkv(g: &mut Graph, sh: &Shape, (hx, hc): (Nid, Nid), (rs, rt): (u64, u64)) -> [Nid; 3] {
    let d = sh.d;
    // `double_forward`: the joint v as one joint linear after the joint q and k where neither
    // v linear carries LoRA; else both linears here and their concatenation.
    let joint_v = sh.lora_rank("attn.add_v_proj").is_none() && sh.lora_rank("attn.to_v").is_none();
    // The joint q and k before their norms: one joint linear each where neither of the pair
    // carries LoRA; else the two linears (bound) and their concatenation.
    let joint_pre = |g: &mut Graph, which: &str, image: &str, text: &str| -> Nid {
        let joint = sh.lora_rank(image).is_none() && sh.lora_rank(text).is_none();
        let y = if joint {
            let [wc, bc] = linear_weights(g, sh, text, hc, (d, d));
            let [wx, bx] = linear_weights(g, sh, image, hx, (d, d));
            joint_linear(
                g,
                &format!("{text} ‖ {image} → [text; image] {which} (joint linear)"),
                [hc, hx],
                [wc, bc, wx, bx],
                (rt, rs, d, d),
                &sh.cpu,
            )
        } else {
            let y = bound_linear(g, sh, image, hx, rs, d, d);
            let ey = bound_linear(g, sh, text, hc, rt, d, d);
            let cat = concat(g, &format!("[text; image] {which}"), ey, y);
            g.release(y);
            g.release(ey);
            cat
        };
        g.bind(y)
    };
    let qc = joint_pre(g, "q", "attn.to_q", "attn.add_q_proj");
    let kc = joint_pre(g, "k", "attn.to_k", "attn.add_k_proj");
    let v = (!joint_v).then(|| bound_linear(g, sh, "attn.to_v", hx, rs, d, d));
    let ev = (!joint_v).then(|| bound_linear(g, sh, "attn.add_v_proj", hc, rt, d, d));
    let vc = match (ev, v) {
        (Some(ev), Some(v)) => {
            let vc = concat(g, "[text; image] v", ev, v);
            g.release(ev);
            g.release(v);
            vc
        }
        _ => {
            let [wc, bc] = linear_weights(g, sh, "attn.add_v_proj", hc, (d, d));
            let [wx, bx] = linear_weights(g, sh, "attn.to_v", hx, (d, d));
            joint_linear(
                g,
                "attn.add_v_proj ‖ attn.to_v → [text; image] v (joint linear)",
                [hc, hx],
                [wc, bc, wx, bx],
                (rt, rs, d, d),
                &sh.cpu,
            )
        }
    };
    g.bind(vc);
    [qc, kc, vc]
}

/// One double-stream block as `double_forward` builds it, on leaf copies of its two streams,
/// tracked or not (`track`: what the engine releases). Returns (graph, [image leaf, text leaf],
/// st leaf, [image out, text out]). The joint q, k, v are [`joint_qkv`]'s.
pub(crate) fn double_block(
    sh: &Shape,
    fg: &FluxGeo,
    track: bool,
) -> (Graph, [Nid; 2], Nid, [Nid; 2]) {
    let mut g = Graph::default();
    let (cd, ad) = (sh.cd(), sh.ad());
    let d = sh.d;
    let (rs, rt) = (sh.b * sh.s, sh.b * fg.t);
    let x = g.var("image (leaf copy)", rs * d, ad, true);
    let c = g.var("text (leaf copy)", rt * d, ad, true);
    let st = sh.cond_leaf(&mut g, "silu(temb) (shared leaf)", sh.b * d, cd);
    let m = modulation(&mut g, sh, "norm1.linear", st, 6);
    let mc = modulation(&mut g, sh, "norm1_context.linear", st, 6);
    let hx = ln_modulate(&mut g, "norm1+modulate", x, m[0], m[1], rs, cd);
    g.bind(hx);
    let hc = ln_modulate(&mut g, "norm1_context+modulate", c, mc[0], mc[1], rt, cd);
    g.bind(hc);
    let [qc, kc, vc] = joint_qkv(&mut g, sh, (hx, hc), (rs, rt));
    let mut normed = Vec::new();
    for (which, x, text, image) in [
        ("q", qc, "attn.norm_added_q", "attn.norm_q"),
        ("k", kc, "attn.norm_added_k", "attn.norm_k"),
    ] {
        let wt = norm_weight(&mut g, sh, text, fg.dh);
        let wi = norm_weight(&mut g, sh, image, fg.dh);
        let name = format!("{text} | {image} + rope {which} (fused)");
        let y = norm_rope(&mut g, sh, &name, x, &[wt, wi], fg.dh);
        normed.push(g.bind(y));
    }
    let (qr, kr) = (normed[0], normed[1]);
    let n = sh.s + fg.t;
    let o = separate_attention(&mut g, sh, "joint attention", [qr, kr, vc], n);
    g.bind(o);
    let oc = slice(&mut g, "text tokens of the attention", o, rt * d);
    g.bind(oc);
    let oi = slice(&mut g, "image tokens of the attention", o, rs * d);
    g.bind(oi);
    let ao = bound_linear(&mut g, sh, "attn.to_out.0", oi, rs, d, d);
    let co = bound_linear(&mut g, sh, "attn.to_add_out", oc, rt, d, d);
    // Image stream.
    let x1 = gated_released(&mut g, track, "x + attn·gate_msa (fused)", x, ao, m[2]);
    g.bind(x1);
    let names = ["norm2+modulate", "ff", "x1 + ff·gate_mlp (fused)"];
    let x2 = stream_feed_forward(&mut g, sh, track, (x1, rs), (m[3], m[4]), |_| m[5], names);
    g.bind(x2);
    // Text stream.
    let c1 = gated_released(&mut g, track, "c + attn·c_gate_msa (fused)", c, co, mc[2]);
    g.bind(c1);
    let names = [
        "norm2_context+modulate",
        "ff_context",
        "c1 + ff·c_gate_mlp (fused)",
    ];
    let mods = (mc[3], mc[4]);
    let c2 = stream_feed_forward(&mut g, sh, track, (c1, rt), mods, |_| mc[5], names);
    g.bind(c2);
    (g, [x, c], st, [x2, c2])
}

/// One single-stream block as `single_forward` builds it, tracked or not (`track`); `first`: the
/// block that joins the image and text leaves into the joint stream itself. Returns (graph,
/// leaves, st leaf, out).
pub(crate) fn single_block(
    sh: &Shape,
    fg: &FluxGeo,
    first: bool,
    track: bool,
) -> (Graph, Vec<Nid>, Nid, Nid) {
    let mut g = Graph::default();
    let (cd, ad) = (sh.cd(), sh.ad());
    let d = sh.d;
    let n = sh.s + fg.t;
    let rows = sh.b * n;
    let (leaves, j) = if first {
        let x = g.var("image (leaf copy)", sh.b * sh.s * d, ad, true);
        let c = g.var("text (leaf copy)", sh.b * fg.t * d, ad, true);
        let j = concat(&mut g, "[text; image] stream", c, x);
        (vec![x, c], g.bind(j))
    } else {
        let j = g.var("joint stream (leaf copy)", rows * d, ad, true);
        (vec![j], j)
    };
    let st = sh.cond_leaf(&mut g, "silu(temb) (shared leaf)", sh.b * d, cd);
    let m = modulation(&mut g, sh, "norm.linear", st, 3);
    let hx = ln_modulate(&mut g, "norm+modulate", j, m[0], m[1], rows, cd);
    g.bind(hx);
    // `single_forward`: proj_mlp, the GELU and proj_out as one fused node after the attention
    // where neither linear carries LoRA; else the MLP first, composed.
    let fused = sh.lora_rank("proj_mlp").is_none() && sh.lora_rank("proj_out").is_none();
    let am = if fused {
        None
    } else {
        let pm = bound_linear(&mut g, sh, "proj_mlp", hx, rows, 4 * d, d);
        let am = gelu(&mut g, "act_mlp gelu(tanh) (fused)", pm);
        Some(g.bind(am))
    };
    let q = bound_linear(&mut g, sh, "attn.to_q", hx, rows, d, d);
    let k = bound_linear(&mut g, sh, "attn.to_k", hx, rows, d, d);
    let v = bound_linear(&mut g, sh, "attn.to_v", hx, rows, d, d);
    let wq = norm_weight(&mut g, sh, "attn.norm_q", fg.dh);
    let qr = norm_rope(&mut g, sh, "attn.norm_q + rope q (fused)", q, &[wq], fg.dh);
    g.bind(qr);
    let wk = norm_weight(&mut g, sh, "attn.norm_k", fg.dh);
    let kr = norm_rope(&mut g, sh, "attn.norm_k + rope k (fused)", k, &[wk], fg.dh);
    g.bind(kr);
    let o = separate_attention(&mut g, sh, "attention", [qr, kr, v], n);
    g.bind(o);
    let p = match am {
        None => {
            let [w1, b1] = linear_weights(&mut g, sh, "proj_mlp", hx, (4 * d, d));
            let [w2, b2] = linear_weights(&mut g, sh, "proj_out", hx, (d, 5 * d));
            let p = fused_mlp_side(
                &mut g,
                "proj_mlp → gelu(tanh) → [attention; MLP] → proj_out (fused)",
                [hx, o],
                [w1, b1, w2, b2],
                (rows, d, 4 * d, d, d),
                &sh.cpu,
            );
            g.bind(p)
        }
        Some(am) => {
            let cat = concat(&mut g, "[attention; MLP]", o, am);
            g.bind(cat);
            g.release(am);
            let p = bound_linear(&mut g, sh, "proj_out", cat, rows, d, 5 * d);
            release_unless_read(&mut g, sh, track, "proj_out", cat);
            p
        }
    };
    let out = gated_released(&mut g, track, "x + proj_out·gate (fused)", j, p, m[2]);
    g.bind(out);
    (g, leaves, st, out)
}

/// The output side and the loss on a leaf copy of the joint stream. Returns (graph, leaf, root).
pub(crate) fn final_graph(sh: &Shape, fg: &FluxGeo) -> (Graph, Nid, Nid) {
    let (cd, ad) = (sh.cd(), sh.ad());
    let ld = grad_dtype(sh.precision);
    let rows = sh.b * sh.s;
    let mut g = Graph::default();
    let x = g.var("final leaf", sh.b * (sh.s + fg.t) * sh.d, ad, true);
    let st = sh.cond_leaf(&mut g, "silu(temb) (shared leaf)", sh.b * sh.d, cd);
    let img = slice(&mut g, "image tokens", x, sh.e());
    g.bind(img);
    let m = modulation(&mut g, sh, "norm_out.linear", st, 2);
    let h = ln_modulate(&mut g, "norm_out+modulate", img, m[1], m[0], rows, cd);
    g.bind(h);
    let out_el = rows * sh.patch2 * sh.c_out;
    let y = module_linear(&mut g, sh, "proj_out", h, rows, sh.patch2 * sh.c_out, sh.d);
    let y = crate::runtime::ditmem_cpu::block::proj_out_released(&mut g, sh, h, y, ad);
    let y = g.view("reshape(b,r,c,C,p,p)", Kind::Reshape, y, out_el);
    let y = g.view("permute", Kind::Transpose, y, out_el);
    let img = g.op("unpack (contiguous)", Kind::Copy, &[y], out_el, ad);
    let pred = g.view("reshape(b,C,h,w)", Kind::Reshape, img, out_el);
    let pred = g.cast(&format!("pred→{ld}"), pred, ld);
    let root = sims::family_loss(&mut g, pred, out_el, ld);
    (g, x, root)
}

/// The embed segment as `FluxLayout::embed` builds it: the streams [image, text], the
/// conditioning st and the tables [cos, sin].
pub(crate) fn embed_graph(sh: &Shape, fg: &FluxGeo) -> EmbedGraph {
    let (cd, ad) = (sh.cd(), sh.ad());
    let rows = sh.b * sh.s;
    let bd = sh.b * sh.d;
    let trows = sh.b * fg.t;
    let inp = sh.c_in * sh.patch2;
    let mut g = Graph::default();
    let xp = g.constant("packed latents", rows * inp, cd, true);
    g.bind(xp);
    let xe = module_linear(&mut g, sh, "x_embedder", xp, rows, sh.d, inp);
    let xe = g.cast(&format!("x_embedder→{ad}"), xe, ad);
    let x0 = g.view("reshape(b,s,D)", Kind::Reshape, xe, sh.e());
    g.bind(x0);
    let cap = g.constant("T5 embeddings", trows * fg.width, cd, true);
    g.bind(cap);
    let ce = module_linear(&mut g, sh, "context_embedder", cap, trows, sh.d, fg.width);
    let ce = g.cast(&format!("context_embedder→{ad}"), ce, ad);
    let c0 = g.view("reshape(b,T,D)", Kind::Reshape, ce, trows * sh.d);
    g.bind(c0);
    // time_text_embed: one MLP per input, summed.
    let mut inputs: Vec<(&str, Nid)> = Vec::new();
    let tf = g.constant("timestep features", sh.b * FLUX_FREQ, ad, true);
    inputs.push(("timestep_embedder", g.cast(&format!("t_freq→{cd}"), tf, cd)));
    if fg.guidance {
        let gf = g.constant("guidance features", sh.b * FLUX_FREQ, ad, true);
        inputs.push(("guidance_embedder", g.cast(&format!("g_freq→{cd}"), gf, cd)));
    }
    let pp = g.constant("pooled embeddings", sh.b * fg.pooled, cd, true);
    inputs.push(("text_embedder", pp));
    let mut temb: Option<Nid> = None;
    for (name, x) in inputs {
        g.bind(x);
        let w = g.elems(x) / sh.b;
        let tte = format!("time_text_embed.{name}");
        let h = module_linear(&mut g, sh, &format!("{tte}.linear_1"), x, sh.b, sh.d, w);
        let a = g.op(&format!("{name} silu"), Kind::Silu, &[h], bd, cd);
        let e = module_linear(&mut g, sh, &format!("{tte}.linear_2"), a, sh.b, sh.d, sh.d);
        g.hold_until(&[a], e);
        temb = Some(match temb {
            None => e,
            Some(t) => g.op("temb +", Kind::Add, &[t, e], bd, cd),
        });
    }
    let temb = temb.unwrap_or(0);
    g.bind(temb);
    let st = g.op("silu(temb)", Kind::Silu, &[temb], bd, cd);
    g.bind(st);
    let tab = (sh.s + fg.t) * fg.dh;
    let td = acc_dtype(sh.precision);
    let cos = g.constant("rope cos", tab, td, true);
    g.bind(cos);
    let sin = g.constant("rope sin", tab, td, true);
    g.bind(sin);
    EmbedGraph {
        graph: g,
        streams: vec![x0, c0],
        conds: vec![st],
        tables: vec![cos, sin],
    }
}

/// Simulate Flux's segments for a spec.
pub(crate) fn sims(spec: &Spec, fg: &FluxGeo) -> Sims {
    let sh = Shape::new(spec);
    let double = sims::blocks_sim(|track| {
        let (g, leaves, _, outs) = double_block(&sh, fg, track);
        (g, leaves.to_vec(), outs.to_vec())
    });
    let single = |first: bool| {
        sims::blocks_sim(|track| {
            let (g, leaves, _, out) = single_block(&sh, fg, first, track);
            (g, leaves, vec![out])
        })
    };
    let (first, rest) = (single(true), single(false));

    let (fgr, fleaf, froot) = final_graph(&sh, fg);
    let embed = embed_graph(&sh, fg).simulate(&sh);
    let text = sh.b * fg.text_elems();
    // The RoPE tables: the flat ids (3 f64 per token) and the f64 tables beside their casts.
    let tab = (sh.s + fg.t) * fg.dh;
    let f64_tables = if sh.precision == Precision::Fp64 {
        0
    } else {
        2 * tab * 8
    };
    let scratch = sims::embed_scratch(&sh, FLUX_FREQ, text).max((sh.s + fg.t) * 3 * 8 + f64_tables);
    Sims {
        second: Some(SecondBlocks {
            start: fg.double as u32,
            first,
            rest,
        }),
        ..sims::sims(embed, double, sims::final_sim(&fgr, fleaf, froot), scratch)
    }
}

impl FamilyRules for FluxGeo {
    fn sims(&self, spec: &Spec) -> Sims {
        sims(spec, self)
    }

    /// Text elements of one sample the batch holds in f64: T·width and the pooled vector.
    fn text_elems(&self) -> u64 {
        self.t * self.width + self.pooled
    }

    fn inventory_segments(&self, spec: &Spec) -> [crate::segment::Segment; 3] {
        let sh = Shape::new(spec);
        inventory([
            &embed_graph(&sh, self).graph,
            &double_block(&sh, self, true).0,
            &final_graph(&sh, self).0,
        ])
    }
}

/// The registry's reader ([`crate::families::registry`]): this family's rules for a spec of it
/// (None for any other model).
pub(crate) fn rules(spec: &Spec, fm: &FamilyModel) -> Option<Box<dyn FamilyRules>> {
    let FamilyDims::Flux(d) = &fm.dims else {
        return None;
    };
    // T5's tokens in the sequence (CLIP-L gives only its pooled vector).
    let geo = fm.geometry();
    let tokens = crate::denoiser::text_tokens(spec, &geo);
    let t = geo
        .text
        .iter()
        .zip(&tokens)
        .filter(|(e, _)| e.sequence)
        .map(|(_, &n)| n)
        .sum();
    Some(Box::new(FluxGeo {
        t,
        width: d.joint_attention_dim,
        pooled: d.pooled_projection_dim,
        guidance: d.guidance_embeds,
        double: d.num_layers,
        single: d.num_single_layers,
        dh: d.attention_head_dim,
    }))
}
