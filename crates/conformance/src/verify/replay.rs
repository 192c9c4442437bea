//! What every family's f64 replay of the reference's first forward (the attention-score probe,
//! [`super::probe`]) is built from: the [`Probe`] it returns, the f64 setup ([`F64Replay`]),
//! weights from the trainer ([`linear`]), the score bound of one attention ([`pair_bound`]) with
//! its softmax amplification, the microbatch loss ([`mse_loss`]), and the rayon pool the trainer's steps run on ([`on_pool`]). Each
//! family's replay is in `crate::families::<family>`.

use candle_core::{DType, Device, Tensor};
use ditmem_budget::Spec;

use super::error::{Result, VerifyError};
use super::softmax::{add_sums as add_softmax_sums, Layout as SoftmaxLayout, Sums as SoftmaxSums};
use crate::diffusion::{alphas_cumprod, Batch};
use crate::error::EngineError;
use crate::layers::{AttnImpl, BlockConfig, LinearW};
use crate::model::Dims;
use crate::trainer::Trainer;

pub(crate) fn e(x: candle_core::Error) -> VerifyError {
    VerifyError::Engine(EngineError::from(x))
}

pub(crate) fn linear(t: &Trainer, name: &str) -> Result<LinearW> {
    Ok(LinearW::new(
        t.parameter(&format!("{name}.weight"))?,
        t.parameter(&format!("{name}.bias"))?,
        // LoRA's B is zero at initialisation: the adapters add nothing to the first forward.
        None,
    ))
}

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
pub(crate) fn add_softmax(
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
