//! Flux: diffusers `FluxTransformer2DModel` (`models/transformers/transformer_flux.py`) in the
//! step of `family_peer.py` (`train_dreambooth_lora_flux.py`): the 2×2-packed latent tokens
//! through `x_embedder`, `time_text_embed` (`CombinedTimestep[Guidance]TextProjEmbeddings`),
//! `context_embedder`, the RoPE tables of `FluxPosEmbed`, the double-stream
//! `FluxTransformerBlock`s (joint attention over text + image, `torch.nn.RMSNorm` on q/k), the
//! single-stream `FluxSingleTransformerBlock`s (one sequence, attention and MLP fused into
//! `proj_out`), `norm_out` (`AdaLayerNormContinuous`), `proj_out`, the unpacking and the
//! flow-matching loss. Ground truth: `families_saved.txt` (`flux-fp32-none-loop`, fp32 and bf16).

use crate::families::FluxDims;
use crate::runtime::pytorch::families::common::{
    self, add_data, chunks, pooled_temb_and_context, two_linears, Fam,
};
use crate::runtime::pytorch::ops::{promote, save, Attn, Builder, Lin, GRAD_VIEWS};
use crate::runtime::pytorch::stages::{Data, Stage, Stages};
use crate::segment::{Segment, Tid};
use crate::spec::Dtype;

/// The sizes one Flux step reads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sz {
    pub b: u64,
    /// Image tokens (packed latent pixels).
    pub s: u64,
    /// Text tokens in the sequence (T5).
    pub t: u64,
    pub d: u64,
    pub heads: u64,
    pub dh: u64,
}

impl Sz {
    /// The sizes of a step of an MMDiT (SD3, Flux) of width `d` in `heads` heads of `dh`.
    pub(crate) fn new(f: &Fam, d: u64, heads: u64, dh: u64) -> Sz {
        Sz {
            b: f.b,
            s: f.s,
            t: sequence_tokens(f),
            d,
            heads,
            dh,
        }
    }

    fn n(&self) -> u64 {
        self.s + self.t
    }
}

/// Text tokens that enter the sequence (Flux: T5's; CLIP-L gives only the pooled vector).
pub(crate) fn sequence_tokens(f: &Fam) -> u64 {
    f.geometry
        .text
        .iter()
        .zip(&f.text)
        .filter(|(e, _)| e.sequence)
        .map(|(_, &n)| n)
        .sum()
}

/// `Linear → GELU(tanh) → Linear` (diffusers `FeedForward(dim, dim_out=dim,
/// activation_fn="gelu-approximate")`; its dropouts have p = 0 and return their input on the
/// CPU): each linear saves its input, GELU saves its input [AG].
pub(crate) fn feed_forward(bl: &mut Builder, name: &str, x: Tid, rows: u64, d: u64) -> Tid {
    let h = bl.linear_g(
        &format!("{name}.net.0.proj"),
        x,
        Lin::new(rows, 4 * d, d, true),
    );
    let a = bl.act(&format!("{name}.net.0 gelu(tanh)"), h);
    bl.linear_g(&format!("{name}.net.2"), a, Lin::new(rows, d, 4 * d, true))
}

/// `linear(silu(emb))` chunked into `k` views of (b, D) (diffusers `AdaLayerNormZero`,
/// `AdaLayerNormZeroSingle`, `AdaLayerNormContinuous`): SiLU saves emb, the linear its output
/// [AG]; the chunks are views of one (b, k·D) tensor, so a saved gate keeps all of it.
pub(crate) fn ada(bl: &mut Builder, name: &str, emb: Tid, k: u64, b: u64, d: u64) -> Vec<Tid> {
    let s = bl.act(&format!("{name} silu(emb)"), emb);
    let m = bl.linear_g(name, s, Lin::new(b, k * d, d, true));
    chunks(bl, name, m, k, b * d)
}

/// The image stream's attention projections (q, k, v).
pub(crate) const ATTN_QKV: [&str; 3] = ["attn.to_q", "attn.to_k", "attn.to_v"];
/// The text stream's (`JointAttnProcessor2_0`, `FluxAttnProcessor`: `attn.add_q_proj` …).
pub(crate) const ATTN_ADDED_QKV: [&str; 3] =
    ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"];

/// The three (b·n, D) → (b·n, D) projections of one input with a bias, in order (q, k, v:
/// `attn.to_q` … or the context's `attn.add_q_proj` …): [`Builder::linear_g`] each.
pub(crate) fn projections(
    bl: &mut Builder,
    names: [&str; 3],
    x: Tid,
    rows: u64,
    d: u64,
) -> [Tid; 3] {
    names.map(|n| bl.linear_g(n, x, Lin::new(rows, d, d, true)))
}

/// RoPE on q and k ([`Builder::rope_real`]) and SDPA over the whole sequence (text + image).
fn rope_attention(bl: &mut Builder, [q, k, v]: [Tid; 3], (cos, sin): (Tid, Tid), z: &Sz) -> Tid {
    let qr = bl.rope_real("rope q", q, cos, sin);
    let kr = bl.rope_real("rope k", k, cos, sin);
    bl.attention(qr, kr, v, Attn::over(z.b, z.heads, z.n(), z.dh))
}

/// `residual + gate.unsqueeze(1) · y` (the mul saves each operand for the other [AG]); returns
/// the sum and the product (which a block's Python local may hold until it returns).
pub(crate) fn gated_add(bl: &mut Builder, name: &str, res: Tid, gate: Tid, y: Tid) -> (Tid, Tid) {
    let n = bl.g.elems(y);
    let gy = bl.mul(&format!("{name} gate·y"), gate, y, n);
    let dt = promote(bl.g.dtype(res), bl.g.dtype(gy));
    (
        bl.g.op(&format!("{name} residual +"), &[res, gy], n, dt),
        gy,
    )
}

/// The image stream's names in an MMDiT joint block: its second norm, its feed-forward, the
/// rebinding of its first norm's output.
pub(crate) const IMAGE_FF: [&str; 3] = ["norm2", "ff", "norm_hidden_states rebound"];
/// The text (context) stream's.
pub(crate) const CONTEXT_FF: [&str; 3] = [
    "norm2_context",
    "ff_context",
    "norm_encoder_hidden_states rebound",
];

/// The feed-forward half of one stream of an MMDiT joint block (Flux's double-stream block,
/// SD3's joint block; `names`: [`IMAGE_FF`] or [`CONTEXT_FF`]) on the stream `x1` of (b, n, D):
/// the second norm, the first norm's output `h` rebound (held until here), the modulation by
/// (shift, scale), the feed-forward and the residual gated by `gate` ([`gated_add`]). Returns
/// the new stream and [the modulated norm, the feed-forward's output, the gated product].
pub(crate) fn stream_feed_forward(
    bl: &mut Builder,
    [norm, ff, rebound]: [&str; 3],
    (x1, h): (Tid, Tid),
    [shift, scale, gate]: [Tid; 3],
    (b, n, d): (u64, u64, u64),
) -> (Tid, [Tid; 3]) {
    let n2 = bl.layer_norm_rg(norm, x1, b * n);
    bl.hold(rebound, &[h]);
    let h2 = bl.modulate_rg(norm, n2, shift, scale, b * d);
    let f = feed_forward(bl, ff, h2, b * n, d);
    let (x2, gf) = gated_add(bl, ff, x1, gate, f);
    (x2, [h2, f, gf])
}

/// `x[:, a:b].contiguous()` of a (b, N, D) tensor: a copy unless b = 1 (one sample's rows are
/// contiguous).
pub(crate) fn split_part(bl: &mut Builder, name: &str, o: Tid, elems: u64, b: u64) -> Tid {
    let v = bl.g.view(&format!("{name} (split view)"), o, elems);
    if b > 1 {
        let dt = bl.g.dtype(v);
        bl.g.op(&format!("{name} .contiguous()"), &[v], elems, dt)
    } else {
        v
    }
}

/// The stream inputs of a block stage: image (b, s, D) and text (b, t, D).
fn stream_inputs(bl: &mut Builder, z: &Sz, sd: Dtype, rg: (bool, bool)) -> (Tid, Tid) {
    let x = bl.g.input("hidden_states", z.b * z.s * z.d, sd, rg.0);
    let c =
        bl.g.input("encoder_hidden_states", z.b * z.t * z.d, sd, rg.1);
    bl.g.stream_in = vec![x, c];
    (x, c)
}

/// The broadcast inputs of every block: temb and the RoPE tables (fp32, no gradient).
fn broadcast_inputs(bl: &mut Builder, z: &Sz, trained: bool) -> (Tid, Tid, Tid) {
    let low = bl.low();
    let temb = bl.g.input("temb", z.b * z.d, low, trained);
    let cos = bl.g.input("rope cos", z.n() * z.dh, Dtype::F32, false);
    let sin = bl.g.input("rope sin", z.n() * z.dh, Dtype::F32, false);
    (temb, cos, sin)
}

/// `FluxTransformerBlock.forward` with `FluxAttnProcessor`.
fn double_block(f: &Fam, z: &Sz, rg: (bool, bool), trained: bool) -> Segment {
    let mut bl = f.builder("flux double block");
    let sd = bl.low();
    let (b, s, t, d) = (z.b, z.s, z.t, z.d);
    let (x, c) = stream_inputs(&mut bl, z, sd, rg);
    let (temb, cos, sin) = broadcast_inputs(&mut bl, z, trained);
    // norm1 / norm1_context: AdaLayerNormZero (shift, scale, gate msa; shift, scale, gate mlp).
    let m = ada(&mut bl, "norm1.linear", temb, 6, b, d);
    let mc = ada(&mut bl, "norm1_context.linear", temb, 6, b, d);
    let n1 = bl.layer_norm_rg("norm1.norm", x, b * s);
    let h = bl.modulate_rg("norm1", n1, m[0], m[1], b * d);
    let n1c = bl.layer_norm_rg("norm1_context.norm", c, b * t);
    let hc = bl.modulate_rg("norm1_context", n1c, mc[0], mc[1], b * d);
    // Projections (one saved input for q, k, v), per-head RMSNorm on q and k.
    let [q, k, v] = projections(&mut bl, ATTN_QKV, h, b * s, d);
    let [eq, ek, ev] = projections(&mut bl, ATTN_ADDED_QKV, hc, b * t, d);
    let q = bl.torch_rms_norm("attn.norm_q", q, b * s * z.heads);
    let k = bl.torch_rms_norm("attn.norm_k", k, b * s * z.heads);
    let eq = bl.torch_rms_norm("attn.norm_added_q", eq, b * t * z.heads);
    let ek = bl.torch_rms_norm("attn.norm_added_k", ek, b * t * z.heads);
    // torch.cat([text, image], dim=1) (saves nothing), RoPE on q and k, SDPA.
    let ne = b * z.n() * d;
    let qd = bl.g.dtype(q);
    let qc = bl.g.op("cat q", &[eq, q], ne, qd);
    let kc = bl.g.op("cat k", &[ek, k], ne, qd);
    let vd = bl.g.dtype(v);
    let vc = bl.g.op("cat v", &[ev, v], ne, vd);
    let o = rope_attention(&mut bl, [qc, kc, vc], (cos, sin), z);
    // split_with_sizes, then `.contiguous()` before to_out / to_add_out.
    let oc = split_part(&mut bl, "context attn out", o, b * t * d, b);
    let oi = split_part(&mut bl, "attn out", o, b * s * d, b);
    let ao = bl.linear_g("attn.to_out.0", oi, Lin::new(b * s, d, d, true));
    let co = bl.linear_g("attn.to_add_out", oc, Lin::new(b * t, d, d, true));
    // The processor's locals `encoder_query`, `encoder_key`, `encoder_value` hold the text
    // projections (after their norms) until it returns.
    bl.hold("FluxAttnProcessor", &[eq, ek, ev]);
    // Image stream; the gated products stay bound to `attn_output`, `ff_output` and
    // `context_attn_output` until the block returns.
    let (x1, ga) = gated_add(&mut bl, "attn", x, m[2], ao);
    // `norm_hidden_states` (norm1's output) is rebound only at norm2.
    let mods = [m[3], m[4], m[5]];
    let (x2, [h2, _, gm]) = stream_feed_forward(&mut bl, IMAGE_FF, (x1, h), mods, (b, s, d));
    // Text stream.
    let (c1, gc) = gated_add(&mut bl, "context attn", c, mc[2], co);
    let mods = [mc[3], mc[4], mc[5]];
    let (c2, [h2c, ffc, _]) = stream_feed_forward(&mut bl, CONTEXT_FF, (c1, hc), mods, (b, t, d));
    // `norm_hidden_states` / `norm_encoder_hidden_states` (the feed-forwards' inputs) and
    // `context_ff_output` stay bound until the block returns too (`transformer_flux.py`
    // `FluxTransformerBlock.forward`): under LoRA with frozen feed-forwards nothing saves them.
    bl.hold("FluxTransformerBlock", &[ga, gm, gc, h2, h2c, ffc]);
    bl.g.output = x2;
    bl.g.side_outputs = vec![c2];
    bl.g
}

/// `FluxSingleTransformerBlock.forward`: `cat([text, image])`, AdaLayerNormZeroSingle, the MLP
/// branch and the pre-only attention side by side, `cat` into `proj_out`, gated residual; the
/// two streams it returns are slices (views) of one (b, t + s, D) tensor.
fn single_block(f: &Fam, z: &Sz, rg: (bool, bool), trained: bool) -> Segment {
    let mut bl = f.builder("flux single block");
    let sd = bl.low();
    let (b, d) = (z.b, z.d);
    let rows = b * z.n();
    let (x, c) = stream_inputs(&mut bl, z, sd, rg);
    let (temb, cos, sin) = broadcast_inputs(&mut bl, z, trained);
    let hs = bl.g.op("cat [text, image]", &[c, x], rows * d, sd);
    let m = ada(&mut bl, "norm.linear", temb, 3, b, d);
    let n = bl.layer_norm_rg("norm.norm", hs, rows);
    let h = bl.modulate_rg("norm", n, m[0], m[1], b * d);
    let pm = bl.linear_g("proj_mlp", h, Lin::new(rows, 4 * d, d, true));
    let am = bl.act("act_mlp gelu(tanh)", pm);
    let [q, k, v] = projections(&mut bl, ATTN_QKV, h, rows, d);
    let q = bl.torch_rms_norm("attn.norm_q", q, rows * z.heads);
    let k = bl.torch_rms_norm("attn.norm_k", k, rows * z.heads);
    let o = rope_attention(&mut bl, [q, k, v], (cos, sin), z);
    let od = promote(bl.g.dtype(o), bl.g.dtype(am));
    let cat = bl.g.op(
        &format!("cat [attn, mlp]{GRAD_VIEWS}"),
        &[o, am],
        rows * 5 * d,
        od,
    );
    let po = bl.linear_g("proj_out", cat, Lin::new(rows, d, 5 * d, true));
    // `hidden_states = gate * self.proj_out(hidden_states)`: the concatenation stays bound
    // until the product exists (family_trace.py, flux-fp32-lora4-none: the 983,040 B cat alive
    // at the forward peak, the gate's mul, where a frozen proj_out saves nothing).
    let n = bl.g.elems(po);
    let gy = bl.mul("proj_out gate·y", m[2], po, n);
    // Its `MulBackward0` packs the block's last saved tensor (the gate, or proj_out's output
    // when the gate needs a gradient; the residual add saves nothing): a checkpoint's
    // recompute stops there, before the product or the held concatenation's moment.
    bl.g.last_pack = bl.g.ops.iter().position(|o| o.output == gy);
    bl.hold("hidden_states rebound to gate·proj_out", &[cat]);
    let dt = promote(bl.g.dtype(hs), bl.g.dtype(gy));
    let out = bl.g.op("proj_out residual +", &[hs, gy], n, dt);
    // `mlp_hidden_states` (the GELU output) and `norm_hidden_states` stay bound until the
    // block returns.
    bl.hold("FluxSingleTransformerBlock", &[am, h]);
    bl.g.output = out;
    bl.g
}

/// Input side: x_embedder on the packed latents, time_text_embed, context_embedder, the RoPE
/// tables (`FluxPosEmbed`: per axis fp64 frequencies, cos / sin repeated and cast to fp32, then
/// concatenated); outputs the two streams; temb (saved by every block's SiLU) and the tables
/// (saved by every RoPE mul) stay until its backward.
fn embed(f: &Fam, d: &FluxDims, z: &Sz) -> (Segment, Vec<Tid>) {
    let mut bl = f.builder("flux embed");
    let low = bl.low();
    let (b, dim) = (z.b, z.d);
    let packed =
        bl.g.input("packed latents", b * z.s * d.in_channels, low, false);
    let x = bl.linear_g(
        "x_embedder",
        packed,
        Lin::new(b * z.s, dim, d.in_channels, true),
    );
    // timestep.to(x.dtype) · 1000, guidance likewise.
    let ts = bl.g.input("timesteps / 1000", b, Dtype::F32, false);
    let tlow = bl.g.cast("timestep →x dtype", ts, low);
    let t1000 = bl.g.op("timestep ·1000", &[tlow], b, low);
    let te = timestep_embedder(&mut bl, "time_text_embed.timestep_embedder", t1000, b, dim);
    let mut temb = te;
    if d.guidance_embeds {
        let g = bl.g.input("guidance", b, Dtype::F32, false);
        let glow = bl.g.cast("guidance →x dtype", g, low);
        let g1000 = bl.g.op("guidance ·1000", &[glow], b, low);
        let ge = timestep_embedder(&mut bl, "time_text_embed.guidance_embedder", g1000, b, dim);
        let dt = promote(bl.g.dtype(te), bl.g.dtype(ge));
        temb =
            bl.g.op("timesteps_emb + guidance_emb", &[te, ge], b * dim, dt);
    }
    // PixArtAlphaTextProjection(pooled, D, act_fn="silu").
    let (temb, ctx) = pooled_temb_and_context(
        &mut bl,
        temb,
        (b, dim, z.t),
        d.pooled_projection_dim,
        d.joint_attention_dim,
    );
    // FluxPosEmbed over cat(txt_ids, img_ids).
    let n = z.n();
    let ids = bl.g.input("txt_ids, img_ids", n * 3, low, false);
    let idc = bl.g.op("ids cat", &[ids], n * 3, low);
    let pos = bl.g.cast("ids.float()", idc, Dtype::F32);
    let mut parts = [Vec::new(), Vec::new()];
    for &a in &d.axes_dims_rope {
        let fr = bl.g.op("axis freqs (fp64)", &[pos], n * a / 2, Dtype::F64);
        for (p, part) in ["cos", "sin"].iter().zip(parts.iter_mut()) {
            let c64 =
                bl.g.op(&format!("axis {p} (fp64)"), &[fr], n * a / 2, Dtype::F64);
            let rep =
                bl.g.op(&format!("axis {p} repeat"), &[c64], n * a, Dtype::F64);
            part.push(bl.g.op(&format!("axis {p} .float()"), &[rep], n * a, Dtype::F32));
        }
    }
    let cos = bl.g.op("rope cos", &parts[0], n * z.dh, Dtype::F32);
    let sin = bl.g.op("rope sin", &parts[1], n * z.dh, Dtype::F32);
    save(&mut bl.g, cos);
    save(&mut bl.g, sin);
    two_stream_embed(bl, (x, ctx), temb, f.lora.is_none())
}

/// The MMDiT input side (SD3's, Flux's) handing on its two streams, the image `x` (its output)
/// and the text `ctx` (a side output), and temb, which every block differentiates when the
/// embedders are `trained`. Returns the segment and the broadcast tensors the blocks
/// differentiate.
pub(crate) fn two_stream_embed(
    bl: Builder,
    (x, ctx): (Tid, Tid),
    temb: Tid,
    trained: bool,
) -> (Segment, Vec<Tid>) {
    let mut g = bl.g;
    g.output = x;
    g.side_outputs = vec![ctx];
    (g, if trained { vec![temb] } else { Vec::new() })
}

/// diffusers `Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)` (fp32 sin/cos,
/// concatenated and flipped), cast to the pooled embedding's dtype, then `TimestepEmbedding`
/// (linear_1 → SiLU → linear_2).
pub(crate) fn timestep_embedder(bl: &mut Builder, name: &str, t: Tid, b: u64, dim: u64) -> Tid {
    let low = bl.low();
    let half = 128;
    let ex = bl.g.op("exponent", &[], half, Dtype::F32);
    let tf = bl.g.cast("timesteps.float()", t, Dtype::F32);
    let args = bl.g.op("t·freqs", &[tf, ex], b * half, Dtype::F32);
    let sc = bl.g.op("scale·args", &[args], b * half, Dtype::F32);
    let s = bl.g.op("sin", &[sc], b * half, Dtype::F32);
    let c = bl.g.op("cos", &[sc], b * half, Dtype::F32);
    let cat = bl.g.op("cat[sin, cos]", &[s, c], b * 2 * half, Dtype::F32);
    let flip = bl.g.op("cat[cos, sin]", &[cat], b * 2 * half, Dtype::F32);
    let proj = bl.g.cast("t_proj →dtype", flip, low);
    two_linears(
        bl,
        Builder::linear_g,
        (name, "act"),
        proj,
        (b, 2 * half, dim),
    )
}

/// Output side: `norm_out` (AdaLayerNormContinuous: scale, shift), `proj_out`, the script's
/// `_unpack_latents` (a copy), `target = noise − x0`, and the loss outside autocast:
/// `mean(((pred.float() − target.float())²).reshape(b, −1), 1).mean()` (PowBackward saves the
/// difference) `/ accumulation`.
fn final_layer(f: &Fam, d: &FluxDims, z: &Sz, rg: bool, joint: bool, trained: bool) -> Segment {
    let mut bl = f.builder("flux final");
    let sd = bl.low();
    let (b, dim) = (z.b, z.d);
    let xv = if joint {
        let xa = bl.g.input("hidden_states", b * z.n() * dim, sd, rg);
        bl.g.stream_in = vec![xa];
        bl.g.view("hidden_states[:, text:]", xa, b * z.s * dim)
    } else {
        stream_inputs(&mut bl, z, sd, (rg, rg)).0
    };
    let width = d.patch_size * d.patch_size * d.out_channels;
    output_side(
        &mut bl,
        xv,
        trained,
        (b, z.s, dim),
        width,
        "_unpack_latents",
    );
    bl.g
}

/// The SD3 / Flux output side on the image stream `x`: temb, `norm_out`
/// (AdaLayerNormContinuous: scale, shift), `proj_out`, the unpatching (a copy), the script's
/// `target = noise − x0` and [`loss`]. `temb_grad`: whether temb carries a gradient; `(b, s,
/// dim)`: microbatch, image tokens, width; `width`: `proj_out`'s (p²·out_channels); `unpatch`:
/// the name of the unpatching copy.
pub(crate) fn output_side(
    bl: &mut Builder,
    x: Tid,
    temb_grad: bool,
    (b, s, dim): (u64, u64, u64),
    width: u64,
    unpatch: &str,
) {
    let sd = bl.low();
    let temb = bl.g.input("temb", b * dim, sd, temb_grad);
    let m = ada(bl, "norm_out.linear", temb, 2, b, dim);
    let n = bl.layer_norm_rg("norm_out.norm", x, b * s);
    let h = bl.modulate_rg("norm_out", n, m[1], m[0], b * dim);
    let y = bl.linear_g("proj_out", h, Lin::new(b * s, width, dim, true));
    let lat = b * s * width;
    let yd = bl.g.dtype(y);
    let pred = bl.g.op(unpatch, &[y], lat, yd);
    let wd = bl.low();
    let x0 = bl.g.input("x0", lat, wd, false);
    let noise = bl.g.input("noise", lat, wd, false);
    let target = bl.g.op("target = noise − x0", &[noise, x0], lat, wd);
    loss(bl, pred, target, b);
}

/// The flow-matching loss of the scripts (fp32, outside autocast): the `.float()` copies below
/// fp32, the difference (saved by PowBackward), its square, the per-sample and batch means and
/// the division by the accumulation steps. Makes the loss scalar the segment's output.
pub(crate) fn loss(bl: &mut Builder, pred: Tid, target: Tid, b: u64) -> Tid {
    let lat = bl.g.elems(pred);
    let tf = bl.g.cast("target.float()", target, Dtype::F32);
    let pf = bl.g.cast("pred.float()", pred, Dtype::F32);
    let diff = bl.g.op("pred − target", &[pf, tf], lat, Dtype::F32);
    save(&mut bl.g, diff);
    let sq = bl.g.op("(·)²", &[diff], lat, Dtype::F32);
    let m1 = bl.g.op("mean(1)", &[sq], b, Dtype::F32);
    let m = bl.g.op("mean", &[m1], 1, Dtype::F32);
    let l = bl.g.op("loss / accumulation", &[m], 1, Dtype::F32);
    bl.g.output = l;
    l
}

/// Build a stack of `count` blocks whose first may differ from the rest in which streams need a
/// gradient (under LoRA the embedders are frozen: the first block's inputs need none, its
/// outputs do): stages of the first block and of the others, as long as they differ.
pub(crate) fn stack<F>(
    count: u64,
    label: &'static str,
    mut rg: (bool, bool),
    build: F,
) -> (Vec<Stage>, (bool, bool))
where
    F: Fn((bool, bool)) -> Segment,
{
    let mut out = Vec::new();
    let mut left = count;
    while left > 0 {
        let seg = build(rg);
        let next = streams_rg(&seg);
        let n = if next == rg { left } else { 1 };
        out.push(Stage::blocks(seg, n as u32, label));
        left -= n;
        rg = next;
    }
    (out, rg)
}

/// Which of a stage's two streams (image, text) carry a gradient: its output's and its first side
/// output's (the output's again when it hands on one stream).
pub(crate) fn streams_rg(seg: &Segment) -> (bool, bool) {
    let outs = seg.outputs();
    let o = seg.tensors[outs[0]].requires_grad;
    (o, outs.get(1).map_or(o, |&t| seg.tensors[t].requires_grad))
}

/// The data outside the model of the SD3 and Flux scripts (`family_peer.py`): `saved_in`, the
/// latents and text embeddings the embedders' linears save when those are trained (until the
/// input side's backward; else dropped after the model call), and `loose`, what goes with the
/// forward.
pub(crate) fn embedder_data(trained: bool, saved_in: u64, loose: u64) -> Data {
    let mut data = Data {
        kept: 0,
        forward_only: loose,
    };
    add_data(&mut data, saved_in, trained);
    data
}

pub(crate) fn stages(f: &Fam, d: &FluxDims) -> Stages {
    let z = Sz::new(f, d.inner(), d.num_attention_heads, d.attention_head_dim);
    let trained = f.lora.is_none();
    let (emb, extra) = embed(f, d, &z);
    let rg = streams_rg(&emb);
    let mut stages = vec![Stage::embed(emb, extra)];
    let (st, rg) = stack(d.num_layers, "double block", rg, |r| {
        double_block(f, &z, r, trained)
    });
    stages.extend(st);
    let (st, rg) = stack(d.num_single_layers, "single block", rg, |r| {
        single_block(f, &z, r, trained)
    });
    stages.extend(st);
    let joint = d.num_single_layers > 0;
    stages.push(Stage::final_loss(final_layer(
        f,
        d,
        &z,
        rg.0 || rg.1,
        joint,
        trained,
    )));
    // Data outside the model (family_peer.py): x0 and noise (wd) until the forward returns,
    // noisy, the timesteps, sigmas and the position ids with it; the packed latents, the T5
    // embeddings and the pooled CLIP vector are saved by the embedders' linears when those are
    // trained (until the input side's backward), else dropped after the model call.
    let wd = f.spec.recipe.precision.compute_dtype().size();
    let lat = z.b * z.s * d.in_channels;
    let saved_in = (lat + z.b * z.t * d.joint_attention_dim + z.b * d.pooled_projection_dim) * wd;
    let loose = 3 * lat * wd + z.b * (8 + 4 + wd) + z.n() * 3 * wd;
    Stages {
        stages,
        data: embedder_data(trained, saved_in, loose),
    }
}

common::stages_of!(Flux);

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::denoiser;
    use crate::runtime::pytorch::allocator::simulate;
    use crate::runtime::pytorch::device::for_spec;
    use crate::runtime::pytorch::families::of_spec;
    use crate::spec::Spec;

    /// A tiny family spec as `bench/torch_peer/specs/families/` writes them (b = 4, 128² pixels,
    /// f8 VAE), with `model.diffusers` = `config`, resolved as the CLI resolves it.
    pub(crate) fn tiny(config: &str, text: &str, precision: &str, lora: &str) -> Spec {
        let json = format!(
            r#"{{"model": {{"name": "tiny", "depth": 1, "hidden": 64, "heads": 4, "patch": 2,
                 "diffusers": {config}}},
               "workload": {{"height": 128, "width": 128, "vae_factor": 8, "batch": 4,
                 "microbatch": 4, "accumulation": 1, "ranks": 1, "text_tokens": {text}}},
               "recipe": {{"precision": "{precision}", "optimizer": "adamw",
                 "attention": "memory-efficient", "recompute": "none", "lora": {lora},
                 "zero_stage": 0, "latents": "cached"}},
               "runtime": "pytorch:cpu"}}"#
        );
        let mut s = Spec::from_json(&json).expect("tiny spec");
        denoiser::resolve(&mut s).expect("resolves");
        s
    }

    /// The stages of a family spec as the runtime builds them.
    pub(crate) fn stages_of_spec(s: &Spec) -> Stages {
        of_spec(for_spec(s), s)
    }

    /// Each stage's label and block count, in order.
    pub(crate) fn labels(st: &Stages) -> Vec<(&'static str, u32)> {
        st.stages.iter().map(|s| (s.label, s.count)).collect()
    }

    /// What a stage keeps for backward, alone (no gradient coming in).
    pub(crate) fn kept(st: &Stage) -> u64 {
        simulate(&st.seg, 0, &st.extra_grads).kept.total()
    }

    const FLUX: &str = r#"{"_class_name": "FluxTransformer2DModel", "patch_size": 1,
        "in_channels": 64, "num_layers": 1, "num_single_layers": 2, "attention_head_dim": 16,
        "num_attention_heads": 4, "joint_attention_dim": 96, "pooled_projection_dim": 48,
        "guidance_embeds": true, "axes_dims_rope": [4, 6, 6]}"#;

    fn flux_stages(precision: &str, lora: &str) -> Stages {
        stages_of_spec(&tiny(FLUX, "[77, 128]", precision, lora))
    }

    /// `families_saved.txt` (flux-fp32-none-loop, fp32): transformer_blocks.0 saves 5008384 B,
    /// of which its inputs (image 65536, text 131072), temb (1024) and the RoPE tables (2 ×
    /// 12288) are tensors of the stages before; single_transformer_blocks.* save 4176896 B each.
    #[test]
    fn fp32_blocks_keep_what_the_dump_lists() {
        let st = flux_stages("fp32", "null");
        assert_eq!(
            labels(&st),
            [
                ("embed", 1),
                ("double block", 1),
                ("single block", 2),
                ("final + loss", 1)
            ]
        );
        assert_eq!(
            kept(&st.stages[1]),
            5008384 - 65536 - 131072 - 1024 - 2 * 12288
        );
        assert_eq!(kept(&st.stages[2]), 4176896);
        // The packed latents, T5 embeddings and pooled vector are saved by trained embedders.
        assert_eq!(st.data.kept, (4 * 64 * 64 + 4 * 128 * 96 + 4 * 48) * 4);
    }

    /// bf16 autocast (families_saved.txt, flux-fp32-none-loop bf16-mixed): single blocks save
    /// 2622976 B (their bf16 weight copies included).
    #[test]
    fn bf16_single_block_keeps_what_the_dump_lists() {
        let st = flux_stages("bf16-mixed", "null");
        assert_eq!(kept(&st.stages[2]), 2622976);
    }

    /// LoRA r4 on to_q/k/v/to_out.0 (family_saved.py on flux-bf16-lora4-none-loop): a single
    /// block saves 1636352 B — three lora_A inputs, no saved input of the frozen proj_mlp /
    /// proj_out; the first double block's streams need no gradient (frozen embedders), so it is
    /// a stage of its own only if the next one differs, and the data is not kept.
    #[test]
    fn lora_freezing_drops_the_bases_saved_inputs() {
        let st = flux_stages("bf16-mixed", r#"{"rank": 4}"#);
        assert_eq!(kept(&st.stages[2]), 1636352);
        assert!(kept(&st.stages[2]) < kept(&flux_stages("bf16-mixed", "null").stages[2]));
        let first = &st.stages[1].seg;
        assert!(!first.tensors[first.stream_in[0]].requires_grad);
        assert_eq!(st.data.kept, 0);
    }

    /// The single block's `hidden_states = gate * proj_out(cat)`: the concatenation is held
    /// until the gate's product exists (the tracked forward's peak there), a checkpoint's
    /// recompute stops at that mul's pack (before it), and the cat's gradient is one buffer
    /// whose slices are the attention's and the MLP's gradients (kept until both are used).
    #[test]
    fn single_block_cat_is_held_and_its_gradient_sliced() {
        use crate::runtime::pytorch::allocator::{simulate_traced, Ev};
        use crate::runtime::pytorch::stages::grad_in;
        let st = flux_stages("fp32", r#"{"rank": 4}"#);
        let seg = &st.stages[2].seg;
        let cat = seg
            .tensors
            .iter()
            .position(|t| t.name.starts_with("cat [attn, mlp]"))
            .unwrap();
        let mul = seg.last_pack.unwrap();
        assert_eq!(seg.ops[mul].name, "proj_out gate·y");
        let c = simulate(seg, grad_in(seg), &st.stages[2].extra_grads);
        let (po, gy) = (
            seg.tensors[seg.ops[mul].inputs[1]].bytes(),
            seg.tensors[seg.ops[mul].output].bytes(),
        );
        // The forward's peak: the product with the cat and proj_out's output alive.
        assert!(c.fwd_peak.total() >= seg.tensors[cat].bytes() + po + gy);
        assert!(c.recompute_peak.total() < c.fwd_peak.total());
        // Backward: the cat's gradient outlives the attention's slice (freed with the MLP's).
        let (_, tr) = simulate_traced(seg, grad_in(seg), &st.stages[2].extra_grads);
        let n = tr.n;
        let id = n + cat as u64;
        let alloc = tr
            .bwd
            .iter()
            .position(|e| *e == Ev::Alloc(id, seg.tensors[cat].bytes()));
        let free = tr.bwd.iter().position(|e| *e == Ev::Free(id));
        let gelu = seg
            .tensors
            .iter()
            .position(|t| t.name.starts_with("act_mlp"))
            .unwrap() as u64;
        let gelu_grad_free = tr.bwd.iter().position(|e| *e == Ev::Free(n + gelu));
        assert!(alloc.is_some() && free.is_some() && free > alloc);
        // The slices are no buffers of their own.
        assert!(!tr
            .bwd
            .iter()
            .any(|e| matches!(e, Ev::Alloc(i, _) if *i == n + gelu)));
        assert!(gelu_grad_free.is_none());
    }
}
