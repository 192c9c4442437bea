//! diffusers' DiT (`DiTTransformer2DModel`) in the conformance suite: its rounding stages, its
//! score probe and its agreement grid.

use candle_core::{DType, Device, Tensor};
use ditmem_budget::Spec;

use crate::agree::builder::{
    accumulation, family_base, larger_image, one_sample_blocks, sgd_without_ema, GridBuilder,
    ACCUMULATION, FAMILY_POLICIES, LARGER_IMAGE, SGD,
};
use crate::diffusion::Batch;
use crate::trainer::Trainer;
use crate::verify::chain::{MLP, SOFTMAX_ATTENTION};
use crate::verify::replay::{
    class_ids, e, linear, on_pool, pair_bound, shift_scale_ln, weights, F64Replay, Probe,
};
use crate::verify::Result;
use ditmem_budget::Recompute;
use ditmem_engine::families::dit_diffusers::{
    DitdGeom, DITD_BLOCK_LINEARS, DITD_EMB_LINEARS, DITD_LABEL_TABLE,
};

/// The score bound S for diffusers' DiT (`DiTTransformer2DModel`): its forward replayed in f64 as
/// `families/dit_diffusers/step.rs` runs it (every block's own embedder on the shared timestep
/// features and label rows, block 0's again for the output side), S over each block's
/// self-attention (PixArt's attn1 setup: separate biased q, k, v, no q/k norm).
fn score_bound(spec: &Spec, t: &Trainer, g: &DitdGeom, batch: &Batch) -> Result<(f64, f64, f64)> {
    use ditmem_engine::families::dit_diffusers::{
        combined_embedding, ditd_block_forward, final_forward as ditd_final,
        label_timestep_features, DitdBlockWeights, EmbWeights, DITD_FREQ,
    };
    let r = F64Replay::of(spec, t);
    let d = r.d;
    let (dev, f) = (Device::Cpu, DType::F64);
    let scale = crate::mutation::attention_scale(d.head_dim);
    let embed = linear(t, "pos_embed.proj")?;
    let pos = t.parameter("pos_embed.pos_embed")?;
    let emb_weights = |i: usize| -> Result<EmbWeights> {
        let p = format!("transformer_blocks.{i}");
        let [linear_1, linear_2] = weights(&p, DITD_EMB_LINEARS, |n| linear(t, n))?;
        Ok(EmbWeights {
            linear_1,
            linear_2,
            table: t.parameter(&format!("{p}.{DITD_LABEL_TABLE}"))?,
        })
    };
    let (p1, p2) = (linear(t, "proj_out_1")?, linear(t, "proj_out_2")?);
    r.over_microbatches(batch, |_, mb, softmax| {
        let b = mb.n;
        let (mut x, tf, ids) = on_pool(|| -> Result<(Tensor, Tensor, Tensor)> {
            let x = r.tokens(&embed, &r.noisy_patches(mb)?, b, Some(&pos))?;
            let tf = label_timestep_features(&mb.timesteps, DITD_FREQ, f, &dev)?;
            Ok((x, tf, class_ids(mb, Some(g.classes as u32))?))
        })?;
        let mut bound = 0.0f64;
        for i in 0..d.depth {
            let prefix = format!("transformer_blocks.{i}");
            let [norm1, q, k, v, o, fc1, fc2] =
                weights(&prefix, DITD_BLOCK_LINEARS, |n| linear(t, n))?;
            let bw = DitdBlockWeights {
                emb: emb_weights(i)?,
                norm1,
                q,
                k,
                v,
                o,
                fc1,
                fc2,
            };
            let (next, sb) = on_pool(|| -> Result<(Tensor, f64)> {
                // q and k of the self-attention as the block computes them.
                let emb = combined_embedding(&tf, &ids, &bw.emb, f)?;
                let modv = bw.norm1.forward(&emb.silu().map_err(e)?)?;
                let h1 = shift_scale_ln(&x, &modv)?;
                let (q, k) = (bw.q.forward(&h1)?, bw.k.forward(&h1)?);
                let sb = pair_bound(&q, &k, b, d.heads, scale, (softmax, 0))?;
                let out = ditd_block_forward(&x, &tf, &ids, &bw, &r.cfg, g.norm_eps)?;
                Ok((out, sb))
            })?;
            bound = bound.max(sb);
            x = next;
        }
        let w0 = emb_weights(0)?;
        let loss = on_pool(|| -> Result<f64> {
            let se0 = combined_embedding(&tf, &ids, &w0, f)?.silu().map_err(e)?;
            r.patch_loss(&ditd_final(&x, &se0, &p1, &p2, f, f)?, mb, spec)
        })?;
        Ok((bound, loss))
    })
}

impl super::VerifyFamily for DitdGeom {
    /// The same block as the DiT's with q, k, v as three linears (one stage beside each
    /// other); its per-block embedder feeds the modulation, beside the stream: 6.
    fn block_stages(&self, depth: u64) -> u64 {
        depth * (SOFTMAX_ATTENTION + MLP)
    }

    fn probe(&self, spec: &Spec, t: &Trainer, _seed: u64, batch: &Batch) -> Result<Probe> {
        score_bound(spec, t, self, batch).map(Probe::plain)
    }
}

// ---------------------------------------------------------------- the agreement grid

/// The diffusers DiT grid's base: [`ditmem_engine::families::dit_diffusers::tiny_spec`]
/// (`DiTTransformer2DModel`, 2 blocks of 4 × 16-wide heads, 64 tokens, batch 4) with an fp32
/// EMA, on this process's CPU.
pub(crate) fn dit_diffusers_grid_base() -> crate::Result<Spec> {
    Ok(family_base(
        ditmem_engine::families::dit_diffusers::tiny_spec(2, 4)?,
        "dit-diffusers-d2-h64",
    ))
}

/// The diffusers DiT agreement grid: the family policies on the base, then accumulation, a
/// larger image, SGD without EMA, a block list, one block, a deeper and wider model, and LoRA
/// (the defaults, and attention, feed-forward and output-side modules; the timestep embedders
/// are refused, see `DitdGeom::new`). Each spec runs in well under a second in release on 2
/// cores.
pub fn dit_diffusers_grid() -> crate::Result<Vec<(String, Spec)>> {
    use ditmem_engine::families::dit_diffusers::tiny_spec;
    use Recompute as R;
    let mut g = GridBuilder::new(
        "dit-diffusers",
        dit_diffusers_grid_base()?,
        &FAMILY_POLICIES,
    );
    g.vary(ACCUMULATION, accumulation)
        .vary(LARGER_IMAGE, larger_image)
        .vary(SGD, sgd_without_ema);
    one_sample_blocks(&mut g, &[1]);
    g.model("1 block × 2 heads (hidden 32)", tiny_spec(1, 2)?, None);
    g.model(
        "4 blocks × 6 heads (hidden 96), every-2",
        tiny_spec(4, 6)?,
        Some(R::EveryK(2)),
    );
    g.lora_custom(&["to_q", "to_v", "ff.net.2", "norm1.linear", "proj_out_1"]);
    Ok(g.finish())
}
