//! The original DiT (facebookresearch/DiT `models.py`) in the conformance suite: its rounding
//! stages and its score probe, the f64 replay of its first forward.

use candle_core::{DType, Device, Tensor};
use ditmem_budget::Spec;
use ditmem_engine::families::dit::{
    block_forward, final_forward, BlockSeeds, BlockWeights, FinalWeights,
};

use crate::diffusion::{alphas_cumprod, Batch};
use crate::layers::{AttnImpl, BlockConfig, LN_EPS};
use crate::model::{patchify, timestep_features, unpatchify, Dims};
use crate::ops::ln_modulate;
use crate::rng::derive_seed;
use crate::trainer::Trainer;
use crate::verify::chain::{MLP, SOFTMAX_ATTENTION};
use crate::verify::replay::{add_softmax, amplification_of, e, linear, mse_loss, on_pool, Probe};
use crate::verify::softmax::Layout as SoftmaxLayout;
use crate::verify::Result;

// Kept whole (> 100 lines): one forward replayed in the model's order (embed, blocks, output side, loss) over shared locals; pieces would each take them all.
/// S of the DiT's first step and the replay's loss.
fn score_bound(spec: &Spec, t: &Trainer, seed: u64, batch: &Batch) -> Result<(f64, f64, f64)> {
    let d: Dims = *t.dims();
    let dev = Device::Cpu;
    let f = DType::F64;
    let w = &spec.workload;
    let (micro, accum) = (w.microbatch as usize, w.accumulation as usize);
    let acp = alphas_cumprod();
    let cfg = BlockConfig {
        hidden: d.hidden,
        heads: d.heads,
        head_dim: d.head_dim,
        compute: f,
        accum: f,
        attn: AttnImpl::Materialized,
        attn_dropout: spec.model.attn_dropout,
        mlp_dropout: spec.model.mlp_dropout,
    };
    let scale = crate::mutation::attention_scale(d.head_dim);
    let embed = linear(t, "x_embedder.proj")?;
    let t0 = linear(t, "t_embedder.mlp.0")?;
    let t2 = linear(t, "t_embedder.mlp.2")?;
    let pos = t.parameter("pos_embed")?;
    let table = t.parameter("y_embedder.embedding_table.weight")?;
    let fw = FinalWeights {
        adaln: linear(t, "final_layer.adaLN_modulation.1")?,
        linear: linear(t, "final_layer.linear")?,
    };
    let (h, dh, s) = (d.hidden, d.head_dim, d.tokens);
    let mut bound = 0.0f64;
    let softmax = std::sync::Mutex::new(1.0f64);
    let mut loss_sum = 0.0;
    for m in 0..accum {
        let mb = batch.slice(m * micro, micro)?;
        let b = mb.n;
        let (mut x, c) = on_pool(|| -> Result<(Tensor, Tensor)> {
            let xt = mb.noisy(&acp, f, &dev)?;
            let xe = embed.forward(&patchify(&xt, &d)?)?;
            let x = xe
                .reshape((b, s, h))
                .and_then(|x| x.broadcast_add(&pos))
                .map_err(e)?;
            let tf = timestep_features(&mb.timesteps, d.freq, f, &dev)?;
            let temb = t2.forward(&t0.forward(&tf)?.silu().map_err(e)?)?;
            let ids: Vec<u32> = mb
                .labels
                .iter()
                .zip(&mb.drop_label)
                .map(|(&y, &drop)| {
                    if drop && d.label_rows > d.num_classes {
                        d.num_classes as u32
                    } else {
                        y
                    }
                })
                .collect();
            let ids = Tensor::from_vec(ids, b, &dev).map_err(e)?;
            let c = (temb + table.index_select(&ids, 0).map_err(e)?).map_err(e)?;
            Ok((x, c))
        })?;
        for i in 0..d.depth {
            // One block's weight copies at a time, made here (the trainer stays on this thread).
            let p = |n: &str| linear(t, &format!("blocks.{i}.{n}"));
            let bw = BlockWeights {
                adaln: p("adaLN_modulation.1")?,
                qkv: p("attn.qkv")?,
                proj: p("attn.proj")?,
                fc1: p("mlp.fc1")?,
                fc2: p("mlp.fc2")?,
            };
            let seeds = BlockSeeds {
                attn: derive_seed(seed, &[0, m as u64, i as u64, 1]),
                mlp: derive_seed(seed, &[0, m as u64, i as u64, 2]),
            };
            let (next, sb) = on_pool(|| -> Result<(Tensor, f64)> {
                // q and k as the block computes them: LN(x)·(1 + scale) + shift, then qkv.
                let modv = bw.adaln.forward(&c.silu().map_err(e)?)?;
                let (shift, sc) = (
                    modv.narrow(1, 0, h).map_err(e)?,
                    modv.narrow(1, h, h).map_err(e)?,
                );
                let h1 = ln_modulate(&x, &shift, &sc, LN_EPS, f).map_err(e)?;
                let qkv: Vec<f64> = bw
                    .qkv
                    .forward(&h1)?
                    .flatten_all()
                    .and_then(|v| v.to_vec1())
                    .map_err(e)?;
                let mut sb = 0.0f64;
                for bi in 0..b {
                    for hd in 0..d.heads {
                        let largest = |which: usize| {
                            (0..s)
                                .map(|r| {
                                    let at = (bi * s + r) * 3 * h + which * h + hd * dh;
                                    qkv[at..at + dh].iter().map(|v| v * v).sum::<f64>()
                                })
                                .fold(0.0f64, f64::max)
                                .sqrt()
                        };
                        sb = sb.max(scale.abs() * largest(0) * largest(1));
                    }
                }
                let layout = SoftmaxLayout {
                    b,
                    sq: s,
                    sk: s,
                    heads: d.heads,
                    dh,
                    q_stride: 3 * h,
                    k_stride: 3 * h,
                };
                add_softmax((&qkv, &qkv[h..]), layout, 0, scale, &softmax);
                Ok((block_forward(&x, &c, &bw, &cfg, seeds)?, sb))
            })?;
            bound = bound.max(sb);
            x = next;
        }
        loss_sum += on_pool(|| -> Result<f64> {
            let out = final_forward(&x, &c, &fw, f, f)?;
            let pred = unpatchify(&out, b, &d)?
                .narrow(1, 0, d.in_channels)
                .map_err(e)?;
            mse_loss(pred, &mb, &acp, spec)
        })?;
    }
    Ok((bound, loss_sum / accum as f64, amplification_of(softmax)))
}

/// The original DiT (no geometry beyond its dims).
pub(crate) struct Dit;

impl super::VerifyFamily for Dit {
    /// qkv, q·kᵀ, softmax, P·v, proj; the MLP: 6 per block (the calibration's count).
    fn block_stages(&self, depth: u64) -> u64 {
        depth * (SOFTMAX_ATTENTION + MLP)
    }

    fn probe(&self, spec: &Spec, t: &Trainer, seed: u64, batch: &Batch) -> Result<Probe> {
        score_bound(spec, t, seed, batch).map(Probe::plain)
    }
}
