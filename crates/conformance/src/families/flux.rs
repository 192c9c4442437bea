//! FLUX.1 in the conformance suite: its rounding stages, its key biases' query siblings, its
//! score probe (with [`flux_qk`], q and k as its blocks form them) and its agreement grid.

use candle_core::{DType, Device, Tensor};
use ditmem_budget::Spec;

use super::family::KeyBiasAttentions;
use crate::agree::builder::{
    accumulation, family_base, larger_image, one_sample_blocks, sgd_without_ema, text_tokens,
    text_tokens_batch2_me, text_tokens_me, GridBuilder, ACCUMULATION, FAMILY_POLICIES,
    LARGER_IMAGE, SGD,
};
use crate::diffusion::Batch;
use crate::layers::LinearW;
use crate::model::timestep_features;
use crate::trainer::Trainer;
use crate::verify::chain::{MLP, SOFTMAX_ATTENTION};
use crate::verify::key_bias::SELF_ATTENTION;
use crate::verify::replay::{
    e, linear, mlp_linears, mse_loss, on_pool, pair_bound, shift_scale_ln, weights, F64Replay,
    Probe,
};
use crate::verify::Result;
use ditmem_budget::Recompute;
use ditmem_engine::families::flux::FluxGeom;

/// The score bound S for Flux from its weights alone: q and k leave a per-head RMSNorm
/// (‖x̂‖ = √d_h·(ms/(ms + ε))^½ ≤ √d_h per head) and RoPE (a rotation), so ‖qᵢ‖ ≤ √d_h·max|w_q|
/// and ‖kⱼ‖ ≤ √d_h·max|w_k|, over both streams' norms in a joint block, and
/// S = d_h^−½·maxᵢ‖qᵢ‖·maxⱼ‖kⱼ‖ ≤ √d_h·max|w_q|·max|w_k| (tight up to ms/(ms + ε)).
fn weight_bound(t: &Trainer, g: &FluxGeom, head_dim: usize) -> Result<f64> {
    let max_abs = |n: &str| -> Result<f64> {
        t.parameter(&format!("{n}.weight"))?
            .abs()
            .and_then(|a| a.max_all())
            .and_then(|a| a.to_dtype(DType::F64))
            .and_then(|a| a.to_scalar::<f64>())
            .map_err(e)
    };
    let (scale, dh) = (
        crate::mutation::attention_scale(head_dim).abs(),
        head_dim as f64,
    );
    let mut bound = 0.0f64;
    for i in 0..g.double + g.single {
        let (p, qs, ks): (String, Vec<&str>, Vec<&str>) = if i < g.double {
            let p = format!("transformer_blocks.{i}.attn");
            (
                p,
                vec!["norm_q", "norm_added_q"],
                vec!["norm_k", "norm_added_k"],
            )
        } else {
            let p = format!("single_transformer_blocks.{}.attn", i - g.double);
            (p, vec!["norm_q"], vec!["norm_k"])
        };
        let mut mq = 0.0f64;
        for n in qs {
            mq = mq.max(max_abs(&format!("{p}.{n}"))?);
        }
        let mut mk = 0.0f64;
        for n in ks {
            mk = mk.max(max_abs(&format!("{p}.{n}"))?);
        }
        // q and k are RMS-normed per head (norm ≤ √d_h · max|w|), scaled as the attention
        // scales them (d_h^−½ and any planted gain).
        bound = bound.max(scale * dh * mq * mk);
    }
    Ok(bound)
}

/// The linears `lins` and the RMSNorm weights `norms` of the Flux block at `prefix`.
fn block_weights<const N: usize>(
    t: &Trainer,
    prefix: &str,
    lins: &[&str],
    norms: [&str; N],
) -> Result<(Vec<LinearW>, [Tensor; N])> {
    let l = lins
        .iter()
        .map(|n| linear(t, &format!("{prefix}.{n}")))
        .collect::<Result<Vec<_>>>()?;
    let w = weights(prefix, norms, |n| Ok(t.parameter(&format!("{n}.weight"))?))?;
    Ok((l, w))
}

/// The embedders of Flux's conditioning (`time_text_embed`): the timestep's, the guidance
/// scale's where the model has one, and the pooled text's, each two linears.
struct Conditions {
    time: [LinearW; 2],
    guidance: Option<[LinearW; 2]>,
    text: [LinearW; 2],
}

impl Conditions {
    fn of(t: &Trainer, guidance: bool) -> Result<Conditions> {
        let mlp = |n: &str| mlp_linears(&format!("time_text_embed.{n}"), |l| linear(t, l));
        Ok(Conditions {
            time: mlp("timestep_embedder")?,
            guidance: if guidance {
                Some(mlp("guidance_embedder")?)
            } else {
                None
            },
            text: mlp("text_embedder")?,
        })
    }

    /// SiLU of the summed embeddings of `mb`'s timesteps, the guidance scale and its pooled
    /// text, (b, D): what every block's modulation reads.
    fn embed(&self, mb: &Batch) -> Result<Tensor> {
        use ditmem_engine::families::flux::mlp_silu;
        use ditmem_engine::families::flux::params::{FLUX_FREQ, GUIDANCE};
        let (dev, f) = (Device::Cpu, DType::F64);
        let [t1, t2] = &self.time;
        let tf = timestep_features(&mb.timesteps, FLUX_FREQ, f, &dev)?;
        let mut temb = mlp_silu(&tf, t1, t2)?;
        if let Some([g1, g2]) = &self.guidance {
            let gf = timestep_features(&vec![GUIDANCE as u32; mb.n], FLUX_FREQ, f, &dev)?;
            temb = (temb + mlp_silu(&gf, g1, g2)?).map_err(e)?;
        }
        let [p1, p2] = &self.text;
        let pooled = mb.pooled_tensor(f, &dev)?;
        temb = (temb + mlp_silu(&pooled, p1, p2)?).map_err(e)?;
        temb.silu().map_err(e)
    }
}

/// The score bound S for Flux ([`weight_bound`]) and its forward replayed in f64 (embed,
/// double- and single-stream blocks, output side) for the loss check and the softmax
/// amplification.
fn score_bound(spec: &Spec, t: &Trainer, g: &FluxGeom, batch: &Batch) -> Result<(f64, f64, f64)> {
    use ditmem_engine::families::flux::params::ROPE_THETA;
    use ditmem_engine::families::flux::{
        double_forward, final_forward as flux_final, image_tokens, join_streams, rope_ids,
        single_forward, unpack, DoubleWeights, FinalWeights, SingleWeights, DOUBLE_LINEARS,
        DOUBLE_NORMS, SINGLE_LINEARS, SINGLE_NORMS,
    };
    let r = F64Replay::of(spec, t);
    let d = r.d;
    let (dev, f) = (Device::Cpu, DType::F64);
    let bound = weight_bound(t, g, d.head_dim)?;
    let scale = crate::mutation::attention_scale(d.head_dim).abs();
    let blocks = g.double + g.single;
    let x_embedder = linear(t, "x_embedder")?;
    let context_embedder = linear(t, "context_embedder")?;
    let conditions = Conditions::of(t, g.guidance)?;
    let table = std::sync::Arc::new(
        crate::ops::RopeTable::new(&rope_ids(g.text_tokens, &d), &g.axes, ROPE_THETA, f)
            .map_err(e)?,
    );
    let fw = FinalWeights {
        norm_out: linear(t, "norm_out.linear")?,
        proj_out: linear(t, "proj_out")?,
    };
    // S comes from the weights above; the replay checks the loss and gathers the softmax
    // amplification.
    let (_, loss, softmax) = r.over_microbatches(batch, |_, mb, softmax| {
        let b = mb.n;
        let (mut xs, st) = on_pool(|| -> Result<(Vec<Tensor>, Tensor)> {
            let x0 = r.tokens(&x_embedder, &r.noisy_patches(mb)?, b, None)?;
            let c0 = context_embedder
                .forward(&mb.text_tensor(f, &dev)?)?
                .reshape((b, g.text_tokens, d.hidden))
                .map_err(e)?;
            Ok((vec![x0, c0], conditions.embed(mb)?))
        })?;
        for i in 0..blocks {
            xs = if i < g.double {
                let p = format!("transformer_blocks.{i}");
                let (lin, norms) = block_weights(t, &p, &DOUBLE_LINEARS, DOUBLE_NORMS)?;
                let w = DoubleWeights { lin, norms };
                on_pool(|| -> Result<Vec<Tensor>> {
                    let (q, k) = flux_qk(
                        (
                            &xs[1],
                            &w.lin[1],
                            [&w.lin[5], &w.lin[6]],
                            [&w.norms[2], &w.norms[3]],
                        ),
                        Some((
                            &xs[0],
                            &w.lin[0],
                            [&w.lin[2], &w.lin[3]],
                            [&w.norms[0], &w.norms[1]],
                        )),
                        &st,
                        &table,
                    )?;
                    pair_bound(&q, &k, b, d.heads, scale, (softmax, g.text_tokens))?;
                    let (x, c) = double_forward(&xs[0], &xs[1], &st, &table, &w, &r.cfg)?;
                    Ok(vec![x, c])
                })?
            } else {
                let p = format!("single_transformer_blocks.{}", i - g.double);
                let (lin, norms) = block_weights(t, &p, &SINGLE_LINEARS, SINGLE_NORMS)?;
                let w = SingleWeights { lin, norms };
                on_pool(|| -> Result<Vec<Tensor>> {
                    let joint = match xs.as_slice() {
                        [img, txt] => join_streams(img, txt)?,
                        _ => xs[0].clone(),
                    };
                    let (q, k) = flux_qk(
                        (
                            &joint,
                            &w.lin[0],
                            [&w.lin[2], &w.lin[3]],
                            [&w.norms[0], &w.norms[1]],
                        ),
                        None,
                        &st,
                        &table,
                    )?;
                    pair_bound(&q, &k, b, d.heads, scale, (softmax, g.text_tokens))?;
                    Ok(vec![single_forward(&joint, &st, &table, &w, &r.cfg)?])
                })?
            };
        }
        let loss = on_pool(|| -> Result<f64> {
            let img = image_tokens(&xs[0], d.tokens)?;
            let out = flux_final(&img, &st, &fw, f, f)?;
            let pred = unpack(&out, b, &d)?;
            mse_loss(pred, mb, &r.acp, spec)
        })?;
        Ok((0.0, loss))
    })?;
    Ok((bound, loss, softmax))
}

/// One Flux stream's part of an attention: its tokens (b, n, D), its AdaLayerNorm's linear,
/// its q and k projections and their RMSNorm weights.
type FluxStream<'a> = (&'a Tensor, &'a LinearW, [&'a LinearW; 2], [&'a Tensor; 2]);

/// q and k (b·n, D) of a Flux attention in f64 as its block forms them (`families/flux/
/// block.rs`: LN with the modulation's shift and scale, projection, RMSNorm, then RoPE over
/// the joint [text; image] sequence): a double block's from `first` the text and `second` the
/// image stream, a single block's from `first` the joint stream alone.
fn flux_qk(
    first: FluxStream<'_>,
    second: Option<FluxStream<'_>>,
    st: &Tensor,
    table: &std::sync::Arc<crate::ops::RopeTable>,
) -> Result<(Tensor, Tensor)> {
    use crate::ops::{rms_norm, rope, RMS_EPS};
    let part = |(x, ada, [lq, lk], [nq, nk]): FluxStream<'_>| -> Result<(Tensor, Tensor)> {
        let (b, n, h) = x.dims3().map_err(e)?;
        let hx = shift_scale_ln(x, &ada.forward(st)?)?;
        let flat = |y: Tensor| y.reshape((b * n, h)).map_err(e);
        let q = rms_norm(&flat(lq.forward(&hx)?)?, nq, RMS_EPS).map_err(e)?;
        let k = rms_norm(&flat(lk.forward(&hx)?)?, nk, RMS_EPS).map_err(e)?;
        Ok((q, k))
    };
    let (mut q, mut k) = part(first)?;
    if let Some(img) = second {
        let (b, s, h) = img.0.dims3().map_err(e)?;
        let t = first.0.dim(1).map_err(e)?;
        let (qi, ki) = part(img)?;
        let joint = |a: &Tensor, c: &Tensor| {
            crate::ops::tokens::concat(a, c, b, (b * (s + t), h)).map_err(e)
        };
        q = joint(&q, &qi)?;
        k = joint(&k, &ki)?;
    }
    Ok((rope(&q, table).map_err(e)?, rope(&k, table).map_err(e)?))
}

impl super::VerifyFamily for FluxGeom {
    /// Double-stream blocks: the joint attention with RMSNorm and RoPE on q (+2), then the FFN:
    /// 8. Single-stream blocks: the attention with RMSNorm and RoPE (+2) whose output
    /// `proj_out` shares with the parallel MLP (proj_mlp → GELU, one stage beside the
    /// attention's four, so not on the longest path): 7. Counted over the geometry's own
    /// blocks of each kind, whatever `depth` says.
    fn block_stages(&self, _depth: u64) -> u64 {
        self.double as u64 * (SOFTMAX_ATTENTION + 2 + MLP)
            + self.single as u64 * (SOFTMAX_ATTENTION + 2)
    }

    /// The joint attention `attn` (q and k from one stream, both streams).
    fn key_bias_attentions(&self) -> KeyBiasAttentions {
        &[(".attn.", SELF_ATTENTION)]
    }

    fn probe(&self, spec: &Spec, t: &Trainer, _seed: u64, batch: &Batch) -> Result<Probe> {
        score_bound(spec, t, self, batch).map(Probe::plain)
    }
}

// ---------------------------------------------------------------- the agreement grid

/// The Flux grid's base: [`ditmem_engine::families::flux::tiny_spec`] (one double-stream and two
/// single-stream blocks of 4 × 16-wide heads, 64 image tokens, 13 T5 tokens of width 32, a
/// pooled width of 24, the guidance embedder, batch 4) with an fp32 EMA, on this process's CPU.
pub fn flux_grid_base() -> crate::Result<Spec> {
    Ok(family_base(
        ditmem_engine::families::flux::tiny_spec(1, 2, 4, 13, true)?,
        "flux-d1s2-h64",
    ))
}

/// The Flux agreement grid: the family policies on the base, then accumulation, odd T5
/// lengths (1, 77 and 300 tokens; the CLIP prompt stays 77), a larger image, SGD without EMA,
/// a block list across the two kinds of block, no guidance embedder, and a deeper, wider model.
pub fn flux_grid() -> crate::Result<Vec<(String, Spec)>> {
    use ditmem_engine::families::flux::tiny_spec;
    let mut g = GridBuilder::new("flux", flux_grid_base()?, &FAMILY_POLICIES);
    g.vary(ACCUMULATION, accumulation)
        .vary("1 T5 token", |s| text_tokens(s, &[77, 1]))
        .vary("77 T5 tokens, memory-efficient", text_tokens_me(&[77, 77]))
        .vary(
            "300 T5 tokens, batch 2, memory-efficient",
            text_tokens_batch2_me(&[77, 300]),
        )
        .vary(LARGER_IMAGE, larger_image)
        .vary(SGD, sgd_without_ema);
    one_sample_blocks(&mut g, &[0, 1]);
    g.model(
        "no guidance embedder (schnell-like)",
        tiny_spec(1, 2, 4, 13, false)?,
        None,
    )
    .model(
        "2 + 3 blocks × 6 heads (hidden 96), 19 tokens, every-2",
        tiny_spec(2, 3, 6, 19, true)?,
        Some(Recompute::EveryK(2)),
    );
    g.lora();
    Ok(g.finish())
}
