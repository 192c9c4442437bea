//! What every family's stages share: the family context ([`Fam`]: the spec's shapes, precision,
//! LoRA, the builders), and the pieces of the training script's step around the model.

use crate::denoiser;
use crate::families::{FamilyModel, Geometry};
use crate::runtime::pytorch::device::PyTorch;
use crate::runtime::pytorch::ops::{promote, save, Builder, Lin, LoraOn};
use crate::runtime::pytorch::stages::{Data, Stage, Stages};
use crate::segment::{Segment, Tid};
use crate::spec::Dtype;
use crate::spec::Spec;

/// A family spec's step, as the builders read it.
pub(crate) struct Fam<'a> {
    pub rt: &'a PyTorch,
    pub spec: &'a Spec,
    pub geometry: Geometry,
    /// Microbatch b.
    pub b: u64,
    /// Image (video) tokens per sample.
    pub s: u64,
    /// Latent frames (1 for images), latent height and width (VAE pixels, before patching).
    pub frames: u64,
    pub latent_h: u64,
    pub latent_w: u64,
    /// Text tokens per text encoder, in the family's order.
    pub text: Vec<u64>,
    pub lora: Option<LoraOn>,
}

impl<'a> Fam<'a> {
    pub(crate) fn new(rt: &'a PyTorch, spec: &'a Spec, fm: &FamilyModel) -> Fam<'a> {
        let geometry = fm.geometry();
        let text = denoiser::text_tokens(spec, &geometry);
        let w = &spec.workload;
        let factor = u64::from(w.vae_factor.max(1));
        let lora = spec.recipe.lora.as_ref().map(|l| LoraOn {
            rank: u64::from(l.rank),
            modules: denoiser::lora_modules(spec),
            dtype: spec.recipe.trained_dtype(),
        });
        Fam {
            rt,
            spec,
            b: u64::from(w.microbatch),
            s: spec.tokens().unwrap_or(0),
            frames: spec.latent_frames().unwrap_or(1),
            latent_h: u64::from(w.height) / factor,
            latent_w: u64::from(w.width) / factor,
            text,
            lora,
            geometry,
        }
    }

    /// A graph builder under the spec's precision, attention mode and LoRA.
    pub(crate) fn builder(&self, name: &str) -> Builder<'a> {
        let mut bl = Builder::new(
            self.rt,
            self.spec.recipe.precision,
            self.spec.recipe.attention,
            name,
        );
        bl.lora = self.lora.clone();
        bl.threads = u64::from(self.spec.cpu().threads);
        bl
    }

    /// Whether the spec's LoRA adapts `module` (PEFT's `target_modules` name match).
    pub(crate) fn lora_on(&self, module: &str) -> bool {
        self.lora.as_ref().is_some_and(|l| {
            l.modules
                .iter()
                .any(|k| denoiser::matches_module(module, k))
        })
    }

    /// Whether the cross-attention's `attn2.to_k` / `to_v` save the text they read as it is
    /// (when it is in the compute dtype, as Wan's text context and Sana's low-precision caption
    /// are): their weights are trained, or LoRA adapts one of them with adapters PEFT's
    /// `_cast_input_dtype(x, lora_A.weight.dtype)` hands x itself (fp32 without autocast, or the
    /// compute dtype: `lora.dtype = "weight"`; peft 0.21.2 `tuners/tuners_utils.py:2233`, called
    /// at `tuners/lora/layer.py:1100`; autocast casts nothing already low). Fp32 adapters under
    /// autocast save lora_A's own copy.
    pub(crate) fn kv_save_text(&self) -> bool {
        let precision = self.spec.recipe.precision;
        let lora_kv = self.lora_on("attn2.to_k") || self.lora_on("attn2.to_v");
        let adapters_low = self
            .lora
            .as_ref()
            .is_some_and(|l| l.dtype == precision.compute_dtype());
        self.lora.is_none() || (lora_kv && (!precision.is_mixed() || adapters_low))
    }

    /// Whether the recompute policy checkpoints any of the first `n` blocks: a checkpointed
    /// block holds the call's arguments (the broadcast tensors) until its recompute [CK].
    pub(crate) fn any_block_recomputed(&self, n: u32) -> bool {
        (0..n).any(|i| self.spec.recipe.recompute.recomputes_block(i))
    }
}

/// A family's reader for the registry ([`crate::families::registry`]), `stages_of`: its
/// `stages(f, d)` for dims of the family (`Dims::$variant`), None for another family's.
macro_rules! stages_of {
    ($variant:ident) => {
        /// The registry's reader: this family's stages for its dims, None for another family's.
        pub(crate) fn stages_of(
            f: &$crate::runtime::pytorch::families::common::Fam,
            dims: &$crate::families::Dims,
        ) -> Option<$crate::runtime::pytorch::stages::Stages> {
            match dims {
                $crate::families::Dims::$variant(d) => Some(stages(f, d)),
                _ => None,
            }
        }
    };
}
pub(crate) use stages_of;

/// A stack of `n` blocks whose block 0 reads the input side's stream (another dtype, or no
/// gradient under LoRA) and the others the previous block's: block 0's stage and the rest's
/// (none for one block). With `merge_equal` (PixArt, diffusers' DiT) block 0 joins the rest
/// when both build the same segment.
pub(crate) fn first_and_rest(
    first: Segment,
    rest: Segment,
    n: u32,
    merge_equal: bool,
) -> Vec<Stage> {
    if merge_equal && rest == first {
        return vec![Stage::blocks(first, n, "block")];
    }
    let mut st = vec![Stage::blocks(first, 1, "block")];
    if n > 1 {
        st.push(Stage::blocks(rest, n - 1, "block"));
    }
    st
}

/// The stages of a step of one stack of `n` blocks (Sana, Wan): the input side `embed`, block 0
/// and the rest ([`first_and_rest`]: block 0 reads the input side's stream, never merged), the
/// output side `final_layer`; `data` outside the model.
pub(crate) fn stack_stages(
    embed: Stage,
    (first, rest): (Segment, Segment),
    n: u32,
    final_layer: Segment,
    data: Data,
) -> Stages {
    let mut stages = vec![embed];
    stages.extend(first_and_rest(first, rest, n, false));
    stages.push(Stage::final_loss(final_layer));
    Stages { stages, data }
}

/// A stage's stream as the next one reads it: the dtype of tensor `t` and whether it carries a
/// gradient.
pub(crate) fn info(g: &Segment, t: Tid) -> (Dtype, bool) {
    (g.tensors[t].dtype, g.tensors[t].requires_grad)
}

/// A stage's input made by an earlier stage, with that tensor's `(dtype, requires grad)`.
pub(crate) fn input_as(bl: &mut Builder, name: &str, elems: u64, (dt, rg): (Dtype, bool)) -> Tid {
    bl.g.input(name, elems, dt, rg)
}

/// The residual stream `x` (`elems`, with its `(dtype, requires grad)`) as a Sana or Wan stage
/// reads it: the stage's stream.
pub(crate) fn stream_x(bl: &mut Builder, elems: u64, x: (Dtype, bool)) -> Tid {
    let xs = input_as(bl, "x", elems, x);
    bl.g.stream_in = vec![xs];
    xs
}

/// The residual stream `hidden_states` (`elems`, with its `(dtype, requires grad)`) as a stage
/// of PixArt or diffusers' DiT reads it: a stream of the stage when a gradient flows back to it.
pub(crate) fn hidden_states_in(bl: &mut Builder, elems: u64, x: (Dtype, bool)) -> Tid {
    let xs = input_as(bl, "hidden_states", elems, x);
    if x.1 {
        bl.g.stream_in = vec![xs];
    }
    xs
}

/// The tensors of `ts` that receive a gradient (the input side's broadcast outputs the blocks
/// differentiate).
pub(crate) fn needing_grad(seg: &Segment, ts: &[Tid]) -> Vec<Tid> {
    ts.iter()
        .copied()
        .filter(|&t| seg.tensors[t].requires_grad)
        .collect()
}

/// Bytes of the input side's broadcast outputs `(tensor, held)` that nothing holds past the
/// forward (`held`: an op saves it, or a checkpoint keeps it as a block's argument): the model's
/// locals keep them until it returns.
pub(crate) fn unheld_bytes(seg: &Segment, outs: &[(Tid, bool)]) -> u64 {
    outs.iter()
        .filter(|&&(_, held)| !held)
        .map(|&(t, _)| seg.tensors[t].bytes())
        .sum()
}

/// The broadcast outputs of an adaLN-single input side (Sana's, Wan's: the (b, 6D) timestep,
/// the embedded timestep, the text) as the step holds them: the timestep saved when a
/// checkpointed block keeps it as an argument (`ck`) [CK], the text when the blocks save it
/// (`text_saved`), the embedded timestep when it carries a gradient. Returns those the blocks
/// differentiate and the bytes of those nothing holds past the forward ([`unheld_bytes`]).
pub(crate) fn adaln_broadcasts(
    seg: &mut Segment,
    [ts, emb, text]: [Tid; 3],
    ck: bool,
    text_saved: bool,
) -> (Vec<Tid>, u64) {
    if ck {
        save(seg, ts);
    }
    let extra = needing_grad(seg, &[ts, emb, text]);
    let emb_held = seg.tensors[emb].requires_grad;
    let unheld = unheld_bytes(seg, &[(ts, ck), (text, text_saved), (emb, emb_held)]);
    (extra, unheld)
}

/// Data outside the model that a saved reference may hold: `bytes` kept until the step's
/// backward ends when `saved` (an embedder's trained linear or conv saves it), else freed with
/// the forward.
pub(crate) fn add_data(data: &mut Data, bytes: u64, saved: bool) {
    if saved {
        data.kept += bytes;
    } else {
        data.forward_only += bytes;
    }
}

/// How a family's autograd records one `F.linear` call: [`Builder::linear_rg`],
/// [`Builder::linear_if_grad`] or [`Builder::linear_g`].
pub(crate) type LinearRule<'a> = fn(&mut Builder<'a>, &str, Tid, Lin) -> Tid;

/// Linear → activation → Linear as diffusers' `TimestepEmbedding` and
/// `PixArtAlphaTextProjection` run it over `rows` rows: `{prefix}.linear_1` (`inp` → `dim`), the
/// activation `{prefix}.{act}` (saves its input [AG]), `{prefix}.linear_2` (`dim` → `dim`), each
/// linear recorded by `linear`. Returns linear_2's output.
pub(crate) fn two_linears<'a>(
    bl: &mut Builder<'a>,
    linear: LinearRule<'a>,
    (prefix, act): (&str, &str),
    x: Tid,
    (rows, inp, dim): (u64, u64, u64),
) -> Tid {
    let h = linear(
        bl,
        &format!("{prefix}.linear_1"),
        x,
        Lin::new(rows, dim, inp, true),
    );
    let h = bl.act(&format!("{prefix}.{act}"), h);
    linear(
        bl,
        &format!("{prefix}.linear_2"),
        h,
        Lin::new(rows, dim, dim, true),
    )
}

/// The `k` chunks of a (b, k·D) tensor `m` (`chunk(k)` of a modulation), views named
/// `{name} chunk {i}` of `bd` = b·D elements each: a saved chunk keeps all of `m`.
pub(crate) fn chunks(bl: &mut Builder, name: &str, m: Tid, k: u64, bd: u64) -> Vec<Tid> {
    (0..k)
        .map(|i| bl.g.view(&format!("{name} chunk {i}"), m, bd))
        .collect()
}

/// Width of diffusers' `Timesteps(256)` sinusoid (`time_proj`, `additional_condition_proj`).
pub(crate) const FREQ: u64 = 256;

/// A Python local that holds `t` until here (reassigned or the function returns): a zero-sized
/// view that reads it, so its storage lives to this point of the forward; nothing flows back
/// through it. Restores the segment's output (the view is not the output).
pub(crate) fn hold(bl: &mut Builder, ts: &[Tid]) {
    let out = bl.g.output;
    for &t in ts {
        bl.g.view("python local (held until reassigned / return)", t, 0);
    }
    bl.g.output = out;
}

/// `get_timestep_embedding` (diffusers `Timesteps`, no grad): the (n, 256) fp32 sinusoid (its
/// arange/exp/sin/cos temporaries are a few n·256 floats, freed at once), then
/// `.to(hidden_dtype)`.
pub(crate) fn sinusoid(bl: &mut Builder, name: &str, src: Tid, n: u64, to: Dtype) -> Tid {
    let e = bl.g.op(name, &[src], n * FREQ, Dtype::F32);
    bl.g.cast(&format!("{name} →{to}"), e, to)
}

/// diffusers `get_timestep_embedding(t, dim, flip_sin_to_cos=True)` as Sana's and Wan's
/// `Timesteps` run it (no grad): on the fp32 timesteps, the exponent, its exp, `t·freqs`, sin and
/// cos, their concatenation and the flip to `[cos, sin]`, all fp32. Returns the flipped (b, dim)
/// table.
pub(crate) fn flipped_sinusoid(bl: &mut Builder, b: u64, dim: u64) -> Tid {
    let half = dim / 2;
    let t = bl.g.input("timesteps", b, Dtype::F32, false);
    let ex = bl.g.op("exponent", &[], half, Dtype::F32);
    let fr = bl.g.op("exp(exponent)", &[ex], half, Dtype::F32);
    let args = bl.g.op("t·freqs", &[t, fr], b * half, Dtype::F32);
    let sin = bl.g.op("sin", &[args], b * half, Dtype::F32);
    let cos = bl.g.op("cos", &[args], b * half, Dtype::F32);
    let cat = bl.g.op("cat[sin, cos]", &[sin, cos], b * dim, Dtype::F32);
    bl.g.op("cat[cos, sin]", &[cat], b * dim, Dtype::F32)
}

/// Unpatchify (`reshape`, `einsum("nhwpqc->nchpwq")` a permuted view, the last `reshape` a copy
/// of `out` elements), the ε channels (`out[:, :C]`, a view, when sigma is learned) and
/// `F.mse_loss(pred.float(), noise.float())` outside autocast (`family_peer.py`): `.float()` copies
/// a low-precision tensor; MseLossBackward0 saves input and target; the forward makes one
/// elementwise buffer before the mean [AG].
pub(crate) fn eps_loss(bl: &mut Builder, y: Tid, out: u64, lat: u64) {
    let wd = bl.low();
    let img = bl.ew("unpatchify reshape", &[y], out);
    let pred = bl.g.view("ε channels", img, lat);
    let pf = bl.g.cast("pred.float()", pred, Dtype::F32);
    let noise = bl.g.input("noise", lat, wd, false);
    let target = bl.g.cast("target.float()", noise, Dtype::F32);
    save(&mut bl.g, pf);
    save(&mut bl.g, target);
    let loss = bl.g.op("mse_loss", &[pf, target], 1, Dtype::F32);
    bl.g.annotate(loss, 0, lat * 4, 0);
    // The script's `pred` lives until `del pred, target` after the loss.
    hold(bl, &[pred]);
}

/// The DDPM step's data shared with diffusers' DiT (`family_peer.py` `Inputs.forward`, `loss_of`),
/// as (kept, forward-only) bytes without the noisy latent: the scheduler's `alphas_cumprod`
/// (1000 fp32, resident in the peer, held here for the whole step); the noise (the target),
/// until the backward ends when the loss saves it as is (fp32), else freed with `del pred,
/// target` after the loss (its `.float()` copy is the saved one); x0, ᾱ_t and the int64 t for
/// the forward.
pub(crate) fn ddpm_data(f: &Fam, lat: u64) -> (u64, u64) {
    let wd = f.spec.recipe.precision.compute_dtype();
    let noise = lat * wd.size();
    let acp = 1000 * 4;
    let fwd = lat * wd.size() + f.b * (8 + wd.size());
    if wd == Dtype::F32 {
        (acp + noise, fwd)
    } else {
        (acp, fwd + noise)
    }
}

/// Bytes of the flow-matching step's own tensors (`family_peer.py`) alive until the model's
/// forward returns: x0, noise and the target (`lat` elements of the scripts' `weight_dtype`, `wd`
/// bytes each), u and the timesteps (fp32) and σ (one each a sample).
pub(crate) fn flow_step_bytes(lat: u64, b: u64, wd: u64) -> u64 {
    3 * lat * wd + 2 * 4 * b + b * wd
}

/// The flow-matching noising of `family_peer.py` (no grad): `(1 − σ)·x0 + σ·noise` in the
/// scripts' `weight_dtype`, both products freed after the sum. Returns `noisy`.
pub(crate) fn noising(bl: &mut Builder, lat: u64, b: u64, wd: Dtype) -> Tid {
    let x0 = bl.g.input("x0", lat, wd, false);
    let noise = bl.g.input("noise", lat, wd, false);
    let sig = bl.g.input("σ", b, wd, false);
    let om = bl.g.op("1−σ", &[sig], b, wd);
    let a = bl.g.op("(1−σ)·x0", &[x0, om], lat, wd);
    let bn = bl.g.op("σ·noise", &[noise, sig], lat, wd);
    bl.g.op("noisy", &[a, bn], lat, wd)
}

/// Unpatchify (a copy when the permutation cannot be viewed) and the scripts' loss
/// `mean(((pred.float() − target.float())²).reshape(b, −1), 1).mean()` outside autocast:
/// `.float()` copies a low-precision prediction / target, `PowBackward0` saves the difference
/// [AG]. The script holds `pred` until the loss is made (`del pred, target` after it): its
/// bytes ride as forward scratch on the ops after its last read.
pub(crate) fn flow_loss(
    bl: &mut Builder,
    f: &Fam,
    y: Tid,
    copy: bool,
    target: Tid,
    lat: u64,
    b: u64,
) {
    let ydt = bl.g.dtype(y);
    let pred = if copy {
        bl.g.op("unpatchify (copy)", &[y], lat, ydt)
    } else {
        bl.g.view("unpatchify (view)", y, lat)
    };
    let pb = bl.g.tensors[pred].bytes();
    let pf = bl.g.cast("pred.float()", pred, Dtype::F32);
    let tf = bl.g.cast("target.float()", target, Dtype::F32);
    let diff = bl.g.op("pred − target", &[pf, tf], lat, Dtype::F32);
    let r = bl.rg(diff);
    bl.save_if(diff, r);
    if pf != pred {
        bl.g.annotate(diff, 0, pb, 0);
    }
    let sq = bl.g.op("(pred − target)²", &[diff], lat, Dtype::F32);
    bl.g.annotate(sq, 0, pb, 0);
    let m1 = bl.g.op("mean over each sample", &[sq], b, Dtype::F32);
    let loss = bl.g.op("mean", &[m1], 1, Dtype::F32);
    if f.spec.workload.accumulation > 1 {
        bl.g.op("loss / accumulation", &[loss], 1, Dtype::F32);
    }
}

/// The SD3/Flux conditioning after the timestep embedding (diffusers
/// `CombinedTimestepTextProjEmbeddings` / `CombinedTimestepGuidanceTextProjEmbeddings`, then the
/// transformer's `context_embedder`): the pooled text through `PixArtAlphaTextProjection`
/// (linear, SiLU, linear) added to `temb` (saved: every block's norms read it), and the text
/// tokens projected to the model width. `(b, dim, t)`: microbatch, width, text tokens. Returns
/// `(temb, context)`.
pub(crate) fn pooled_temb_and_context(
    bl: &mut Builder,
    temb: Tid,
    (b, dim, t): (u64, u64, u64),
    pooled_dim: u64,
    joint_dim: u64,
) -> (Tid, Tid) {
    let low = bl.low();
    let pooled = bl.g.input("pooled", b * pooled_dim, low, false);
    let names = ("time_text_embed.text_embedder", "act_1");
    let p2 = two_linears(bl, Builder::linear_g, names, pooled, (b, pooled_dim, dim));
    let dt = promote(bl.g.dtype(temb), bl.g.dtype(p2));
    let temb = bl.g.op("temb", &[temb, p2], b * dim, dt);
    save(&mut bl.g, temb);
    let enc =
        bl.g.input("encoder_hidden_states", b * t * joint_dim, low, false);
    let ctx = bl.linear_g(
        "context_embedder",
        enc,
        Lin::new(b * t, dim, joint_dim, true),
    );
    (temb, ctx)
}

/// A family spec as `bench/torch_peer/specs/families/*.json` states it for the peer's CPU runs:
/// `model` and `workload` (JSON objects) under the peer's recipe — AdamW's for-loop,
/// memory-efficient attention, cached latents, no ZeRO, no EMA — with `precision`, `recompute`
/// and `lora` (a JSON value) set, resolved as the CLI resolves it.
#[cfg(test)]
pub(crate) fn peer_spec(
    model: &str,
    workload: &str,
    (precision, recompute, lora): (&str, &str, &str),
) -> Spec {
    let json = format!(
        r#"{{"model": {model}, "workload": {workload},
             "recipe": {{"precision": "{precision}", "optimizer": "adamw",
               "optimizer_impl": "for-loop", "attention": "memory-efficient",
               "recompute": "{recompute}", "lora": {lora}, "zero_stage": 0, "latents": "cached",
               "ema": {{"enabled": false, "dtype": "f32", "decay": 0.9999}}}},
             "runtime": "pytorch:cpu"}}"#
    );
    let mut s = Spec::from_json(&json).expect("a peer spec");
    denoiser::resolve(&mut s).expect("resolves");
    s
}
