//! Sana: diffusers `SanaTransformer2DModel` (`models/transformers/sana_transformer.py`) as eager
//! PyTorch runs it in `bench/torch_peer/family_peer.py`'s step (flow matching, the caption
//! embeddings and the padded attention mask cached). Ground truth: the Sana sections of
//! `bench/torch_peer/runs/2026-12-01-epyc-families-saved/families_saved.txt` (fp32 and CPU bf16 autocast).
//!
//! Stages: the input side (noising, `PatchEmbed` conv, `AdaLayerNormSingle`, the caption
//! projection and its RMSNorm), block 0 (its stream is the transposed, low-precision patch
//! embedding), blocks 1.. (an fp32 contiguous stream), `norm_out` + `proj_out` + the loss.

use crate::families::pixart::pytorch::scale_shift_table;
use crate::families::SanaDims;
use crate::runtime::pytorch::families::common::{
    self, adaln_broadcasts, add_data, chunks, flipped_sinusoid, flow_loss, flow_step_bytes, info,
    input_as, noising, stack_stages, stream_x, two_linears, Fam, FREQ,
};
use crate::runtime::pytorch::ops::{save, Attn, Builder, Lin};
use crate::runtime::pytorch::stages::{Data, Stage, Stages};
use crate::segment::{Segment, Tid};
use crate::spec::Dtype;

/// The sizes of one step.
struct Dm {
    b: u64,
    /// Image tokens (h/p)·(w/p).
    s: u64,
    d: u64,
    heads: u64,
    dh: u64,
    /// Cross-attention heads, head size, inner width.
    hc: u64,
    dhc: u64,
    dc: u64,
    /// GLUMBConv hidden channels H (the inverted conv makes 2H).
    hid: u64,
    /// Caption tokens and Gemma width.
    t: u64,
    cc: u64,
    c_in: u64,
    c_out: u64,
    p: u64,
    /// Latent elements b·C·h·w.
    lat: u64,
    /// The scripts' `weight_dtype` (latents, caption embeddings): the compute dtype.
    wd: Dtype,
}

fn dm(f: &Fam, d: &SanaDims) -> Dm {
    let wd = f.spec.recipe.precision.compute_dtype();
    Dm {
        b: f.b,
        s: f.s,
        d: d.inner(),
        heads: d.num_attention_heads,
        dh: d.attention_head_dim,
        hc: d.num_cross_attention_heads,
        dhc: d.cross_attention_head_dim,
        dc: d.num_cross_attention_heads * d.cross_attention_head_dim,
        hid: d.mlp_hidden(),
        t: f.text.first().copied().unwrap_or(300),
        cc: d.caption_channels,
        c_in: d.in_channels,
        c_out: d.out_channels,
        p: d.patch_size,
        lat: f.b * d.in_channels * f.latent_h * f.latent_w,
        wd,
    }
}

/// What a block stage reads: the stream's dtype and layout, the broadcast tensors' dtypes, and
/// which of them carry a gradient.
#[derive(Debug, Clone, Copy)]
struct Io {
    x: (Dtype, bool),
    /// The patch embedding's `flatten(2).transpose(1, 2)` (block 0) is not contiguous.
    x_contig: bool,
    ts: (Dtype, bool),
    cap: (Dtype, bool),
    emb: (Dtype, bool),
}

/// `F.relu`: `ReluBackward0` saves its result [AG].
fn relu(bl: &mut Builder, name: &str, x: Tid) -> Tid {
    let (n, dt) = (bl.g.elems(x), bl.g.dtype(x));
    let y = bl.g.op(name, &[x], n, dt);
    let r = bl.rg(y);
    bl.save_if(y, r);
    y
}

/// The operands `a`, `b` of a matmul as `BmmBackward0` saves them: each when the other needs a
/// gradient [AG].
fn saved_for_each_other(bl: &mut Builder, a: Tid, b: Tid) {
    let (ra, rb) = (bl.rg(a), bl.rg(b));
    bl.save_if(a, rb);
    bl.save_if(b, ra);
}

/// `SanaLinearAttnProcessor2_0` after the projections (`attention_processor.py`): ReLU kernels,
/// `.float()` copies, V padded with a row of ones, `matmul(v, kᵀ)` then `matmul(·, q)` — under
/// autocast both matmuls cast their fp32 operands back to the low dtype, and the strided k and q
/// are reshaped into copies for `bmm` [MM][AC] — then the division by the last row. Returns
/// to_out's input (b, s, D), a transposed view.
fn linear_attention(bl: &mut Builder, m: &Dm, q: Tid, k: Tid, v: Tid) -> Tid {
    let e = m.b * m.s * m.d;
    let low = bl.low();
    let padded = m.b * m.heads * (m.dh + 1) * m.s;
    let rq = relu(bl, "attn1 relu(q)", q);
    let rk = relu(bl, "attn1 relu(k)", k);
    let qf = bl.g.cast("attn1 q.float()", rq, Dtype::F32);
    let kf = bl.g.cast("attn1 k.float()", rk, Dtype::F32);
    let vf = bl.g.cast("attn1 v.float()", v, Dtype::F32);
    let vp =
        bl.g.op("attn1 F.pad(v, 1 row of ones)", &[vf], padded, Dtype::F32);
    let vc = bl.cast_low("attn1 padded v", vp);
    let kc = bl.cast_low("attn1 k", kf);
    let kdt = bl.g.dtype(kc);
    let kr = bl.g.op("attn1 k reshaped for bmm", &[kc], e, kdt);
    saved_for_each_other(bl, vc, kr);
    let sc = bl.g.op(
        "attn1 v·kᵀ",
        &[vc, kr],
        m.b * m.heads * (m.dh + 1) * m.dh,
        low,
    );
    let qc = bl.cast_low("attn1 q", qf);
    let qdt = bl.g.dtype(qc);
    let qr = bl.g.op("attn1 q reshaped for bmm", &[qc], e, qdt);
    saved_for_each_other(bl, sc, qr);
    let hs = bl.g.op("attn1 (v·kᵀ)·q", &[sc, qr], padded, low);
    let den =
        bl.g.op("attn1 last row + 1e-15", &[hs], m.b * m.heads * m.s, low);
    // DivBackward0: self's gradient reads other; other's reads self and other [AG].
    let (rh, rd) = (bl.rg(hs), bl.rg(den));
    bl.save_if(hs, rd);
    bl.save_if(den, rh || rd);
    bl.g.op("attn1 rows / last row", &[hs, den], e, low)
}

/// The input side: noising (no grad), `PatchEmbed` (conv, flatten + transpose: a view; plus
/// the sin-cos table when `interpolation_scale` is set),
/// `AdaLayerNormSingle` (timestep MLP, SiLU, Linear D → 6D), `PixArtAlphaTextProjection`
/// (Linear, GELU-tanh, Linear) and `caption_norm` (RMSNorm, affine).
/// Returns the segment, its broadcast outputs (timestep 6D, embedded timestep, caption) and
/// whether the caption is saved by the blocks (their k/v linears read it without a cast).
fn embed(f: &Fam, m: &Dm, pos: bool, cap_saved_by_blocks: bool) -> (Segment, [Tid; 3]) {
    let mut bl = f.builder("embed");
    let (b, d, wd) = (m.b, m.d, m.wd);
    let xt = noising(&mut bl, m.lat, b, wd);
    let pw = d * m.c_in * m.p * m.p;
    let conv = bl.conv_rg("patch_embed.proj", xt, b * d * m.s, pw, Some(d));
    let mut x = bl.g.view(
        "patch embedding (b, s, D) transposed view",
        conv,
        b * d * m.s,
    );
    if pos {
        // `(latent + pos_embed).to(latent.dtype)` (`PatchEmbed.forward`): an fp32 sum with the
        // sin-cos buffer in the latent's (transposed) layout, cast back.
        let pe =
            bl.g.param("patch_embed.pos_embed", m.s * d, Dtype::F32, false);
        let sum = bl.ew("patch embedding + pos_embed", &[x, pe], b * d * m.s);
        let cdt = bl.g.dtype(conv);
        x = bl.g.cast("(latent + pos_embed).to(latent dtype)", sum, cdt);
    }

    // Timesteps(256, flip_sin_to_cos) in fp32, no grad; `.to(hidden_dtype)` (the patch
    // embedding's dtype).
    let flip = flipped_sinusoid(&mut bl, b, FREQ);
    let tf = bl.g.cast("t_freq →hidden dtype", flip, bl.g.dtype(conv));
    let te = ("time_embed.emb.timestep_embedder", "act silu");
    let emb = two_linears(&mut bl, Builder::linear_if_grad, te, tf, (b, FREQ, d));
    let s2 = bl.act("time_embed.silu", emb);
    let ts = bl.linear_if_grad("time_embed.linear", s2, Lin::new(b, 6 * d, d, true));

    // Caption: the cached Gemma states (wd, no grad).
    let enc =
        bl.g.input("encoder_hidden_states", b * m.t * m.cc, wd, false);
    let rows = b * m.t;
    let names = ("caption_projection", "act_1 gelu(tanh)");
    let c2 = two_linears(
        &mut bl,
        Builder::linear_if_grad,
        names,
        enc,
        (rows, m.cc, d),
    );
    let cap = bl.rms_norm("caption_norm", c2, rows, true);
    if cap_saved_by_blocks {
        save(&mut bl.g, cap);
    }
    bl.g.output = x;
    (bl.g, [ts, emb, cap])
}

/// One `SanaTransformerBlock`, op by op.
// Over 100 lines on purpose: one statement per op of SanaTransformerBlock in the order the code runs,
// each reading the locals before it; split, the parts would pass most of them back and forth.
fn block(f: &Fam, m: &Dm, d: &SanaDims, io: Io) -> Segment {
    let mut bl = f.builder("block");
    let (b, s, dd) = (m.b, m.s, m.d);
    let (e, rows) = (b * s * dd, b * s);
    let x = stream_x(&mut bl, e, io.x);
    let ts = input_as(&mut bl, "timestep (b, 6D)", b * 6 * dd, io.ts);
    let cap = input_as(&mut bl, "caption", b * m.t * dd, io.cap);
    let mask = bl.g.input("caption mask bias", b * m.t, m.wd, false);

    // 1. Modulation: the (b, 6, D) sum in the promoted dtype, chunked into views.
    let sst = bl.plain_param("scale_shift_table", 6 * dd);
    let m6 = bl.ew("scale_shift_table + timestep", &[sst, ts], b * 6 * dd);
    let ch = chunks(&mut bl, "modulation", m6, 6, b * dd);
    let (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp) =
        (ch[0], ch[1], ch[2], ch[3], ch[4], ch[5]);

    // 2. Self-attention (linear), `.to(hidden_states.dtype)` after the modulation.
    let n1 = bl.layer_norm_strided("norm1", x, rows, io.x_contig);
    let h = bl.modulate_rg("norm1", n1, shift_msa, scale_msa, b * dd);
    let h = bl.g.cast("norm1 →hidden dtype", h, io.x.0);
    let hdt = bl.g.dtype(h);
    let ab = d.attention_bias;
    let mut q = bl.linear_peft("attn1.to_q", h, Lin::new(rows, dd, dd, ab));
    let mut k = bl.linear_peft("attn1.to_k", h, Lin::new(rows, dd, dd, ab));
    let v = bl.linear_peft("attn1.to_v", h, Lin::new(rows, dd, dd, ab));
    if d.qk_norm {
        q = bl.rms_norm("attn1.norm_q", q, rows, true);
        k = bl.rms_norm("attn1.norm_k", k, rows, true);
    }
    let o = linear_attention(&mut bl, m, q, k, v);
    let o = bl.g.cast("attn1 →original dtype", o, hdt);
    let ao = bl.linear_strided("attn1.to_out.0", o, Lin::new(rows, dd, dd, true));
    let gp = bl.mul("gate_msa·attn", gate_msa, ao, e);
    let x1 = bl.ew("x + gated attn", &[x, gp], e);

    // 3. Cross-attention (SDPA with the repeated mask bias); the residual stream stays in the
    // input's layout, so block 0's to_q reads a strided tensor.
    let mr = bl.g.op(
        "mask repeat_interleave(heads)",
        &[mask],
        b * m.hc * m.t,
        m.wd,
    );
    let mut q2 = if io.x_contig {
        bl.linear_peft("attn2.to_q", x1, Lin::new(rows, m.dc, dd, true))
    } else {
        bl.linear_strided("attn2.to_q", x1, Lin::new(rows, m.dc, dd, true))
    };
    let trows = b * m.t;
    let mut k2 = bl.linear_peft("attn2.to_k", cap, Lin::new(trows, m.dc, dd, true));
    let v2 = bl.linear_peft("attn2.to_v", cap, Lin::new(trows, m.dc, dd, true));
    if d.qk_norm {
        q2 = bl.rms_norm("attn2.norm_q", q2, rows, true);
        k2 = bl.rms_norm("attn2.norm_k", k2, trows, true);
    }
    let qv = bl.g.view("attn2 q", q2, rows * m.dc);
    let kv = bl.g.view("attn2 k", k2, trows * m.dc);
    let vv = bl.g.view("attn2 v", v2, trows * m.dc);
    let at = Attn {
        skv: m.t,
        ..Attn::over(b, m.hc, s, m.dhc)
    };
    let o2 = bl.attention_mask_saved(qv, kv, vv, at, Some(mr));
    let a2 = bl.linear_peft("attn2.to_out.0", o2, Lin::new(rows, dd, m.dc, true));
    let a2dt = bl.g.dtype(a2);
    let a2 = bl.g.op("attn2 / rescale_output_factor", &[a2], e, a2dt);
    let x2 = bl.ew("attn2 + x", &[a2, x1], e);

    // 4. Mix-FFN (GLUMBConv) on the (b, D, h, w) view of the modulated norm.
    let n2 = bl.layer_norm_strided("norm2", x2, rows, true);
    let h2 = bl.modulate_rg("norm2", n2, shift_mlp, scale_mlp, b * dd);
    let (hid, px) = (m.hid, b * s);
    let c1 = bl.conv_rg(
        "ff.conv_inverted",
        h2,
        2 * hid * px,
        2 * hid * dd,
        Some(2 * hid),
    );
    let a1 = bl.act("ff silu", c1);
    let c2 = bl.conv_rg(
        "ff.conv_depth",
        a1,
        2 * hid * px,
        2 * hid * 9,
        Some(2 * hid),
    );
    let hv = bl.g.view("ff chunk hidden", c2, hid * px);
    let gv = bl.g.view("ff chunk gate", c2, hid * px);
    let sg = bl.act("ff silu(gate)", gv);
    let mm = bl.mul("ff hidden·silu(gate)", hv, sg, hid * px);
    let fo = bl.conv_rg("ff.conv_point", mm, e, dd * hid, None);
    let gm = bl.mul("gate_mlp·ff", gate_mlp, fo, e);
    bl.ew("x + gated ff", &[x2, gm], e);
    bl.g
}

/// `norm_out` (SanaModulatedNorm with the model's 2×D table), `proj_out`, unpatchify, and the
/// scripts' loss `mean(((pred.float() − target.float())²).reshape(b, −1), 1).mean()`.
fn final_layer(f: &Fam, m: &Dm, io: Io) -> Segment {
    let mut bl = f.builder("final");
    let (b, dd) = (m.b, m.d);
    let (e, rows) = (b * m.s * dd, b * m.s);
    let x = stream_x(&mut bl, e, io.x);
    let emb = input_as(&mut bl, "embedded_timestep", b * dd, io.emb);
    let target = bl.g.input("target", m.lat, m.wd, false);
    let n = bl.layer_norm_strided("norm_out.norm", x, rows, true);
    let names = ["norm_out shift", "norm_out scale"];
    let (_, shift, scale) = scale_shift_table(&mut bl, ("embedded_timestep", emb), b, dd, names);
    let h = bl.modulate_rg("norm_out", n, shift, scale, b * dd);
    let out = m.p * m.p * m.c_out;
    let y = bl.linear_opt("proj_out", h, Lin::new(rows, out, dd, true));
    flow_loss(&mut bl, f, y, m.p > 1, target, m.lat, b);
    bl.g
}

/// The stages of a Sana step.
pub(crate) fn stages(f: &Fam, d: &SanaDims) -> Stages {
    let m = dm(f, d);
    let probe = f.builder("probe");
    let low = probe.low();
    let frozen = f.lora.is_some();
    let param_dt = if frozen {
        low
    } else {
        f.spec.recipe.precision.param_dtype()
    };
    // The caption leaves caption_norm in fp32 (x·rsqrt promotes; the weight's dtype when it is
    // bf16 under LoRA); the blocks' to_k/to_v save it as-is when no autocast copy is needed and
    // something saves their input (a trained weight, or LoRA on them).
    let cap_dt = if matches!(param_dt, Dtype::Bf16 | Dtype::F16) {
        param_dt
    } else {
        Dtype::F32
    };
    // A checkpointed block keeps its inputs until its recompute (non-reentrant
    // `torch.utils.checkpoint` holds the call's arguments) [CK]: the caption, the 6·D timestep
    // and the mask bias then live until block 0's backward.
    let n = d.num_layers as u32;
    let ck = f.any_block_recomputed(n);
    // Under autocast PEFT's lora_A saves its own copy of the caption (`linear_peft`), unless
    // the adapters are in the compute dtype (`Fam::kv_save_text`).
    let cap_saved = ck || (cap_dt == low && f.kv_save_text());
    let (mut emb_seg, [ts, emb, cap]) = embed(f, &m, d.pos_embed, cap_saved);
    let (extra, unheld) = adaln_broadcasts(&mut emb_seg, [ts, emb, cap], ck, cap_saved);
    let mut io = Io {
        x: info(&emb_seg, emb_seg.output),
        x_contig: false,
        ts: info(&emb_seg, ts),
        cap: info(&emb_seg, cap),
        emb: info(&emb_seg, emb),
    };
    let (b, wd) = (m.b, m.wd.size());
    // Alive until the model's forward returns (locals of `forward()`, of the model's forward, or
    // the script's): x0, noise, the target (made right after the model), u and the timesteps
    // (fp32), σ, the int64 mask and its additive bias, the 6·D timestep, and whatever of the
    // embedded timestep, caption and Gemma states no op saves.
    let mask_bias = b * m.t * wd;
    let mut data = Data {
        kept: 0,
        forward_only: flow_step_bytes(m.lat, b, wd) + b * m.t * 8 + unheld,
    };
    // A checkpoint holds the mask bias until block 0's recompute [CK].
    add_data(&mut data, mask_bias, ck);
    // The Gemma states are saved by caption_projection.linear_1 when its weight is trained.
    add_data(&mut data, b * m.t * m.cc * wd, !frozen);

    let b0 = block(f, &m, d, io);
    io.x = info(&b0, b0.output);
    io.x_contig = true;
    let rest = block(f, &m, d, io);
    let embed = Stage::embed(emb_seg, extra);
    stack_stages(embed, (b0, rest), n, final_layer(f, &m, io), data)
}

common::stages_of!(Sana);

#[cfg(test)]
pub(crate) mod tests {
    use crate::runtime::pytorch::device::for_spec;
    use crate::runtime::pytorch::families::common::peer_spec;
    use crate::runtime::pytorch::families::of_spec as stages;
    use crate::runtime::pytorch::stages::StageCost;
    use crate::spec::Spec;

    /// `bench/torch_peer/specs/families/sana-fp32-none-loop.json` (b 4, 8×8 latent of 32
    /// channels, D 64 in 4 heads, cross 2×32, Gemma 96 wide, 300 tokens), with `precision`,
    /// `recompute` and LoRA set.
    pub(crate) fn spec(precision: &str, recompute: &str, lora: &str) -> Spec {
        let model = r#"{"name": "sana-tiny", "depth": 2, "hidden": 64, "patch": 1,
            "diffusers": {"_class_name": "SanaTransformer2DModel", "in_channels": 32,
              "out_channels": 32, "num_attention_heads": 4, "attention_head_dim": 16,
              "num_layers": 2, "num_cross_attention_heads": 2, "cross_attention_head_dim": 32,
              "cross_attention_dim": 64, "caption_channels": 96, "mlp_ratio": 2.5,
              "attention_bias": false, "sample_size": 8, "patch_size": 1,
              "norm_elementwise_affine": false, "norm_eps": 1e-06, "interpolation_scale": null}}"#;
        let workload = r#"{"height": 256, "width": 256, "vae_factor": 32, "latent_channels": 32,
            "batch": 4, "microbatch": 4, "accumulation": 1, "ranks": 1, "frames": 1,
            "text_tokens": [300]}"#;
        peer_spec(model, workload, (precision, recompute, lora))
    }

    /// The stages' costs of a family spec as the runtime builds them.
    pub(crate) fn costs(s: &Spec) -> Vec<StageCost> {
        stages(for_spec(s), s).costs()
    }

    /// What a stage keeps for backward.
    pub(crate) fn kept(c: &StageCost) -> u64 {
        c.cost.kept.total()
    }

    /// The dump's per-block totals (`families_saved.txt`, `--all-tensors`), less what our
    /// stages hold elsewhere: the stream input a block's norm saves (the previous stage's
    /// output) and, in fp32, the caption its to_k/to_v save (kept by the input side).
    #[test]
    fn blocks_keep_the_dump_bytes() {
        let (b, s, d, t) = (4u64, 64u64, 64u64, 300u64);
        let e = b * s * d;
        let f32s = costs(&spec("fp32", "none", "null"));
        assert_eq!(kept(&f32s[1]), 3_465_600 - b * t * d * 4 - e * 4);
        assert_eq!(kept(&f32s[2]), 3_158_400 - e * 4);
        let bf16 = costs(&spec("bf16-mixed", "none", "null"));
        // Block 0 reads the bf16 patch embedding; its caption copies are its own.
        assert_eq!(kept(&bf16[1]), 2_090_816 - e * 2);
        assert_eq!(kept(&bf16[2]), 2_222_912 - e * 4);
    }

    /// The input side of the dump: patch_embed + time_embed + caption_projection + caption_norm
    /// (the Gemma states are the step's data, not the segment's; the fp32 caption, first saved by
    /// block 0's to_k in the dump, is held by the input side here).
    #[test]
    fn input_side_keeps_the_dump_bytes() {
        let f32s = costs(&spec("fp32", "none", "null"));
        let enc = 4 * 300 * 96 * 4;
        let caption = 4 * 300 * 64 * 4;
        let dump = 32_768 + 8_192 + 1_075_200 + 619_200;
        assert_eq!(kept(&f32s[0]), dump - enc + caption);
    }

    /// LoRA (to_q, to_k, to_v) freezes the base: the input side saves nothing, block 0 (whose
    /// input carries no gradient) saves the dump's tensors and no base linear input.
    #[test]
    fn lora_freezes_the_base() {
        let l = r#"{"rank": 4, "modules": ["to_k", "to_q", "to_v"]}"#;
        let c = costs(&spec("bf16-mixed", "none", l));
        assert_eq!(kept(&c[0]), 0);
        assert_eq!(kept(&c[1]), 1_785_792);
        assert!(!c[1].cost.input_saved);
        assert!(c[2].cost.input_saved);
    }

    /// Adapters in the weight dtype (`lora.dtype = "weight"`, bf16 like the caption under a
    /// frozen bf16 base): PEFT's `_cast_input_dtype` returns the caption itself and the
    /// cross-attention's lora_A saves it, so the input side keeps it (b·t·D bf16 = 4·300·64·2 B).
    #[test]
    fn weight_dtype_adapters_save_the_caption() {
        let l = r#"{"rank": 4, "modules": ["to_k", "to_q", "to_v"], "dtype": "weight"}"#;
        let c = costs(&spec("bf16-mixed", "none", l));
        assert_eq!(kept(&c[0]), 4 * 300 * 64 * 2);
    }
}
