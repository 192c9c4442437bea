//! The pieces the diffusers families of one block kind (DiT, PixArt, Sana, Wan; twins: the
//! engine's `families/<family>/step.rs` and `block.rs`) build alike, each written once: the
//! patch stream, the timestep embedder and its 6·D projection, an adaLN modulation's linear, the
//! caption (text) projection, the block's and the output side's `scale_shift_table` modulation
//! (an adaLN-single block's start, its output side), the self-attention over separate q, k, v,
//! the cross-attention `attn2` and the feed-forward tail of a block; and the feed-forward half of
//! a stream of the MMDiT families' joint blocks (SD3, Flux). Node names are the engine's, so the
//! op inventory reads the same for each family.

use crate::runtime::ditmem_cpu::block::{
    base_weight, block_leaf, bound_linear, chunks, fused_cross, gated_released, linear_weights,
    module_feed_forward, module_linear, patch_embed, proj_out_released, release_unless_read,
    sink_context_grad,
};
use crate::runtime::ditmem_cpu::cross::cross_attention;
use crate::runtime::ditmem_cpu::graph::{Graph, Kind, Nid};
use crate::runtime::ditmem_cpu::ops::{gelu, ln_modulate};
use crate::runtime::ditmem_cpu::separate::separate_attention;
use crate::runtime::ditmem_cpu::sims;
use crate::runtime::shape::Shape;

/// The timestep embedder (`TimestepEmbedding`): `names.0` on the features `tf` (b × `freq`),
/// SiLU, `names.1`, cast to the accumulation dtype; the SiLU and the cast bound (the embed's
/// locals). `label` names the result as the engine does ("emb", "temb"). Returns it.
pub(crate) fn timestep_mlp(
    g: &mut Graph,
    sh: &Shape,
    names: (&str, &str),
    tf: Nid,
    freq: u64,
    label: &str,
) -> Nid {
    let (cd, ad) = (sh.cd(), sh.ad());
    let h = module_linear(g, sh, names.0, tf, sh.b, sh.d, freq);
    let h = g.op("t silu", Kind::Silu, &[h], sh.b * sh.d, cd);
    g.bind(h);
    let emb = module_linear(g, sh, names.1, h, sh.b, sh.d, sh.d);
    let emb = g.cast(&format!("{label}→{ad}"), emb, ad);
    g.bind(emb)
}

/// An adaLN modulation's projection of the conditioning `cond` (b, D): the linear `name` to
/// (b, k·D), cast to the accumulation dtype (DiT's `norm1.linear` and `proj_out_1`, Flux's
/// `norm1.linear` …); the caller binds it or its chunks. Returns the cast.
pub(crate) fn modulation_linear(g: &mut Graph, sh: &Shape, name: &str, cond: Nid, k: u64) -> Nid {
    let ad = sh.ad();
    let m = module_linear(g, sh, name, cond, sh.b, k * sh.d, sh.d);
    g.cast(&format!("{name}→{ad}"), m, ad)
}

/// The embedded patches as the residual stream (PixArt, Sana, Wan, diffusers' DiT): the patch
/// embedding through the conv `module` ([`patch_embed`]), cast to the accumulation dtype and
/// viewed as (b, s, D).
pub(crate) fn patch_stream(g: &mut Graph, sh: &Shape, module: &str, flatten: &str) -> Nid {
    let ad = sh.ad();
    let xe = patch_embed(g, sh, module, flatten);
    let xe = g.cast(&format!("x_embed→{ad}"), xe, ad);
    g.view("reshape(b,s,D)", Kind::Reshape, xe, sh.e())
}

/// The fixed sin-cos table `pos_embed.pos_embed` (s·D, not tracked) broadcast-added to the
/// stream `xe` (PixArt's and diffusers' DiT's `PatchEmbed`). Returns x0.
pub(crate) fn plus_pos_embed(g: &mut Graph, sh: &Shape, xe: Nid) -> Nid {
    let pos = g.constant("pos_embed.pos_embed", sh.s * sh.d, sh.ad(), false);
    g.broadcast_binary("+pos_embed", Kind::Add, xe, pos, false)
}

/// adaLN-single's shared projection: SiLU of the embedded timestep `emb` (named `label`) cast to
/// the compute dtype, the linear `name` to (b, 6·D), cast to the accumulation dtype; each bound.
/// Returns t6.
pub(crate) fn six_modulations(g: &mut Graph, sh: &Shape, name: &str, emb: Nid, label: &str) -> Nid {
    let (cd, ad) = (sh.cd(), sh.ad());
    let se = g.op(
        &format!("silu({label})"),
        Kind::Silu,
        &[emb],
        sh.b * sh.d,
        ad,
    );
    let se = g.cast(&format!("silu({label})→{cd}"), se, cd);
    g.bind(se);
    let t6 = module_linear(g, sh, name, se, sh.b, 6 * sh.d, sh.d);
    let t6 = g.cast(&format!("t6→{ad}"), t6, ad);
    g.bind(t6)
}

/// The text projection (`PixArtAlphaTextProjection`): `{prefix}.linear_1` on the text states `x`
/// ((`rows`, `width`) in the compute dtype), GELU-tanh (named `act`), `{prefix}.linear_2`.
/// Returns [linear_1, GELU, linear_2]: the caller holds the first two as long as its function
/// keeps them.
pub(crate) fn text_projection(
    g: &mut Graph,
    sh: &Shape,
    prefix: &str,
    x: Nid,
    (rows, width): (u64, u64),
    act: &str,
) -> [Nid; 3] {
    let c1 = module_linear(g, sh, &format!("{prefix}.linear_1"), x, rows, sh.d, width);
    let a = gelu(g, act, c1);
    let y = module_linear(g, sh, &format!("{prefix}.linear_2"), a, rows, sh.d, sh.d);
    [c1, a, y]
}

/// A block's adaLN-single modulation: its `scale_shift_table` (6·D, `table`) viewed as (1, 6D)
/// and added to the shared t6 (b, 6D), bound, then its six (b, D) chunks.
pub(crate) fn table_modulation(g: &mut Graph, sh: &Shape, t6: Nid, table: Nid) -> Vec<Nid> {
    let d = sh.d;
    let tr = g.view("table.reshape(1, 6D)", Kind::Reshape, table, 6 * d);
    let modv = g.broadcast_binary("t6 + table", Kind::Add, t6, tr, false);
    g.bind(modv);
    chunks(g, "modulation", modv, 6, sh.b * d)
}

/// An adaLN-single block's graph begun (PixArt's, Wan's): the leaf copy of its input, the
/// shared leaves of t6 and of the text context (its leaf's name and b·T·D elements, in the
/// compute dtype), the block's `scale_shift_table` and its six modulations
/// ([`table_modulation`]). Returns (graph, input leaf, text leaf, modulations).
pub(crate) fn adaln_single_block(
    sh: &Shape,
    (name, elems): (&str, u64),
) -> (Graph, Nid, Nid, Vec<Nid>) {
    let (cd, ad) = (sh.cd(), sh.ad());
    let (mut g, x) = block_leaf(sh);
    let t6 = sh.cond_leaf(&mut g, "t6 (shared leaf)", 6 * sh.b * sh.d, ad);
    let y = sh.cond_leaf(&mut g, name, elems, cd);
    let table = base_weight(&mut g, sh, "scale_shift_table", 6 * sh.d, ad);
    let m = table_modulation(&mut g, sh, t6, table);
    (g, x, y, m)
}

/// The output side's modulation: the embedded timestep `emb` (b, D; named `label`) unsqueezed
/// and the final `scale_shift_table` (2·D, `table`; `unsqueeze`: stored as (2, D), else as
/// (1, 2, D) as Wan's is) broadcast to (b, 2, D) and added, viewed as (b, 2D); its shift and
/// scale chunks.
pub(crate) fn final_modulation(
    g: &mut Graph,
    sh: &Shape,
    (emb, label): (Nid, &str),
    table: Nid,
    unsqueeze: bool,
) -> Vec<Nid> {
    let (ad, bd) = (sh.ad(), sh.b * sh.d);
    let eu = g.view(&format!("{label}.unsqueeze(1)"), Kind::Reshape, emb, bd);
    let tu = if unsqueeze {
        g.view("table.unsqueeze(0)", Kind::Reshape, table, 2 * sh.d)
    } else {
        table
    };
    let eb = g.view(&format!("{label} broadcast"), Kind::Broadcast, eu, 2 * bd);
    let tb = g.view("table broadcast", Kind::Broadcast, tu, 2 * bd);
    let ss = g.op(
        &format!("{label} + table"),
        Kind::Add,
        &[eb, tb],
        2 * bd,
        ad,
    );
    let ss = g.view("reshape(b, 2D)", Kind::Reshape, ss, 2 * bd);
    chunks(g, "final modulation", ss, 2, bd)
}

/// The output side of an adaLN-single model (PixArt, Sana, Wan) on a leaf copy of the last
/// block's output, up to its projection: the embedded timestep's shared leaf (its name, and its
/// label in the modulation's node names), the final `scale_shift_table` ([`final_modulation`], `unsqueeze` as there),
/// `norm_out` + modulate, `proj_out` to p²·`c_out`. Returns (graph, leaf, the modulated norm,
/// the projection).
pub(crate) fn table_final_layer(
    sh: &Shape,
    (name, label): (&str, &str),
    unsqueeze: bool,
    c_out: u64,
) -> (Graph, Nid, Nid, Nid) {
    let (cd, ad) = (sh.cd(), sh.ad());
    let rows = sh.b * sh.s;
    let (mut g, x) = sims::final_leaf(sh);
    let emb = sh.cond_leaf(&mut g, name, sh.b * sh.d, ad);
    let table = base_weight(&mut g, sh, "scale_shift_table", 2 * sh.d, ad);
    let md = final_modulation(&mut g, sh, (emb, label), table, unsqueeze);
    let h = ln_modulate(&mut g, "norm_out+modulate", x, md[0], md[1], rows, cd);
    let y = module_linear(&mut g, sh, "proj_out", h, rows, sh.patch2 * c_out, sh.d);
    (g, x, h, y)
}

/// Self-attention as DiT's and PixArt's blocks run it: `norm1` + modulate of `x` by (shift,
/// scale), `attn1`'s q, k, v projections, the attention over them ([`separate_attention`]),
/// `to_out.0`; each bound (the block function's locals); then the gated residual with `gate`
/// ([`gated_released`]), bound. Returns the residual.
pub(crate) fn self_attention(
    g: &mut Graph,
    sh: &Shape,
    track: bool,
    x: Nid,
    (shift, scale, gate): (Nid, Nid, Nid),
) -> Nid {
    let (d, rows) = (sh.d, sh.b * sh.s);
    let h1 = ln_modulate(g, "norm1+modulate", x, shift, scale, rows, sh.cd());
    g.bind(h1);
    let q = bound_linear(g, sh, "attn1.to_q", h1, rows, d, d);
    let k = bound_linear(g, sh, "attn1.to_k", h1, rows, d, d);
    let v = bound_linear(g, sh, "attn1.to_v", h1, rows, d, d);
    let o = separate_attention(g, sh, "attn1 (separate q, k, v)", [q, k, v], sh.s);
    g.bind(o);
    let p = bound_linear(g, sh, "attn1.to_out.0", o, rows, d, d);
    let x1 = gated_released(g, track, "x + out·gate_msa (fused)", x, p, gate);
    g.bind(x1)
}

/// Cross-attention as PixArt's and Sana's blocks run it (`families::cross::cross_attend`): the
/// stream `x1` cast to the compute dtype as (b·s, D) rows (bound), `attn2.to_q` to the
/// cross-attention's width, then either one fused node that projects k and v of the caption `y`
/// inside ([`fused_cross`]) or the projections and the attention over separate q, k, v; bound;
/// `attn2.to_out.0` back to D. `t`: caption tokens; `(heads, width)`: the cross-attention's
/// (PixArt: the block's own). Returns to_out's output, bound.
pub(crate) fn cross_attend(
    g: &mut Graph,
    sh: &Shape,
    (x1, y): (Nid, Nid),
    t: u64,
    (heads, width): (u64, u64),
) -> Nid {
    let (cd, d, rows) = (sh.cd(), sh.d, sh.b * sh.s);
    let trows = sh.b * t;
    let xc = g.cast(&format!("x1→{cd}"), x1, cd);
    let xq = g.view("reshape(b·s, D)", Kind::Reshape, xc, sh.e());
    g.bind(xq);
    let q2 = bound_linear(g, sh, "attn2.to_q", xq, rows, width, d);
    let mut csh = sh.clone();
    csh.d = width;
    csh.heads = heads;
    let o2 = if fused_cross(sh) {
        let kw = linear_weights(g, sh, "attn2.to_k", y, (width, d));
        let vw = linear_weights(g, sh, "attn2.to_v", y, (width, d));
        let name = "attn2 (cross, k and v projected inside)";
        cross_attention(g, &csh, name, q2, y, (kw, vw), None, (sh.s, t, d))
    } else {
        let k2 = bound_linear(g, sh, "attn2.to_k", y, trows, width, d);
        sink_context_grad(g, k2, y);
        let v2 = bound_linear(g, sh, "attn2.to_v", y, trows, width, d);
        sink_context_grad(g, v2, y);
        let name = "attn2 (cross, separate q, k, v)";
        separate_attention(g, &csh, name, [q2, k2, v2], sh.s)
    };
    g.bind(o2);
    bound_linear(g, sh, "attn2.to_out.0", o2, rows, d, width)
}

/// The GELU feed-forward tail of DiT's and PixArt's blocks: the norm `names.0` + modulate of the
/// stream `x` by (shift, scale), bound; the feed-forward `ff.net.0.proj` → `ff.net.2`
/// ([`module_feed_forward`], `mlp` wide), the norm's output released unless its backward reads
/// it; the gated residual `names.1` with `gate` ([`gated_released`]). Returns the block's output.
pub(crate) fn feed_forward_tail(
    g: &mut Graph,
    sh: &Shape,
    track: bool,
    x: Nid,
    (shift, scale, gate): (Nid, Nid, Nid),
    names: (&str, &str),
) -> Nid {
    let (d, rows) = (sh.d, sh.b * sh.s);
    let h2 = ln_modulate(g, names.0, x, shift, scale, rows, sh.cd());
    g.bind(h2);
    let ff = ("ff.net.0.proj", "ff.net.2");
    let f2 = module_feed_forward(g, sh, ff, h2, (rows, d, sh.mlp, d));
    release_unless_read(g, sh, track, ff.0, h2);
    gated_released(g, track, names.1, x, f2, gate)
}

/// The image prediction `y` of the output side's `proj_out` on the modulated norm `h`
/// ([`proj_out_released`]) and the family schedule's loss on it ([`sims::prediction_loss`]),
/// `c_out` channels a patch. Returns the root.
pub(crate) fn image_loss(g: &mut Graph, sh: &Shape, (h, y): (Nid, Nid), c_out: u64) -> Nid {
    let y = proj_out_released(g, sh, h, y, sh.ad());
    let names = ["reshape(b,r,c,p,p,C)", "reshape(b,C,h,w)", "ε channels"];
    sims::prediction_loss(g, sh, y, c_out, names)
}

/// The feed-forward half of one stream of an MMDiT joint block (SD3's and Flux's; `names`: the
/// norm, the feed-forward module `ff` or `ff_context`, the gated residual): the norm + modulate
/// of the stream `x1` (`rows` tokens) by (shift, scale), bound; the feed-forward
/// `{ff}.net.0.proj` → `{ff}.net.2` (`sh.mlp` wide), the norm's output released unless its
/// backward reads it; the gated residual with the gate `gate` makes (SD3 takes its chunk view
/// only here). Returns the residual, unbound.
pub(crate) fn stream_feed_forward(
    g: &mut Graph,
    sh: &Shape,
    track: bool,
    (x1, rows): (Nid, u64),
    (shift, scale): (Nid, Nid),
    gate: impl FnOnce(&mut Graph) -> Nid,
    [norm, ff, gated]: [&str; 3],
) -> Nid {
    let h2 = ln_modulate(g, norm, x1, shift, scale, rows, sh.cd());
    g.bind(h2);
    let (fc1, fc2) = (format!("{ff}.net.0.proj"), format!("{ff}.net.2"));
    let f = module_feed_forward(g, sh, (&fc1, &fc2), h2, (rows, sh.d, sh.mlp, sh.d));
    release_unless_read(g, sh, track, &fc1, h2);
    let gate = gate(g);
    gated_released(g, track, gated, x1, f, gate)
}
