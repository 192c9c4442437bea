//! SD3 / SD3.5 in the conformance suite: its rounding stages, its key biases' query siblings,
//! its score probe and its agreement grid.

use candle_core::{DType, Device, Tensor};
use ditmem_budget::Spec;

use super::family::KeyBiasAttentions;
use crate::agree::builder::{
    accumulation, batch, family_base, lora_specs, memory_efficient, one_sample_blocks,
    sgd_without_ema, text_tokens, text_tokens_me, GridBuilder, ACCUMULATION, FAMILY_POLICIES, SGD,
};
use crate::diffusion::Batch;
use crate::model::timestep_features;
use crate::trainer::Trainer;
use crate::verify::chain::{MLP, SOFTMAX_ATTENTION};
use crate::verify::error::bad;
use crate::verify::key_bias::SELF_ATTENTION;
use crate::verify::replay::{e, linear, mlp_linears, on_pool, pair_bound, F64Replay, Probe};
use crate::verify::Result;
use ditmem_budget::{Precision, Recompute};
use ditmem_engine::families::sd3::{Sd3BlockWeights, Sd3Geom};

/// The weights of SD3's `depth` joint blocks (the last one `context_pre_only`: no context
/// output side), with SD3.5's q/k RMSNorms and dual-attention `attn2` where the geometry has
/// them.
fn block_weights(t: &Trainer, g: &Sd3Geom, depth: usize) -> Result<Vec<Sd3BlockWeights>> {
    use ditmem_engine::families::sd3::{
        block_linears, ContextOut, DualAttn, DUAL_LINEARS, DUAL_QK_NORMS, QK_NORMS,
    };
    let mut blocks = Vec::with_capacity(depth);
    for i in 0..depth {
        let last = i + 1 == depth;
        let l = block_linears(last)
            .into_iter()
            .map(|n| linear(t, &format!("transformer_blocks.{i}.{n}")))
            .collect::<Result<Vec<_>>>()?;
        let qk = if g.qk_norm {
            let n =
                |k: usize| t.parameter(&format!("transformer_blocks.{i}.{}.weight", QK_NORMS[k]));
            Some([n(0)?, n(1)?, n(2)?, n(3)?])
        } else {
            None
        };
        let (ff, ctx) = if last {
            (9, None)
        } else {
            (
                10,
                Some(ContextOut {
                    to_add_out: l[9].clone(),
                    ff1: l[12].clone(),
                    ff2: l[13].clone(),
                }),
            )
        };
        let dual = if g.is_dual(i) {
            let n = |k: &str| format!("transformer_blocks.{i}.{k}");
            let qk = if g.qk_norm {
                let w = |k: usize| t.parameter(&format!("{}.weight", n(DUAL_QK_NORMS[k])));
                Some([w(0)?, w(1)?])
            } else {
                None
            };
            Some(DualAttn {
                to_q: linear(t, &n(DUAL_LINEARS[0]))?,
                to_k: linear(t, &n(DUAL_LINEARS[1]))?,
                to_v: linear(t, &n(DUAL_LINEARS[2]))?,
                to_out: linear(t, &n(DUAL_LINEARS[3]))?,
                qk,
            })
        } else {
            None
        };
        blocks.push(Sd3BlockWeights {
            norm1: l[0].clone(),
            norm1_context: l[1].clone(),
            to_q: l[2].clone(),
            to_k: l[3].clone(),
            to_v: l[4].clone(),
            add_k: l[5].clone(),
            add_v: l[6].clone(),
            add_q: l[7].clone(),
            to_out: l[8].clone(),
            ff1: l[ff].clone(),
            ff2: l[ff + 1].clone(),
            ctx,
            qk,
            dual,
        });
    }
    Ok(blocks)
}

/// The score bound S for SD3: its forward replayed in f64 (embed, joint blocks, output side), S
/// over each block's joint attention (queries and keys of both streams) and, in SD3.5's
/// dual-attention blocks, over `attn2` (the image tokens' self-attention).
fn score_bound(spec: &Spec, t: &Trainer, g: &Sd3Geom, batch: &Batch) -> Result<(f64, f64, f64)> {
    use ditmem_engine::families::sd3::{
        dual_qk, final_forward as sd3_final, joint_qk, sd3_block_forward, silu_mlp, SD3_FREQ,
    };
    let r = F64Replay::of(spec, t);
    let d = r.d;
    let (dev, f) = (Device::Cpu, DType::F64);
    let scale = crate::mutation::attention_scale(d.head_dim);
    let embed = linear(t, "pos_embed.proj")?;
    let [t1, t2] = mlp_linears("time_text_embed.timestep_embedder", |n| linear(t, n))?;
    let [p1, p2] = mlp_linears("time_text_embed.text_embedder", |n| linear(t, n))?;
    let context = linear(t, "context_embedder")?;
    let (norm_out, proj_out) = (linear(t, "norm_out.linear")?, linear(t, "proj_out")?);
    // The crop of the position table to the latent's grid, as (s, D) rows.
    let side = g.pos_side;
    let (top, left) = ((side - d.rows) / 2, (side - d.cols) / 2);
    let pos = t
        .parameter("pos_embed.pos_embed")?
        .reshape((side, side, d.hidden))
        .and_then(|p| p.narrow(0, top, d.rows))
        .and_then(|p| p.narrow(1, left, d.cols))
        .and_then(|p| p.reshape((d.tokens, d.hidden)))
        .map_err(e)?;
    let blocks = block_weights(t, g, d.depth)?;
    r.over_microbatches(batch, |_, mb, softmax| {
        let b = mb.n;
        let (mut streams, se) = on_pool(|| -> Result<(Vec<Tensor>, Tensor)> {
            let x = r.tokens(&embed, &r.noisy_patches(mb)?, b, Some(&pos))?;
            let tf = timestep_features(&mb.timesteps, SD3_FREQ, f, &dev)?;
            let tt = silu_mlp(&tf, &t1, &t2)?;
            let tp = silu_mlp(&mb.pooled_tensor(f, &dev)?, &p1, &p2)?;
            let se = (tt + tp).and_then(|v| v.silu()).map_err(e)?;
            let c = context
                .forward(&mb.text_tensor(f, &dev)?)?
                .reshape((b, g.text_tokens, d.hidden))
                .map_err(e)?;
            Ok((vec![c, x], se))
        })?;
        let mut bound = 0.0f64;
        for bw in &blocks {
            let (next, sb) = on_pool(|| -> Result<(Vec<Tensor>, f64)> {
                let (q, k) = joint_qk(&streams[0], &streams[1], &se, bw, &r.cfg)?;
                let mut sb = pair_bound(&q, &k, b, d.heads, scale, (softmax, d.tokens))?;
                // attn2 reads the block's input image stream (its own LN of x).
                if let Some((q2, k2)) = dual_qk(&streams[1], &se, bw, &r.cfg)? {
                    sb = sb.max(pair_bound(&q2, &k2, b, d.heads, scale, (softmax, 0))?);
                }
                Ok((
                    sd3_block_forward(&streams[0], &streams[1], &se, bw, &r.cfg)?,
                    sb,
                ))
            })?;
            bound = bound.max(sb);
            streams = next;
        }
        let loss = on_pool(|| -> Result<f64> {
            let x = streams
                .last()
                .ok_or_else(|| bad("attention-score probe", "no image stream"))?;
            r.patch_loss(&sd3_final(x, &se, &norm_out, &proj_out, f, f)?, mb, spec)
        })?;
        Ok((bound, loss))
    })
}

impl super::VerifyFamily for Sd3Geom {
    /// One joint attention (+ the per-head RMSNorm of q and k with `qk_norm`), then the MLP of
    /// each stream: 6, or 7 (SD3.5). SD3.5's dual-attention blocks add `attn2` beside the joint
    /// attention, not after it (it reads the block input's LN, as the joint attention does, and
    /// joins the residual before norm2), with as many stages as it: not longer.
    fn block_stages(&self, depth: u64) -> u64 {
        depth * (SOFTMAX_ATTENTION + u64::from(self.qk_norm) + MLP)
    }

    /// The joint attention `attn` (q and k from one stream, both streams) and SD3.5's
    /// dual-attention `attn2` (a self-attention over the image tokens).
    fn key_bias_attentions(&self) -> KeyBiasAttentions {
        &[(".attn.", SELF_ATTENTION), (".attn2.", SELF_ATTENTION)]
    }

    fn probe(&self, spec: &Spec, t: &Trainer, _seed: u64, batch: &Batch) -> Result<Probe> {
        score_bound(spec, t, self, batch).map(Probe::plain)
    }
}

// ---------------------------------------------------------------- the agreement grid

/// The SD3 grid's base: [`ditmem_engine::families::sd3::tiny_spec`] (3 joint blocks of 4 × 16-wide
/// heads, hidden 64, 16 latent channels), 5 + 8 caption tokens, EMA on.
pub fn sd3_grid_base() -> crate::Result<Spec> {
    Ok(family_base(
        ditmem_engine::families::sd3::tiny_spec(3, 4, false, 5, 8)?,
        "sd3-d3-h64",
    ))
}

/// The SD3 agreement grid: the family policies on the base, then accumulation, odd caption
/// lengths (1 + 1 … 77 + 77: more keys than a streaming block), SGD without EMA, a block list,
/// q/k RMSNorm (SD3.5), one block (only the `context_pre_only` one), a deeper, wider model and
/// SD3.5's dual-attention blocks.
/// Each spec runs in well under a second in release on 2 cores.
pub fn sd3_grid() -> crate::Result<Vec<(String, Spec)>> {
    use ditmem_engine::families::sd3::{tiny_dual_spec, tiny_spec};
    use Recompute as R;
    let mut g = GridBuilder::new("sd3", sd3_grid_base()?, &FAMILY_POLICIES);
    g.vary(ACCUMULATION, accumulation)
        .vary("1 + 1 caption tokens", |s| text_tokens(s, &[1, 1]))
        .vary(
            "77 + 77 caption tokens, memory-efficient",
            text_tokens_me(&[77, 77]),
        )
        .vary("77 + 77 caption tokens, batch 2", |s| {
            text_tokens(s, &[77, 77]);
            batch(s, 2);
        })
        .vary(SGD, sgd_without_ema);
    one_sample_blocks(&mut g, &[1, 2]);
    let mut qk_bf16 = tiny_spec(3, 4, true, 7, 12)?;
    qk_bf16.recipe.precision = Precision::Bf16Mixed;
    g.model(
        "q/k RMSNorm (SD3.5), every-2",
        tiny_spec(3, 4, true, 7, 12)?,
        Some(R::EveryK(2)),
    )
    .model("q/k RMSNorm, bf16-mixed", qk_bf16, Some(R::None))
    .model(
        "1 block (context_pre_only only)",
        tiny_spec(1, 4, false, 7, 12)?,
        Some(R::None),
    )
    .model(
        "4 blocks × 6 heads (hidden 96), q/k RMSNorm, all",
        tiny_spec(4, 6, true, 7, 12)?,
        Some(R::All),
    );
    // SD3.5's dual-attention blocks (attn2, 9-chunk norm1): blocks 0 and 2 of 3, so a stored
    // dual block, a plain one and a dual last (context_pre_only) block; then SD3.5-medium's
    // layout (dual first) under bf16-mixed and recompute.
    let mut dual_bf16 = tiny_dual_spec(3, 4, &[0, 1], 7, 12)?;
    dual_bf16.recipe.precision = Precision::Bf16Mixed;
    g.model(
        "dual attention [0, 2] (SD3.5), q/k RMSNorm",
        tiny_dual_spec(3, 4, &[0, 2], 7, 12)?,
        Some(R::None),
    )
    .model(
        "dual attention [0, 1] (SD3.5-medium's layout), bf16-mixed, every-2",
        dual_bf16,
        Some(R::EveryK(2)),
    );
    g.lora();
    // LoRA on the dual-attention model, memory-efficient attention: the defaults leave attn2
    // frozen (its input released, its output kept for the attention's backward); the custom
    // targets adapt attn2's to_q and to_v too.
    let mut dual = family_base(tiny_dual_spec(3, 4, &[0, 2], 7, 12)?, "sd3.5-dual");
    memory_efficient(&mut dual);
    g.specs
        .extend(lora_specs("sd3 dual [0, 2], memory-efficient,", &dual));
    Ok(g.finish())
}
