//! Process-wide settings of the thread pools the step runs on.
//!
//! Two pools work in a step: rayon's (the engine's kernels, `gemm`) and candle's barrier pool
//! (candle's own elementwise ops, such as the `add`s of its backward). After each op a barrier
//! worker spins before it parks, 25,000 rounds by default (candle 0.11), while the next kernel
//! already runs on rayon's threads: with as many rayon threads as cores, that spinning takes a
//! core from them. The engine shortens it to [`BARRIER_SPIN`] rounds (measured side by side,
//! alternating runs of `ditmem run` on DiT-S/2 at 256², batch 2, bf16-mixed, no recompute,
//! materialized attention, AMD EPYC with 2 threads, release: step p50 0.45–0.47 s with the
//! default, 0.41–0.43 s with 1,000; 0, 200 and 5,000 rounds were no better).

/// Spin rounds of candle's barrier-pool workers before they park.
pub(crate) const BARRIER_SPIN: u32 = 1000;

/// The environment variable candle 0.11 reads once, when its barrier pool starts.
pub(crate) const BARRIER_SPIN_VAR: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";

/// Sets the engine's thread settings that the environment leaves unset. Call it first thing in
/// `main`, before any thread exists (it writes the process environment, which is only sound
/// while the process has one thread). Returns the spin limit in force.
pub fn configure_before_threads() -> u32 {
    match std::env::var(BARRIER_SPIN_VAR)
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(v) => v,
        None => {
            std::env::set_var(BARRIER_SPIN_VAR, BARRIER_SPIN.to_string());
            BARRIER_SPIN
        }
    }
}

/// The spin limit candle's barrier pool runs with (the environment's, else candle's default).
pub fn barrier_spin() -> u32 {
    std::env::var(BARRIER_SPIN_VAR)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(25_000)
}
