//! Sana in the conformance suite: its rounding stages, its score probe (with the cancellation and
//! ReLU kink of its linear attention's q and k gradients), the tensors those reach, and its
//! agreement grid.

use candle_core::{DType, Device, Tensor};
use ditmem_budget::Spec;

use crate::agree::builder::{
    accumulation, family_base, lora, memory_efficient, one_sample_blocks, sgd_without_ema,
    text_tokens, text_tokens_batch2_me, GridBuilder, ACCUMULATION, FAMILY_POLICIES, SGD,
};
use crate::diffusion::Batch;
use crate::model::{timestep_features, Dims};
use crate::trainer::Trainer;
use crate::verify::cancellation::{add_sums, Sums};
use crate::verify::chain::{MLP, SOFTMAX_ATTENTION};
use crate::verify::kink::{add_kink_sums, KinkSums};
use crate::verify::replay::{
    cross_query, e, linear_or_unbiased, mlp_linears, on_pool, pair_bound, shift_scale_ln, silu_mlp,
    table_modulation, weights, F64Replay, Probe,
};
use crate::verify::upstream::with_upstream;
use crate::verify::Result;
use ditmem_budget::{AttentionMode, Precision, Recompute};
use ditmem_engine::families::sana::{SanaGeom, SANA_BLOCK_LINEARS};

/// The cancellation ([`add_sums`]) and ReLU kink ([`add_kink_sums`]) of one block's linear
/// attention on its q, k, v (b·s, D) from `h1`, the block's normed input; `geom` (b samples,
/// s tokens, heads, head width) and `roundings` the rounding stages `h1` carries.
fn linear_attention_sums(
    h1: &Tensor,
    [q, k, v]: [&Tensor; 3],
    bw: &ditmem_engine::families::sana::SanaBlockWeights,
    roundings: f64,
    geom: (usize, usize, usize, usize),
) -> Result<(Sums, KinkSums)> {
    let (b, s, heads, dh) = geom;
    let h = heads * dh;
    let mut block_sums = Sums::default();
    let flat =
        |t: &Tensor| -> Result<Vec<f64>> { t.flatten_all().and_then(|v| v.to_vec1()).map_err(e) };
    let qkv = (&flat(q)?[..], &flat(k)?[..], &flat(v)?[..]);
    add_sums(qkv, geom, &mut block_sums);
    // √(Σⱼ hⱼ²·W_cj²) of each component of q and k: the spread of its terms.
    let h2 = h1.sqr().and_then(|x| x.reshape((b * s, h))).map_err(e)?;
    let spread = |w: &Tensor| -> Result<Vec<f64>> {
        flat(
            &h2.matmul(&w.sqr().and_then(|w| w.t()).map_err(e)?)
                .and_then(|x| x.sqrt())
                .map_err(e)?,
        )
    };
    let mut block_kinks = KinkSums::default();
    add_kink_sums(
        qkv,
        (&spread(&bw.q1.w)?, &spread(&bw.k1.w)?),
        roundings,
        geom,
        &mut block_kinks,
    );
    Ok((block_sums, block_kinks))
}

// Kept whole (> 100 lines): one forward replayed in the model's order (embed, blocks with their cancellation and kink sums, output side, loss) over shared locals.
/// The score bound S for Sana: its forward replayed in f64 (embed, blocks, output side), S over
/// the softmax cross-attention to the caption (the linear self-attention has no softmax).
fn score_bound(spec: &Spec, t: &Trainer, g: &SanaGeom, batch: &Batch) -> Result<Probe> {
    use crate::ops::linear_attention::linear_attention;
    use ditmem_engine::families::sana::{
        caption_forward, final_forward as sana_final, sana_block_forward, SanaBlockGeom,
        SanaBlockWeights, SanaCaptionWeights, SanaFinalWeights, SANA_FREQ,
    };
    let r = F64Replay::of(spec, t);
    let d = r.d;
    let (dev, f) = (Device::Cpu, DType::F64);
    let geo = SanaBlockGeom {
        rows: d.rows,
        cols: d.cols,
        cross_heads: g.cross_heads,
    };
    let scale = crate::mutation::attention_scale(g.cross_width / g.cross_heads);
    let lin = |n: &str| linear_or_unbiased(t, n);
    let embed = lin("patch_embed.proj")?;
    let [t1, t2] = mlp_linears("time_embed.emb.timestep_embedder", lin)?;
    let adaln = lin("time_embed.linear")?;
    let cw = SanaCaptionWeights {
        linear_1: lin("caption_projection.linear_1")?,
        linear_2: lin("caption_projection.linear_2")?,
        norm: t.parameter("caption_norm.weight")?,
    };
    let fw = SanaFinalWeights {
        table: t.parameter("scale_shift_table")?,
        proj_out: lin("proj_out")?,
    };
    let h = d.hidden;
    let mut sums = vec![Sums::default(); d.depth];
    let mut kinks = vec![KinkSums::default(); d.depth];
    let (bound, loss, softmax) = r.over_microbatches(batch, |_, mb, softmax| {
        let b = mb.n;
        let (mut x, emb, t6, y) = on_pool(|| -> Result<(Tensor, Tensor, Tensor, Tensor)> {
            let x = r.tokens(&embed, &r.noisy_patches(mb)?, b, None)?;
            let tf = timestep_features(&mb.timesteps, SANA_FREQ, f, &dev)?;
            let emb = silu_mlp(&tf, &t1, &t2)?;
            let t6 = adaln.forward(&emb.silu().map_err(e)?)?;
            let y = caption_forward(&mb.text_tensor(f, &dev)?, &cw)?;
            Ok((x, emb, t6, y))
        })?;
        let mut bound = 0.0f64;
        for (i, (block_total, kink_total)) in sums.iter_mut().zip(kinks.iter_mut()).enumerate() {
            let prefix = format!("transformer_blocks.{i}");
            let [q1, k1, v1, o1, q2, k2, v2, o2, conv_inverted, conv_point] =
                weights(&prefix, SANA_BLOCK_LINEARS, lin)?;
            let dp = |n: &str| t.parameter(&format!("{prefix}.ff.conv_depth.{n}"));
            let bw = SanaBlockWeights::new(
                t.parameter(&format!("{prefix}.scale_shift_table"))?,
                [q1, k1, v1, o1, q2, k2, v2, o2],
                conv_inverted,
                (dp("weight")?, dp("bias")?),
                conv_point,
            );
            // What h carries into the block's q and k: the embedding, the earlier blocks' stages,
            // its norm; and the weight's own rounding (see kink.rs).
            let roundings = (3 + super::VerifyFamily::block_stages(g, i as u64)) as f64;
            let (next, sb, block_sums, block_kinks) =
                on_pool(|| -> Result<(Tensor, f64, Sums, KinkSums)> {
                    // q and k of the cross-attention as the block computes them.
                    let modv = table_modulation(&t6, &bw.table)?;
                    let h1 = shift_scale_ln(&x, &modv)?;
                    let (q, k, v) = (
                        bw.q1.forward(&h1)?,
                        bw.k1.forward(&h1)?,
                        bw.v1.forward(&h1)?,
                    );
                    let (block_sums, block_kinks) = linear_attention_sums(
                        &h1,
                        [&q, &k, &v],
                        &bw,
                        roundings,
                        (b, d.tokens, d.heads, h / d.heads),
                    )?;
                    let o = linear_attention(&q, &k, &v, b, d.heads).map_err(e)?;
                    let gate = modv.narrow(1, 2 * h, h).map_err(e)?;
                    let q2 = cross_query(&x, &o, (&bw.o1, &gate), &bw.q2)?;
                    let k2 = bw.k2.forward(&y)?;
                    let sb = pair_bound(&q2, &k2, b, g.cross_heads, scale, (softmax, 0))?;
                    Ok((
                        sana_block_forward(&x, &t6, &y, &bw, &r.cfg, &geo)?,
                        sb,
                        block_sums,
                        block_kinks,
                    ))
                })?;
            bound = bound.max(sb);
            block_total.add(block_sums);
            kink_total.add(block_kinks);
            x = next;
        }
        let loss = on_pool(|| r.patch_loss(&sana_final(&x, &emb, &fw, f, f)?, mb, spec))?;
        Ok((bound, loss))
    })?;
    probe_of(spec, g, (&sums, &kinks), (bound, loss, softmax))
}

/// The probe from the replay's S, loss and softmax amplification and its blocks' cancellation
/// and kink sums: each linear attention's `to_q` and `to_k` with its own, raised to what
/// reaches the tensors upstream ([`with_upstream`]).
fn probe_of(
    spec: &Spec,
    g: &SanaGeom,
    (sums, kinks): (&[Sums], &[KinkSums]),
    (score_bound, loss, softmax): (f64, f64, f64),
) -> Result<Probe> {
    let amplification = super::VerifyFamily::amplified_tensors(g, spec)?
        .into_iter()
        .zip(sums.iter().flat_map(|s| {
            let (aq, ak) = s.amplification();
            [aq, ak]
        }))
        .collect();
    let kink = super::VerifyFamily::amplified_tensors(g, spec)?
        .into_iter()
        .zip(kinks.iter().flat_map(|s| [s.q.errors(), s.k.errors()]))
        .collect();
    let amplification = with_upstream(spec, sana_qk_inputs, amplification, f64::max)?;
    let kink = with_upstream(spec, sana_qk_inputs, kink, |a: [f64; 3], b: [f64; 3]| {
        std::array::from_fn(|i| a[i].max(b[i]))
    })?;
    Ok(Probe {
        score_bound,
        loss,
        softmax,
        amplification,
        kink,
    })
}

/// The tensors of Sana block `i` that its linear attention's q and k are computed from, besides
/// the block's input stream and the embedded timestep: norm1's modulation (chunks 0 and 1 of
/// the block's `scale_shift_table` plus the timestep's, as the replay computes `h1` below).
fn sana_qk_inputs(i: u32) -> Vec<String> {
    vec![format!("transformer_blocks.{i}.scale_shift_table")]
}

impl super::VerifyFamily for SanaGeom {
    /// The ReLU linear self-attention: q, φ = ReLU, KV·φ(q) and z·φ(q), their ratio, `to_out`
    /// (5, as a softmax attention's); the softmax cross-attention (5); the Mix-FFN:
    /// conv_inverted → SiLU + depthwise conv → GLU → conv_point, one stage more than an MLP
    /// (the depthwise conv is a second sum between the two pointwise ones): 12. No key-bias
    /// sibling: `attn1` is the linear attention (its own cancellation, `cancellation.rs`).
    fn block_stages(&self, depth: u64) -> u64 {
        depth * (SOFTMAX_ATTENTION + SOFTMAX_ATTENTION + MLP + 1)
    }

    fn probe(&self, spec: &Spec, t: &Trainer, _seed: u64, batch: &Batch) -> Result<Probe> {
        score_bound(spec, t, self, batch)
    }

    /// The `to_q` and `to_k` of each block's linear attention.
    fn amplified_tensors(&self, spec: &Spec) -> Result<Vec<String>> {
        Ok((0..Dims::new(spec)?.depth)
            .flat_map(|i| ["to_q", "to_k"].map(|p| format!("transformer_blocks.{i}.attn1.{p}")))
            .collect())
    }

    fn qk_inputs(&self, block: u32) -> Vec<String> {
        sana_qk_inputs(block)
    }
}

// ---------------------------------------------------------------- the agreement grid

/// The Sana grid's base: [`ditmem_engine::families::sana::tiny_spec`] (2 blocks of 4 × 16-wide heads,
/// cross-attention 2 × 32 wide, Mix-FFN 160 wide, 64 image tokens on an 8×8 grid, 13 caption
/// tokens of width 48, batch 4) with an fp32 EMA, on this process's CPU.
pub(crate) fn sana_grid_base() -> crate::Result<Spec> {
    Ok(family_base(
        ditmem_engine::families::sana::tiny_spec(2, 4, 13)?,
        "sana-d2-h64",
    ))
}

/// The Sana agreement grid: the family policies but fp64 attention-only (the attention modes
/// are the softmax cross-attention's; the linear self-attention has one form) on the base,
/// then accumulation, odd caption lengths, an odd and non-square token grid (7×5: the
/// depthwise conv's borders), SGD without EMA, a block list, LoRA (the scripts' default
/// targets; and the Mix-FFN-free list `to_q, to_v` on bias-less projections) and a deeper
/// model with biased q/k/v.
pub fn sana_grid() -> crate::Result<Vec<(String, Spec)>> {
    let policies = &FAMILY_POLICIES[..FAMILY_POLICIES.len() - 1];
    let mut g = GridBuilder::new("sana", sana_grid_base()?, policies);
    g.vary(ACCUMULATION, accumulation)
        .vary("1 caption token", |s| text_tokens(s, &[1]))
        .vary(
            "300 caption tokens, batch 2, memory-efficient",
            text_tokens_batch2_me(&[300]),
        )
        .vary("224×160 (7×5 tokens), memory-efficient", |s| {
            s.workload.height = 224;
            s.workload.width = 160;
            memory_efficient(s);
        })
        .vary(SGD, sgd_without_ema);
    one_sample_blocks(&mut g, &[1]);
    g.vary("LoRA r4 (to_k, to_q, to_v, to_out.0), bf16-mixed", |s| {
        s.recipe.precision = Precision::Bf16Mixed;
        s.recipe.lora = lora(4, &[]);
    })
    .vary("LoRA r8 (to_q, to_v), fp32, recompute all", |s| {
        s.recipe.recompute = Recompute::All;
        s.recipe.lora = lora(8, &["to_q", "to_v"]);
    });
    let mut cfg = ditmem_engine::families::sana::tiny_config(4, 6);
    cfg.insert("attention_bias".into(), serde_json::Value::Bool(true));
    let mut deep = ditmem_budget::denoiser::with_family(Spec::small(), "sana-d4-h96", cfg)?;
    deep.workload.height = 256;
    deep.workload.width = 256;
    text_tokens(&mut deep, &[19]);
    deep.recipe.attention = AttentionMode::Materialized;
    g.model(
        "4 blocks × 6 heads (hidden 96), biased q/k/v, 19 tokens, every-2",
        deep,
        Some(Recompute::EveryK(2)),
    );
    Ok(g.finish())
}
