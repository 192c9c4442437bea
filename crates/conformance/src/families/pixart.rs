//! PixArt in the conformance suite: its rounding stages, its key biases' query siblings and its
//! score probe.

use candle_core::{DType, Device, Tensor};
use ditmem_budget::Spec;

use crate::diffusion::Batch;
use crate::layers::{LinearW, LN_EPS};
use crate::model::{patchify, timestep_features, unpatchify};
use crate::ops::ln_modulate;
use crate::trainer::Trainer;
use crate::verify::chain::{MLP, SOFTMAX_ATTENTION};
use crate::verify::key_bias::SELF_ATTENTION;
use crate::verify::replay::{
    amplification_of, e, linear, mse_loss, on_pool, pair_bound, F64Replay, Probe,
};
use crate::verify::Result;
use ditmem_engine::families::pixart::PixartGeom;

// Kept whole (> 100 lines): one forward replayed in the model's order (embed, blocks, output side, loss) over shared locals; pieces would each take them all.
/// The score bound S for PixArt: its forward replayed in f64 (embed, blocks, output side), S over
/// both the self-attention and the cross-attention to the caption.
fn score_bound(spec: &Spec, t: &Trainer, g: &PixartGeom, batch: &Batch) -> Result<(f64, f64, f64)> {
    use crate::ops::gated_residual;
    use ditmem_engine::families::pixart::{
        caption_forward, final_forward as pixart_final, pixart_block_forward, CaptionWeights,
        PixartBlockWeights, PixartFinalWeights,
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
    let te = "adaln_single.emb.timestep_embedder";
    let t1 = linear(t, &format!("{te}.linear_1"))?;
    let t2 = linear(t, &format!("{te}.linear_2"))?;
    let adaln = linear(t, "adaln_single.linear")?;
    // PixArt-α's resolution and aspect-ratio embedders (`families/pixart/step.rs`).
    let sizes = match g.sizes {
        Some(hw) => {
            let l = |e: &str, k: u8| linear(t, &format!("adaln_single.emb.{e}.linear_{k}"));
            let [r, a] = ditmem_engine::families::pixart::params::SIZE_EMBEDDERS;
            Some((hw, [l(r, 1)?, l(r, 2)?, l(a, 1)?, l(a, 2)?]))
        }
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
    let (h, s) = (d.hidden, d.tokens);
    let mut bound = 0.0f64;
    let softmax = std::sync::Mutex::new(1.0f64);
    let mut loss_sum = 0.0;
    for m in 0..accum {
        let mb = batch.slice(m * micro, micro)?;
        let b = mb.n;
        let (mut x, emb, t6, y) = on_pool(|| -> Result<(Tensor, Tensor, Tensor, Tensor)> {
            let xt = mb.noisy(&acp, f, &dev)?;
            let xe = embed.forward(&patchify(&xt, &d)?)?;
            let x = xe
                .reshape((b, s, h))
                .and_then(|x| x.broadcast_add(&pos))
                .map_err(e)?;
            let tf = timestep_features(&mb.timesteps, 256, f, &dev)?;
            let mut emb = t2.forward(&t1.forward(&tf)?.silu().map_err(e)?)?;
            if let Some(((hp, wp), [r1, r2, a1, a2])) = &sizes {
                let mlp = |l1: &LinearW, l2: &LinearW, v: &[f64]| -> Result<Tensor> {
                    let x = crate::model::sinusoid_features(v, 256, f, &dev)?;
                    Ok(l2.forward(&l1.forward(&x)?.silu().map_err(e)?)?)
                };
                let (hp, wp) = (f64::from(*hp), f64::from(*wp));
                let res: Vec<f64> = (0..b).flat_map(|_| [hp, wp]).collect();
                let r = mlp(r1, r2, &res)?.reshape((b, 2 * (h / 3))).map_err(e)?;
                let a = mlp(a1, a2, &vec![hp / wp; b])?;
                emb = emb.add(&Tensor::cat(&[&r, &a], 1).map_err(e)?).map_err(e)?;
            }
            let t6 = adaln.forward(&emb.silu().map_err(e)?)?;
            let cap = mb.text_tensor(f, &dev)?;
            let y = match &cw {
                Some(cw) => caption_forward(&cap, cw)?,
                None => cap,
            };
            Ok((x, emb, t6, y))
        })?;
        for i in 0..d.depth {
            let p = |n: &str| linear(t, &format!("transformer_blocks.{i}.{n}"));
            let bw = PixartBlockWeights {
                table: t.parameter(&format!("transformer_blocks.{i}.scale_shift_table"))?,
                q1: p("attn1.to_q")?,
                k1: p("attn1.to_k")?,
                v1: p("attn1.to_v")?,
                o1: p("attn1.to_out.0")?,
                q2: p("attn2.to_q")?,
                k2: p("attn2.to_k")?,
                v2: p("attn2.to_v")?,
                o2: p("attn2.to_out.0")?,
                fc1: p("ff.net.0.proj")?,
                fc2: p("ff.net.2")?,
            };
            let (next, sb) = on_pool(|| -> Result<(Tensor, f64)> {
                // q and k of both attentions as the block computes them.
                let modv = t6
                    .broadcast_add(&bw.table.reshape((1, 6 * h)).map_err(e)?)
                    .map_err(e)?;
                let chunk = |k: usize| modv.narrow(1, k * h, h).map_err(e);
                let h1 = ln_modulate(&x, &chunk(0)?, &chunk(1)?, LN_EPS, f).map_err(e)?;
                let q = bw.q1.forward(&h1)?;
                let (k, v) = (bw.k1.forward(&h1)?, bw.v1.forward(&h1)?);
                let sb1 = pair_bound(&q, &k, b, d.heads, scale, (&softmax, 0))?;
                let o = crate::ops::attention::separate::attention(
                    &q,
                    &k,
                    &v,
                    b,
                    d.heads,
                    crate::ops::AttnKeep::Nothing,
                )
                .map_err(e)?;
                let x1 = gated_residual(&x, &bw.o1.forward(&o)?, &chunk(2)?).map_err(e)?;
                let q2 = bw.q2.forward(&x1.reshape((b * s, h)).map_err(e)?)?;
                let sb2 = pair_bound(&q2, &bw.k2.forward(&y)?, b, d.heads, scale, (&softmax, 0))?;
                Ok((pixart_block_forward(&x, &t6, &y, &bw, &cfg)?, sb1.max(sb2)))
            })?;
            bound = bound.max(sb);
            x = next;
        }
        loss_sum += on_pool(|| -> Result<f64> {
            let out = pixart_final(&x, &emb, &fw, f, f)?;
            let pred = unpatchify(&out, b, &d)?
                .narrow(1, 0, d.in_channels)
                .map_err(e)?;
            mse_loss(pred, &mb, &acp, spec)
        })?;
    }
    Ok((bound, loss_sum / accum as f64, amplification_of(softmax)))
}

impl super::VerifyFamily for PixartGeom {
    /// Self-attention, then the cross-attention whose query is its output, then the MLP: 11.
    fn block_stages(&self, depth: u64) -> u64 {
        depth * (2 * SOFTMAX_ATTENTION + MLP)
    }

    /// `attn1`'s key biases: a self-attention (the cross-attention's key bias gets an exact
    /// zero gradient instead, `ditmem_engine::families::zero_gradient`).
    fn key_bias_pairs(&self, name: &str) -> &'static [(&'static str, &'static str)] {
        if name.contains(".attn1.") {
            SELF_ATTENTION
        } else {
            &[]
        }
    }

    fn probe(&self, spec: &Spec, t: &Trainer, _seed: u64, batch: &Batch) -> Result<Probe> {
        score_bound(spec, t, self, batch).map(Probe::plain)
    }
}
