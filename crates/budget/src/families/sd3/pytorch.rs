//! SD3 / SD3.5: diffusers `SD3Transformer2DModel` (`models/transformers/transformer_sd3.py`) in
//! the step of `family_peer.py` (`train_dreambooth_lora_sd3.py`): `pos_embed` (PatchEmbed conv,
//! the sin-cos table cropped from `pos_embed_max_size`), `time_text_embed`
//! (`CombinedTimestepTextProjEmbeddings`), `context_embedder`, the MMDiT `JointTransformerBlock`s
//! (`JointAttnProcessor2_0`: the image and context projections concatenated along the sequence,
//! optional diffusers `RMSNorm` on q/k, SD3.5-medium's second self-attention `attn2`), the last
//! block `context_pre_only`, `norm_out`, `proj_out`, unpatchify and the flow-matching loss.
//! Ground truth: `families_saved.txt` (`sd3-fp32-none-loop`, fp32 and bf16).

use crate::families::flux::pytorch::{
    ada, embedder_data, gated_add, output_side, projections, split_part, stack,
    stream_feed_forward, streams_rg, timestep_embedder, two_stream_embed, Sz, ATTN_ADDED_QKV,
    ATTN_QKV, CONTEXT_FF, IMAGE_FF,
};
use crate::families::Sd3Dims;
use crate::runtime::pytorch::families::common::{self, pooled_temb_and_context, Fam};
use crate::runtime::pytorch::ops::{promote, save, Attn, Builder, Lin};
use crate::runtime::pytorch::stages::{Stage, Stages};
use crate::segment::{Segment, Tid};
use crate::spec::Dtype;

/// q or k of one projection, with the optional per-head RMSNorm.
fn qk(bl: &mut Builder, d: &Sd3Dims, norm: &str, x: Tid, rows: u64, z: &Sz) -> Tid {
    if d.qk_norm {
        bl.rms_norm(norm, x, rows * z.heads, true)
    } else {
        x
    }
}

/// `hidden_states.to(query.dtype)` after SDPA: a copy when q/k RMSNorm made the query fp32 under
/// autocast.
fn to_query_dtype(bl: &mut Builder, o: Tid, qd: Dtype) -> Tid {
    bl.g.cast("attn out .to(query.dtype)", o, qd)
}

/// One part of the attention output (`hidden_states[:, :s]` or `[:, s:]`) as its linear reads
/// it: below autocast's dtype (fp32 after `.to(query.dtype)`) the autocast cast is a contiguous
/// copy [AC]; otherwise F.linear on the non-contiguous slice goes through matmul, which folds it
/// with a copy that mm saves (none for b = 1).
fn out_part(bl: &mut Builder, name: &str, o: Tid, elems: u64, b: u64) -> Tid {
    if bl.g.dtype(o) != bl.low() {
        let v = bl.g.view(&format!("{name} (split view)"), o, elems);
        bl.cast_low(name, v)
    } else {
        split_part(bl, name, o, elems, b)
    }
}

/// `JointAttnProcessor2_0` on the modulated streams `(h, hc)`: q/k/v views (b, heads, s, dh)
/// with their optional norms, `cat([image, context], dim=2)`, SDPA, and the output projections
/// (`to_add_out` first; none for the `last`, `context_pre_only` block). Returns the attention
/// output, the context's projection and the image's.
fn joint_attention(
    bl: &mut Builder,
    d: &Sd3Dims,
    z: &Sz,
    (h, hc): (Tid, Tid),
    last: bool,
) -> (Tid, Option<Tid>, Tid) {
    let (b, s, t, dim) = (z.b, z.s, z.t, z.d);
    let [q, k, v] = projections(bl, ATTN_QKV, h, b * s, dim);
    let q = qk(bl, d, "attn.norm_q", q, b * s, z);
    let k = qk(bl, d, "attn.norm_k", k, b * s, z);
    let [eq, ek, ev] = projections(bl, ATTN_ADDED_QKV, hc, b * t, dim);
    let eq = qk(bl, d, "attn.norm_added_q", eq, b * t, z);
    let ek = qk(bl, d, "attn.norm_added_k", ek, b * t, z);
    let n = s + t;
    let ne = b * n * dim;
    let cat = |bl: &mut Builder, name: &str, a: Tid, e: Tid| {
        let dt = promote(bl.g.dtype(a), bl.g.dtype(e));
        let o = bl.g.op(name, &[a, e], ne, dt);
        // SDPA is on autocast's low-precision list: fp32 (RMSNorm) inputs are cast [AC].
        (o, bl.cast_low(&format!("{name} (sdpa input)"), o))
    };
    // The processor's `query` (before autocast's cast): its dtype is the output's after
    // `hidden_states.to(query.dtype)`.
    let qd = promote(bl.g.dtype(q), bl.g.dtype(eq));
    let (q0, qc) = cat(bl, "cat q", q, eq);
    let (k0, kc) = cat(bl, "cat k", k, ek);
    let (v0, vc) = cat(bl, "cat v", v, ev);
    let at = Attn::over(b, z.heads, n, z.dh);
    let o = bl.attention(qc, kc, vc, at);
    // The fused kernels allocate their output like the query (`empty_like`): the concatenated
    // (b, heads, n, dh) query makes `transpose(1, 2).reshape(b, -1, D)` a copy.
    let od = bl.g.dtype(o);
    let o =
        bl.g.op("attn out transpose(1, 2).reshape copy", &[o], ne, od);
    let o = to_query_dtype(bl, o, qd);
    // to_add_out runs before to_out.0.
    let co = if last {
        None
    } else {
        let oc = out_part(bl, "context attn out", o, b * t * dim, b);
        Some(bl.linear_g("attn.to_add_out", oc, Lin::new(b * t, dim, dim, true)))
    };
    let oi = out_part(bl, "attn out", o, b * s * dim, b);
    let ao = bl.linear_g("attn.to_out.0", oi, Lin::new(b * s, dim, dim, true));
    // The processor's locals hold the context projections (after their norms) until it
    // returns, and `query`, `key`, `value` the concatenations (fp32 under autocast after the
    // norms; SDPA saves its own casts).
    bl.hold("JointAttnProcessor2_0", &[eq, ek, ev, q0, k0, v0]);
    (o, co, ao)
}

/// SD3.5's `attn2` on norm(x)·(1 + scale_msa2) + shift_msa2 (chunks 6, 7 of the nine; `n1`:
/// norm1's output): self-attention (b, heads, s, dh) views, its output a (b, s, D) view into
/// to_out.0, and x1 + ·gate_msa2 (chunk 8). Returns (x1, the gated product,
/// `norm_hidden_states2`), the last two bound until the block returns.
fn dual_attention(
    bl: &mut Builder,
    d: &Sd3Dims,
    z: &Sz,
    (n1, x1): (Tid, Tid),
    m: &[Tid],
) -> (Tid, Tid, Tid) {
    let (b, s, dim) = (z.b, z.s, z.d);
    let h2 = bl.modulate_rg("norm1 (attn2)", n1, m[6], m[7], b * dim);
    let [q, k, v] = projections(
        bl,
        ["attn2.to_q", "attn2.to_k", "attn2.to_v"],
        h2,
        b * s,
        dim,
    );
    let q = qk(bl, d, "attn2.norm_q", q, b * s, z);
    let k = qk(bl, d, "attn2.norm_k", k, b * s, z);
    let qd = bl.g.dtype(q);
    let (q0, k0) = (q, k);
    let q = bl.cast_low("attn2 q (sdpa input)", q);
    let k = bl.cast_low("attn2 k (sdpa input)", k);
    let at = Attn::over(b, z.heads, s, z.dh);
    let o2 = bl.attention(q, k, v, at);
    let o2 = to_query_dtype(bl, o2, qd);
    let o2 = bl.cast_low("attn2 out (to_out input)", o2);
    let a2 = bl.linear_g("attn2.to_out.0", o2, Lin::new(b * s, dim, dim, true));
    // `query` and `key` (the norms' outputs) are bound until the processor returns.
    bl.hold("JointAttnProcessor2_0 (attn2)", &[q0, k0]);
    let (x, g2) = gated_add(bl, "attn2", x1, m[8], a2);
    (x, g2, h2)
}

/// The context stream after the attention (not in the `context_pre_only` block): c + ·c_gate_msa,
/// norm2_context, ff_context and the gated residual. Returns c2; pushes onto `held` what stays
/// bound until the block returns.
fn context_stream(
    bl: &mut Builder,
    z: &Sz,
    (c, hc, co): (Tid, Tid, Tid),
    mc: &[Tid],
    held: &mut Vec<Tid>,
) -> Tid {
    let (b, t, dim) = (z.b, z.t, z.d);
    let (c1, gc) = gated_add(bl, "context attn", c, mc[2], co);
    held.push(gc);
    let mods = [mc[3], mc[4], mc[5]];
    let (c2, [h2c, ffc, _]) = stream_feed_forward(bl, CONTEXT_FF, (c1, hc), mods, (b, t, dim));
    // `norm_encoder_hidden_states` (the context feed-forward's input) and
    // `context_ff_output` stay bound until the block returns (the gated product is a
    // temporary of the residual add).
    held.push(h2c);
    held.push(ffc);
    c2
}

/// `JointTransformerBlock.forward` (`models/attention.py`) of block `i`: norm1 and
/// norm1_context, the joint attention ([`joint_attention`]), the image stream (SD3.5's
/// [`dual_attention`], norm2, ff), the context stream ([`context_stream`]).
fn joint_block(f: &Fam, d: &Sd3Dims, z: &Sz, i: u64, rg: (bool, bool), trained: bool) -> Segment {
    let mut bl = f.builder("sd3 joint block");
    let sd = bl.low();
    let (b, s, t, dim) = (z.b, z.s, z.t, z.d);
    let last = i + 1 == d.num_layers;
    let dual = d.dual_attention_layers.binary_search(&i).is_ok();
    let x = bl.g.input("hidden_states", b * s * dim, sd, rg.0);
    let c = bl.g.input("encoder_hidden_states", b * t * dim, sd, rg.1);
    bl.g.stream_in = vec![x, c];
    let temb = bl.g.input("temb", b * dim, sd, trained);
    // norm1: AdaLayerNormZero (6 chunks) or SD35AdaLayerNormZeroX (9: a second shift / scale /
    // gate for attn2 on the same normalized x).
    let m = ada(
        &mut bl,
        "norm1.linear",
        temb,
        if dual { 9 } else { 6 },
        b,
        dim,
    );
    let n1 = bl.layer_norm_rg("norm1.norm", x, b * s);
    let h = bl.modulate_rg("norm1", n1, m[0], m[1], b * dim);
    // norm1_context: AdaLayerNormZero, or AdaLayerNormContinuous (scale, shift) when last.
    let mc = ada(
        &mut bl,
        "norm1_context.linear",
        temb,
        if last { 2 } else { 6 },
        b,
        dim,
    );
    let n1c = bl.layer_norm_rg("norm1_context.norm", c, b * t);
    let hc = if last {
        bl.modulate_rg("norm1_context", n1c, mc[1], mc[0], b * dim)
    } else {
        bl.modulate_rg("norm1_context", n1c, mc[0], mc[1], b * dim)
    };
    let (o, co, ao) = joint_attention(&mut bl, d, z, (h, hc), last);
    // The gated products stay bound to the block's locals until it returns.
    let (mut x1, ga) = gated_add(&mut bl, "attn", x, m[2], ao);
    let mut dual_in = None;
    let mut held = vec![ga];
    if dual {
        let (x, g2, h2) = dual_attention(&mut bl, d, z, (n1, x1), &m);
        // `norm_hidden_states2` stays bound until the block returns.
        dual_in = Some(h2);
        x1 = x;
        held.push(g2);
    }
    // `norm_hidden_states` (norm1's output) is rebound only at norm2.
    let mods = [m[3], m[4], m[5]];
    let (x2, [h2, _, gm]) = stream_feed_forward(&mut bl, IMAGE_FF, (x1, h), mods, (b, s, dim));
    held.push(gm);
    // `norm_hidden_states` (norm2's modulated output, the feed-forward's input) stays bound
    // until the block returns (`attention.py` `JointTransformerBlock.forward`): under LoRA
    // with a frozen `ff` nothing saves it, yet it is alive in the recompute's peak
    // (family_trace.py, sd3-bf16-lora4w-all: `transformer_blocks.0 > aten::add`, 32,768 B).
    held.push(h2);
    let mut side = Vec::new();
    if let Some(co) = co {
        side.push(context_stream(&mut bl, z, (c, hc, co), &mc, &mut held));
    } else {
        // context_pre_only: `norm_encoder_hidden_states` and `context_attn_output` (a slice of
        // the attention output, which no to_add_out consumes) stay bound until the block
        // returns.
        held.push(hc);
        held.push(o);
    }
    held.extend(dual_in);
    bl.hold("JointTransformerBlock", &held);
    bl.g.side_outputs = side;
    bl.g.output = x2;
    bl.g
}

/// Input side: PatchEmbed (conv saves its input and weight; flatten + transpose a view; the
/// cropped table a copy; `(latent + pos).to(latent.dtype)` laid out as the transposed conv output,
/// so the model's `.contiguous()` copies), time_text_embed, context_embedder.
fn embed(f: &Fam, d: &Sd3Dims, z: &Sz) -> (Segment, Vec<Tid>) {
    let mut bl = f.builder("sd3 embed");
    let low = bl.low();
    let (b, dim, s) = (z.b, z.d, z.s);
    let p = d.patch_size;
    let lat = b * s * p * p * d.in_channels;
    let noisy = bl.g.input("noisy latents", lat, low, false);
    let w = bl.weight("pos_embed.proj.weight", dim * d.in_channels * p * p);
    let bias = bl.cached_weight("pos_embed.proj.bias", dim);
    let xin = bl.cast_low("pos_embed.proj input", noisy);
    save(&mut bl.g, xin);
    let conv =
        bl.g.op("pos_embed.proj conv", &[xin, w, bias], b * s * dim, low);
    let pe =
        bl.g.param("pos_embed.pos_embed", s * dim, Dtype::F32, false);
    let crop = bl.g.op("cropped pos_embed", &[pe], s * dim, Dtype::F32);
    let sum = bl.g.op(
        "latent + pos_embed",
        &[conv, crop],
        b * s * dim,
        promote(low, Dtype::F32),
    );
    let sum = bl.g.cast("(latent + pos).to(latent dtype)", sum, low);
    let x =
        bl.g.op("hidden_states.contiguous()", &[sum], b * s * dim, low);
    let ts = bl.g.input("timesteps", b, Dtype::F32, false);
    let te = timestep_embedder(&mut bl, "time_text_embed.timestep_embedder", ts, b, dim);
    let (temb, ctx) = pooled_temb_and_context(
        &mut bl,
        te,
        (b, dim, z.t),
        d.pooled_projection_dim,
        d.joint_attention_dim,
    );
    two_stream_embed(bl, (x, ctx), temb, f.lora.is_none())
}

/// Output side: norm_out (AdaLayerNormContinuous), proj_out, unpatchify (reshape, einsum
/// permutation views, the last reshape a copy), `target = noise − x0` and the loss.
fn final_layer(f: &Fam, d: &Sd3Dims, z: &Sz, rg: bool, trained: bool) -> Segment {
    let mut bl = f.builder("sd3 final");
    let sd = bl.low();
    let (b, dim) = (z.b, z.d);
    let x = bl.g.input("hidden_states", b * z.s * dim, sd, rg);
    bl.g.stream_in = vec![x];
    let width = d.patch_size * d.patch_size * d.out_channels;
    output_side(&mut bl, x, trained, (b, z.s, dim), width, "unpatchify");
    bl.g
}

pub(crate) fn stages(f: &Fam, d: &Sd3Dims) -> Stages {
    let z = Sz::new(f, d.inner(), d.num_attention_heads, d.attention_head_dim);
    let trained = f.lora.is_none();
    let (emb, extra) = embed(f, d, &z);
    let mut rg = streams_rg(&emb);
    let mut stages = vec![Stage::embed(emb, extra)];
    // Blocks differ by index (dual attention, the last one context_pre_only): runs of equal
    // blocks become one stage each.
    let kind = |i: u64| {
        (
            d.dual_attention_layers.binary_search(&i).is_ok(),
            i + 1 == d.num_layers,
        )
    };
    let mut i = 0;
    while i < d.num_layers {
        let mut j = i + 1;
        while j < d.num_layers && kind(j) == kind(i) {
            j += 1;
        }
        let first = i;
        let (st, r) = stack(j - i, "joint block", rg, |r| {
            joint_block(f, d, &z, first, r, trained)
        });
        stages.extend(st);
        rg = r;
        i = j;
    }
    stages.push(Stage::final_loss(final_layer(f, d, &z, rg.0, trained)));
    // Data outside the model (family_peer.py): x0 and noise (wd) until the forward returns, the
    // timesteps and sigmas with them; the noisy latents (saved by the conv), the CLIP ⊕ T5
    // embeddings and the pooled vector are saved by the embedders when those are trained (until
    // the input side's backward), else dropped after the model call.
    let wd = f.spec.recipe.precision.compute_dtype().size();
    let p = d.patch_size;
    let lat = z.b * z.s * p * p * d.in_channels;
    let saved_in = (lat + z.b * z.t * d.joint_attention_dim + z.b * d.pooled_projection_dim) * wd;
    let loose = 2 * lat * wd + z.b * (8 + wd);
    Stages {
        stages,
        data: embedder_data(trained, saved_in, loose),
    }
}

common::stages_of!(Sd3);

#[cfg(test)]
mod tests {
    use crate::families::flux::pytorch::tests::{kept, labels, stages_of_spec, tiny};
    use crate::runtime::pytorch::stages::Stages;

    const SD3: &str = r#"{"_class_name": "SD3Transformer2DModel", "sample_size": 16,
        "patch_size": 2, "in_channels": 16, "num_layers": 2, "attention_head_dim": 16,
        "num_attention_heads": 4, "joint_attention_dim": 96, "caption_projection_dim": 64,
        "pooled_projection_dim": 80, "out_channels": 16, "pos_embed_max_size": 24"#;

    fn sd3_stages(extra: &str, precision: &str) -> Stages {
        stages_of_spec(&tiny(
            &format!("{SD3}{extra}}}"),
            "[77, 77]",
            precision,
            "null",
        ))
    }

    /// `families_saved.txt` (sd3-fp32-none-loop, fp32): transformer_blocks.0 saves 4735232 B,
    /// its inputs (image 65536, text 157696) and temb (1024) counted there; the last block
    /// (context_pre_only: no to_add_out, no ff_context) 2514368 B with its two inputs.
    #[test]
    fn fp32_joint_blocks_keep_what_the_dump_lists() {
        let st = sd3_stages("", "fp32");
        assert_eq!(
            labels(&st),
            [
                ("embed", 1),
                ("joint block", 1),
                ("joint block", 1),
                ("final + loss", 1)
            ]
        );
        assert_eq!(kept(&st.stages[1]), 4735232 - 65536 - 157696 - 1024);
        assert_eq!(kept(&st.stages[2]), 2514368 - 65536 - 157696);
        assert!(st.stages[2].seg.side_outputs.is_empty());
    }

    /// SD3.5-medium's dual attention and q/k RMSNorm (family_saved.py on
    /// sd3-bf16-none-foreach-35m, fp32): transformer_blocks.0 saves 6327808 B; under bf16
    /// autocast 4442304 B (the fp32 norms' copies, SDPA's bf16 casts of q and k, to_out's cast
    /// inputs after `.to(query.dtype)`).
    #[test]
    fn dual_attention_block_keeps_what_the_dump_lists() {
        let extra = r#", "qk_norm": "rms_norm", "dual_attention_layers": [0]"#;
        let st = sd3_stages(extra, "fp32");
        assert_eq!(kept(&st.stages[1]), 6327808 - 65536 - 157696 - 1024);
        let st = sd3_stages(extra, "bf16-mixed");
        assert_eq!(kept(&st.stages[1]), 4442304 - 32768 - 78848 - 512);
    }

    /// `JointTransformerBlock.forward` keeps `norm_hidden_states`, `norm_encoder_hidden_states`
    /// (the feed-forwards' inputs) and `context_ff_output` bound until it returns: under LoRA
    /// with frozen feed-forwards nothing saves them, yet they are alive to the block's end
    /// (family_trace.py, sd3-bf16-lora4w-all, inside block 0's recompute).
    #[test]
    fn joint_block_holds_its_feed_forward_locals() {
        let s = tiny(
            &format!("{SD3}}}"),
            "[77, 77]",
            "bf16-mixed",
            r#"{"rank": 4}"#,
        );
        let st = stages_of_spec(&s);
        let g = &st.stages[1].seg;
        let hold = g
            .ops
            .iter()
            .find(|o| o.name.starts_with("JointTransformerBlock"))
            .unwrap();
        let names: Vec<&str> = hold
            .inputs
            .iter()
            .map(|&t| g.tensors[t].name.as_str())
            .collect();
        for n in ["norm2 +shift", "norm2_context +shift", "ff_context.net.2"] {
            assert!(names.iter().any(|m| m.starts_with(n)), "{n} in {names:?}");
        }
    }
}
