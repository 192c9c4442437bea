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
}

impl Mutation {
    pub const ALL: [Mutation; 4] = [
        Mutation::EmaBf16,
        Mutation::TimestepEmbeddingBf16,
        Mutation::Fp16NoLossScaling,
        Mutation::AccumulateBf16,
    ];
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
pub fn active(m: Mutation) -> bool {
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
