//! Sana in the conformance suite: its rounding stages, its score probe (with the cancellation and
//! ReLU kink of its linear attention's q and k gradients) and the tensors those reach.

use candle_core::{DType, Device, Tensor};
use ditmem_budget::Spec;

use crate::diffusion::Batch;
use crate::layers::{LinearW, LN_EPS};
use crate::model::{patchify, timestep_features, unpatchify, Dims};
use crate::ops::ln_modulate;
use crate::trainer::Trainer;
use crate::verify::cancellation::{add_sums, Sums};
use crate::verify::chain::{MLP, SOFTMAX_ATTENTION};
use crate::verify::kink::{add_kink_sums, KinkSums};
use crate::verify::replay::{amplification_of, e, mse_loss, on_pool, pair_bound, F64Replay, Probe};
use crate::verify::upstream::with_upstream;
use crate::verify::Result;
use ditmem_engine::families::sana::SanaGeom;

/// A Sana linear or 1×1 conv from the trainer's weights (as its (out, in) view), with a zero
/// bias where diffusers has none.
fn sana_linear(t: &Trainer, name: &str) -> Result<LinearW> {
    let w = t.parameter(&format!("{name}.weight"))?;
    let w = if w.rank() > 2 {
        w.flatten_from(1).map_err(e)?
    } else {
        w
    };
    let bname = format!("{name}.bias");
    let b = if t.trained_names().contains(&bname) {
        t.parameter(&bname)?
    } else {
        Tensor::zeros(w.dim(0).map_err(e)?, w.dtype(), &Device::Cpu).map_err(e)?
    };
    Ok(LinearW::new(w, b, None))
}

// Kept whole (> 100 lines): one forward replayed in the model's order (embed, blocks with their cancellation and kink sums, output side, loss) over shared locals.
/// The score bound S for Sana: its forward replayed in f64 (embed, blocks, output side), S over
/// the softmax cross-attention to the caption (the linear self-attention has no softmax).
fn score_bound(spec: &Spec, t: &Trainer, g: &SanaGeom, batch: &Batch) -> Result<Probe> {
    use crate::ops::gated_residual;
    use crate::ops::linear_attention::linear_attention;
    use ditmem_engine::families::sana::{
        caption_forward, final_forward as sana_final, sana_block_forward, SanaBlockGeom,
        SanaBlockWeights, SanaCaptionWeights, SanaFinalWeights, SANA_FREQ,
    };
    let F64Replay {
        d,
        micro,
        accum,
        acp,
        cfg,
    } = F64Replay::of(spec, t);
    let (dev, f) = (Device::Cpu, DType::F64);
    let geo = SanaBlockGeom {
        rows: d.rows,
        cols: d.cols,
        cross_heads: g.cross_heads,
    };
    let scale = crate::mutation::attention_scale(g.cross_width / g.cross_heads);
    let embed = sana_linear(t, "patch_embed.proj")?;
    let te = "time_embed.emb.timestep_embedder";
    let t1 = sana_linear(t, &format!("{te}.linear_1"))?;
    let t2 = sana_linear(t, &format!("{te}.linear_2"))?;
    let adaln = sana_linear(t, "time_embed.linear")?;
    let cw = SanaCaptionWeights {
        linear_1: sana_linear(t, "caption_projection.linear_1")?,
        linear_2: sana_linear(t, "caption_projection.linear_2")?,
        norm: t.parameter("caption_norm.weight")?,
    };
    let fw = SanaFinalWeights {
        table: t.parameter("scale_shift_table")?,
        proj_out: sana_linear(t, "proj_out")?,
    };
    let (h, s) = (d.hidden, d.tokens);
    let mut bound = 0.0f64;
    let softmax = std::sync::Mutex::new(1.0f64);
    let mut loss_sum = 0.0;
    let mut sums = vec![Sums::default(); d.depth];
    let mut kinks = vec![KinkSums::default(); d.depth];
    for m in 0..accum {
        let mb = batch.slice(m * micro, micro)?;
        let b = mb.n;
        let (mut x, emb, t6, y) = on_pool(|| -> Result<(Tensor, Tensor, Tensor, Tensor)> {
            let xt = mb.noisy(&acp, f, &dev)?;
            let xe = embed.forward(&patchify(&xt, &d)?)?;
            let x = xe.reshape((b, s, h)).map_err(e)?;
            let tf = timestep_features(&mb.timesteps, SANA_FREQ, f, &dev)?;
            let emb = t2.forward(&t1.forward(&tf)?.silu().map_err(e)?)?;
            let t6 = adaln.forward(&emb.silu().map_err(e)?)?;
            let y = caption_forward(&mb.text_tensor(f, &dev)?, &cw)?;
            Ok((x, emb, t6, y))
        })?;
        for (i, (block_total, kink_total)) in sums.iter_mut().zip(kinks.iter_mut()).enumerate() {
            let p = |n: &str| sana_linear(t, &format!("transformer_blocks.{i}.{n}"));
            let dp = |n: &str| t.parameter(&format!("transformer_blocks.{i}.ff.conv_depth.{n}"));
            let bw = SanaBlockWeights {
                table: t.parameter(&format!("transformer_blocks.{i}.scale_shift_table"))?,
                q1: p("attn1.to_q")?,
                k1: p("attn1.to_k")?,
                v1: p("attn1.to_v")?,
                o1: p("attn1.to_out.0")?,
                q2: p("attn2.to_q")?,
                k2: p("attn2.to_k")?,
                v2: p("attn2.to_v")?,
                o2: p("attn2.to_out.0")?,
                conv_inverted: p("ff.conv_inverted")?,
                conv_depth: (dp("weight")?, dp("bias")?),
                conv_point: p("ff.conv_point")?,
            };
            // What h carries into the block's q and k: the embedding, the earlier blocks' stages,
            // its norm; and the weight's own rounding (see kink.rs).
            let roundings = (3 + super::VerifyFamily::block_stages(g, i as u64)) as f64;
            let (next, sb, block_sums, block_kinks) =
                on_pool(|| -> Result<(Tensor, f64, Sums, KinkSums)> {
                    // q and k of the cross-attention as the block computes them.
                    let modv = t6
                        .broadcast_add(&bw.table.reshape((1, 6 * h)).map_err(e)?)
                        .map_err(e)?;
                    let chunk = |k: usize| modv.narrow(1, k * h, h).map_err(e);
                    let h1 = ln_modulate(&x, &chunk(0)?, &chunk(1)?, LN_EPS, f).map_err(e)?;
                    let (q, k, v) = (
                        bw.q1.forward(&h1)?,
                        bw.k1.forward(&h1)?,
                        bw.v1.forward(&h1)?,
                    );
                    // The linear attention's cancellation, on the same q, k, v.
                    let mut block_sums = Sums::default();
                    let flat = |t: &Tensor| -> Result<Vec<f64>> {
                        t.flatten_all().and_then(|v| v.to_vec1()).map_err(e)
                    };
                    let qkv = (&flat(&q)?[..], &flat(&k)?[..], &flat(&v)?[..]);
                    let geom = (b, s, d.heads, h / d.heads);
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
                    let o = linear_attention(&q, &k, &v, b, d.heads).map_err(e)?;
                    let x1 = gated_residual(&x, &bw.o1.forward(&o)?, &chunk(2)?).map_err(e)?;
                    let q2 = bw.q2.forward(&x1.reshape((b * s, h)).map_err(e)?)?;
                    let sb = pair_bound(
                        &q2,
                        &bw.k2.forward(&y)?,
                        b,
                        g.cross_heads,
                        scale,
                        (&softmax, 0),
                    )?;
                    Ok((
                        sana_block_forward(&x, &t6, &y, &bw, &cfg, &geo)?,
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
        loss_sum += on_pool(|| -> Result<f64> {
            let out = sana_final(&x, &emb, &fw, f, f)?;
            let pred = unpatchify(&out, b, &d)?
                .narrow(1, 0, d.in_channels)
                .map_err(e)?;
            mse_loss(pred, &mb, &acp, spec)
        })?;
    }
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
        score_bound: bound,
        loss: loss_sum / accum as f64,
        softmax: amplification_of(softmax),
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
