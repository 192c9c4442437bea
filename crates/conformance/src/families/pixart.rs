//! PixArt in the conformance suite: its rounding stages, its key biases' query siblings, its
//! score probe and its agreement grid.

use candle_core::{DType, Device, Tensor};
use ditmem_budget::Spec;

use super::family::KeyBiasAttentions;
use crate::agree::builder::{
    accumulation, batch, family_base, larger_image, one_sample_blocks, sgd_without_ema,
    text_tokens, text_tokens_batch2_me, text_tokens_me, GridBuilder, ACCUMULATION, FAMILY_POLICIES,
    LARGER_IMAGE, SGD,
};
use crate::diffusion::Batch;
use crate::layers::LinearW;
use crate::model::timestep_features;
use crate::trainer::Trainer;
use crate::verify::chain::{MLP, SOFTMAX_ATTENTION};
use crate::verify::key_bias::SELF_ATTENTION;
use crate::verify::replay::{
    cross_query, e, linear, mlp_linears, on_pool, pair_bound, shift_scale_ln, silu_mlp,
    table_modulation, weights, F64Replay, Probe,
};
use crate::verify::Result;
use ditmem_budget::Recompute;
use ditmem_engine::families::pixart::{PixartGeom, PIXART_BLOCK_LINEARS};

/// PixArt-α's resolution and aspect-ratio embedders (`families/pixart/step.rs`): the latent's
/// (height, width) in patches and the two embedders' linears.
struct SizeEmbedders {
    hw: (u32, u32),
    /// The resolution embedder's linear_1, linear_2, then the aspect ratio's.
    linears: [LinearW; 4],
}

impl SizeEmbedders {
    fn of(t: &Trainer, hw: (u32, u32)) -> Result<SizeEmbedders> {
        let l = |e: &str, k: u8| linear(t, &format!("adaln_single.emb.{e}.linear_{k}"));
        let [r, a] = ditmem_engine::families::pixart::params::SIZE_EMBEDDERS;
        Ok(SizeEmbedders {
            hw,
            linears: [l(r, 1)?, l(r, 2)?, l(a, 1)?, l(a, 2)?],
        })
    }

    /// The conditions added to the embedded timestep of `b` samples, (b, D) for hidden `h`:
    /// [resolution (2·D/3); aspect ratio (D/3)].
    fn embedding(&self, b: usize, h: usize) -> Result<Tensor> {
        let (f, dev) = (DType::F64, Device::Cpu);
        let [r1, r2, a1, a2] = &self.linears;
        let mlp = |l1: &LinearW, l2: &LinearW, v: &[f64]| -> Result<Tensor> {
            let x = crate::model::sinusoid_features(v, 256, f, &dev)?;
            Ok(silu_mlp(&x, l1, l2)?)
        };
        let (hp, wp) = (f64::from(self.hw.0), f64::from(self.hw.1));
        let res: Vec<f64> = (0..b).flat_map(|_| [hp, wp]).collect();
        let r = mlp(r1, r2, &res)?.reshape((b, 2 * (h / 3))).map_err(e)?;
        let a = mlp(a1, a2, &vec![hp / wp; b])?;
        Tensor::cat(&[&r, &a], 1).map_err(e)
    }
}

/// The score bound S for PixArt: its forward replayed in f64 (embed, blocks, output side), S over
/// both the self-attention and the cross-attention to the caption.
fn score_bound(spec: &Spec, t: &Trainer, g: &PixartGeom, batch: &Batch) -> Result<(f64, f64, f64)> {
    use ditmem_engine::families::pixart::{
        caption_forward, final_forward as pixart_final, pixart_block_forward, CaptionWeights,
        PixartBlockWeights, PixartFinalWeights,
    };
    let r = F64Replay::of(spec, t);
    let d = r.d;
    let (dev, f) = (Device::Cpu, DType::F64);
    let scale = crate::mutation::attention_scale(d.head_dim);
    let embed = linear(t, "pos_embed.proj")?;
    let [t1, t2] = mlp_linears("adaln_single.emb.timestep_embedder", |n| linear(t, n))?;
    let adaln = linear(t, "adaln_single.linear")?;
    let sizes = match g.sizes {
        Some(hw) => Some(SizeEmbedders::of(t, hw)?),
        None => None,
    };
    let cw = if g.caption_projection {
        Some(CaptionWeights {
            linear_1: linear(t, "caption_projection.linear_1")?,
            linear_2: linear(t, "caption_projection.linear_2")?,
        })
    } else {
        None
    };
    let pos = t.parameter("pos_embed.pos_embed")?;
    let fw = PixartFinalWeights {
        table: t.parameter("scale_shift_table")?,
        proj_out: linear(t, "proj_out")?,
    };
    let h = d.hidden;
    r.over_microbatches(batch, |_, mb, softmax| {
        let b = mb.n;
        let (mut x, emb, t6, y) = on_pool(|| -> Result<(Tensor, Tensor, Tensor, Tensor)> {
            let x = r.tokens(&embed, &r.noisy_patches(mb)?, b, Some(&pos))?;
            let tf = timestep_features(&mb.timesteps, 256, f, &dev)?;
            let mut emb = silu_mlp(&tf, &t1, &t2)?;
            if let Some(sizes) = &sizes {
                emb = emb.add(&sizes.embedding(b, h)?).map_err(e)?;
            }
            let t6 = adaln.forward(&emb.silu().map_err(e)?)?;
            let cap = mb.text_tensor(f, &dev)?;
            let y = match &cw {
                Some(cw) => caption_forward(&cap, cw)?,
                None => cap,
            };
            Ok((x, emb, t6, y))
        })?;
        let mut bound = 0.0f64;
        for i in 0..d.depth {
            let prefix = format!("transformer_blocks.{i}");
            let [q1, k1, v1, o1, q2, k2, v2, o2, fc1, fc2] =
                weights(&prefix, PIXART_BLOCK_LINEARS, |n| linear(t, n))?;
            let bw = PixartBlockWeights::new(
                t.parameter(&format!("{prefix}.scale_shift_table"))?,
                [q1, k1, v1, o1, q2, k2, v2, o2],
                [fc1, fc2],
            );
            let (next, sb) = on_pool(|| -> Result<(Tensor, f64)> {
                // q and k of both attentions as the block computes them.
                let modv = table_modulation(&t6, &bw.table)?;
                let h1 = shift_scale_ln(&x, &modv)?;
                let q = bw.q1.forward(&h1)?;
                let (k, v) = (bw.k1.forward(&h1)?, bw.v1.forward(&h1)?);
                let sb1 = pair_bound(&q, &k, b, d.heads, scale, (softmax, 0))?;
                let o = crate::ops::attention::separate::attention(
                    &q,
                    &k,
                    &v,
                    b,
                    d.heads,
                    crate::ops::AttnKeep::Nothing,
                )
                .map_err(e)?;
                let gate = modv.narrow(1, 2 * h, h).map_err(e)?;
                let q2 = cross_query(&x, &o, (&bw.o1, &gate), &bw.q2)?;
                let sb2 = pair_bound(&q2, &bw.k2.forward(&y)?, b, d.heads, scale, (softmax, 0))?;
                Ok((
                    pixart_block_forward(&x, &t6, &y, &bw, &r.cfg)?,
                    sb1.max(sb2),
                ))
            })?;
            bound = bound.max(sb);
            x = next;
        }
        let loss = on_pool(|| r.patch_loss(&pixart_final(&x, &emb, &fw, f, f)?, mb, spec))?;
        Ok((bound, loss))
    })
}

impl super::VerifyFamily for PixartGeom {
    /// Self-attention, then the cross-attention whose query is its output, then the MLP: 11.
    fn block_stages(&self, depth: u64) -> u64 {
        depth * (2 * SOFTMAX_ATTENTION + MLP)
    }

    /// `attn1`'s key biases: a self-attention (the cross-attention's key bias gets an exact
    /// zero gradient instead, `ditmem_engine::families::zero_gradient`).
    fn key_bias_attentions(&self) -> KeyBiasAttentions {
        &[(".attn1.", SELF_ATTENTION)]
    }

    fn probe(&self, spec: &Spec, t: &Trainer, _seed: u64, batch: &Batch) -> Result<Probe> {
        score_bound(spec, t, self, batch).map(Probe::plain)
    }
}

// ---------------------------------------------------------------- the agreement grid

/// The PixArt grid's base: [`ditmem_engine::families::pixart::tiny_spec`] (2 blocks of 4 × 16-wide heads,
/// 64 image tokens, 13 caption tokens of width 32, batch 4) with an fp32 EMA, on this process's
/// CPU.
pub fn pixart_grid_base() -> crate::Result<Spec> {
    Ok(family_base(
        ditmem_engine::families::pixart::tiny_spec(2, 4, 13)?,
        "pixart-d2-h64",
    ))
}

/// The PixArt agreement grid: the family policies on the base, then accumulation, odd caption
/// lengths (1, 77 and 300 tokens: more keys than a streaming block; 300 in both attention
/// modes), a larger image, SGD without EMA, a block list and a deeper and wider model. Each
/// spec runs in well under a second in release on 2 cores.
pub fn pixart_grid() -> crate::Result<Vec<(String, Spec)>> {
    let mut g = GridBuilder::new("pixart", pixart_grid_base()?, &FAMILY_POLICIES);
    g.vary(ACCUMULATION, accumulation)
        .vary("1 caption token", |s| text_tokens(s, &[1]))
        .vary("77 caption tokens, memory-efficient", text_tokens_me(&[77]))
        .vary(
            "300 caption tokens, batch 2, memory-efficient",
            text_tokens_batch2_me(&[300]),
        )
        .vary("300 caption tokens, batch 2", |s| {
            text_tokens(s, &[300]);
            batch(s, 2);
        })
        .vary(LARGER_IMAGE, larger_image)
        .vary(SGD, sgd_without_ema);
    one_sample_blocks(&mut g, &[1]);
    g.model(
        "4 blocks × 6 heads (hidden 96), 19 tokens, every-2",
        ditmem_engine::families::pixart::tiny_spec(4, 6, 19)?,
        Some(Recompute::EveryK(2)),
    );
    g.lora();
    Ok(g.finish())
}
