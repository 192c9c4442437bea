//! diffusers `DiTTransformer2DModel` (`models/transformers/dit_transformer_2d.py`) in the step of
//! `bench/torch_peer/family_peer.py` (DDPM ε, class labels), op by op with what each op saves
//! (rule sources in `pytorch/mod.rs`; ground truth: `bench/torch_peer/runs/2026-12-01-epyc-families-saved/families_saved.txt`,
//! section dit).
//!
//! Stages: the input side (`pos_embed` PatchEmbed alone: every block embeds t and y itself), the
//! `BasicTransformerBlock`s (`norm_type="ada_norm_zero"`: `AdaLayerNormZero` with its own
//! `CombinedTimestepLabelEmbeddings`), the output side (`transformer_blocks[0].norm1.emb` run
//! again, `proj_out_1`, `norm_out`, `proj_out_2`, unpatchify, the fp32 MSE loss).
//!
//! Block 0's embedder is used twice: the output side runs first in backward, so it creates those
//! parameters' `.grad`; block 0's backward accumulates into them (its own stage, reading them as
//! parameters that carry a gradient but create no `.grad`), and under autocast the output side
//! reads the weight copies block 0 put in the autocast cache.

use crate::families::pixart::pytorch::{
    gated_feed_forward, norm_out_and_loss, patch_embed, self_attention, Geo,
};
use crate::families::DitDiffusersDims;
use crate::runtime::pytorch::families::common::{
    self, add_data, chunks, ddpm_data, first_and_rest, hidden_states_in, hold, info, sinusoid, Fam,
    FREQ,
};
use crate::runtime::pytorch::ops::{save, Builder, Lin, CACHED, SAVED};
use crate::runtime::pytorch::stages::{Data, Stage, Stages};
use crate::segment::{Segment, Tid};
use crate::spec::Dtype;

/// How a segment reads the parameters of `transformer_blocks.0.norm1.emb`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Emb {
    /// Its own (every block but 0 reads its own embedder).
    Own,
    /// Block 0 when the output side reuses its embedder: the gradient flows into `.grad`s the
    /// output side's backward created (a transient of the new gradient while it is added).
    Accumulated,
    /// The output side: the `.grad`s are created here; under autocast the low-precision weight
    /// copies are the ones block 0 cached (no new copy).
    Reused,
}

/// A parameter of block 0's embedder as `how` reads it.
fn emb_param(bl: &mut Builder, name: &str, elems: u64, how: Emb) -> Tid {
    if how == Emb::Accumulated && bl.lora.is_none() {
        let pd = bl.param_dtype();
        let p = bl.g.param(name, elems, pd, false);
        bl.g.tensors[p].requires_grad = true;
        return p;
    }
    bl.plain_param(name, elems)
}

/// `F.linear` of block 0's embedder under `how` (the bases are never LoRA-adapted by the
/// defaults): see [`Builder::linear_rg`]. A reused weight reads the parameter itself (its
/// autocast copy is a cache hit, saved by block 0 already).
#[allow(clippy::too_many_arguments)]
fn emb_linear(
    bl: &mut Builder,
    name: &str,
    x: Tid,
    rows: u64,
    out: u64,
    inp: u64,
    how: Emb,
) -> Tid {
    if how == Emb::Own || bl.lora.is_some() {
        return bl.linear_rg(name, x, Lin::new(rows, out, inp, true));
    }
    let w = emb_param(bl, &format!("{name}.weight"), out * inp, how);
    let bias = emb_param(bl, &format!("{name}.bias"), out, how);
    let (w, bias) = if how == Emb::Accumulated {
        let x_rg = bl.rg(x);
        let wc = bl.cast_low(&format!("{name}.weight"), w);
        if wc != w {
            let mark = if x_rg { SAVED } else { CACHED };
            bl.g.tensors[wc].name.push_str(mark);
        }
        let bc = bl.cast_low(&format!("{name}.bias"), bias);
        if bc != bias {
            bl.g.tensors[bc].name.push_str(CACHED);
        }
        (wc, bc)
    } else {
        (w, bias)
    };
    let xin = bl.cast_low(&format!("{name} input"), x);
    save(&mut bl.g, xin);
    let low = bl.low();
    let y = bl.g.op(name, &[xin, w, bias], rows * out, low);
    let x_rg = bl.rg(x);
    bl.gemm_scratch(y, rows, inp, out, x_rg, true);
    if how == Emb::Accumulated {
        // AccumulateGrad: the new gradient lives while it is added into `.grad` [AG].
        let pd = bl.param_dtype().size();
        bl.g.annotate(y, 0, 0, (out * inp + out) * pd);
    }
    y
}

/// `AdaLayerNormZero.emb` = `CombinedTimestepLabelEmbeddings(t, y, hidden_dtype)`: the sinusoid
/// cast to the stream's dtype, `TimestepEmbedding`, `LabelEmbedding` (training: `token_drop`'s
/// `torch.where` makes new labels, which the embedding saves [AG]), their sum.
fn label_emb(bl: &mut Builder, g: &Geo, prefix: &str, hd: Dtype, how: Emb) -> Tid {
    let b = g.b;
    let t = bl.g.input("t", b, Dtype::F64, false);
    let y = bl.g.input("class_labels", b, Dtype::F64, false);
    let tp = sinusoid(bl, &format!("{prefix}.time_proj"), t, b, hd);
    let te = format!("{prefix}.timestep_embedder");
    let h = emb_linear(bl, &format!("{te}.linear_1"), tp, b, g.d, FREQ, how);
    let h = bl.act(&format!("{te}.act silu"), h);
    let temb = emb_linear(bl, &format!("{te}.linear_2"), h, b, g.d, g.d, how);
    let name = format!("{prefix}.class_embedder.embedding_table.weight");
    let table = emb_param(bl, &name, g.labels * g.d, how);
    let labels = bl.g.op("token_drop labels", &[y], b, Dtype::F64);
    let trained = bl.rg(table);
    bl.save_if(labels, trained);
    let tdt = bl.g.dtype(table);
    let ye = bl.g.op("class_embedder", &[table, labels], b * g.d, tdt);
    if how == Emb::Accumulated && bl.lora.is_none() {
        // `embedding_dense_backward` makes a dense table-sized gradient, added into `.grad`.
        let pd = bl.param_dtype().size();
        bl.g.annotate(ye, 0, 0, g.labels * g.d * pd);
    }
    bl.ew("timesteps_emb + class_labels", &[temb, ye], b * g.d)
}

/// The input side: PatchEmbed (conv, `+ pos_embed`, `.to(latent.dtype)`).
fn embed(f: &Fam, d: &DitDiffusersDims, g: &Geo) -> Segment {
    let mut bl = f.builder("embed");
    let wd = bl.low();
    let noisy = bl.g.input("noisy latent", g.lat, wd, false);
    let conf = (d.in_channels, d.patch_size, d.sample_size);
    let x = patch_embed(&mut bl, f, conf, g, noisy);
    bl.g.output = x;
    bl.g
}

/// One `BasicTransformerBlock` with `norm_type="ada_norm_zero"` (diffusers `attention.py`).
fn block(f: &Fam, d: &DitDiffusersDims, g: &Geo, x: (Dtype, bool), how: Emb) -> Segment {
    let mut bl = f.builder("block");
    let (b, dim, e, rows) = (g.b, g.d, g.e(), g.rows());
    let xs = hidden_states_in(&mut bl, e, x);
    // AdaLayerNormZero: emb, `linear(silu(emb))` chunked in six.
    let p = "transformer_blocks.i.norm1";
    let cond = label_emb(&mut bl, g, &format!("{p}.emb"), x.0, how);
    let s = bl.act(&format!("{p}.silu"), cond);
    let m6 = bl.linear_rg(&format!("{p}.linear"), s, Lin::new(b, 6 * dim, dim, true));
    let m = chunks(&mut bl, "emb", m6, 6, b * dim);
    let (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp) =
        (m[0], m[1], m[2], m[3], m[4], m[5]);
    let n1 = bl.layer_norm_rg("norm1.norm", xs, rows);
    let hn = bl.modulate_rg("norm1 modulate", n1, shift_msa, scale_msa, b * dim);
    let ab = d.attention_bias;
    let (go, x1, _) = self_attention(&mut bl, (hn, xs, gate_msa), g, ab);
    let n3 = bl.layer_norm_rg("norm3", x1, rows);
    // `norm_hidden_states = self.norm3(...)` reassigns the self-attention input's local.
    hold(&mut bl, &[hn]);
    let hn = bl.modulate_rg("norm3 modulate", n3, shift_mlp, scale_mlp, b * dim);
    gated_feed_forward(&mut bl, (hn, x1, gate_mlp), g);
    // Until `return`: `attn_output` (gated) and `norm_hidden_states` (the FF's input).
    hold(&mut bl, &[go, hn]);
    bl.g
}

/// The output side: `conditioning = transformer_blocks[0].norm1.emb(t, y, hidden_dtype)`,
/// `proj_out_1(F.silu(conditioning)).chunk(2)`, `norm_out(x)·(1 + scale) + shift`, `proj_out_2`,
/// unpatchify and the loss.
fn final_layer(f: &Fam, d: &DitDiffusersDims, g: &Geo, x: (Dtype, bool)) -> Segment {
    let mut bl = f.builder("final");
    let (b, dim, e) = (g.b, g.d, g.e());
    let xs = hidden_states_in(&mut bl, e, x);
    let cond = label_emb(
        &mut bl,
        g,
        "transformer_blocks.0.norm1.emb",
        x.0,
        Emb::Reused,
    );
    let s = bl.act("F.silu(conditioning)", cond);
    let m2 = bl.linear_rg("proj_out_1", s, Lin::new(b, 2 * dim, dim, true));
    let shift = bl.g.view("shift", m2, b * dim);
    let scale = bl.g.view("scale", m2, b * dim);
    // `conditioning`, `shift, scale` stay in the model's locals until it returns.
    let proj = ("proj_out_2", d.out_channels);
    norm_out_and_loss(&mut bl, g, xs, (shift, scale), proj, &[cond, m2]);
    bl.g
}

/// The stages of a `DiTTransformer2DModel` step.
pub(crate) fn stages(f: &Fam, d: &DitDiffusersDims) -> Stages {
    let b = f.b;
    let latent = (d.in_channels, d.out_channels, d.patch_size);
    let g = Geo {
        labels: d.num_embeds_ada_norm + 1,
        ..Geo::basic(f, (d.inner(), d.num_attention_heads), latent)
    };
    let emb = embed(f, d, &g);
    let out = |s: &Segment| info(s, s.output);
    let first = block(f, d, &g, out(&emb), Emb::Accumulated);
    let rest = block(f, d, &g, out(&first), Emb::Own);
    let mut stages = vec![Stage::embed(emb, Vec::new())];
    stages.extend(first_and_rest(first, rest, d.num_layers as u32, true));
    let last = stages.last().map_or((Dtype::F32, false), |st| out(&st.seg));
    stages.push(Stage::final_loss(final_layer(f, d, &g, last)));
    let wd = f.spec.recipe.precision.compute_dtype().size();
    // `family_peer.py`: the DDPM data ([`ddpm_data`]), y (int64) for the forward, the noisy
    // latent while the conv saves it.
    let (kept, fwd) = ddpm_data(f, g.lat);
    let mut data = Data {
        kept,
        forward_only: fwd + 8 * b,
    };
    add_data(&mut data, g.lat * wd, f.lora.is_none());
    Stages { stages, data }
}

common::stages_of!(DitDiffusers);

#[cfg(test)]
mod tests {
    use crate::families::pixart::pytorch::tests::{costs, kept, tiny};
    use crate::spec::Precision;

    const DIT: &str = r#"{"_class_name": "DiTTransformer2DModel", "sample_size": 16,
        "num_layers": 2, "attention_head_dim": 16, "in_channels": 4, "out_channels": 8,
        "patch_size": 2, "attention_bias": true, "num_attention_heads": 4,
        "activation_fn": "gelu-approximate", "num_embeds_ada_norm": 1000,
        "norm_type": "ada_norm_zero", "norm_elementwise_affine": false}"#;
    /// b·s·D of the tiny spec.
    const E: u64 = 4 * 64 * 64;

    #[test]
    fn fp32_blocks_and_output_side_keep_what_autograd_saves() {
        let c = costs(&tiny(DIT, Precision::Fp32, None));
        // embed, block 0 (its embedder shared with the output side), block 1, final.
        assert_eq!(c.len(), 4);
        let k = kept(&c);
        // `families_saved.txt`: 1335328 B per block, with its fp32 input (saved by norm1).
        assert_eq!(k[1], 1_335_328 - 4 * E);
        assert_eq!(k[2], 1_335_328 - 4 * E);
        // Output side: model body 73760, proj_out_1 1024, norm_out 67584 (its input is the
        // stream), proj_out_2 65536, and the loss's input (32768; the noise is data).
        assert_eq!(k[3], 73_760 + 1024 + 67_584 - 4 * E + 65_536 + 32_768);
    }

    #[test]
    fn the_output_side_creates_block_zero_embedder_grads_once() {
        let c = costs(&tiny(DIT, Precision::Fp32, None));
        // Block 0 reads the embedder the output side already differentiated: its own `.grad`s
        // are those of attn1, ff, norm1.linear only; block 1 makes all of its own.
        let emb = (256 * 64 + 64 + 64 * 64 + 64 + 1001 * 64) * 4;
        assert_eq!(c[1].cost.param_grads + emb, c[2].cost.param_grads);
        assert!(c[3].cost.param_grads >= emb);
    }

    #[test]
    fn bf16_stream_stays_bf16() {
        let c = costs(&tiny(DIT, Precision::Bf16Mixed, None));
        let k = kept(&c);
        // 825888 B per block with the bf16 input; the output side 157728 B (model body 37408
        // without the timestep weight copy block 0 cached, proj_out_1, norm_out, proj_out_2,
        // the two fp32 copies of the loss) less its bf16 input.
        assert_eq!(k[1], 825_888 - 2 * E);
        assert_eq!(k[2], 825_888 - 2 * E);
        assert_eq!(k[3], 37_408 + 16_896 + 33_792 + 36_864 + 32_768 - 2 * E);
    }

    #[test]
    fn lora_saves_no_frozen_input() {
        let c = costs(&tiny(DIT, Precision::Bf16Mixed, Some(4)));
        let k = kept(&c);
        // `family_saved.py` on dit-bf16-lora4: block 0 445440 B (no grad reaches its input),
        // block 1 481280 B with its bf16 input.
        assert_eq!(k[1], 445_440);
        assert_eq!(k[2], 481_280 - 2 * E);
    }
}
