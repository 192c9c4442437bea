//! The original DiT (facebookresearch/DiT `models.py`) in the conformance suite: its rounding
//! stages, its score probe (the f64 replay of its first forward) and its agreement grid.

use candle_core::{DType, Device, Tensor};
use ditmem_budget::Spec;
use ditmem_engine::families::dit::{
    block_forward, final_forward, BlockSeeds, BlockWeights, FinalWeights,
};

use crate::agree::builder::{
    accumulation, batch, family_base, lora, memory_efficient, policy_grid, sgd_without_ema,
    GridBuilder, ACCUMULATION, SGD,
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
use ditmem_budget::{AttentionMode, LoraSpec, Precision, Recompute};

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

// ---------------------------------------------------------------- the agreement grid

/// The spec the grid varies: [`Spec::small`] with an fp32 EMA, as in DiT's training script, on
/// this process's CPU ([`crate::host::resolve`]).
fn grid_base() -> Spec {
    family_base(Spec::small(), "grid-d2-h64")
}

/// The agreement grid: precision × recompute × attention on a depth-3 base, then batch
/// splits, resolution and patch, depth, LoRA, optimizer and EMA variations. Every spec runs in
/// about a second in release on 2 cores.
pub fn grid() -> Vec<(String, Spec)> {
    use AttentionMode as A;
    use Precision as P;
    use Recompute as R;
    let mut policies = Vec::new();
    for p in [P::Fp64, P::Fp32, P::Bf16Mixed, P::Fp16Mixed] {
        for rc in [R::None, R::EveryK(2), R::All, R::AttentionOnly] {
            for a in [A::Materialized, A::MemoryEfficient] {
                // Attention-only recompute is the materialized attention's policy.
                if rc != R::AttentionOnly || a == A::Materialized {
                    policies.push((p, rc.clone(), a));
                }
            }
        }
    }
    let base = grid_base();
    let mut d3 = base.clone();
    d3.model.depth = 3;
    let mut specs = policy_grid("d3", &d3, &policies);
    let mut g = GridBuilder {
        prefix: "",
        base,
        specs: Vec::new(),
    };
    g.vary("bf16-pure", |s| s.recipe.precision = P::Bf16Pure)
        .vary("batch 8 = 4 × accumulation 2", |s| {
            s.workload.batch = 8;
            s.workload.accumulation = 2;
        })
        .vary(ACCUMULATION, accumulation)
        .vary("batch 1", |s| batch(s, 1))
        .vary("256×256 patch 4 (64 tokens)", |s| {
            s.workload.height = 256;
            s.workload.width = 256;
            s.model.patch = 4;
        })
        .vary("256×256 patch 2 (256 tokens), batch 2", |s| {
            s.workload.height = 256;
            s.workload.width = 256;
            batch(s, 2);
        })
        .vary("128×256 patch 2 (128 tokens), memory-efficient", |s| {
            s.workload.width = 256;
            memory_efficient(s);
        })
        .vary("hidden 128, 8 heads, depth 4, every-2", |s| {
            s.model.hidden = 128;
            s.model.heads = 8;
            s.model.depth = 4;
            s.recipe.recompute = R::EveryK(2);
        })
        .vary("LoRA rank 8 on qkv,proj,fc1,fc2", |s| {
            s.recipe.lora = lora(8, &[])
        })
        .vary("LoRA rank 4 on all, bf16-mixed, recompute all", |s| {
            s.recipe.lora = Some(LoraSpec {
                dtype: Default::default(),
                rank: 4,
                targets: ditmem_budget::LoraTarget::ALL.to_vec(),
                modules: Vec::new(),
            });
            s.recipe.precision = P::Bf16Mixed;
            s.recipe.recompute = R::All;
        })
        .vary(SGD, sgd_without_ema)
        .vary("EMA in bf16", |s| {
            s.recipe.ema.dtype = ditmem_budget::Dtype::Bf16
        })
        .vary("learn_sigma off, v-prediction", |s| {
            s.model.learn_sigma = false;
            s.recipe.prediction = ditmem_budget::Prediction::V;
        })
        .vary("blocks:1 of depth 4", |s| {
            s.model.depth = 4;
            s.recipe.recompute = R::Blocks(vec![1]);
        });
    specs.extend(g.finish());
    specs
}
