//! Planted precision bugs, for the tests of `verify` only. Behind the cargo feature `mutations`
//! (enabled by the engine's own dev-dependency, so `cargo test` builds it and release builds of
//! the CLI do not): without it [`active`] is a constant `false` and every injection point folds
//! away. No mutation changes an allocation of a correct run.

/// A realistic precision bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mutation {
    /// The EMA shadow kept and updated in bf16 (decay 0.9999: updates vanish under rounding).
    EmaBf16,
    /// The timestep embedding's arguments t·ω computed in bf16 (t = 999 rounds to 1000).
    TimestepEmbeddingBf16,
    /// fp16-mixed without a loss scaler: small gradients underflow.
    Fp16NoLossScaling,
    /// Microbatch gradients accumulated in bf16.
    AccumulateBf16,
    /// LayerNorm statistics of bf16 activations (sum, variance, mean, rstd) computed in bf16.
    LayerNormStatsBf16,
    /// The attention softmax without the max subtraction (e^x overflows f32 above x ≈ 88.7).
    SoftmaxNoMax,
    /// The attention scale d_h^−½ applied twice (scores scaled by 1/d_h).
    AttentionScaleTwice,
    /// The gradient norm (what clipping would use) taken before unscaling the fp16 loss scale.
    GradNormBeforeUnscale,
    /// AdamW's moments m and v rounded to bf16 after every update (in place).
    AdamMomentsBf16,
    /// A recomputed block replays other dropout masks than its forward drew.
    RecomputeDropoutMask,
}

impl Mutation {
    pub const ALL: [Mutation; 10] = [
        Mutation::EmaBf16,
        Mutation::TimestepEmbeddingBf16,
        Mutation::Fp16NoLossScaling,
        Mutation::AccumulateBf16,
        Mutation::LayerNormStatsBf16,
        Mutation::SoftmaxNoMax,
        Mutation::AttentionScaleTwice,
        Mutation::GradNormBeforeUnscale,
        Mutation::AdamMomentsBf16,
        Mutation::RecomputeDropoutMask,
    ];
}

#[cfg(feature = "mutations")]
static LOGIT_GAIN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Multiply every attention score by `gain` (reference and variants alike: a correct model whose
/// attention logits have grown, as they do in training) — not a bug, the condition under which
/// [`Mutation::SoftmaxNoMax`] shows. 1 restores the model.
#[cfg(feature = "mutations")]
pub fn set_logit_gain(gain: f64) {
    let bits = if gain == 1.0 { 0 } else { gain.to_bits() };
    LOGIT_GAIN.store(bits, std::sync::atomic::Ordering::SeqCst);
}

/// The attention-score gain set by `set_logit_gain` (always 1 without the feature).
#[inline(always)]
pub(crate) fn logit_gain() -> f64 {
    #[cfg(feature = "mutations")]
    {
        match LOGIT_GAIN.load(std::sync::atomic::Ordering::Relaxed) {
            0 => 1.0,
            b => f64::from_bits(b),
        }
    }
    #[cfg(not(feature = "mutations"))]
    {
        1.0
    }
}

/// The attention score scale of a head of width `dh`: d_h^−½ (twice under
/// [`Mutation::AttentionScaleTwice`]), times [`logit_gain`].
#[inline]
pub fn attention_scale(dh: usize) -> f64 {
    let s = 1.0 / (dh as f64).sqrt();
    let s = if active(Mutation::AttentionScaleTwice) {
        s * s
    } else {
        s
    };
    s * logit_gain()
}

#[cfg(feature = "mutations")]
static ACTIVE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Plant `m` (or none) for every trainer built from now on in this process.
#[cfg(feature = "mutations")]
pub fn set(m: Option<Mutation>) {
    let v = m.map_or(0, |m| {
        1 + Mutation::ALL.iter().position(|&x| x == m).unwrap_or(0) as u8
    });
    ACTIVE.store(v, std::sync::atomic::Ordering::SeqCst);
}

/// Whether `m` is planted (always `false` without the feature).
#[inline(always)]
pub(crate) fn active(m: Mutation) -> bool {
    #[cfg(feature = "mutations")]
    {
        let v = ACTIVE.load(std::sync::atomic::Ordering::Relaxed);
        v != 0 && Mutation::ALL[(v - 1) as usize] == m
    }
    #[cfg(not(feature = "mutations"))]
    {
        let _ = m;
        false
    }
}
