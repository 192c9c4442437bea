//! What every family's f64 replay of the reference's first forward (the attention-score probe,
//! [`super::probe`]) is built from: the [`Probe`] it returns; the f64 setup ([`F64Replay`]) with
//! its microbatch loop, patch tokens and loss; weights from the trainer by name ([`linear`],
//! [`weights`]); the steps several families' blocks share ([`shift_scale_ln`],
//! [`table_modulation`], [`cross_query`], [`class_ids`]); the score bound of one attention
//! ([`pair_bound`], [`strided_bound`]) with its softmax amplification; the microbatch loss
//! ([`mse_loss`]); and the rayon pool the trainer's steps run on ([`on_pool`]). Each family's
//! replay is in `crate::families::<family>`.

use candle_core::{DType, Device, Tensor};
use ditmem_budget::Spec;

use super::error::{Result, VerifyError};
use super::softmax::{add_sums as add_softmax_sums, Layout as SoftmaxLayout, Sums as SoftmaxSums};
use crate::diffusion::{alphas_cumprod, Batch};
use crate::error::EngineError;
use crate::layers::{AttnImpl, BlockConfig, LinearW, LN_EPS};
use crate::model::{patchify, unpatchify, Dims};
use crate::ops::{gated_residual, ln_modulate};
use crate::trainer::Trainer;

pub(crate) fn e(x: candle_core::Error) -> VerifyError {
    VerifyError::Engine(EngineError::from(x))
}

/// The weight `{name}.weight` as a linear's (out, in): a convolution's (out, in, kh, kw)
/// flattened (a patch embedding over patchified latents, a 1×1 conv).
fn weight_2d(t: &Trainer, name: &str) -> Result<Tensor> {
    let w = t.parameter(&format!("{name}.weight"))?;
    if w.rank() > 2 {
        w.flatten_from(1).map_err(e)
    } else {
        Ok(w)
    }
}

/// The linear (or patch-embedding conv) `name` from the trainer's weights, with its bias.
pub(crate) fn linear(t: &Trainer, name: &str) -> Result<LinearW> {
    Ok(LinearW::new(
        weight_2d(t, name)?,
        t.parameter(&format!("{name}.bias"))?,
        // LoRA's B is zero at initialisation: the adapters add nothing to the first forward.
        None,
    ))
}

/// As [`linear`], with a zero bias where the model has none (diffusers' Sana).
pub(crate) fn linear_or_unbiased(t: &Trainer, name: &str) -> Result<LinearW> {
    let w = weight_2d(t, name)?;
    let bname = format!("{name}.bias");
    let b = if t.trained_names().contains(&bname) {
        t.parameter(&bname)?
    } else {
        Tensor::zeros(w.dim(0).map_err(e)?, w.dtype(), &Device::Cpu).map_err(e)?
    };
    Ok(LinearW::new(w, b, None))
}

/// The weights `{prefix}.{name}` of `names` (linears, norm weights), in their order, each
/// loaded by `load`.
pub(crate) fn weights<const N: usize, T>(
    prefix: &str,
    names: [&str; N],
    load: impl Fn(&str) -> Result<T>,
) -> Result<[T; N]> {
    let v = names
        .iter()
        .map(|n| load(&format!("{prefix}.{n}")))
        .collect::<Result<Vec<_>>>()?;
    v.try_into()
        .map_err(|_| super::error::bad("f64 replay", "a block's weights miscounted"))
}

/// `linear_1` and `linear_2` under `prefix`: the two linears of a diffusers MLP embedder
/// (`TimestepEmbedding`, `PixArtAlphaTextProjection`), each loaded by `load`.
pub(crate) fn mlp_linears(
    prefix: &str,
    load: impl Fn(&str) -> Result<LinearW>,
) -> Result<[LinearW; 2]> {
    weights(prefix, ["linear_1", "linear_2"], load)
}

/// The two-linear SiLU MLP of the timestep embedders (`TimestepEmbedding`): the engine's own.
pub(crate) use ditmem_engine::families::sd3::silu_mlp;

/// What the replay measures on the reference's first step.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Probe {
    /// S (see the module docs).
    pub score_bound: f64,
    /// The replay's loss, to be checked with [`super::probe::check_loss`] against the step's.
    pub loss: f64,
    /// ‖terms‖ / ‖result‖ of the softmax attentions' backward ([`super::softmax`]; 1 where
    /// none is replayed).
    pub softmax: f64,
    /// (tensor prefix, ‖terms‖ / ‖result‖) of the gradients that come out of a cancellation
    /// ([`super::cancellation`]; Sana's linear attention's `to_q` and `to_k`), in the order of
    /// `amplified_tensors`.
    pub amplification: Vec<(String, f64)>,
    /// (tensor prefix, the expected relative error per dtype of [`super::kink::KINK_DTYPES`])
    /// of the gradients behind a ReLU kink ([`super::kink`]), in the same order.
    pub kink: Vec<(String, [f64; 3])>,
}

impl Probe {
    /// The probe of a family whose replay measures only S, the loss and the softmax
    /// amplification: no cancellation, no kink.
    pub(crate) fn plain((score_bound, loss, softmax): (f64, f64, f64)) -> Probe {
        Probe {
            score_bound,
            loss,
            softmax,
            amplification: Vec::new(),
            kink: Vec::new(),
        }
    }
}

/// The largest softmax amplification gathered (1 where none).
pub(crate) fn amplification_of(largest: std::sync::Mutex<f64>) -> f64 {
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
pub(crate) fn pair_bound(
    q: &Tensor,
    k: &Tensor,
    b: usize,
    heads: usize,
    scale: f64,
    softmax: (&std::sync::Mutex<f64>, usize),
) -> Result<f64> {
    let (rq, h) = q.dims2().map_err(e)?;
    let rk = k.dim(0).map_err(e)?;
    let qv: Vec<f64> = q.flatten_all().and_then(|v| v.to_vec1()).map_err(e)?;
    let kv: Vec<f64> = k.flatten_all().and_then(|v| v.to_vec1()).map_err(e)?;
    let layout = SoftmaxLayout {
        b,
        sq: rq / b,
        sk: rk / b,
        heads,
        dh: h / heads,
        q_stride: h,
        k_stride: h,
    };
    Ok(strided_bound((&qv, &kv), layout, scale, softmax))
}

/// [`pair_bound`] on q and k as laid out in memory (a row of q every `q_stride` values, of k
/// every `k_stride`: the DiT's fused qkv holds both in one buffer).
pub(crate) fn strided_bound(
    (q, k): (&[f64], &[f64]),
    layout: SoftmaxLayout,
    scale: f64,
    (softmax, split): (&std::sync::Mutex<f64>, usize),
) -> f64 {
    let dh = layout.dh;
    let largest = |x: &[f64], s: usize, stride: usize, bi: usize, hd: usize| {
        (0..s)
            .map(|r| {
                let at = (bi * s + r) * stride + hd * dh;
                x[at..at + dh].iter().map(|v| v * v).sum::<f64>()
            })
            .fold(0.0f64, f64::max)
            .sqrt()
    };
    let mut sb = 0.0f64;
    for bi in 0..layout.b {
        for hd in 0..layout.heads {
            let lq = largest(q, layout.sq, layout.q_stride, bi, hd);
            let lk = largest(k, layout.sk, layout.k_stride, bi, hd);
            sb = sb.max(scale.abs() * lq * lk);
        }
    }
    add_softmax((q, k), layout, split, scale, softmax);
    sb
}

/// What each diffusers family's f64 forward replay (`<family>_score_bound`) starts from: the
/// trainer's dims, the microbatch and accumulation counts, the noise schedule, and a block
/// config that computes in f64 with materialized attention and no dropout.
pub(crate) struct F64Replay {
    pub d: Dims,
    pub micro: usize,
    pub accum: usize,
    pub acp: Vec<f64>,
    pub cfg: BlockConfig,
}

impl F64Replay {
    pub(crate) fn of(spec: &Spec, t: &Trainer) -> F64Replay {
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

    /// The replay of each microbatch of `batch` in turn by `micro` (given the microbatch's
    /// index, its samples and the largest softmax amplification to raise), which returns the
    /// microbatch's S and loss: S over all, the mean loss and the softmax amplification
    /// (as the trainer's step averages the microbatches' losses).
    pub(crate) fn over_microbatches(
        &self,
        batch: &Batch,
        mut micro: impl FnMut(usize, &Batch, &std::sync::Mutex<f64>) -> Result<(f64, f64)>,
    ) -> Result<(f64, f64, f64)> {
        let softmax = std::sync::Mutex::new(1.0f64);
        let (mut bound, mut loss_sum) = (0.0f64, 0.0);
        for m in 0..self.accum {
            let mb = batch.slice(m * self.micro, self.micro)?;
            let (sb, loss) = micro(m, &mb, &softmax)?;
            bound = bound.max(sb);
            loss_sum += loss;
        }
        Ok((
            bound,
            loss_sum / self.accum as f64,
            amplification_of(softmax),
        ))
    }

    /// The noisy latents of `mb` as patches, (b·s, C·p·p): what a 2-D family's patch
    /// embedding reads.
    pub(crate) fn noisy_patches(&self, mb: &Batch) -> Result<Tensor> {
        let xt = mb.noisy(&self.acp, DType::F64, &Device::Cpu)?;
        Ok(patchify(&xt, &self.d)?)
    }

    /// The image tokens (b, s, D): `embed` over `patches`, plus the position table where the
    /// family adds one.
    pub(crate) fn tokens(
        &self,
        embed: &LinearW,
        patches: &Tensor,
        b: usize,
        pos: Option<&Tensor>,
    ) -> Result<Tensor> {
        let x = embed
            .forward(patches)?
            .reshape((b, self.d.tokens, self.d.hidden))
            .map_err(e)?;
        match pos {
            Some(pos) => x.broadcast_add(pos).map_err(e),
            None => Ok(x),
        }
    }

    /// A microbatch's loss from the output side's patches `out` (b·s, C_out·p·p) of a 2-D
    /// family: unpatchified, cut to the latent channels (a learned sigma's are not in the
    /// loss), held against the target ([`mse_loss`]).
    pub(crate) fn patch_loss(&self, out: &Tensor, mb: &Batch, spec: &Spec) -> Result<f64> {
        let pred = unpatchify(out, mb.n, &self.d)?
            .narrow(1, 0, self.d.in_channels)
            .map_err(e)?;
        mse_loss(pred, mb, &self.acp, spec)
    }
}

/// LN(x) modulated by chunks 0 (shift) and 1 (scale) of `modv` (b, k·D): the input of a DiT-like
/// block's first attention (the DiT, diffusers' DiT, PixArt, Sana, Flux's AdaLayerNorm).
pub(crate) fn shift_scale_ln(x: &Tensor, modv: &Tensor) -> Result<Tensor> {
    let h = x.dim(2).map_err(e)?;
    let (shift, sc) = (
        modv.narrow(1, 0, h).map_err(e)?,
        modv.narrow(1, h, h).map_err(e)?,
    );
    ln_modulate(x, &shift, &sc, LN_EPS, DType::F64).map_err(e)
}

/// adaLN-single's modulation of a block (PixArt, Sana): the embedded timestep's six chunks
/// `t6` (b, 6·D) plus the block's own `table` (6, D).
pub(crate) fn table_modulation(t6: &Tensor, table: &Tensor) -> Result<Tensor> {
    let (six, h) = table.dims2().map_err(e)?;
    t6.broadcast_add(&table.reshape((1, six * h)).map_err(e)?)
        .map_err(e)
}

/// The query of a block's cross-attention after its self-attention (PixArt, Sana): the
/// residual x + gate·`to_out`(o), projected by `to_q`, (b·s, D).
pub(crate) fn cross_query(
    x: &Tensor,
    o: &Tensor,
    (to_out, gate): (&LinearW, &Tensor),
    to_q: &LinearW,
) -> Result<Tensor> {
    let (b, s, h) = x.dims3().map_err(e)?;
    let x1 = gated_residual(x, &to_out.forward(o)?, gate).map_err(e)?;
    Ok(to_q.forward(&x1.reshape((b * s, h)).map_err(e)?)?)
}

/// The class ids of a microbatch's samples on the CPU, a dropped label's as `null` where the
/// model has a null row: the DiT families' own lookup
/// ([`ditmem_engine::families::dit::class_ids`]).
pub(crate) fn class_ids(mb: &Batch, null: Option<u32>) -> Result<Tensor> {
    Ok(ditmem_engine::families::dit::class_ids(
        mb,
        null,
        &Device::Cpu,
    )?)
}

/// Run `f` on the rayon pool the trainer's steps run on, as they do: gemm keeps per-thread
/// packing slabs for a thread's lifetime, and the calling thread must not grow a set of its own.
pub(crate) fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        f()
    } else {
        rayon::scope(|_| f())
    }
}

/// A microbatch's loss in the f64 replay, as the trainer computes it: the mean square of the
/// prediction (already cut to the latent channels) against the schedule's target.
pub(crate) fn mse_loss(pred: Tensor, mb: &Batch, acp: &[f64], spec: &Spec) -> Result<f64> {
    let target = mb.target(acp, spec.recipe.prediction, DType::F64, &Device::Cpu)?;
    (pred - target)
        .and_then(|r| r.sqr())
        .and_then(|r| r.mean_all())
        .and_then(|r| r.to_scalar::<f64>())
        .map_err(e)
}
