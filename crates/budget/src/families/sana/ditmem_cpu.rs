//! Sana in the engine as candle nodes (twin: the engine's `families/sana/block.rs` and
//! `families/sana/step.rs`): the embed segment (patch embedding, timestep MLP, `time_embed.linear`,
//! caption projection + `caption_norm`), the `SanaTransformerBlock` (ReLU linear
//! self-attention, softmax cross-attention over separate q, k, v, the GLUMBConv Mix-FFN) and the
//! output side with the final `scale_shift_table`; then their simulation into [`crate::runtime::costs::Sims`] for the
//! step replay ([`crate::runtime::ditmem_cpu::step`]), which schedules them as PixArt's.
//!
//! The engine's Sana ops, each one node here: [`linear_attention`]
//! (`ops::linear_attention`), [`mix_ffn`] (`ops::mix_ffn`, the whole Mix-FFN; composed of the
//! linears, [`silu_dwconv`] (`ops::dwconv`) and [`glu`] (`ops::glu`) under LoRA on its
//! linears), `ops::rms_norm` (the rule of [`crate::families::flux::ditmem_cpu::rms_norm`]).

use crate::families::{Dims as FamilyDims, FamilyModel};
use crate::runtime::ditmem_cpu::block::{
    base_weight, block_leaf, linear_weights, module_linear, timestep_features, weights_and_bias,
    zero_bias_linear,
};
use crate::runtime::ditmem_cpu::dtypes::{acc_bytes, grad_dtype};
use crate::runtime::ditmem_cpu::family::{caption_tokens, EmbedGraph, FamilyRules, OneBlockKind};
use crate::runtime::ditmem_cpu::graph::{Graph, Kind, Nid};
use crate::runtime::ditmem_cpu::ops::{
    dwconv_elems, gated_residual, linear_attention_head_elems, linear_workspace, ln_modulate,
};
use crate::runtime::ditmem_cpu::parts::{
    cross_attend, patch_stream, six_modulations, table_final_layer, table_modulation,
    text_projection, timestep_mlp,
};
use crate::runtime::ditmem_cpu::sims;
use crate::runtime::shape::Shape;
use crate::spec::{CpuSpec, Dtype, Spec};

/// Width of diffusers' `Timesteps(256)` sinusoid.
pub const SANA_FREQ: u64 = 256;

/// What a Sana step reads beyond [`Shape`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SanaGeo {
    /// Caption tokens T.
    pub t: u64,
    /// Width of the cached Gemma states (`caption_channels`).
    pub width: u64,
    /// `out_channels` of the config.
    pub c_out: u64,
    /// Cross-attention heads and inner width.
    pub hc: u64,
    pub dc: u64,
    /// GLUMBConv hidden channels H.
    pub hid: u64,
    /// attn1's q/k/v have biases.
    pub qkv_bias: bool,
}

/// `ops::linear_attention` of the engine: q, k, v (b·s, D) → one fresh (b·s, D) output in the
/// compute dtype; it keeps nothing beyond its inputs. Forward and backward run on one scratch
/// per thread (at most one per head, [`linear_attention_head_elems`] accumulation-type elements
/// each); the backward returns three fresh gradients.
pub fn linear_attention(g: &mut Graph, sh: &Shape, name: &str, qkv: [Nid; 3]) -> Nid {
    let nh = sh.b * sh.heads;
    let nt = u64::from(sh.cpu.threads).clamp(1, nh.max(1));
    let (fwd, bwd) = linear_attention_head_elems(sh.s, sh.d / sh.heads);
    let acc = acc_bytes(sh.precision);
    let o = g.op(
        name,
        Kind::Custom {
            bwd_scratch: nt * bwd * acc,
        },
        &qkv,
        sh.b * sh.s * sh.d,
        sh.cd(),
    );
    g.nodes[o].fwd_scratch = nt * fwd * acc;
    o
}

/// `ops::dwconv::silu_dwconv3x3` of the engine: SiLU + depthwise 3×3 conv of x (rows, C) with
/// its weight (C·9) and bias (C): one fresh output of x's size; its forward and backward
/// workspaces are [`dwconv_elems`] accumulation-type values.
pub(crate) fn silu_dwconv(g: &mut Graph, sh: &Shape, name: &str, ins: [Nid; 3], c: u64) -> Nid {
    let acc = acc_bytes(sh.precision);
    let (conv_f, conv_b) = dwconv_elems(c);
    let (e, dt) = (g.elems(ins[0]), g.dtype(ins[0]));
    let o = g.op(
        name,
        Kind::Custom {
            bwd_scratch: conv_b * acc,
        },
        &ins,
        e,
        dt,
    );
    g.nodes[o].fwd_scratch = conv_f * acc;
    o
}

/// `ops::glu::glu_silu` of the engine: (rows, 2H) → one fresh (rows, H); saves nothing beyond
/// its input, backward one fresh gradient.
pub fn glu(g: &mut Graph, name: &str, u: Nid) -> Nid {
    let (e, dt) = (g.elems(u), g.dtype(u));
    g.op(name, Kind::Custom { bwd_scratch: 0 }, &[u], e / 2, dt)
}

/// `mix_ffn_forward` of the engine's Sana block on h2 (rows, D): one [`mix_ffn`] node where
/// neither linear carries LoRA (always, today: both are 1×1 `Conv2d`s in diffusers, which the
/// spec's LoRA targets refuse), else `conv_inverted`, [`silu_dwconv`], [`glu`] and
/// `conv_point` composed, the first three held until `conv_point`'s output exists (the engine
/// function's locals).
fn mix_ffn_block(g: &mut Graph, sh: &Shape, sg: &SanaGeo, h2: Nid, zero: Nid) -> Nid {
    let (d, hid, rows) = (sh.d, sg.hid, sh.b * sh.s);
    let wd = sh.weight_dtype();
    let conv = |g: &mut Graph| {
        let dw = base_weight(g, sh, "ff.conv_depth.weight", 2 * hid * 9, wd);
        (dw, base_weight(g, sh, "ff.conv_depth.bias", 2 * hid, wd))
    };
    let fused =
        sh.lora_rank("ff.conv_inverted").is_none() && sh.lora_rank("ff.conv_point").is_none();
    if fused {
        let [wi, bi] = linear_weights(g, sh, "ff.conv_inverted", h2, (2 * hid, d));
        let (dw, db) = conv(g);
        let [wp, _] = weights_and_bias(g, sh, "ff.conv_point", h2, (d, hid), Some(zero));
        let name = "ff.conv_inverted → silu → conv_depth → glu → ff.conv_point (fused Mix-FFN)";
        return mix_ffn(g, sh, name, [h2, wi, bi, dw, db, wp, zero], (rows, d, hid));
    }
    let f1 = module_linear(g, sh, "ff.conv_inverted", h2, rows, 2 * hid, d);
    let (dw, db) = conv(g);
    let c2 = silu_dwconv(g, sh, "ff silu + conv_depth (fused)", [f1, dw, db], 2 * hid);
    let gl = glu(g, "ff hidden·silu(gate) (fused)", c2);
    let f2 = zero_bias_linear(g, sh, ("ff.conv_point", gl), (rows, d, hid), Some(zero));
    g.hold_until(&[f1, c2, gl], f2);
    f2
}

/// Heap bytes of a tracked `ops::MixFfn` node's op beside the f1 it keeps: candle's
/// `Arc<Box<dyn CustomOp3>>` (32) and the op (four weight handles, two sink handles, the grid,
/// the keep flag and the mutex over f1: `size_of::<MixFfn>()`, held equal by the engine's test).
pub const MIX_FFN_OP_BYTES: u64 = 32 + 112;

/// `ops::mix_ffn` of the engine: Sana's Mix-FFN as one node on h (rows, D); `ins` = [h, Wi, bi,
/// conv weight, conv bias, Wp, bp] (bp the block's zero bias), `dims` = (rows, D, H). A fresh
/// (rows, D) output; tracked, it keeps f1 = conv_inverted(h) (rows × 2H, compute dtype; turned
/// into df1 in place by its backward and freed there, which `released_by_bwd` replays) and its
/// boxed op ([`MIX_FFN_OP_BYTES`]). Workspace: [`mix_ffn_workspace`]. Its backward returns dh
/// and the conv's dW, db (the linears' gradients go to their sinks).
pub fn mix_ffn(g: &mut Graph, sh: &Shape, name: &str, ins: [Nid; 7], dims: (u64, u64, u64)) -> Nid {
    let (rows, d, hid) = dims;
    let (cd, wd) = (g.dtype(ins[0]), g.dtype(ins[1]));
    let wants = |i: Nid| g.nodes[i].tracks || g.nodes[i].sunk;
    let grads = ins.map(wants);
    let master = wd == Dtype::F32 && matches!(cd, Dtype::Bf16 | Dtype::F16);
    // The engine keeps f1 when h or the conv's weights track (a sunk weight means h tracks).
    let tracked = grads.iter().any(|&t| t);
    let (fwd, bwd) = mix_ffn_workspace(
        &sh.cpu,
        (cd, wd, acc_bytes(sh.precision)),
        dims,
        (tracked, grads),
        master,
    );
    let f1 = rows * 2 * hid * cd.size();
    g.keeping_op(
        name,
        &ins,
        (rows * d, cd),
        (fwd, bwd),
        (f1, MIX_FFN_OP_BYTES),
    )
}

/// Workspace bytes (forward, backward) of the engine's fused Mix-FFN with its linears'
/// workspace from [`linear_workspace`] (their own buffers and `gemm`'s packing) on `cpu`:
/// see [`mix_ffn_phases`].
pub(crate) fn mix_ffn_workspace(
    cpu: &CpuSpec,
    types: (Dtype, Dtype, u64),
    dims: (u64, u64, u64),
    (tracked, grads): (bool, [bool; 7]),
    master: bool,
) -> (u64, u64) {
    let lin = |dims, t| linear_workspace(cpu, types.0, dims, t, master);
    mix_ffn_phases(lin, types, dims, (tracked, grads))
}

/// The fused Mix-FFN's phases over the workspace `lin((rows, inp, out), tracks)` of each of its
/// linear calls; `types` = (compute dtype, weight dtype, accumulation bytes), `dims` = (rows,
/// D, H) (C = 2H channels), `grads` = which of [h, Wi, bi, conv W, conv b, Wp, bp] get a
/// gradient. Forward, beyond y and (tracked) the kept f1: `conv_inverted`'s workspace before y
/// exists; c2 with the conv's widened weights (10·C); c2 beside the gate's output; the gate's
/// output with `conv_point`'s workspace (untracked, f1 is freed after c2, so it counts in the
/// first two). Backward, beyond the gradients it hands out, f1 counted throughout: f1 and c2
/// (recomputed) with the conv's weights; f1, c2, the gate's output, dWp, dbp and `conv_point`'s
/// dW workspace; f1, c2, dgl and its dx workspace; f1, dc2 (over c2) and the conv's backward
/// workspace (19·C) with its dW, db; then df1 (over f1) with `conv_inverted`'s backward and
/// every gradient.
pub(crate) fn mix_ffn_phases(
    lin: impl Fn((u64, u64, u64), (bool, bool, bool)) -> (u64, u64),
    (cd, wd, acc): (Dtype, Dtype, u64),
    (rows, d, hid): (u64, u64, u64),
    (tracked, grads): (bool, [bool; 7]),
) -> (u64, u64) {
    let (e, we) = (cd.size(), wd.size());
    let c = 2 * hid;
    let (f1, gl, y) = (e * rows * c, e * rows * hid, e * rows * d);
    let (s1, _) = lin((rows, d, c), (false, false, false));
    let (s2, _) = lin((rows, hid, d), (false, false, false));
    let (conv_f, conv_b) = dwconv_elems(c);
    let (conv_f, conv_b) = (conv_f * acc, conv_b * acc);
    let kept = if tracked { 0 } else { f1 };
    // c2 is as big as f1.
    let fwd = (kept + s1)
        .saturating_sub(y)
        .max((kept + f1 + conv_f).saturating_sub(y))
        .max((f1 + gl).saturating_sub(y))
        .max(gl + s2);
    let on = |b: bool, n: u64| if b { we * n } else { 0 };
    let [th, ti, tbi, tw, tb, tp, tbp] = grads;
    let gi = on(ti, c * d) + on(tbi, c);
    let gc = on(tw, 9 * c) + on(tb, c);
    let gp = on(tp, d * hid) + on(tbp, d);
    let dh = if th { e * rows * d } else { 0 };
    let (_, sp_w) = lin((rows, hid, d), (false, tp, tbp));
    let (_, sp_x) = lin((rows, hid, d), (true, false, false));
    let (_, si) = lin((rows, d, c), (th, ti, tbi));
    let mut peak = f1 + f1 + conv_f;
    if tp || tbp {
        peak = peak.max(f1 + f1 + gl + gp + sp_w);
    }
    peak = peak.max(f1 + f1 + gp + gl + sp_x);
    peak = peak.max(f1 + f1 + gp + conv_b + gc);
    if th || ti || tbi {
        peak = peak.max(f1 + gp + gc + si + gi + dh);
    }
    (fwd, peak.saturating_sub(gi + gc + gp + dh))
}

impl OneBlockKind for SanaGeo {
    fn freq(&self) -> u64 {
        SANA_FREQ
    }

    /// Text elements of one sample (T·width): the batch holds them in f64.
    fn caption_elems(&self) -> u64 {
        self.t * self.width
    }

    /// The embed segment as `SanaLayout::embed` builds it. Returns (graph, x0, t6, embedded
    /// timestep, caption).
    fn embed(&self, sh: &Shape) -> EmbedGraph {
        let sg = self;
        let cd = sh.cd();
        let trows = sh.b * sg.t;
        let wd = sh.weight_dtype();
        let mut g = Graph::default();
        let x0 = patch_stream(
            &mut g,
            sh,
            "patch_embed.proj",
            "proj.weight.flatten_from(1)",
        );
        let tf = timestep_features(&mut g, sh, SANA_FREQ);
        let te = "time_embed.emb.timestep_embedder";
        let (l1, l2) = (format!("{te}.linear_1"), format!("{te}.linear_2"));
        let emb = timestep_mlp(&mut g, sh, (&l1, &l2), tf, SANA_FREQ, "emb");
        let t6 = six_modulations(&mut g, sh, "time_embed.linear", emb, "emb");
        let cap = g.constant("caption embeddings", trows * sg.width, cd, true);
        g.bind(cap);
        let dims = (trows, sg.width);
        let act = "caption gelu(tanh) (fused)";
        let [c1, act, c2] = text_projection(&mut g, sh, "caption_projection", cap, dims, act);
        let nw = base_weight(&mut g, sh, "caption_norm.weight", sh.d, wd);
        let y = crate::families::flux::ditmem_cpu::rms_norm(
            &mut g,
            sh,
            "caption_norm (fused)",
            c2,
            nw,
            sh.d,
        );
        // `caption_forward`'s locals live until it returns.
        g.hold_until(&[c1, act, c2], y);
        g.bind(y);
        EmbedGraph::of_stream(g, x0, vec![t6, emb, y])
    }

    /// One Sana block as `sana_block_forward` builds it, on a leaf copy of its input, after the
    /// block's weights (the zero bias is made with them). Returns (graph, input leaf, output).
    fn block(&self, sh: &Shape, _track: bool) -> (Graph, Nid, Nid) {
        let sg = self;
        let (cd, ad) = (sh.cd(), sh.ad());
        let d = sh.d;
        let rows = sh.b * sh.s;
        let (bd, trows) = (sh.b * d, sh.b * sg.t);
        let (mut g, x) = block_leaf(sh);
        let t6 = sh.cond_leaf(&mut g, "t6 (shared leaf)", 6 * bd, ad);
        let y = sh.cond_leaf(&mut g, "caption (shared leaf)", trows * d, cd);
        let wd = sh.weight_dtype();
        // `sana_block_weights`: the table's cast, then the zero bias the bias-less linears share.
        let table = base_weight(&mut g, sh, "scale_shift_table", 6 * d, ad);
        let zero = g.constant("zero bias (D)", d, wd, true);
        g.bind(zero);
        let m = table_modulation(&mut g, sh, t6, table);
        let lin = |g: &mut Graph, name: &str, x: Nid, z: bool| {
            let y = zero_bias_linear(g, sh, (name, x), (rows, d, d), z.then_some(zero));
            g.bind(y)
        };
        let nb = !sg.qkv_bias;

        // Linear self-attention.
        let h1 = ln_modulate(&mut g, "norm1+modulate", x, m[0], m[1], rows, cd);
        g.bind(h1);
        let q = lin(&mut g, "attn1.to_q", h1, nb);
        let k = lin(&mut g, "attn1.to_k", h1, nb);
        let v = lin(&mut g, "attn1.to_v", h1, nb);
        let o = linear_attention(&mut g, sh, "attn1 (linear, ReLU kernel)", [q, k, v]);
        g.bind(o);
        let p = lin(&mut g, "attn1.to_out.0", o, false);
        let x1 = gated_residual(&mut g, "x + out·gate_msa (fused)", x, p, m[2]);
        g.bind(x1);

        // Cross-attention (its own heads and width).
        let p2 = cross_attend(&mut g, sh, (x1, y), sg.t, (sg.hc, sg.dc));
        let ones = g.constant("ones (b, D)", bd, ad, true);
        g.bind(ones);
        let x2 = gated_residual(&mut g, "x1 + out (fused, gate of ones)", x1, p2, ones);
        g.bind(x2);

        // Mix-FFN.
        let h2 = ln_modulate(&mut g, "norm2+modulate", x2, m[3], m[4], rows, cd);
        g.bind(h2);
        let f2 = mix_ffn_block(&mut g, sh, sg, h2, zero);
        g.bind(f2);
        let out = gated_residual(&mut g, "x2 + out·gate_mlp (fused)", x2, f2, m[5]);
        (g, x, out)
    }

    /// The output side and the loss on a leaf copy of the last block's output (PixArt's; the
    /// prediction's channel `narrow` is candle's no-op when `out_channels` = `in_channels`).
    /// Returns (graph, leaf, root).
    fn final_layer(&self, sh: &Shape) -> (Graph, Nid, Nid) {
        let pg = self;
        let ad = sh.ad();
        let ld = grad_dtype(sh.precision);
        let p2 = sh.patch2;
        let rows = sh.b * sh.s;
        let emb = ("embedded timestep (shared leaf)", "emb");
        let (mut g, x, _, y) = table_final_layer(sh, emb, true, pg.c_out);
        let out_el = rows * p2 * pg.c_out;
        let y = g.cast(&format!("prediction→{ad}"), y, ad);
        let y = g.view("reshape(b,r,c,p,p,C)", Kind::Reshape, y, out_el);
        let y = g.view("permute", Kind::Transpose, y, out_el);
        let img = g.op("unpatchify (contiguous)", Kind::Copy, &[y], out_el, ad);
        let img = g.view("reshape(b,C,h,w)", Kind::Reshape, img, out_el);
        let lat = rows * p2 * sh.c_in;
        let pred = if out_el > lat {
            g.view(
                "ε channels",
                Kind::Narrow {
                    pad_before: 0,
                    pad_after: out_el - lat,
                },
                img,
                lat,
            )
        } else {
            img
        };
        let pred = g.cast(&format!("pred→{ld}"), pred, ld);
        let root = sims::family_loss(&mut g, pred, lat, ld);
        (g, x, root)
    }
}

/// The registry's reader ([`crate::families::registry`]): this family's rules for a spec of it
/// (None for any other model).
pub(crate) fn rules(spec: &Spec, fm: &FamilyModel) -> Option<Box<dyn FamilyRules>> {
    let FamilyDims::Sana(d) = &fm.dims else {
        return None;
    };
    let t = caption_tokens(spec, fm);
    Some(Box::new(SanaGeo {
        t,
        width: d.caption_channels,
        c_out: d.out_channels,
        hc: d.num_cross_attention_heads,
        dc: d.num_cross_attention_heads * d.cross_attention_head_dim,
        hid: d.mlp_hidden(),
        qkv_bias: d.attention_bias,
    }))
}
