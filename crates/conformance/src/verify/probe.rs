//! The attention-score probe: the reference's first forward replayed in f64 from its own
//! weights, block by block, to measure what the rounding error of the attention scales with —
//! the score bound S = max over blocks, samples, heads of d_h^−½ · maxᵢ ‖qᵢ‖ · maxⱼ ‖kⱼ‖
//! (Cauchy–Schwarz: every |sᵢⱼ| ≤ S, and rounding q and k to a dtype with unit roundoff u moves
//! a score by up to ≈ u·S, which moves e^(sᵢⱼ − mᵢ) by a relative u·S).
//!
//! The replay composes the engine's own pieces ([`block_forward`], [`final_forward`], the
//! embedders) as the trainer does and checks itself: its loss must equal the reference step's
//! loss to 1e-9 relative, so a probe that no longer follows the model is an error, not a quiet
//! misestimate. It runs before the reference step, while the trainer holds only its weights:
//! one block's activations and weight copies at a time, below the step's own peak.

use candle_core::{DType, Device, Tensor};
use ditmem_budget::Spec;

use super::cancellation::{add_sums, Sums};
use super::error::{bad, Result, VerifyError};
use super::kink::{add_kink_sums, KinkSums};
use super::softmax::{add_sums as add_softmax_sums, Layout as SoftmaxLayout, Sums as SoftmaxSums};
use crate::diffusion::{alphas_cumprod, Batch};
use crate::error::EngineError;
use crate::families::dit::{block_forward, final_forward, BlockSeeds, BlockWeights, FinalWeights};
use crate::layers::{AttnImpl, BlockConfig, LinearW, LN_EPS};
use crate::model::{patchify, timestep_features, unpatchify, Dims};
use crate::ops::ln_modulate;
use crate::rng::derive_seed;
use crate::trainer::Trainer;

/// Relative difference allowed between the probe's loss and the reference step's (both f64,
/// summed in other orders: ~1e-15 expected).
const LOSS_AGREEMENT: f64 = 1e-9;

fn e(x: candle_core::Error) -> VerifyError {
    VerifyError::Engine(EngineError::from(x))
}

fn linear(t: &Trainer, name: &str) -> Result<LinearW> {
    Ok(LinearW::new(
        t.parameter(&format!("{name}.weight"))?,
        t.parameter(&format!("{name}.bias"))?,
        // LoRA's B is zero at initialisation: the adapters add nothing to the first forward.
        None,
    ))
}

/// What the replay measures on the reference's first step.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Probe {
    /// S (see the module docs).
    pub score_bound: f64,
    /// The replay's loss, to be checked with [`check_loss`] against the step's.
    pub loss: f64,
    /// ‖terms‖ / ‖result‖ of the softmax attentions' backward ([`super::softmax`]; 1 where
    /// none is replayed).
    pub softmax: f64,
    /// (tensor prefix, ‖terms‖ / ‖result‖) of the gradients that come out of a cancellation
    /// ([`super::cancellation`]; Sana's linear attention's `to_q` and `to_k`), in the order of
    /// [`amplified_tensors`].
    pub amplification: Vec<(String, f64)>,
    /// (tensor prefix, the expected relative error per dtype of [`super::kink::KINK_DTYPES`])
    /// of the gradients behind a ReLU kink ([`super::kink`]), in the same order.
    pub kink: Vec<(String, [f64; 3])>,
}

/// The prefixes of the tensors whose gradients come out of a cancellation the probe measures:
/// the `to_q` and `to_k` of each Sana block's linear attention.
pub(super) fn amplified_tensors(spec: &Spec) -> Result<Vec<String>> {
    Ok(match crate::families::Arch::of(spec)? {
        crate::families::Arch::Sana(_) => (0..Dims::new(spec)?.depth)
            .flat_map(|i| ["to_q", "to_k"].map(|p| format!("transformer_blocks.{i}.attn1.{p}")))
            .collect(),
        _ => Vec::new(),
    })
}

/// The tensors of Sana block `i` that its linear attention's q and k are computed from, besides
/// the block's input stream and the embedded timestep: norm1's modulation (chunks 0 and 1 of
/// the block's `scale_shift_table` plus the timestep's, as the replay computes `h1` below).
fn sana_qk_inputs(i: u32) -> Vec<String> {
    vec![format!("transformer_blocks.{i}.scale_shift_table")]
}

/// `sources` (a cancellation's or a kink's (tensor prefix, term), from [`amplified_tensors`])
/// with the same term, as the largest `max` of the sources that reach it, on every trained
/// tensor upstream of them: an error in a block's q or k gradient flows into the block's input
/// gradient, so into every tensor the forward read before it — the embed segment's (the family
/// schedule runs it before every block: patch, position, timestep, label and text embedders),
/// every earlier block's, and the block's own tensors that q and k are computed from
/// ([`sana_qk_inputs`]). Tensors after them (the block's v, out, cross-attention and
/// feed-forward, later blocks, the final layer) are not reached: the kink changes the q and k
/// gradient alone. The set follows from the model's table (module and block of each tensor),
/// never from names of the tensors that failed.
pub(super) fn with_upstream<T: Copy>(
    spec: &Spec,
    sources: Vec<(String, T)>,
    max: impl Fn(T, T) -> T,
) -> Result<Vec<(String, T)>> {
    use ditmem_budget::Module;
    if sources.is_empty() {
        return Ok(sources);
    }
    let table = ditmem_budget::denoiser::param_table(spec);
    let embed = |m: Module| {
        matches!(
            m,
            Module::PatchEmbed
                | Module::PosEmbed
                | Module::TimestepEmbed
                | Module::LabelEmbed
                | Module::TextEmbed
        )
    };
    let under = |name: &str, prefix: &str| {
        name.strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('.'))
    };
    let mut reached: Vec<Option<T>> = vec![None; table.len()];
    for (prefix, v) in &sources {
        // The block of the source, from the table.
        let Some(block) = table
            .iter()
            .find(|t| under(&t.name, prefix))
            .and_then(|t| t.block)
        else {
            continue;
        };
        let own = sana_qk_inputs(block);
        for (slot, t) in reached.iter_mut().zip(&table) {
            let upstream = embed(t.module)
                || (t.block.is_some_and(|b| b < block) && t.module != Module::FinalLayer)
                || own.contains(&t.name);
            if upstream {
                *slot = Some(slot.map_or(*v, |w| max(w, *v)));
            }
        }
    }
    let mut out = sources;
    out.extend(
        table
            .iter()
            .zip(reached)
            .filter_map(|(t, v)| Some((t.name.clone(), v?))),
    );
    Ok(out)
}

/// [`Probe`] of the first step of `spec` (the reference spec: f64, nothing recomputed) with the
/// weights of `t` (fresh, not yet stepped) on `batch`.
pub(super) fn probe(spec: &Spec, t: &Trainer, seed: u64, batch: &Batch) -> Result<Probe> {
    let plain = |(score_bound, loss, softmax): (f64, f64, f64)| Probe {
        score_bound,
        loss,
        softmax,
        amplification: Vec::new(),
        kink: Vec::new(),
    };
    match crate::families::Arch::of(spec)? {
        crate::families::Arch::Pixart(g) => pixart_score_bound(spec, t, &g, batch).map(plain),
        crate::families::Arch::Sd3(g) => sd3_score_bound(spec, t, &g, batch).map(plain),
        crate::families::Arch::Flux(g) => flux_score_bound(spec, t, &g, batch).map(plain),
        crate::families::Arch::Sana(g) => sana_score_bound(spec, t, &g, batch),
        crate::families::Arch::Wan(g) => wan_score_bound(spec, t, &g, batch).map(plain),
        crate::families::Arch::DitDiffusers(g) => ditd_score_bound(spec, t, &g, batch).map(plain),
        crate::families::Arch::Dit => score_bound(spec, t, seed, batch).map(plain),
    }
}

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
            let target = mb.target(&acp, spec.recipe.prediction, f, &dev)?;
            (pred - target)
                .and_then(|r| r.sqr())
                .and_then(|r| r.mean_all())
                .and_then(|r| r.to_scalar::<f64>())
                .map_err(e)
        })?;
    }
    Ok((bound, loss_sum / accum as f64, amplification_of(softmax)))
}

/// The largest softmax amplification gathered (1 where none).
fn amplification_of(largest: std::sync::Mutex<f64>) -> f64 {
    largest.into_inner().unwrap_or_else(|e| e.into_inner())
}

/// Raise `largest` to the softmax amplification ([`super::softmax`]) of each query group of
/// one attention: the first `split` query rows of each sample (one stream of a joint
/// attention: SD3's image, Flux's text), and the rest.
fn add_softmax(
    (q, k): (&[f64], &[f64]),
    layout: SoftmaxLayout,
    split: usize,
    scale: f64,
    largest: &std::sync::Mutex<f64>,
) {
    for rows in [0..split, split..layout.sq] {
        if rows.is_empty() {
            continue;
        }
        let mut sums = SoftmaxSums::default();
        add_softmax_sums(q, k, layout, rows, scale, &mut sums);
        let mut l = largest.lock().unwrap_or_else(|e| e.into_inner());
        *l = l.max(sums.amplification());
    }
}

/// max over samples and heads of `scale`·maxᵢ ‖qᵢ‖·maxⱼ ‖kⱼ‖ for q (b·s_q, D) and k (b·s_k, D);
/// `softmax` raised to the attention's softmax amplification, its first `split` query rows per
/// sample a group of their own ([`add_softmax`]).
fn pair_bound(
    q: &Tensor,
    k: &Tensor,
    b: usize,
    heads: usize,
    scale: f64,
    (softmax, split): (&std::sync::Mutex<f64>, usize),
) -> Result<f64> {
    let (rq, h) = q.dims2().map_err(e)?;
    let rk = k.dim(0).map_err(e)?;
    let (sq, sk, dh) = (rq / b, rk / b, h / heads);
    let qv: Vec<f64> = q.flatten_all().and_then(|v| v.to_vec1()).map_err(e)?;
    let kv: Vec<f64> = k.flatten_all().and_then(|v| v.to_vec1()).map_err(e)?;
    let largest = |x: &[f64], s: usize, bi: usize, hd: usize| {
        (0..s)
            .map(|r| {
                let at = (bi * s + r) * h + hd * dh;
                x[at..at + dh].iter().map(|v| v * v).sum::<f64>()
            })
            .fold(0.0f64, f64::max)
            .sqrt()
    };
    let mut sb = 0.0f64;
    for bi in 0..b {
        for hd in 0..heads {
            sb = sb.max(scale.abs() * largest(&qv, sq, bi, hd) * largest(&kv, sk, bi, hd));
        }
    }
    let layout = SoftmaxLayout {
        b,
        sq,
        sk,
        heads,
        dh,
        q_stride: h,
        k_stride: h,
    };
    add_softmax((&qv, &kv), layout, split, scale, softmax);
    Ok(sb)
}

/// What each diffusers family's f64 forward replay (`<family>_score_bound`) starts from: the
/// trainer's dims, the microbatch and accumulation counts, the noise schedule, and a block
/// config that computes in f64 with materialized attention and no dropout.
struct F64Replay {
    d: Dims,
    micro: usize,
    accum: usize,
    acp: Vec<f64>,
    cfg: BlockConfig,
}

impl F64Replay {
    fn of(spec: &Spec, t: &Trainer) -> F64Replay {
        let d: Dims = *t.dims();
        let w = &spec.workload;
        F64Replay {
            d,
            micro: w.microbatch as usize,
            accum: w.accumulation as usize,
            acp: alphas_cumprod(),
            cfg: BlockConfig {
                hidden: d.hidden,
                heads: d.heads,
                head_dim: d.head_dim,
                compute: DType::F64,
                accum: DType::F64,
                attn: AttnImpl::Materialized,
                attn_dropout: 0.0,
                mlp_dropout: 0.0,
            },
        }
    }
}

/// [`score_bound`] for PixArt: its forward replayed in f64 (embed, blocks, output side), S over
/// both the self-attention and the cross-attention to the caption.
fn pixart_score_bound(
    spec: &Spec,
    t: &Trainer,
    g: &crate::families::pixart::PixartGeom,
    batch: &Batch,
) -> Result<(f64, f64, f64)> {
    use crate::families::pixart::{
        caption_forward, final_forward as pixart_final, pixart_block_forward, CaptionWeights,
        PixartBlockWeights, PixartFinalWeights,
    };
    use crate::ops::gated_residual;
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
    // PixArt-α's resolution and aspect-ratio embedders (`trainer/pixart.rs`).
    let sizes = match g.sizes {
        Some(hw) => {
            let l = |e: &str, k: u8| linear(t, &format!("adaln_single.emb.{e}.linear_{k}"));
            let [r, a] = crate::families::pixart::params::SIZE_EMBEDDERS;
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
            let target = mb.target(&acp, spec.recipe.prediction, f, &dev)?;
            (pred - target)
                .and_then(|r| r.sqr())
                .and_then(|r| r.mean_all())
                .and_then(|r| r.to_scalar::<f64>())
                .map_err(e)
        })?;
    }
    Ok((bound, loss_sum / accum as f64, amplification_of(softmax)))
}

/// [`score_bound`] for diffusers' DiT (`DiTTransformer2DModel`): its forward replayed in f64 as
/// `trainer/dit_diffusers.rs` runs it (every block's own embedder on the shared timestep
/// features and label rows, block 0's again for the output side), S over each block's
/// self-attention (PixArt's attn1 setup: separate biased q, k, v, no q/k norm).
fn ditd_score_bound(
    spec: &Spec,
    t: &Trainer,
    g: &crate::families::dit_diffusers::DitdGeom,
    batch: &Batch,
) -> Result<(f64, f64, f64)> {
    use crate::families::dit_diffusers::{
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
            let target = mb.target(&acp, spec.recipe.prediction, f, &dev)?;
            (pred - target)
                .and_then(|r| r.sqr())
                .and_then(|r| r.mean_all())
                .and_then(|r| r.to_scalar::<f64>())
                .map_err(e)
        })?;
    }
    Ok((bound, loss_sum / accum as f64, amplification_of(softmax)))
}

/// [`score_bound`] for SD3: its forward replayed in f64 (embed, joint blocks, output side), S
/// over each block's joint attention (queries and keys of both streams) and, in SD3.5's
/// dual-attention blocks, over `attn2` (the image tokens' self-attention).
fn sd3_score_bound(
    spec: &Spec,
    t: &Trainer,
    g: &crate::families::sd3::Sd3Geom,
    batch: &Batch,
) -> Result<(f64, f64, f64)> {
    use crate::families::sd3::{
        block_linears, dual_qk, final_forward as sd3_final, joint_qk, sd3_block_forward, silu_mlp,
        ContextOut, DualAttn, Sd3BlockWeights, DUAL_LINEARS, DUAL_QK_NORMS, QK_NORMS, SD3_FREQ,
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
    let te = "time_text_embed.timestep_embedder";
    let pe = "time_text_embed.text_embedder";
    let (t1, t2) = (
        linear(t, &format!("{te}.linear_1"))?,
        linear(t, &format!("{te}.linear_2"))?,
    );
    let (p1, p2) = (
        linear(t, &format!("{pe}.linear_1"))?,
        linear(t, &format!("{pe}.linear_2"))?,
    );
    let context = linear(t, "context_embedder")?;
    let (norm_out, proj_out) = (linear(t, "norm_out.linear")?, linear(t, "proj_out")?);
    let side = g.pos_side;
    let (top, left) = ((side - d.rows) / 2, (side - d.cols) / 2);
    let pos = t
        .parameter("pos_embed.pos_embed")?
        .reshape((side, side, d.hidden))
        .and_then(|p| p.narrow(0, top, d.rows))
        .and_then(|p| p.narrow(1, left, d.cols))
        .map_err(e)?;
    let mut blocks = Vec::with_capacity(d.depth);
    for i in 0..d.depth {
        let last = i + 1 == d.depth;
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
    let mut bound = 0.0f64;
    let softmax = std::sync::Mutex::new(1.0f64);
    let mut loss_sum = 0.0;
    for m in 0..accum {
        let mb = batch.slice(m * micro, micro)?;
        let b = mb.n;
        let (mut streams, se) = on_pool(|| -> Result<(Vec<Tensor>, Tensor)> {
            let xt = mb.noisy(&acp, f, &dev)?;
            let xe = embed.forward(&patchify(&xt, &d)?)?;
            let x = xe
                .reshape((b, d.rows, d.cols, d.hidden))
                .and_then(|x| x.broadcast_add(&pos))
                .and_then(|x| x.reshape((b, d.tokens, d.hidden)))
                .map_err(e)?;
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
        for bw in &blocks {
            let (next, sb) = on_pool(|| -> Result<(Vec<Tensor>, f64)> {
                let (q, k) = joint_qk(&streams[0], &streams[1], &se, bw, &cfg)?;
                let mut sb = pair_bound(&q, &k, b, d.heads, scale, (&softmax, d.tokens))?;
                // attn2 reads the block's input image stream (its own LN of x).
                if let Some((q2, k2)) = dual_qk(&streams[1], &se, bw, &cfg)? {
                    sb = sb.max(pair_bound(&q2, &k2, b, d.heads, scale, (&softmax, 0))?);
                }
                Ok((
                    sd3_block_forward(&streams[0], &streams[1], &se, bw, &cfg)?,
                    sb,
                ))
            })?;
            bound = bound.max(sb);
            streams = next;
        }
        loss_sum += on_pool(|| -> Result<f64> {
            let x = streams
                .last()
                .ok_or_else(|| bad("attention-score probe", "no image stream"))?;
            let out = sd3_final(x, &se, &norm_out, &proj_out, f, f)?;
            let pred = unpatchify(&out, b, &d)?
                .narrow(1, 0, d.in_channels)
                .map_err(e)?;
            let target = mb.target(&acp, spec.recipe.prediction, f, &dev)?;
            (pred - target)
                .and_then(|r| r.sqr())
                .and_then(|r| r.mean_all())
                .and_then(|r| r.to_scalar::<f64>())
                .map_err(e)
        })?;
    }
    Ok((bound, loss_sum / accum as f64, amplification_of(softmax)))
}

/// Run `f` on the rayon pool the trainer's steps run on, as they do: gemm keeps per-thread
/// packing slabs for a thread's lifetime, and the calling thread must not grow a set of its own.
fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        f()
    } else {
        rayon::scope(|_| f())
    }
}

/// The replay must reproduce the step's loss: a probe that no longer follows the model is an
/// error, not a quiet misestimate of S.
pub(super) fn check_loss(probe_loss: f64, loss: f64) -> Result<()> {
    // NaN disagrees.
    let agrees = (probe_loss - loss).abs() <= LOSS_AGREEMENT * loss.abs();
    if !agrees {
        return Err(bad(
            "attention-score probe",
            format!(
                "its replay of the reference forward gives loss {probe_loss:e}, the step {loss:e}: \
                 the probe no longer follows the model"
            ),
        ));
    }
    Ok(())
}

/// [`score_bound`] for Flux: its forward replayed in f64 (embed, double- and single-stream
/// blocks, output side) for the loss check. S needs no activations: q and k leave a per-head
/// RMSNorm (‖x̂‖ = √d_h·(ms/(ms + ε))^½ ≤ √d_h per head) and RoPE (a rotation), so
/// ‖qᵢ‖ ≤ √d_h·max|w_q| and ‖kⱼ‖ ≤ √d_h·max|w_k|, over both streams' norms in a joint block, and
/// S = d_h^−½·maxᵢ‖qᵢ‖·maxⱼ‖kⱼ‖ ≤ √d_h·max|w_q|·max|w_k| (tight up to ms/(ms + ε)).
fn flux_score_bound(
    spec: &Spec,
    t: &Trainer,
    g: &crate::families::flux::FluxGeom,
    batch: &Batch,
) -> Result<(f64, f64, f64)> {
    use crate::families::flux::params::{FLUX_FREQ, GUIDANCE, ROPE_THETA};
    use crate::families::flux::{
        double_forward, final_forward as flux_final, image_tokens, join_streams, mlp_silu,
        rope_ids, single_forward, unpack, DoubleWeights, FinalWeights, SingleWeights,
        DOUBLE_LINEARS, DOUBLE_NORMS, SINGLE_LINEARS, SINGLE_NORMS,
    };
    let F64Replay {
        d,
        micro,
        accum,
        acp,
        cfg,
    } = F64Replay::of(spec, t);
    let (dev, f) = (Device::Cpu, DType::F64);
    let max_abs = |n: &str| -> Result<f64> {
        t.parameter(&format!("{n}.weight"))?
            .abs()
            .and_then(|a| a.max_all())
            .and_then(|a| a.to_dtype(f))
            .and_then(|a| a.to_scalar::<f64>())
            .map_err(e)
    };
    let (scale, dh) = (
        crate::mutation::attention_scale(d.head_dim).abs(),
        d.head_dim as f64,
    );
    let mut bound = 0.0f64;
    let softmax = std::sync::Mutex::new(1.0f64);
    let blocks = g.double + g.single;
    for i in 0..blocks {
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
    let x_embedder = linear(t, "x_embedder")?;
    let context_embedder = linear(t, "context_embedder")?;
    let tte = "time_text_embed";
    let mlp = |n: &str| -> Result<[LinearW; 2]> {
        Ok([
            linear(t, &format!("{tte}.{n}.linear_1"))?,
            linear(t, &format!("{tte}.{n}.linear_2"))?,
        ])
    };
    let time = mlp("timestep_embedder")?;
    let guidance = if g.guidance {
        Some(mlp("guidance_embedder")?)
    } else {
        None
    };
    let text = mlp("text_embedder")?;
    let table = std::sync::Arc::new(
        crate::ops::RopeTable::new(&rope_ids(g.text_tokens, &d), &g.axes, ROPE_THETA, f)
            .map_err(e)?,
    );
    let weights =
        |prefix: String, lins: &[&str], norms: &[&str]| -> Result<(Vec<LinearW>, Vec<Tensor>)> {
            let l = lins
                .iter()
                .map(|n| linear(t, &format!("{prefix}.{n}")))
                .collect::<Result<Vec<_>>>()?;
            let w = norms
                .iter()
                .map(|n| t.parameter(&format!("{prefix}.{n}.weight")))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            Ok((l, w))
        };
    let fw = FinalWeights {
        norm_out: linear(t, "norm_out.linear")?,
        proj_out: linear(t, "proj_out")?,
    };
    let mut loss_sum = 0.0;
    for m in 0..accum {
        let mb = batch.slice(m * micro, micro)?;
        let b = mb.n;
        let (mut xs, st) = on_pool(|| -> Result<(Vec<Tensor>, Tensor)> {
            let xt = mb.noisy(&acp, f, &dev)?;
            let x0 = x_embedder
                .forward(&patchify(&xt, &d)?)?
                .reshape((b, d.tokens, d.hidden))
                .map_err(e)?;
            let c0 = context_embedder
                .forward(&mb.text_tensor(f, &dev)?)?
                .reshape((b, g.text_tokens, d.hidden))
                .map_err(e)?;
            let tf = timestep_features(&mb.timesteps, FLUX_FREQ, f, &dev)?;
            let mut temb = mlp_silu(&tf, &time[0], &time[1])?;
            if let Some(gm) = &guidance {
                let gf = timestep_features(&vec![GUIDANCE as u32; b], FLUX_FREQ, f, &dev)?;
                temb = (temb + mlp_silu(&gf, &gm[0], &gm[1])?).map_err(e)?;
            }
            let pooled = mb.pooled_tensor(f, &dev)?;
            temb = (temb + mlp_silu(&pooled, &text[0], &text[1])?).map_err(e)?;
            Ok((vec![x0, c0], temb.silu().map_err(e)?))
        })?;
        for i in 0..blocks {
            xs = if i < g.double {
                let (lin, n) = weights(
                    format!("transformer_blocks.{i}"),
                    &DOUBLE_LINEARS,
                    &DOUBLE_NORMS,
                )?;
                let w = DoubleWeights {
                    lin,
                    norms: [n[0].clone(), n[1].clone(), n[2].clone(), n[3].clone()],
                };
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
                    pair_bound(&q, &k, b, d.heads, scale, (&softmax, g.text_tokens))?;
                    let (x, c) = double_forward(&xs[0], &xs[1], &st, &table, &w, &cfg)?;
                    Ok(vec![x, c])
                })?
            } else {
                let p = format!("single_transformer_blocks.{}", i - g.double);
                let (lin, n) = weights(p, &SINGLE_LINEARS, &SINGLE_NORMS)?;
                let w = SingleWeights {
                    lin,
                    norms: [n[0].clone(), n[1].clone()],
                };
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
                    pair_bound(&q, &k, b, d.heads, scale, (&softmax, g.text_tokens))?;
                    Ok(vec![single_forward(&joint, &st, &table, &w, &cfg)?])
                })?
            };
        }
        loss_sum += on_pool(|| -> Result<f64> {
            let img = image_tokens(&xs[0], d.tokens)?;
            let out = flux_final(&img, &st, &fw, f, f)?;
            let pred = unpack(&out, b, &d)?;
            let target = mb.target(&acp, spec.recipe.prediction, f, &dev)?;
            (pred - target)
                .and_then(|r| r.sqr())
                .and_then(|r| r.mean_all())
                .and_then(|r| r.to_scalar::<f64>())
                .map_err(e)
        })?;
    }
    Ok((bound, loss_sum / accum as f64, amplification_of(softmax)))
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
        let m = ada.forward(st)?;
        let (shift, sc) = (m.narrow(1, 0, h).map_err(e)?, m.narrow(1, h, h).map_err(e)?);
        let hx = ln_modulate(x, &shift, &sc, LN_EPS, DType::F64).map_err(e)?;
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

/// [`score_bound`] for Sana: its forward replayed in f64 (embed, blocks, output side), S over
/// the softmax cross-attention to the caption (the linear self-attention has no softmax).
fn sana_score_bound(
    spec: &Spec,
    t: &Trainer,
    g: &crate::families::sana::SanaGeom,
    batch: &Batch,
) -> Result<Probe> {
    use crate::families::sana::{
        caption_forward, final_forward as sana_final, sana_block_forward, SanaBlockGeom,
        SanaBlockWeights, SanaCaptionWeights, SanaFinalWeights, SANA_FREQ,
    };
    use crate::ops::gated_residual;
    use crate::ops::linear_attention::linear_attention;
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
    let arch = crate::families::Arch::of(spec)?;
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
            let roundings = (3 + super::chain::block_stages(&arch, i as u64)) as f64;
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
            let target = mb.target(&acp, spec.recipe.prediction, f, &dev)?;
            (pred - target)
                .and_then(|r| r.sqr())
                .and_then(|r| r.mean_all())
                .and_then(|r| r.to_scalar::<f64>())
                .map_err(e)
        })?;
    }
    let amplification = amplified_tensors(spec)?
        .into_iter()
        .zip(sums.iter().flat_map(|s| {
            let (aq, ak) = s.amplification();
            [aq, ak]
        }))
        .collect();
    let kink = amplified_tensors(spec)?
        .into_iter()
        .zip(kinks.iter().flat_map(|s| [s.q.errors(), s.k.errors()]))
        .collect();
    let amplification = with_upstream(spec, amplification, f64::max)?;
    let kink = with_upstream(spec, kink, |a: [f64; 3], b: [f64; 3]| {
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

/// [`score_bound`] for Wan: its forward replayed in f64 (embed, blocks, output side), S over
/// both the self-attention (q, k after the RMSNorm and RoPE) and the cross-attention to the
/// text (after the RMSNorm).
fn wan_score_bound(
    spec: &Spec,
    t: &Trainer,
    g: &crate::families::wan::WanGeom,
    batch: &Batch,
) -> Result<(f64, f64, f64)> {
    use crate::families::wan::{
        final_forward as wan_final, patchify3d, rope_tables, text_forward, unpatchify3d,
        wan_block_forward, wan_block_qk, WanBlockWeights, WanConds, WanFinalWeights,
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
        .parameter("patch_embedding.weight")?
        .flatten_from(1)
        .map_err(e)?;
    let embed = LinearW::new(conv, t.parameter("patch_embedding.bias")?, None);
    let ce = "condition_embedder";
    let t1 = linear(t, &format!("{ce}.time_embedder.linear_1"))?;
    let t2 = linear(t, &format!("{ce}.time_embedder.linear_2"))?;
    let tp = linear(t, &format!("{ce}.time_proj"))?;
    let x1 = linear(t, &format!("{ce}.text_embedder.linear_1"))?;
    let x2 = linear(t, &format!("{ce}.text_embedder.linear_2"))?;
    let fw = WanFinalWeights {
        table: t.parameter("scale_shift_table")?,
        proj_out: linear(t, "proj_out")?,
    };
    let (cv, sv) = rope_tables(g, d.rows, d.cols);
    let half = cv.len() / d.tokens.max(1);
    let cos = Tensor::from_vec(cv, (d.tokens, half), &dev).map_err(e)?;
    let sin = Tensor::from_vec(sv, (d.tokens, half), &dev).map_err(e)?;
    let (h, s) = (d.hidden, d.tokens);
    let mut bound = 0.0f64;
    let softmax = std::sync::Mutex::new(1.0f64);
    let mut loss_sum = 0.0;
    for m in 0..accum {
        let mb = batch.slice(m * micro, micro)?;
        let b = mb.n;
        let (mut x, temb, t6, ctx) = on_pool(|| -> Result<(Tensor, Tensor, Tensor, Tensor)> {
            let xt = mb.noisy(&acp, f, &dev)?;
            let xp = patchify3d(&xt, d.in_channels, g.frames, d.rows, d.cols, d.patch)?;
            let x = embed.forward(&xp)?.reshape((b, s, h)).map_err(e)?;
            let tf = timestep_features(&mb.timesteps, g.freq, f, &dev)?;
            let temb = t2.forward(&t1.forward(&tf)?.silu().map_err(e)?)?;
            let t6 = tp.forward(&temb.silu().map_err(e)?)?;
            let ctx = text_forward(&mb.text_tensor(f, &dev)?, &x1, &x2)?;
            Ok((x, temb, t6, ctx))
        })?;
        for i in 0..d.depth {
            let p = |n: &str| linear(t, &format!("blocks.{i}.{n}"));
            let q = |n: &str| t.parameter(&format!("blocks.{i}.{n}.weight"));
            let bw = WanBlockWeights {
                table: t.parameter(&format!("blocks.{i}.scale_shift_table"))?,
                q1: p("attn1.to_q")?,
                k1: p("attn1.to_k")?,
                v1: p("attn1.to_v")?,
                o1: p("attn1.to_out.0")?,
                norm_q1: q("attn1.norm_q")?,
                norm_k1: q("attn1.norm_k")?,
                q2: p("attn2.to_q")?,
                k2: p("attn2.to_k")?,
                v2: p("attn2.to_v")?,
                o2: p("attn2.to_out.0")?,
                norm_q2: q("attn2.norm_q")?,
                norm_k2: q("attn2.norm_k")?,
                norm2: if g.cross_attn_norm {
                    Some((q("norm2")?, t.parameter(&format!("blocks.{i}.norm2.bias"))?))
                } else {
                    None
                },
                fc1: p("ffn.net.0.proj")?,
                fc2: p("ffn.net.2")?,
            };
            let conds = WanConds {
                t6: &t6,
                ctx: &ctx,
                cos: &cos,
                sin: &sin,
            };
            let (next, sb) = on_pool(|| -> Result<(Tensor, f64)> {
                let [(q1, k1), (q2, k2)] = wan_block_qk(&x, conds, &bw, &cfg)?;
                let sb1 = pair_bound(&q1, &k1, b, d.heads, scale, (&softmax, 0))?;
                let sb2 = pair_bound(&q2, &k2, b, d.heads, scale, (&softmax, 0))?;
                Ok((wan_block_forward(&x, conds, &bw, &cfg)?, sb1.max(sb2)))
            })?;
            bound = bound.max(sb);
            x = next;
        }
        loss_sum += on_pool(|| -> Result<f64> {
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
            let target = mb.target(&acp, spec.recipe.prediction, f, &dev)?;
            (pred - target)
                .and_then(|r| r.sqr())
                .and_then(|r| r.mean_all())
                .and_then(|r| r.to_scalar::<f64>())
                .map_err(e)
        })?;
    }
    Ok((bound, loss_sum / accum as f64, amplification_of(softmax)))
}
