//! PixArt-α / Σ: diffusers `PixArtTransformer2DModel` (`models/transformers/pixart_transformer_2d.py`)
//! in the step of `bench/torch_peer/family_peer.py` (DDPM ε, cached T5 embeddings with a padded
//! prompt's mask), op by op with what each op saves (rule sources in `pytorch/mod.rs`; ground
//! truth: `bench/torch_peer/runs/2026-12-01-epyc-families-saved/families_saved.txt`, section pixart).
//!
//! Stages: the input side (`pos_embed` PatchEmbed, `adaln_single`, `caption_projection`; its
//! broadcast outputs are the (b, 6D) `timestep`, the (b, D) `embedded_timestep` and the projected
//! caption), the `BasicTransformerBlock`s (`norm_type="ada_norm_single"`) — block 0 on its own
//! when it reads a stream of another dtype than the later blocks (PatchEmbed returns
//! `(latent + pos_embed).to(latent.dtype)`: bf16 under autocast, while a block's residual sums
//! are fp32) — and the output side (`norm_out`, the final `scale_shift_table`, `proj_out`,
//! unpatchify, the fp32 MSE loss).

use crate::families::PixartDims;
use crate::runtime::pytorch::families::common::{
    self, add_data, chunks, ddpm_data, eps_loss, first_and_rest, hidden_states_in, hold, info,
    input_as, sinusoid, two_linears, Fam, FREQ,
};
use crate::runtime::pytorch::ops::{save, Attn, Builder, Lin};
use crate::runtime::pytorch::stages::{Data, Stage, Stages};
use crate::segment::{Segment, TensorKind, Tid};
use crate::spec::Dtype;

/// The shapes one step of a `BasicTransformerBlock` model (PixArt, diffusers' DiT) runs at.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geo {
    pub b: u64,
    /// Image tokens.
    pub s: u64,
    /// Hidden size heads × head_dim.
    pub d: u64,
    pub heads: u64,
    /// Caption tokens (PixArt).
    pub t: u64,
    /// Width of the blocks' keys/values (PixArt: the projected caption).
    pub kv: u64,
    /// Rows of the label table (diffusers' DiT: the classes and the null class).
    pub labels: u64,
    /// Latent elements of x0 / noise / the ε prediction.
    pub lat: u64,
    /// Output elements (b, out_channels, h, w).
    pub out: u64,
    pub patch2: u64,
}

impl Geo {
    /// The shapes of width `inner` in `heads` heads, from latents of `in_channels` to
    /// `out_channels` in square patches of `patch`; no caption, no labels.
    pub(crate) fn basic(
        f: &Fam,
        (inner, heads): (u64, u64),
        (in_channels, out_channels, patch): (u64, u64, u64),
    ) -> Geo {
        let b = f.b;
        Geo {
            b,
            s: f.s,
            d: inner,
            heads,
            t: 0,
            kv: 0,
            labels: 0,
            lat: b * in_channels * f.latent_h * f.latent_w,
            out: b * out_channels * f.latent_h * f.latent_w,
            patch2: patch * patch,
        }
    }

    fn new(f: &Fam, d: &PixartDims) -> Geo {
        let latent = (d.in_channels, d.out_channels, d.patch_size);
        Geo {
            t: f.text.first().copied().unwrap_or(0),
            kv: d.cross_attention_dim,
            ..Geo::basic(f, (d.inner(), d.num_attention_heads), latent)
        }
    }

    pub(crate) fn e(&self) -> u64 {
        self.b * self.s * self.d
    }
    pub(crate) fn rows(&self) -> u64 {
        self.b * self.s
    }
}

/// What the input side hands on: the stream's dtype and whether a gradient flows to it, and the
/// broadcast tensors' (bytes, dtype, requires grad).
#[derive(Debug, Clone, Copy)]
struct Handoff {
    x: (Dtype, bool),
    timestep: (Dtype, bool),
    emb: (Dtype, bool),
    caption: (Dtype, bool),
}

/// diffusers `TimestepEmbedding`: `linear_1` → SiLU → `linear_2`.
pub(super) fn timestep_embedding(
    bl: &mut Builder,
    prefix: &str,
    x: Tid,
    rows: u64,
    dim: u64,
) -> Tid {
    two_linears(
        bl,
        Builder::linear_rg,
        (prefix, "act silu"),
        x,
        (rows, FREQ, dim),
    )
}

/// diffusers `PatchEmbed` (PixArt's and DiT's `pos_embed`; `(in_channels, patch_size,
/// sample_size)` from the config) on the noisy latent: `proj`, a conv2d that saves its (cast)
/// input and weight when recorded [AG][AC], `+ pos_embed`, `.to(latent.dtype)`. Returns the
/// embedded stream (b, s, D).
pub(crate) fn patch_embed(
    bl: &mut Builder,
    f: &Fam,
    (in_channels, patch_size, sample_size): (u64, u64, u64),
    g: &Geo,
    noisy: Tid,
) -> Tid {
    let (s, dim, e) = (g.s, g.d, g.e());
    let w = bl.weight("pos_embed.proj.weight", dim * in_channels * g.patch2);
    let bias = bl.cached_weight("pos_embed.proj.bias", dim);
    let xin = bl.cast_low("pos_embed.proj input", noisy);
    let low = bl.low();
    let conv = bl.g.op("pos_embed.proj", &[xin, w, bias], e, low);
    let rec = bl.rg(conv);
    bl.save_if(xin, rec);
    // The sin-cos table: the buffer at the config's grid (cast with the model under LoRA), else
    // `get_2d_sincos_pos_embed(...).float()` made anew each forward.
    let side = sample_size / patch_size.max(1);
    let grid = (
        f.latent_h / patch_size.max(1),
        f.latent_w / patch_size.max(1),
    );
    let pos = if grid == (side, side) {
        let pdt = if f.lora.is_some() { low } else { Dtype::F32 };
        bl.g.param("pos_embed.pos_embed", s * dim, pdt, false)
    } else {
        bl.g.op("get_2d_sincos_pos_embed", &[], s * dim, Dtype::F32)
    };
    let sum = bl.ew("latent + pos_embed", &[conv, pos], e);
    bl.g.cast("(latent + pos_embed).to(latent.dtype)", sum, low)
}

/// The input side: PatchEmbed (conv, `+ pos_embed`, `.to(latent.dtype)`), `adaln_single`
/// (`PixArtAlphaCombinedTimestepSizeEmbeddings`, SiLU, `Linear(D, 6D)`), the caption projection
/// (`PixArtAlphaTextProjection`: Linear, GELU-tanh, Linear).
fn embed(f: &Fam, d: &PixartDims, g: &Geo) -> (Segment, Vec<Tid>, Handoff) {
    let mut bl = f.builder("embed");
    let wd = bl.low();
    let (b, dim) = (g.b, g.d);
    // The noisy latent (the script's `noisy`, in the weight dtype), counted as data.
    let noisy = bl.g.input("noisy latent", g.lat, wd, false);
    let conf = (d.in_channels, d.patch_size, d.sample_size);
    let x = patch_embed(&mut bl, f, conf, g, noisy);
    // adaln_single: t (int64) → sinusoid → TimestepEmbedding; α's size embedders.
    let hd = bl.g.dtype(x);
    let t = bl.g.input("t", b, Dtype::F64, false);
    let tp = sinusoid(&mut bl, "adaln_single.emb.time_proj", t, b, hd);
    let temb = timestep_embedding(&mut bl, "adaln_single.emb.timestep_embedder", tp, b, dim);
    let emb = if d.use_additional_conditions {
        let size = dim / 3;
        let res = bl.g.input("resolution", 2 * b, wd, false);
        let rp = sinusoid(&mut bl, "resolution proj", res, 2 * b, hd);
        let re = timestep_embedding(
            &mut bl,
            "adaln_single.emb.resolution_embedder",
            rp,
            2 * b,
            size,
        );
        let ar = bl.g.input("aspect_ratio", b, wd, false);
        let ap = sinusoid(&mut bl, "aspect ratio proj", ar, b, hd);
        let ae = timestep_embedding(
            &mut bl,
            "adaln_single.emb.aspect_ratio_embedder",
            ap,
            b,
            size,
        );
        let cat = bl.ew("cat[resolution, aspect]", &[re, ae], b * 3 * size);
        bl.ew("timesteps_emb + sizes", &[temb, cat], b * dim)
    } else {
        temb
    };
    let s = bl.act("adaln_single.silu", emb);
    let timestep = bl.linear_rg("adaln_single.linear", s, Lin::new(b, 6 * dim, dim, true));
    // Caption projection (T5 width → D), or the caption itself.
    let caption = match d.caption_channels {
        Some(cc) => {
            let enc =
                bl.g.input("encoder_hidden_states", g.b * g.t * cc, wd, false);
            let names = ("caption_projection", "act_1 gelu(tanh)");
            two_linears(
                &mut bl,
                Builder::linear_rg,
                names,
                enc,
                (g.b * g.t, cc, dim),
            )
        }
        None => {
            bl.g.input("encoder_hidden_states", g.b * g.t * g.kv, wd, false)
        }
    };
    // The broadcast outputs stay alive with the graph (the blocks read them, their gradients
    // come back before this side's backward); without a gradient (a frozen input side under
    // LoRA) the model's locals still hold them through the forward, marked saved here too (they
    // stay until this side's backward: b·(7D + T·D) low-precision bytes too long).
    let outs = [timestep, emb, caption];
    let bcast: Vec<Tid> = outs.into_iter().filter(|&t| bl.rg(t)).collect();
    for t in outs {
        if bl.g.tensors[t].kind == TensorKind::Alloc {
            save(&mut bl.g, t);
        }
    }
    let h = Handoff {
        x: info(&bl.g, x),
        timestep: info(&bl.g, timestep),
        emb: info(&bl.g, emb),
        caption: info(&bl.g, caption),
    };
    bl.g.output = x;
    (bl.g, bcast, h)
}

/// `BasicTransformerBlock`'s self-attention `attn1` (PixArt's and diffusers' DiT's) on the
/// modulated norm `hn`: `to_q`, `to_k`, `to_v` (`bias`: the config's `attention_bias`), SDPA,
/// `to_out.0`, `hidden_states / attn.rescale_output_factor` (1.0, which allocates [AG: no save
/// for a scalar]), gated by `gate_msa` and added to the stream `xs`. Returns the gated output,
/// the new stream and the attention's geometry.
pub(crate) fn self_attention(
    bl: &mut Builder,
    (hn, xs, gate_msa): (Tid, Tid, Tid),
    g: &Geo,
    bias: bool,
) -> (Tid, Tid, Attn) {
    let (b, s, dim, heads) = (g.b, g.s, g.d, g.heads);
    let (rows, e) = (g.rows(), g.e());
    let p = "transformer_blocks.i.attn1";
    let q = bl.linear_rg(&format!("{p}.to_q"), hn, Lin::new(rows, dim, dim, bias));
    let k = bl.linear_rg(&format!("{p}.to_k"), hn, Lin::new(rows, dim, dim, bias));
    let v = bl.linear_rg(&format!("{p}.to_v"), hn, Lin::new(rows, dim, dim, bias));
    let at = Attn::over(b, heads, s, dim / heads.max(1));
    let o = bl.attention_masked(q, k, v, None, at);
    let o = bl.linear_rg(&format!("{p}.to_out.0"), o, Lin::new(rows, dim, dim, true));
    let o = bl.ew("attn1 / rescale_output_factor", &[o], e);
    let go = bl.mul("gate_msa · attn1", gate_msa, o, e);
    let x1 = bl.ew("attn1 + hidden_states", &[go, xs], e);
    (go, x1, at)
}

/// `BasicTransformerBlock`'s feed-forward `ff` (PixArt's and diffusers' DiT's) on the modulated
/// norm `hn`: Linear → GELU(tanh) (saves its input [AG]) → Linear, gated by `gate_mlp` and added
/// to the stream `res`.
pub(crate) fn gated_feed_forward(bl: &mut Builder, (hn, res, gate_mlp): (Tid, Tid, Tid), g: &Geo) {
    let (rows, dim, e) = (g.rows(), g.d, g.e());
    let inner = 4 * dim;
    let p = "transformer_blocks.i.ff";
    let f1 = bl.linear_rg(
        &format!("{p}.net.0.proj"),
        hn,
        Lin::new(rows, inner, dim, true),
    );
    let a = bl.act("ff gelu(tanh)", f1);
    let f2 = bl.linear_rg(&format!("{p}.net.2"), a, Lin::new(rows, dim, inner, true));
    let gf = bl.mul("gate_mlp · ff", gate_mlp, f2, e);
    bl.ew("ff + hidden_states", &[gf, res], e);
}

/// One `BasicTransformerBlock` with `norm_type="ada_norm_single"` (diffusers `attention.py`
/// `BasicTransformerBlock.forward`), reading a stream of `x` = (dtype, requires grad).
fn block(f: &Fam, d: &PixartDims, g: &Geo, h: &Handoff, x: (Dtype, bool)) -> Segment {
    let mut bl = f.builder("block");
    let (b, dim, e, rows) = (g.b, g.d, g.e(), g.rows());
    let wd = bl.low();
    let ab = d.attention_bias;
    let xs = hidden_states_in(&mut bl, e, x);
    let ts = input_as(&mut bl, "timestep", b * 6 * dim, h.timestep);
    let cap = input_as(&mut bl, "caption", b * g.t * g.kv, h.caption);
    let bias =
        bl.g.input("encoder_attention_mask bias", b * g.t, wd, false);
    // `scale_shift_table[None] + timestep.reshape(b, 6, -1)`, chunked: the add saves nothing [AG].
    let table = bl.plain_param("transformer_blocks.i.scale_shift_table", 6 * dim);
    let t6 = bl.ew("scale_shift_table + timestep", &[table, ts], b * 6 * dim);
    let m = chunks(&mut bl, "modulation", t6, 6, b * dim);
    let (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp) =
        (m[0], m[1], m[2], m[3], m[4], m[5]);
    let heads = g.heads;
    // Self-attention on norm1(x)·(1 + scale) + shift.
    let n1 = bl.layer_norm_rg("norm1", xs, rows);
    let hn = bl.modulate_rg("modulate msa", n1, shift_msa, scale_msa, b * dim);
    let (go, x1, at) = self_attention(&mut bl, (hn, xs, gate_msa), g, ab);
    // `norm_hidden_states = hidden_states` (the msa input's local is reassigned).
    hold(&mut bl, &[hn]);
    // Cross-attention to the caption with the padded prompt's bias (no norm for PixArt):
    // `prepare_attention_mask` repeats the (b, 1, T) bias per head.
    let p = "transformer_blocks.i.attn2";
    let q = bl.linear_rg(&format!("{p}.to_q"), x1, Lin::new(rows, dim, dim, ab));
    let ct = b * g.t;
    let k = bl.linear_rg(&format!("{p}.to_k"), cap, Lin::new(ct, dim, g.kv, ab));
    let v = bl.linear_rg(&format!("{p}.to_v"), cap, Lin::new(ct, dim, g.kv, ab));
    let mask = bl.g.op(
        "attn2 mask repeat_interleave(heads)",
        &[bias],
        heads * b * g.t,
        wd,
    );
    let at = Attn { skv: g.t, ..at };
    let o = bl.attention_masked(q, k, v, Some(mask), at);
    let o = bl.linear_rg(&format!("{p}.to_out.0"), o, Lin::new(rows, dim, dim, true));
    let o = bl.ew("attn2 / rescale_output_factor", &[o], e);
    // `attn_output = self.attn2(...)`: the gated self-attention output's local is reassigned;
    // the cross-attention output stays in it until the block returns.
    hold(&mut bl, &[go]);
    let o2 = o;
    let x2 = bl.ew("attn2 + hidden_states", &[o, x1], e);
    // Feed-forward on norm2(x)·(1 + scale) + shift: GELU(tanh) saves its input [AG].
    let n2 = bl.layer_norm_rg("norm2", x2, rows);
    let hn = bl.modulate_rg("modulate mlp", n2, shift_mlp, scale_mlp, b * dim);
    gated_feed_forward(&mut bl, (hn, x2, gate_mlp), g);
    // Until `return`: `attn_output` (attn2's) and `norm_hidden_states` (the FF's input).
    hold(&mut bl, &[o2, hn]);
    bl.g
}

/// `scale_shift_table[None] + emb[:, None]` (the model's 2×D parameter plus the `(b, D)`
/// embedding `emb`, named `emb.0`) and its two chunks, views named `names` (shift, scale): the
/// output side of PixArt, Sana and Wan. Returns (the sum, shift, scale).
pub(crate) fn scale_shift_table(
    bl: &mut Builder,
    emb: (&str, Tid),
    b: u64,
    dim: u64,
    names: [&str; 2],
) -> (Tid, Tid, Tid) {
    let table = bl.plain_param("scale_shift_table", 2 * dim);
    let t2 = bl.ew(
        &format!("scale_shift_table + {}", emb.0),
        &[table, emb.1],
        b * 2 * dim,
    );
    let shift = bl.g.view(names[0], t2, b * dim);
    let scale = bl.g.view(names[1], t2, b * dim);
    (t2, shift, scale)
}

/// The output side: `scale_shift_table[None] + embedded_timestep[:, None]` chunked in two,
/// `norm_out`, the modulation, `proj_out`, unpatchify (the last reshape copies), the ε channels
/// (a view when sigma is learned) and `F.mse_loss(pred.float(), noise.float())` outside autocast.
fn final_layer(f: &Fam, d: &PixartDims, g: &Geo, h: &Handoff, x: (Dtype, bool)) -> Segment {
    let mut bl = f.builder("final");
    let (b, dim, e) = (g.b, g.d, g.e());
    let xs = hidden_states_in(&mut bl, e, x);
    let emb = input_as(&mut bl, "embedded_timestep", b * dim, h.emb);
    let (t2, shift, scale) = scale_shift_table(
        &mut bl,
        ("embedded_timestep", emb),
        b,
        dim,
        ["shift", "scale"],
    );
    // `shift, scale` stay in the model's locals until it returns.
    let proj = ("proj_out", d.out_channels);
    norm_out_and_loss(&mut bl, g, xs, (shift, scale), proj, &[t2]);
    bl.g
}

/// The output side of a `BasicTransformerBlock` model (PixArt, diffusers' DiT) after its
/// modulation's (shift, scale): `norm_out(x)·(1 + scale) + shift`, the projection `proj`
/// (name, output channels), the model's `locals` held until it returns, unpatchify and the loss.
pub(crate) fn norm_out_and_loss(
    bl: &mut Builder,
    g: &Geo,
    xs: Tid,
    (shift, scale): (Tid, Tid),
    (proj, out_channels): (&str, u64),
    locals: &[Tid],
) {
    let (b, dim, rows) = (g.b, g.d, g.rows());
    let n = bl.layer_norm_rg("norm_out", xs, rows);
    let hn = bl.modulate_rg("final modulate", n, shift, scale, b * dim);
    let y = bl.linear_rg(proj, hn, Lin::new(rows, g.patch2 * out_channels, dim, true));
    hold(bl, locals);
    eps_loss(bl, y, g.out, g.lat);
}

/// The stages of a PixArt step.
pub(crate) fn stages(f: &Fam, d: &PixartDims) -> Stages {
    let g = Geo::new(f, d);
    let (emb, bcast, h) = embed(f, d, &g);
    let out = |s: &Segment| info(s, s.output);
    let first = block(f, d, &g, &h, h.x);
    let rest = block(f, d, &g, &h, out(&first));
    let mut stages = vec![Stage::embed(emb, bcast)];
    stages.extend(first_and_rest(first, rest, d.num_layers as u32, true));
    let last = stages.last().map_or(h.x, |st| out(&st.seg));
    stages.push(Stage::final_loss(final_layer(f, d, &g, &h, last)));
    Stages {
        stages,
        data: data(f, d, &g),
    }
}

common::stages_of!(Pixart);

/// The step's tensors outside the model (`family_peer.py` `Inputs.forward`, DDPM branch): see
/// [`ddpm_data`]; the caption while a saved reference holds it (the caption projection's or
/// `to_k`'s input), the int64 mask, its bias and α's size conditions for the forward.
fn data(f: &Fam, d: &PixartDims, g: &Geo) -> Data {
    let wd = f.spec.recipe.precision.compute_dtype().size();
    let frozen = f.lora.is_some();
    let enc_w = d.caption_channels.unwrap_or(g.kv);
    let enc = g.b * g.t * enc_w * wd;
    let enc_saved = match d.caption_channels {
        Some(_) => !frozen || f.lora_on("caption_projection.linear_1"),
        None => !frozen || f.lora_on("attn2.to_k") || f.lora_on("attn2.to_v"),
    };
    let (kept, fwd) = ddpm_data(f, g.lat);
    let mut data = Data {
        kept,
        forward_only: fwd + g.b * g.t * (8 + wd),
    };
    add_data(&mut data, g.lat * wd, !frozen);
    add_data(&mut data, enc, enc_saved);
    if d.use_additional_conditions {
        data.forward_only += 3 * g.b * wd;
    }
    data
}

#[cfg(test)]
pub(crate) mod tests {
    use crate::runtime::pytorch::device::PyTorch;
    use crate::runtime::pytorch::families::of_spec as stages;
    use crate::runtime::pytorch::stages::StageCost;
    use crate::spec::{LoraSpec, Precision, SdpaBackend, Spec, TorchDevice};

    /// The family peer's tiny spec (`bench/torch_peer/specs/families/<family>-fp32-none-loop.json`):
    /// b = 4, 128² pixels (16² latent, 8² tokens of 2² patches), 4 heads of 16 (D = 64), 2 blocks,
    /// 120 caption tokens (PixArt), on the CPU.
    pub(crate) fn tiny(config: &str, precision: Precision, lora: Option<u32>) -> Spec {
        let mut s = Spec::default_xl();
        s.workload.height = 128;
        s.workload.width = 128;
        s.workload.batch = 4;
        s.workload.microbatch = 4;
        s.workload.accumulation = 1;
        s.recipe.precision = precision;
        s.recipe.ema.enabled = false;
        s.recipe.lora = lora.map(|rank| LoraSpec {
            dtype: Default::default(),
            rank,
            targets: Vec::new(),
            modules: Vec::new(),
        });
        s.runtime = crate::spec::Runtime::Pytorch {
            device: TorchDevice::Cpu,
            sdpa: SdpaBackend::Auto,
        };
        let cfg: serde_json::Value = serde_json::from_str(config).expect("config");
        let map = cfg.as_object().expect("object").clone();
        crate::denoiser::with_family(s, "tiny", map).expect("tiny spec")
    }

    pub(crate) const PIXART: &str = r#"{"_class_name": "PixArtTransformer2DModel", "sample_size": 16,
        "num_layers": 2, "attention_head_dim": 16, "in_channels": 4, "out_channels": 8,
        "patch_size": 2, "attention_bias": true, "num_attention_heads": 4,
        "cross_attention_dim": 64, "activation_fn": "gelu-approximate",
        "num_embeds_ada_norm": 1000, "norm_type": "ada_norm_single",
        "norm_elementwise_affine": false, "norm_eps": 1e-06, "caption_channels": 96}"#;

    pub(crate) fn costs(spec: &Spec) -> Vec<StageCost> {
        let rt = PyTorch::instance(TorchDevice::Cpu, SdpaBackend::Auto);
        stages(rt, spec).costs()
    }

    /// Kept bytes (activations and weight copies) of each stage.
    pub(crate) fn kept(c: &[StageCost]) -> Vec<u64> {
        c.iter()
            .map(|s| s.cost.kept.activations + s.cost.kept.weight_casts)
            .collect()
    }

    // `families_saved.txt` counts, per block, its stream input (saved by norm1) and, in block 0,
    // the projected caption (saved first by attn2's to_k); here the input is the previous
    // stage's output and the caption the input side's.
    const E: u64 = 4 * 64 * 64;
    const CAPTION: u64 = 4 * 120 * 64;

    #[test]
    fn fp32_blocks_keep_what_autograd_saves() {
        let c = costs(&tiny(PIXART, Precision::Fp32, None));
        // embed, 2 identical blocks in one stage, final.
        assert_eq!(c.len(), 3);
        assert_eq!(c[1].count, 2);
        // transformer_blocks.0: 1904128 B saved, less its fp32 input and the caption.
        assert_eq!(kept(&c)[1], 1_904_128 - 4 * E - 4 * CAPTION);
        // Input side: pos_embed 16384 (its input is data here), adaln_single 8192,
        // caption_projection 430080 (its input, 184320, is data) + the caption itself, and the
        // (b, 6D) timestep held for the blocks.
        assert_eq!(
            kept(&c)[0],
            8192 + 430_080 - 184_320 + 4 * CAPTION + 4 * 4 * 6 * 64
        );
    }

    #[test]
    fn bf16_block_zero_reads_the_bf16_patch_embedding() {
        let c = costs(&tiny(PIXART, Precision::Bf16Mixed, None));
        assert_eq!(c.len(), 4, "block 0 and block 1 are different stages");
        let k = kept(&c);
        // transformer_blocks.0: 1223424 B, less its bf16 input and the bf16 caption.
        assert_eq!(k[1], 1_223_424 - 2 * E - 2 * CAPTION);
        // transformer_blocks.1: 1228544 B (the caption counted earlier), less its fp32 input.
        assert_eq!(k[2], 1_228_544 - 4 * E);
    }

    #[test]
    fn lora_freezes_the_base_inputs() {
        let full = kept(&costs(&tiny(PIXART, Precision::Fp32, None)));
        let c = costs(&tiny(PIXART, Precision::Fp32, Some(8)));
        let k = kept(&c);
        // `family_saved.py` on pixart-fp32 with LoRA r = 8 on to_q/k/v/to_out.0: block 0 saves
        // 1325568 B (nothing upstream needs a gradient: no norm1 input, no modulation), block 1
        // 1271296 B (+ the caption, first saved by block 0's attn2.to_k.lora_A).
        assert_eq!(k[1], 1_325_568 - 4 * CAPTION);
        assert_eq!(k[2], 1_271_296 - 4 * E);
        assert!(k[1] < full[1]);
        // A frozen input side saves nothing for backward but the broadcast tensors it holds.
        assert_eq!(k[0], 4 * CAPTION + 4 * 4 * 7 * 64);
    }
}
