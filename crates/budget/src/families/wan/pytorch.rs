//! Wan 2.1: diffusers `WanTransformer3DModel` (`models/transformers/transformer_wan.py`) as eager
//! PyTorch runs it in `bench/torch_peer/family_peer.py`'s step (flow matching on video latents
//! (b, 16, F', h, w), the umT5 states cached). Ground truth: the Wan sections of
//! `bench/torch_peer/runs/2026-12-01-epyc-families-saved/families_saved.txt` (fp32 and CPU bf16 autocast).
//!
//! Stages: the input side (noising, the 3-D RoPE tables, the Conv3d patch embedding made
//! contiguous, `WanTimeTextImageEmbedding`), the blocks (all alike: the stream keeps the patch
//! embedding's dtype), `norm_out` + `proj_out` + the loss.

use crate::families::pixart::pytorch::scale_shift_table;
use crate::families::WanDims;
use crate::runtime::pytorch::families::common::{
    self, adaln_broadcasts, add_data, chunks, flipped_sinusoid, flow_loss, flow_step_bytes, info,
    input_as, noising, stack_stages, stream_x, two_linears, Fam,
};
use crate::runtime::pytorch::ops::{save, Attn, Builder, Lin};
use crate::runtime::pytorch::stages::{Data, Stage, Stages};
use crate::segment::{Segment, Tid};
use crate::spec::Dtype;

struct Dm {
    b: u64,
    /// Video tokens (F'/pt)·(h/ph)·(w/pw).
    s: u64,
    d: u64,
    heads: u64,
    dh: u64,
    ffn: u64,
    /// umT5 tokens and width.
    t: u64,
    text_dim: u64,
    freq: u64,
    c_in: u64,
    c_out: u64,
    patch: u64,
    lat: u64,
    wd: Dtype,
}

fn dm(f: &Fam, d: &WanDims) -> Dm {
    let [pt, ph, pw] = d.patch_size;
    Dm {
        b: f.b,
        s: f.s,
        d: d.inner(),
        heads: d.num_attention_heads,
        dh: d.attention_head_dim,
        ffn: d.ffn_dim,
        t: f.text.first().copied().unwrap_or(512),
        text_dim: d.text_dim,
        freq: d.freq_dim,
        c_in: d.in_channels,
        c_out: d.out_channels,
        patch: pt * ph * pw,
        lat: f.b * d.in_channels * f.frames * f.latent_h * f.latent_w,
        wd: f.spec.recipe.precision.compute_dtype(),
    }
}

/// What a block reads, with dtypes and which carry a gradient.
#[derive(Debug, Clone, Copy)]
struct Io {
    x: (Dtype, bool),
    tp: (Dtype, bool),
    ctx: (Dtype, bool),
    temb: (Dtype, bool),
}

/// `apply_rotary_emb` of `WanAttnProcessor`: `out = empty_like(x)`, the even and odd channels
/// written from `x1·cos − x2·sin` and `x1·sin + x2·cos` (fp32 by promotion with the fp32 tables;
/// each `mul` saves its table, a no-grad view of the broadcast cos/sin) [AG]. The output is
/// modelled as made from the two halves (its bytes the same, allocated last).
fn rope(bl: &mut Builder, name: &str, x: Tid, cos: Tid, sin: Tid) -> Tid {
    let (n, dt) = (bl.g.elems(x), bl.g.dtype(x));
    let h = n / 2;
    let x1 = bl.g.view(&format!("{name} x1"), x, h);
    let x2 = bl.g.view(&format!("{name} x2"), x, h);
    let a = bl.mul(&format!("{name} x1·cos"), x1, cos, h);
    let b = bl.mul(&format!("{name} x2·sin"), x2, sin, h);
    let even = bl.ew(&format!("{name} x1·cos − x2·sin"), &[a, b], h);
    let c = bl.mul(&format!("{name} x1·sin"), x1, sin, h);
    let e = bl.mul(&format!("{name} x2·cos"), x2, cos, h);
    let odd = bl.ew(&format!("{name} x1·sin + x2·cos"), &[c, e], h);
    bl.g.op(
        &format!("{name} out (even, odd written)"),
        &[even, odd],
        n,
        dt,
    )
}

/// `FP32LayerNorm` on `x.float()`: the fp32 copy is what `native_layer_norm` saves; the output
/// is fp32 (`.to(origin_dtype)` of an fp32 input is a no-op). The affine weight and bias are
/// parameters (saved as-is).
fn fp32_layer_norm(bl: &mut Builder, name: &str, x: Tid, rows: u64, affine: bool) -> Tid {
    let xf = bl.g.cast(&format!("{name} input.float()"), x, Dtype::F32);
    let y = bl.layer_norm_strided(name, xf, rows, true);
    if affine {
        let d = bl.g.elems(x) / rows.max(1);
        let w = bl.plain_param(&format!("{name}.weight"), d);
        let b = bl.plain_param(&format!("{name}.bias"), d);
        let op = bl.g.ops.iter_mut().find(|o| o.output == y);
        if let Some(op) = op {
            op.inputs.extend([w, b]);
        }
    }
    y
}

/// The input side: noising, the RoPE tables (`WanRotaryPosEmbed.forward`: slices of the fp32
/// buffers expanded and concatenated to (1, s, 1, dh), cos and sin; saved by every block's RoPE
/// muls), the Conv3d patch embedding `flatten(2).transpose(1, 2).contiguous()` (a copy; the
/// conv output is freed), the condition embedder (timestep MLP, SiLU, `time_proj` to 6·D, the
/// GELU-tanh text projection). Returns the segment, its broadcast outputs
/// (timestep_proj, temb, text context, cos, sin).
fn embed(f: &Fam, m: &Dm, d: &WanDims, ctx_saved: bool) -> (Segment, [Tid; 5]) {
    let mut bl = f.builder("embed");
    let (b, dd, wd) = (m.b, m.d, m.wd);
    let xt = noising(&mut bl, m.lat, b, wd);
    let cb = bl.g.param(
        "rope.freqs_cos",
        d.rope_max_seq_len * m.dh,
        Dtype::F32,
        false,
    );
    let sb = bl.g.param(
        "rope.freqs_sin",
        d.rope_max_seq_len * m.dh,
        Dtype::F32,
        false,
    );
    let cos =
        bl.g.op("rope cos (s, dh) cat", &[cb], m.s * m.dh, Dtype::F32);
    let sin =
        bl.g.op("rope sin (s, dh) cat", &[sb], m.s * m.dh, Dtype::F32);
    save(&mut bl.g, cos);
    save(&mut bl.g, sin);
    let e = b * m.s * dd;
    let pw = dd * m.c_in * m.patch;
    let conv = bl.conv_rg("patch_embedding", xt, e, pw, Some(dd));
    let cdt = bl.g.dtype(conv);
    let x = bl.g.op("patch embedding .contiguous()", &[conv], e, cdt);

    // Timesteps(freq_dim) fp32, `.to(time_embedder dtype)` (its parameters').
    let flip = flipped_sinusoid(&mut bl, b, m.freq);
    let pdt = if f.lora.is_some() {
        bl.low()
    } else {
        bl.param_dtype()
    };
    let tf = bl.g.cast("t_freq →time_embedder dtype", flip, pdt);
    let ce = "condition_embedder";
    let tm = format!("{ce}.time_embedder");
    let names = (tm.as_str(), "act silu");
    let temb = two_linears(&mut bl, Builder::linear_if_grad, names, tf, (b, m.freq, dd));
    // `.type_as(encoder_hidden_states)` (wd).
    let temb = bl.g.cast("temb type_as(text)", temb, wd);
    let a = bl.act(&format!("{ce}.act_fn silu"), temb);
    let tp = bl.linear_if_grad(&format!("{ce}.time_proj"), a, Lin::new(b, 6 * dd, dd, true));

    let enc =
        bl.g.input("encoder_hidden_states", b * m.t * m.text_dim, wd, false);
    let rows = b * m.t;
    let te = format!("{ce}.text_embedder");
    let names = (te.as_str(), "act_1 gelu(tanh)");
    let ctx = two_linears(
        &mut bl,
        Builder::linear_if_grad,
        names,
        enc,
        (rows, m.text_dim, dd),
    );
    if ctx_saved {
        save(&mut bl.g, ctx);
    }
    bl.g.output = x;
    (bl.g, [tp, temb, ctx, cos, sin])
}

/// One `WanTransformerBlock`, op by op.
fn block(f: &Fam, m: &Dm, d: &WanDims, io: Io) -> Segment {
    let mut bl = f.builder("block");
    let (b, s, dd) = (m.b, m.s, m.d);
    let (e, rows, trows) = (b * s * dd, b * s, b * m.t);
    let x = stream_x(&mut bl, e, io.x);
    let tp = input_as(&mut bl, "timestep_proj (b, 6, D)", b * 6 * dd, io.tp);
    let ctx = input_as(&mut bl, "text context", trows * dd, io.ctx);
    let cos = bl.g.input("rope cos", s * m.dh, Dtype::F32, false);
    let sin = bl.g.input("rope sin", s * m.dh, Dtype::F32, false);

    // `scale_shift_table + temb.float()` (fp32), chunked into (b, 1, D) views.
    let sst = bl.plain_param("scale_shift_table", 6 * dd);
    let tpf = bl.g.cast("timestep_proj.float()", tp, Dtype::F32);
    let m6 = bl.ew("scale_shift_table + temb", &[sst, tpf], b * 6 * dd);
    let ch = chunks(&mut bl, "modulation", m6, 6, b * dd);
    let (shift_msa, scale_msa, gate_msa, c_shift, c_scale, c_gate) =
        (ch[0], ch[1], ch[2], ch[3], ch[4], ch[5]);

    // Self-attention with q/k RMSNorm across heads and 3-D RoPE.
    let n1 = fp32_layer_norm(&mut bl, "norm1", x, rows, false);
    let h = bl.modulate_rg("norm1", n1, shift_msa, scale_msa, b * dd);
    let h = bl.g.cast("norm1 type_as(hidden_states)", h, io.x.0);
    let q = bl.linear_peft("attn1.to_q", h, Lin::new(rows, dd, dd, true));
    let k = bl.linear_peft("attn1.to_k", h, Lin::new(rows, dd, dd, true));
    let v = bl.linear_peft("attn1.to_v", h, Lin::new(rows, dd, dd, true));
    let q = bl.torch_rms_norm("attn1.norm_q", q, rows);
    let k = bl.torch_rms_norm("attn1.norm_k", k, rows);
    let q = rope(&mut bl, "attn1 rope(q)", q, cos, sin);
    let k = rope(&mut bl, "attn1 rope(k)", k, cos, sin);
    let at = Attn::over(b, m.heads, s, m.dh);
    let o = bl.attention(q, k, v, at);
    let ao = bl.linear_peft("attn1.to_out.0", o, Lin::new(rows, dd, dd, true));
    // `(hidden_states.float() + attn_output · gate_msa).type_as(hidden_states)`.
    let xf = bl.g.cast("x.float() (residual 1)", x, Dtype::F32);
    let g1 = bl.mul("attn · gate_msa", ao, gate_msa, e);
    let s1 = bl.ew("x + gated attn", &[xf, g1], e);
    let x1 = bl.g.cast("residual 1 type_as(hidden_states)", s1, io.x.0);

    // Cross-attention to the text context (norm2: affine FP32LayerNorm, or Identity).
    let h2 = if d.cross_attn_norm {
        let n2 = fp32_layer_norm(&mut bl, "norm2", x1, rows, true);
        bl.g.cast("norm2 type_as(hidden_states)", n2, io.x.0)
    } else {
        let xf = bl.g.cast("norm2 (Identity) input.float()", x1, Dtype::F32);
        let dt = bl.g.dtype(x1);
        if xf == x1 {
            x1
        } else {
            bl.g.op("norm2 type_as(hidden_states)", &[xf], e, dt)
        }
    };
    let q2 = bl.linear_peft("attn2.to_q", h2, Lin::new(rows, dd, dd, true));
    let k2 = bl.linear_peft("attn2.to_k", ctx, Lin::new(trows, dd, dd, true));
    let v2 = bl.linear_peft("attn2.to_v", ctx, Lin::new(trows, dd, dd, true));
    let q2 = bl.torch_rms_norm("attn2.norm_q", q2, rows);
    let k2 = bl.torch_rms_norm("attn2.norm_k", k2, trows);
    let at2 = Attn {
        skv: m.t,
        ..Attn::over(b, m.heads, s, m.dh)
    };
    let o2 = bl.attention(q2, k2, v2, at2);
    let ao2 = bl.linear_peft("attn2.to_out.0", o2, Lin::new(rows, dd, dd, true));
    let x2 = bl.ew("x + cross attn", &[x1, ao2], e);

    // Feed-forward (GELU-tanh MLP) on the modulated norm3.
    let n3 = fp32_layer_norm(&mut bl, "norm3", x2, rows, false);
    let h3 = bl.modulate_rg("norm3", n3, c_shift, c_scale, b * dd);
    let x2dt = bl.g.dtype(x2);
    let h3 = bl.g.cast("norm3 type_as(hidden_states)", h3, x2dt);
    let f1 = bl.linear_peft("ffn.net.0.proj", h3, Lin::new(rows, m.ffn, dd, true));
    let ga = bl.act("ffn gelu(tanh)", f1);
    let f2 = bl.linear_peft("ffn.net.2", ga, Lin::new(rows, dd, m.ffn, true));
    // `(hidden_states.float() + ff_output.float() · c_gate_msa).type_as(hidden_states)`.
    let x2f = bl.g.cast("x.float() (residual 3)", x2, Dtype::F32);
    let f2f = bl.g.cast("ff_output.float()", f2, Dtype::F32);
    let g3 = bl.mul("ff · c_gate_msa", f2f, c_gate, e);
    let s3 = bl.ew("x + gated ff", &[x2f, g3], e);
    let out = bl.g.cast("residual 3 type_as(hidden_states)", s3, x2dt);
    bl.g.output = out;
    bl.g
}

/// `scale_shift_table + temb` (fp32), `norm_out` (FP32LayerNorm on `x.float()`), modulation,
/// `type_as`, `proj_out`, the unpatchify permutation (a copy unless the patch is 1×1×1) and the
/// loss.
fn final_layer(f: &Fam, m: &Dm, io: Io) -> Segment {
    let mut bl = f.builder("final");
    let (b, dd) = (m.b, m.d);
    let (e, rows) = (b * m.s * dd, b * m.s);
    let x = stream_x(&mut bl, e, io.x);
    let temb = input_as(&mut bl, "temb", b * dd, io.temb);
    let target = bl.g.input("target", m.lat, m.wd, false);
    let names = ["norm_out shift", "norm_out scale"];
    let (_, shift, scale) = scale_shift_table(&mut bl, ("temb", temb), b, dd, names);
    let n = fp32_layer_norm(&mut bl, "norm_out", x, rows, false);
    let h = bl.modulate_rg("norm_out", n, shift, scale, b * dd);
    let h = bl.g.cast("norm_out type_as(hidden_states)", h, io.x.0);
    let out = m.patch * m.c_out;
    let y = bl.linear_peft("proj_out", h, Lin::new(rows, out, dd, true));
    flow_loss(&mut bl, f, y, m.patch > 1, target, m.lat, b);
    bl.g
}

/// The stages of a Wan step.
pub(crate) fn stages(f: &Fam, d: &WanDims) -> Stages {
    let m = dm(f, d);
    let frozen = f.lora.is_some();
    let n = d.num_layers as u32;
    // A checkpointed block holds its arguments (the text context, timestep_proj, RoPE) until
    // its recompute [CK].
    let ck = f.any_block_recomputed(n);
    // The text context leaves the text projection in the compute dtype: attn2's to_k/to_v save
    // it as-is (`Fam::kv_save_text`).
    let ctx_saved = ck || f.kv_save_text();
    let (mut emb_seg, [tp, temb, ctx, _cos, _sin]) = embed(f, &m, d, ctx_saved);
    let (extra, unheld) = adaln_broadcasts(&mut emb_seg, [tp, temb, ctx], ck, ctx_saved);
    let mut io = Io {
        x: info(&emb_seg, emb_seg.output),
        tp: info(&emb_seg, tp),
        ctx: info(&emb_seg, ctx),
        temb: info(&emb_seg, temb),
    };
    let (b, wd) = (m.b, m.wd.size());
    // Alive until the forward returns: x0, noise, the target, u and the timesteps (fp32), σ,
    // timestep_proj (unless a checkpoint holds it), and what no op saves.
    let mut data = Data {
        kept: 0,
        forward_only: flow_step_bytes(m.lat, b, wd) + unheld,
    };
    // The umT5 states are saved by the text embedder's linear_1 when its weight is trained.
    add_data(&mut data, b * m.t * m.text_dim * wd, !frozen);
    // Block 0 reads the patch embedding; later blocks the previous block's output (the same
    // dtype, but under LoRA block 0's input carries no gradient).
    let b0 = block(f, &m, d, io);
    io.x = info(&b0, b0.output);
    let rest = block(f, &m, d, io);
    let embed = Stage::embed(emb_seg, extra);
    stack_stages(embed, (b0, rest), n, final_layer(f, &m, io), data)
}

common::stages_of!(Wan);

#[cfg(test)]
mod tests {
    use crate::families::sana::pytorch::tests::{costs, kept};
    use crate::runtime::pytorch::device::for_spec;
    use crate::runtime::pytorch::families::common::peer_spec;
    use crate::runtime::pytorch::families::of_spec as stages;
    use crate::spec::Spec;

    /// `bench/torch_peer/specs/families/wan-fp32-none-loop-f5.json` (b 4, 5 frames → 2 latent
    /// frames of 8×8×16, patch 1×2×2: 32 tokens, D 64 in 2 heads, FFN 128, umT5 96 wide, 512
    /// tokens), with `precision`, `recompute` and LoRA set.
    fn spec(precision: &str, recompute: &str, lora: &str) -> Spec {
        let model = r#"{"name": "wan-tiny", "depth": 2, "hidden": 64, "patch": 2,
            "diffusers": {"_class_name": "WanTransformer3DModel", "added_kv_proj_dim": null,
              "attention_head_dim": 32, "cross_attn_norm": true, "eps": 1e-06, "ffn_dim": 128,
              "freq_dim": 256, "in_channels": 16, "num_attention_heads": 2, "num_layers": 2,
              "out_channels": 16, "patch_size": [1, 2, 2], "qk_norm": "rms_norm_across_heads",
              "text_dim": 96}}"#;
        let workload = r#"{"height": 64, "width": 64, "vae_factor": 8, "latent_channels": 16,
            "batch": 4, "microbatch": 4, "accumulation": 1, "ranks": 1, "frames": 5,
            "vae_temporal_factor": 4, "text_tokens": [512]}"#;
        peer_spec(model, workload, (precision, recompute, lora))
    }

    /// The dump's per-block totals (`families_saved.txt`) less what the input side holds here:
    /// the text context (first saved by block 0's to_k/to_v) and the RoPE cos/sin tables, and
    /// in fp32 the stream input norm1 saves (the patch embedding's `.contiguous()` copy). Every
    /// block then keeps the same bytes.
    #[test]
    fn blocks_keep_the_dump_bytes() {
        let (b, s, d, t) = (4u64, 32u64, 64u64, 512u64);
        let rope = 2 * s * 32 * 4;
        let f32s = costs(&spec("fp32", "none", "null"));
        let want = 3_504_640 - b * t * d * 4 - rope - b * s * d * 4;
        assert_eq!(kept(&f32s[1]), want);
        assert_eq!(kept(&f32s[2]), 2_972_160 - b * s * d * 4);
        let bf16 = costs(&spec("bf16-mixed", "none", "null"));
        // Under autocast norm1 saves its own fp32 copy of the stream.
        assert_eq!(kept(&bf16[1]), 2_587_136 - b * t * d * 2 - rope);
        assert_eq!(kept(&bf16[2]), 2_316_800);
    }

    /// LoRA on attention: the input side saves nothing but the RoPE tables; the text context is
    /// not held for the frozen to_k/to_v (lora_A saves its own copies).
    #[test]
    fn lora_freezes_the_base() {
        let l = r#"{"rank": 4, "modules": ["to_q", "to_k", "to_v", "to_out.0"]}"#;
        let c = costs(&spec("bf16-mixed", "none", l));
        assert_eq!(kept(&c[0]), 2 * 32 * 32 * 4);
        let full = costs(&spec("bf16-mixed", "none", "null"));
        assert!(kept(&c[1]) < kept(&full[1]));
    }

    /// Adapters in the weight dtype under autocast (`lora.dtype = "weight"`): PEFT's
    /// `_cast_input_dtype` returns the bf16 text context itself, autocast casts nothing, so
    /// attn2's lora_A saves it: the input side keeps it (b·t·D bf16 = 4·512·64·2 B) beside the
    /// RoPE tables, and the forward no longer drops it at its end.
    #[test]
    fn weight_dtype_adapters_save_the_text_context() {
        let fp32 = r#"{"rank": 8, "modules": ["to_k", "to_v"]}"#;
        let weight = r#"{"rank": 8, "modules": ["to_k", "to_v"], "dtype": "weight"}"#;
        let (a, w) = (
            spec("bf16-mixed", "none", fp32),
            spec("bf16-mixed", "none", weight),
        );
        let ctx = 4 * 512 * 64 * 2;
        assert_eq!(kept(&costs(&a)[0]), 2 * 32 * 32 * 4);
        assert_eq!(kept(&costs(&w)[0]), 2 * 32 * 32 * 4 + ctx);
        let fwd = |s: &Spec| stages(for_spec(s), s).data.forward_only;
        assert_eq!(fwd(&a) - fwd(&w), ctx);
    }
}
