//! Wan 2.1 in the engine as candle nodes (twin: the engine's `families/wan/block.rs` and
//! `families/wan/step.rs` on the family schedule): the embed segment (3-D patch embedding, timestep
//! MLP, `time_proj`, text projection, the RoPE tables), the `WanTransformerBlock` (q/k RMSNorm
//! across heads, RoPE, self- and cross-attention over separate q, k, v, the affine `norm2`),
//! and the output side with the final `scale_shift_table`; then their simulation into
//! [`crate::runtime::costs::Sims`] for the step replay ([`crate::runtime::ditmem_cpu::step`]).

use crate::families::{Dims as FamilyDims, FamilyModel};
use crate::runtime::ditmem_cpu::block::{
    base_weight, bound_linear, fused_cross, linear_weights, module_feed_forward, sink_context_grad,
    timestep_features,
};
use crate::runtime::ditmem_cpu::cross::cross_attention;
use crate::runtime::ditmem_cpu::family::{caption_tokens, EmbedGraph, FamilyRules, OneBlockKind};
use crate::runtime::ditmem_cpu::graph::{Graph, Kind, Nid};
use crate::runtime::ditmem_cpu::ops::{gated_residual, ln_modulate, rms_norm, rope};
use crate::runtime::ditmem_cpu::parts::{
    adaln_single_block, patch_stream, six_modulations, table_final_layer, text_projection,
    timestep_mlp,
};
use crate::runtime::ditmem_cpu::separate::separate_attention;
use crate::runtime::ditmem_cpu::sims;
use crate::runtime::shape::Shape;
use crate::spec::{Dtype, Spec};

/// What a Wan step reads beyond [`Shape`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WanGeo {
    /// umT5 tokens T.
    pub t: u64,
    /// `text_dim`.
    pub text_dim: u64,
    /// `ffn_dim`.
    pub ffn: u64,
    /// `freq_dim`.
    pub freq: u64,
    /// `out_channels`.
    pub c_out: u64,
    pub cross_attn_norm: bool,
    /// Channel pairs of a head's RoPE (d_h / 2): the width of the per-step tables.
    pub half: u64,
}

/// Dtype of the RoPE tables: f64 under an f64 compute dtype, else f32.
fn rope_dtype(sh: &Shape) -> Dtype {
    if sh.cd() == Dtype::F64 {
        Dtype::F64
    } else {
        Dtype::F32
    }
}

impl OneBlockKind for WanGeo {
    fn freq(&self) -> u64 {
        self.freq
    }

    /// Text elements of one sample (T·text_dim): the batch holds them in f64.
    fn caption_elems(&self) -> u64 {
        self.t * self.text_dim
    }

    /// The f64 angle tables made on the host (both alive while the first is cast) beside the
    /// embed's usual scratch.
    fn embed_scratch(&self, sh: &Shape) -> u64 {
        let tab = sh.s * self.half;
        sims::embed_scratch(sh, self.freq, sh.b * self.caption_elems()).max(2 * tab * 8)
    }

    /// The embed segment as `WanLayout::embed` builds it. Returns (graph, x0, t6, temb, ctx,
    /// cos, sin).
    fn embed(&self, sh: &Shape) -> EmbedGraph {
        let wg = self;
        let cd = sh.cd();
        let trows = sh.b * wg.t;
        let mut g = Graph::default();
        let x0 = patch_stream(&mut g, sh, "patch_embedding", "weight.flatten_from(1)");
        let tf = timestep_features(&mut g, sh, wg.freq);
        let ce = "condition_embedder";
        let l1 = format!("{ce}.time_embedder.linear_1");
        let l2 = format!("{ce}.time_embedder.linear_2");
        let temb = timestep_mlp(&mut g, sh, (&l1, &l2), tf, wg.freq, "temb");
        let t6 = six_modulations(&mut g, sh, &format!("{ce}.time_proj"), temb, "temb");
        let cap = g.constant("umT5 states", trows * wg.text_dim, cd, true);
        g.bind(cap);
        let te = format!("{ce}.text_embedder");
        let dims = (trows, wg.text_dim);
        let act = "text gelu(tanh) (fused)";
        let [c1, act, ctx] = text_projection(&mut g, sh, &te, cap, dims, act);
        // `text_forward`'s locals live until it returns.
        g.hold_until(&[c1, act], ctx);
        g.bind(ctx);
        let rd = rope_dtype(sh);
        let cos = g.constant("rope cos (s, d_h/2)", sh.s * wg.half, rd, true);
        g.bind(cos);
        let sin = g.constant("rope sin (s, d_h/2)", sh.s * wg.half, rd, true);
        g.bind(sin);
        EmbedGraph::of_stream(g, x0, vec![t6, temb, ctx, cos, sin])
    }

    /// One Wan block as `wan_block_forward` builds it, on a leaf copy of its input; every
    /// intermediate is a local of that function (bound). Returns the graph, the input leaf and
    /// the output.
    fn block(&self, sh: &Shape, _track: bool) -> (Graph, Nid, Nid) {
        let wg = self;
        let (cd, ad) = (sh.cd(), sh.ad());
        let (e, d) = (sh.e(), sh.d);
        let rows = sh.b * sh.s;
        let (bd, trows) = (sh.b * d, sh.b * wg.t);
        let text = ("text context (shared leaf)", trows * d);
        let (mut g, x, ctx, m) = adaln_single_block(sh, text);
        let norm = |g: &mut Graph, name: &str, x: Nid, rows: u64| {
            let w = base_weight(g, sh, &format!("{name}.weight"), d, cd);
            let y = rms_norm(g, &format!("{name} (fused)"), x, w, rows, cd);
            g.bind(y)
        };

        // Self-attention.
        let h1 = ln_modulate(&mut g, "norm1+modulate", x, m[0], m[1], rows, cd);
        g.bind(h1);
        let q = bound_linear(&mut g, sh, "attn1.to_q", h1, rows, d, d);
        let k = bound_linear(&mut g, sh, "attn1.to_k", h1, rows, d, d);
        let v = bound_linear(&mut g, sh, "attn1.to_v", h1, rows, d, d);
        let qn = norm(&mut g, "attn1.norm_q", q, rows);
        let kn = norm(&mut g, "attn1.norm_k", k, rows);
        let qr = rope(&mut g, "attn1 rope(q) (fused)", qn);
        g.bind(qr);
        let kr = rope(&mut g, "attn1 rope(k) (fused)", kn);
        g.bind(kr);
        let o = separate_attention(&mut g, sh, "attn1 (separate q, k, v)", [qr, kr, v], sh.s);
        g.bind(o);
        let p = bound_linear(&mut g, sh, "attn1.to_out.0", o, rows, d, d);
        let x1 = gated_residual(&mut g, "x + out·gate_msa (fused)", x, p, m[2]);
        g.bind(x1);

        // Cross-attention: norm2 as ln_modulate with the bias as shift and weight − 1 as scale.
        let h2 = if wg.cross_attn_norm {
            let nw = base_weight(&mut g, sh, "norm2.weight", d, ad);
            let nb = base_weight(&mut g, sh, "norm2.bias", d, ad);
            let sr = g.view("norm2.bias.reshape(1, D)", Kind::Reshape, nb, d);
            let shift = g.view("broadcast (b, D)", Kind::Broadcast, sr, bd);
            let w1 = g.op("norm2.weight − 1", Kind::Affine, &[nw], d, ad);
            let wr = g.view("reshape(1, D)", Kind::Reshape, w1, d);
            let scale = g.view("broadcast (b, D)", Kind::Broadcast, wr, bd);
            let h2 = ln_modulate(
                &mut g,
                "norm2 (affine LN, fused)",
                x1,
                shift,
                scale,
                rows,
                cd,
            );
            g.bind(h2)
        } else {
            let xc = g.cast(&format!("x1→{cd}"), x1, cd);
            let xq = g.view("reshape(b·s, D)", Kind::Reshape, xc, e);
            g.bind(xq)
        };
        let q2 = bound_linear(&mut g, sh, "attn2.to_q", h2, rows, d, d);
        let o2 = if fused_cross(sh) {
            let q2n = norm(&mut g, "attn2.norm_q", q2, rows);
            let nk = base_weight(&mut g, sh, "attn2.norm_k.weight", d, cd);
            let kw = linear_weights(&mut g, sh, "attn2.to_k", ctx, (d, d));
            let vw = linear_weights(&mut g, sh, "attn2.to_v", ctx, (d, d));
            let name = "attn2 (cross, k and v projected and k normed inside)";
            let dims = (sh.s, wg.t, d);
            cross_attention(&mut g, sh, name, q2n, ctx, (kw, vw), Some(nk), dims)
        } else {
            let k2 = bound_linear(&mut g, sh, "attn2.to_k", ctx, trows, d, d);
            sink_context_grad(&mut g, k2, ctx);
            let v2 = bound_linear(&mut g, sh, "attn2.to_v", ctx, trows, d, d);
            sink_context_grad(&mut g, v2, ctx);
            let q2n = norm(&mut g, "attn2.norm_q", q2, rows);
            let k2n = norm(&mut g, "attn2.norm_k", k2, trows);
            let name = "attn2 (cross, separate q, k, v)";
            separate_attention(&mut g, sh, name, [q2n, k2n, v2], sh.s)
        };
        g.bind(o2);
        let p2 = bound_linear(&mut g, sh, "attn2.to_out.0", o2, rows, d, d);
        let ones = g.constant("ones (b, D)", bd, ad, true);
        g.bind(ones);
        let x2 = gated_residual(&mut g, "x1 + out (fused, gate of ones)", x1, p2, ones);
        g.bind(x2);

        // Feed-forward.
        let h3 = ln_modulate(&mut g, "norm3+modulate", x2, m[3], m[4], rows, cd);
        g.bind(h3);
        let names = ("ffn.net.0.proj", "ffn.net.2");
        let f2 = module_feed_forward(&mut g, sh, names, h3, (rows, d, wg.ffn, d));
        let out = gated_residual(&mut g, "x2 + out·c_gate (fused)", x2, f2, m[5]);
        (g, x, out)
    }

    /// The output side and the loss on a leaf copy of the last block's output.
    /// Returns (graph, leaf, root).
    fn final_layer(&self, sh: &Shape) -> (Graph, Nid, Nid) {
        let wg = self;
        let ad = sh.ad();
        let temb = ("temb (shared leaf)", "temb");
        let (mut g, x, _, y) = table_final_layer(sh, temb, false, wg.c_out);
        let y = g.cast(&format!("prediction→{ad}"), y, ad);
        let root = sims::prediction_loss(
            &mut g,
            sh,
            y,
            wg.c_out,
            ["reshape(b,F,r,c,p,p,C)", "reshape(b,C,F,h,w)", "ε channels"],
        );
        (g, x, root)
    }
}

/// The registry's reader ([`crate::families::registry`]): this family's rules for a spec of it
/// (None for any other model).
pub(crate) fn rules(spec: &Spec, fm: &FamilyModel) -> Option<Box<dyn FamilyRules>> {
    let FamilyDims::Wan(d) = &fm.dims else {
        return None;
    };
    let t = caption_tokens(spec, fm);
    Some(Box::new(WanGeo {
        t,
        text_dim: d.text_dim,
        ffn: d.ffn_dim,
        freq: d.freq_dim,
        c_out: d.out_channels,
        cross_attn_norm: d.cross_attn_norm,
        half: d.attention_head_dim / 2,
    }))
}
