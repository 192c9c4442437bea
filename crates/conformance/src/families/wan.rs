//! Wan 2.x in the conformance suite: its rounding stages, its key biases' query siblings, its
//! score probe and its agreement grid.

use candle_core::{DType, Device, Tensor};
use ditmem_budget::Spec;

use super::family::KeyBiasAttentions;
use crate::agree::builder::{
    accumulation, batch, family_base, memory_efficient, one_sample_blocks, sgd_without_ema,
    text_tokens, text_tokens_me, GridBuilder, ACCUMULATION, FAMILY_POLICIES, SGD,
};
use crate::diffusion::Batch;
use crate::model::timestep_features;
use crate::trainer::Trainer;
use crate::verify::chain::{MLP, SOFTMAX_ATTENTION};
use crate::verify::key_bias::{CROSS_ATTENTION, SELF_ATTENTION};
use crate::verify::replay::{
    e, linear, mlp_linears, mse_loss, on_pool, pair_bound, silu_mlp, weights, F64Replay, Probe,
};
use crate::verify::Result;
use ditmem_budget::{Precision, Recompute};
use ditmem_engine::families::wan::{WanGeom, WAN_BLOCK_LINEARS, WAN_BLOCK_NORMS};

/// The score bound S for Wan: its forward replayed in f64 (embed, blocks, output side), S over
/// both the self-attention (q, k after the RMSNorm and RoPE) and the cross-attention to the
/// text (after the RMSNorm).
fn score_bound(spec: &Spec, t: &Trainer, g: &WanGeom, batch: &Batch) -> Result<(f64, f64, f64)> {
    use ditmem_engine::families::wan::{
        final_forward as wan_final, patchify3d, rope_tables, text_forward, unpatchify3d,
        wan_block_forward, wan_block_qk, WanBlockWeights, WanConds, WanFinalWeights,
    };
    let r = F64Replay::of(spec, t);
    let d = r.d;
    let (dev, f) = (Device::Cpu, DType::F64);
    let scale = crate::mutation::attention_scale(d.head_dim);
    let embed = linear(t, "patch_embedding")?;
    let ce = "condition_embedder";
    let [t1, t2] = mlp_linears(&format!("{ce}.time_embedder"), |n| linear(t, n))?;
    let tp = linear(t, &format!("{ce}.time_proj"))?;
    let [x1, x2] = mlp_linears(&format!("{ce}.text_embedder"), |n| linear(t, n))?;
    let fw = WanFinalWeights {
        table: t.parameter("scale_shift_table")?,
        proj_out: linear(t, "proj_out")?,
    };
    let (cv, sv) = rope_tables(g, d.rows, d.cols);
    let half = cv.len() / d.tokens.max(1);
    let cos = Tensor::from_vec(cv, (d.tokens, half), &dev).map_err(e)?;
    let sin = Tensor::from_vec(sv, (d.tokens, half), &dev).map_err(e)?;
    r.over_microbatches(batch, |_, mb, softmax| {
        let b = mb.n;
        let (mut x, temb, t6, ctx) = on_pool(|| -> Result<(Tensor, Tensor, Tensor, Tensor)> {
            let xt = mb.noisy(&r.acp, f, &dev)?;
            let xp = patchify3d(&xt, d.in_channels, g.frames, d.rows, d.cols, d.patch)?;
            let x = r.tokens(&embed, &xp, b, None)?;
            let tf = timestep_features(&mb.timesteps, g.freq, f, &dev)?;
            let temb = silu_mlp(&tf, &t1, &t2)?;
            let t6 = tp.forward(&temb.silu().map_err(e)?)?;
            let ctx = text_forward(&mb.text_tensor(f, &dev)?, &x1, &x2)?;
            Ok((x, temb, t6, ctx))
        })?;
        let mut bound = 0.0f64;
        for i in 0..d.depth {
            let prefix = format!("blocks.{i}");
            let [q1, k1, v1, o1, q2, k2, v2, o2, fc1, fc2] =
                weights(&prefix, WAN_BLOCK_LINEARS, |n| linear(t, n))?;
            let [norm_q1, norm_k1, norm_q2, norm_k2] = weights(&prefix, WAN_BLOCK_NORMS, |n| {
                Ok(t.parameter(&format!("{n}.weight"))?)
            })?;
            let bw = WanBlockWeights {
                table: t.parameter(&format!("{prefix}.scale_shift_table"))?,
                q1,
                k1,
                v1,
                o1,
                norm_q1,
                norm_k1,
                q2,
                k2,
                v2,
                o2,
                norm_q2,
                norm_k2,
                norm2: if g.cross_attn_norm {
                    let n = |p: &str| t.parameter(&format!("{prefix}.norm2.{p}"));
                    Some((n("weight")?, n("bias")?))
                } else {
                    None
                },
                fc1,
                fc2,
            };
            let conds = WanConds {
                t6: &t6,
                ctx: &ctx,
                cos: &cos,
                sin: &sin,
            };
            let (next, sb) = on_pool(|| -> Result<(Tensor, f64)> {
                let [(q1, k1), (q2, k2)] = wan_block_qk(&x, conds, &bw, &r.cfg)?;
                let sb1 = pair_bound(&q1, &k1, b, d.heads, scale, (softmax, 0))?;
                let sb2 = pair_bound(&q2, &k2, b, d.heads, scale, (softmax, 0))?;
                Ok((wan_block_forward(&x, conds, &bw, &r.cfg)?, sb1.max(sb2)))
            })?;
            bound = bound.max(sb);
            x = next;
        }
        let loss = on_pool(|| -> Result<f64> {
            let out = wan_final(&x, &temb, &fw, f, f)?;
            let shape = if g.frames == 1 {
                vec![b, g.out_channels, d.latent_h, d.latent_w]
            } else {
                vec![b, g.out_channels, g.frames, d.latent_h, d.latent_w]
            };
            let geo = (g.out_channels, g.frames, d.rows, d.cols, d.patch);
            let pred = unpatchify3d(&out, b, geo, &shape)?
                .narrow(1, 0, d.in_channels)
                .map_err(e)?;
            mse_loss(pred, mb, &r.acp, spec)
        })?;
        Ok((bound, loss))
    })
}

impl super::VerifyFamily for WanGeom {
    /// Self-attention with RMSNorm and RoPE on q (7), the cross-attention with RMSNorm on q
    /// (norm2 counted with its q projection: 6), the FFN with norm3: 14.
    fn block_stages(&self, depth: u64) -> u64 {
        depth * ((SOFTMAX_ATTENTION + 2) + (SOFTMAX_ATTENTION + 1) + MLP)
    }

    /// `attn1` a self-attention; `attn2` the cross-attention, whose k and v both read the
    /// caption (its k passes an RMSNorm, so the key bias's gradient is a remainder, not an exact
    /// zero; v's bias sums dO over the queries and cancels nothing).
    fn key_bias_attentions(&self) -> KeyBiasAttentions {
        &[(".attn1.", SELF_ATTENTION), (".attn2.", CROSS_ATTENTION)]
    }

    fn probe(&self, spec: &Spec, t: &Trainer, _seed: u64, batch: &Batch) -> Result<Probe> {
        score_bound(spec, t, self, batch).map(Probe::plain)
    }
}

// ---------------------------------------------------------------- the agreement grid

/// The Wan grid's base: [`ditmem_engine::families::wan::tiny_spec`] (2 blocks of 2 × 16-wide heads,
/// 64×64 pixels at 9 frames: 3 latent frames of 4×4 tokens, 48 video tokens, 13 umT5 tokens of
/// width 32, batch 4) with an fp32 EMA, on this process's CPU.
pub fn wan_grid_base() -> crate::Result<Spec> {
    let mut s = ditmem_engine::families::wan::tiny_spec(2, 2, 9, 13)?;
    s.workload.height = 64;
    s.workload.width = 64;
    Ok(family_base(s, "wan-d2-h32"))
}

/// The Wan agreement grid: the family policies on the base, then accumulation, odd token
/// counts (1 and 77 umT5 tokens, one latent frame, an odd 5×3 token grid, 5 latent frames),
/// SGD without EMA, a block list and a wider and deeper model.
pub fn wan_grid() -> crate::Result<Vec<(String, Spec)>> {
    let mut g = GridBuilder::new("wan", wan_grid_base()?, &FAMILY_POLICIES);
    g.vary(ACCUMULATION, accumulation)
        .vary("1 umT5 token", |s| text_tokens(s, &[1]))
        .vary("77 umT5 tokens, memory-efficient", text_tokens_me(&[77]))
        .vary("1 frame (an image)", |s| s.workload.frames = 1)
        .vary("80×48 (5×3 tokens a frame), 5 frames, bf16-mixed", |s| {
            s.workload.height = 80;
            s.workload.width = 48;
            s.workload.frames = 5;
            s.recipe.precision = Precision::Bf16Mixed;
        })
        .vary(
            "17 frames (5 latent frames, 80 tokens), batch 2, memory-efficient",
            |s| {
                s.workload.frames = 17;
                batch(s, 2);
                memory_efficient(s);
            },
        )
        .vary(SGD, sgd_without_ema);
    one_sample_blocks(&mut g, &[1]);
    let mut deep = ditmem_engine::families::wan::tiny_spec(4, 4, 5, 19)?;
    deep.workload.height = 64;
    deep.workload.width = 64;
    g.model(
        "4 blocks × 4 heads (hidden 64), 5 frames, 19 tokens, every-2",
        deep,
        Some(Recompute::EveryK(2)),
    );
    g.lora();
    Ok(g.finish())
}
