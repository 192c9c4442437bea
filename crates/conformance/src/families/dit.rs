//! The original DiT (facebookresearch/DiT `models.py`) in the conformance suite: its rounding
//! stages and its score probe, the f64 replay of its first forward.

use candle_core::{DType, Device, Tensor};
use ditmem_budget::Spec;
use ditmem_engine::families::dit::{
    block_forward, final_forward, BlockSeeds, BlockWeights, FinalWeights,
};

use crate::diffusion::Batch;
use crate::model::timestep_features;
use crate::rng::derive_seed;
use crate::trainer::Trainer;
use crate::verify::chain::{MLP, SOFTMAX_ATTENTION};
use crate::verify::replay::{
    class_ids, e, linear, on_pool, shift_scale_ln, silu_mlp, strided_bound, weights, F64Replay,
    Probe,
};
use crate::verify::softmax::Layout as SoftmaxLayout;
use crate::verify::Result;

/// S of the DiT's first step and the replay's loss.
fn score_bound(spec: &Spec, t: &Trainer, seed: u64, batch: &Batch) -> Result<(f64, f64, f64)> {
    let mut r = F64Replay::of(spec, t);
    // The original DiT's replay keeps the spec's dropout: its masks come from the step's seeds.
    r.cfg.attn_dropout = spec.model.attn_dropout;
    r.cfg.mlp_dropout = spec.model.mlp_dropout;
    let d = r.d;
    let (dev, f) = (Device::Cpu, DType::F64);
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
    let (h, s) = (d.hidden, d.tokens);
    // A dropped label's row: the null class, where the table has one.
    let null = (d.label_rows > d.num_classes).then_some(d.num_classes as u32);
    r.over_microbatches(batch, |m, mb, softmax| {
        let b = mb.n;
        let (mut x, c) = on_pool(|| -> Result<(Tensor, Tensor)> {
            let x = r.tokens(&embed, &r.noisy_patches(mb)?, b, Some(&pos))?;
            let tf = timestep_features(&mb.timesteps, d.freq, f, &dev)?;
            let temb = silu_mlp(&tf, &t0, &t2)?;
            let ids = class_ids(mb, null)?;
            let c = (temb + table.index_select(&ids, 0).map_err(e)?).map_err(e)?;
            Ok((x, c))
        })?;
        let mut bound = 0.0f64;
        for i in 0..d.depth {
            // One block's weight copies at a time, made here (the trainer stays on this thread).
            let [adaln, qkv, proj, fc1, fc2] = weights(
                &format!("blocks.{i}"),
                [
                    "adaLN_modulation.1",
                    "attn.qkv",
                    "attn.proj",
                    "mlp.fc1",
                    "mlp.fc2",
                ],
                |n| linear(t, n),
            )?;
            let bw = BlockWeights {
                adaln,
                qkv,
                proj,
                fc1,
                fc2,
            };
            let seeds = BlockSeeds {
                attn: derive_seed(seed, &[0, m as u64, i as u64, 1]),
                mlp: derive_seed(seed, &[0, m as u64, i as u64, 2]),
            };
            let (next, sb) = on_pool(|| -> Result<(Tensor, f64)> {
                // q and k as the block computes them: LN(x)·(1 + scale) + shift, then qkv.
                let modv = bw.adaln.forward(&c.silu().map_err(e)?)?;
                let h1 = shift_scale_ln(&x, &modv)?;
                let qkv: Vec<f64> = bw
                    .qkv
                    .forward(&h1)?
                    .flatten_all()
                    .and_then(|v| v.to_vec1())
                    .map_err(e)?;
                // q and k read in place from the fused qkv rows (q, k, v of D each).
                let layout = SoftmaxLayout {
                    b,
                    sq: s,
                    sk: s,
                    heads: d.heads,
                    dh: d.head_dim,
                    q_stride: 3 * h,
                    k_stride: 3 * h,
                };
                let sb = strided_bound((&qkv, &qkv[h..]), layout, scale, (softmax, 0));
                Ok((block_forward(&x, &c, &bw, &r.cfg, seeds)?, sb))
            })?;
            bound = bound.max(sb);
            x = next;
        }
        let loss = on_pool(|| r.patch_loss(&final_forward(&x, &c, &fw, f, f)?, mb, spec))?;
        Ok((bound, loss))
    })
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
