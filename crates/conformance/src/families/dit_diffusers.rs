//! diffusers' DiT (`DiTTransformer2DModel`) in the conformance suite: its rounding stages and its
//! score probe.

use candle_core::{DType, Device, Tensor};
use ditmem_budget::Spec;

use crate::diffusion::Batch;
use crate::layers::{LinearW, LN_EPS};
use crate::model::{patchify, unpatchify};
use crate::ops::ln_modulate;
use crate::trainer::Trainer;
use crate::verify::chain::{MLP, SOFTMAX_ATTENTION};
use crate::verify::replay::{
    amplification_of, e, linear, mse_loss, on_pool, pair_bound, F64Replay, Probe,
};
use crate::verify::Result;
use ditmem_engine::families::dit_diffusers::DitdGeom;

/// The score bound S for diffusers' DiT (`DiTTransformer2DModel`): its forward replayed in f64 as
/// `families/dit_diffusers/step.rs` runs it (every block's own embedder on the shared timestep
/// features and label rows, block 0's again for the output side), S over each block's
/// self-attention (PixArt's attn1 setup: separate biased q, k, v, no q/k norm).
fn score_bound(spec: &Spec, t: &Trainer, g: &DitdGeom, batch: &Batch) -> Result<(f64, f64, f64)> {
    use ditmem_engine::families::dit_diffusers::{
        combined_embedding, ditd_block_forward, final_forward as ditd_final,
        label_timestep_features, DitdBlockWeights, EmbWeights, DITD_FREQ,
    };
    let F64Replay {
        d,
        micro,
        accum,
        acp,
        cfg,
    } = F64Replay::of(spec, t);
    let (dev, f) = (Device::Cpu, DType::F64);
    let scale = crate::mutation::attention_scale(d.head_dim);
    let conv = t
        .parameter("pos_embed.proj.weight")?
        .flatten_from(1)
        .map_err(e)?;
    let embed = LinearW::new(conv, t.parameter("pos_embed.proj.bias")?, None);
    let pos = t.parameter("pos_embed.pos_embed")?;
    let emb_weights = |i: usize| -> Result<EmbWeights> {
        let p = format!("transformer_blocks.{i}.norm1.emb");
        Ok(EmbWeights {
            linear_1: linear(t, &format!("{p}.timestep_embedder.linear_1"))?,
            linear_2: linear(t, &format!("{p}.timestep_embedder.linear_2"))?,
            table: t.parameter(&format!("{p}.class_embedder.embedding_table.weight"))?,
        })
    };
    let (p1, p2) = (linear(t, "proj_out_1")?, linear(t, "proj_out_2")?);
    let (h, s) = (d.hidden, d.tokens);
    let mut bound = 0.0f64;
    let softmax = std::sync::Mutex::new(1.0f64);
    let mut loss_sum = 0.0;
    for m in 0..accum {
        let mb = batch.slice(m * micro, micro)?;
        let b = mb.n;
        let (mut x, tf, ids) = on_pool(|| -> Result<(Tensor, Tensor, Tensor)> {
            let xt = mb.noisy(&acp, f, &dev)?;
            let xe = embed.forward(&patchify(&xt, &d)?)?;
            let x = xe
                .reshape((b, s, h))
                .and_then(|x| x.broadcast_add(&pos))
                .map_err(e)?;
            let tf = label_timestep_features(&mb.timesteps, DITD_FREQ, f, &dev)?;
            let null = g.classes as u32;
            let ids: Vec<u32> = mb
                .labels
                .iter()
                .zip(&mb.drop_label)
                .map(|(&y, &drop)| if drop { null } else { y })
                .collect();
            Ok((x, tf, Tensor::from_vec(ids, b, &dev).map_err(e)?))
        })?;
        for i in 0..d.depth {
            let p = |n: &str| linear(t, &format!("transformer_blocks.{i}.{n}"));
            let bw = DitdBlockWeights {
                emb: emb_weights(i)?,
                norm1: p("norm1.linear")?,
                q: p("attn1.to_q")?,
                k: p("attn1.to_k")?,
                v: p("attn1.to_v")?,
                o: p("attn1.to_out.0")?,
                fc1: p("ff.net.0.proj")?,
                fc2: p("ff.net.2")?,
            };
            let (next, sb) = on_pool(|| -> Result<(Tensor, f64)> {
                // q and k of the self-attention as the block computes them.
                let emb = combined_embedding(&tf, &ids, &bw.emb, f)?;
                let modv = bw.norm1.forward(&emb.silu().map_err(e)?)?;
                let chunk = |k: usize| modv.narrow(1, k * h, h).map_err(e);
                let h1 = ln_modulate(&x, &chunk(0)?, &chunk(1)?, LN_EPS, f).map_err(e)?;
                let (q, k) = (bw.q.forward(&h1)?, bw.k.forward(&h1)?);
                let sb = pair_bound(&q, &k, b, d.heads, scale, (&softmax, 0))?;
                let out = ditd_block_forward(&x, &tf, &ids, &bw, &cfg, g.norm_eps)?;
                Ok((out, sb))
            })?;
            bound = bound.max(sb);
            x = next;
        }
        let w0 = emb_weights(0)?;
        loss_sum += on_pool(|| -> Result<f64> {
            let se0 = combined_embedding(&tf, &ids, &w0, f)?.silu().map_err(e)?;
            let out = ditd_final(&x, &se0, &p1, &p2, f, f)?;
            let pred = unpatchify(&out, b, &d)?
                .narrow(1, 0, d.in_channels)
                .map_err(e)?;
            mse_loss(pred, &mb, &acp, spec)
        })?;
    }
    Ok((bound, loss_sum / accum as f64, amplification_of(softmax)))
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
