//! Phase times of `plan` and `estimate`, for finding where their time goes: with
//! `DITMEM_PROFILE=1` in the environment each phase's calls, events and seconds (summed over
//! threads) go to stderr when the command ends ([`report`]). Off (one relaxed load per phase)
//! otherwise; nothing here changes a result.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;
use std::time::Instant;

/// A timed phase.
#[derive(Debug, Clone, Copy)]
pub enum Phase {
    /// Building a step's allocation sequence (`runtime/pytorch/trace.rs`).
    Sequence,
    /// Replaying a sequence on the caching allocator (`caching_allocator.rs`).
    Replay,
    /// The step timeline (allocated bytes, `timeline.rs`).
    Timeline,
}

const PHASES: [(Phase, &str); 3] = [
    (Phase::Sequence, "allocation sequence"),
    (Phase::Replay, "allocator replay"),
    (Phase::Timeline, "step timeline"),
];

static NANOS: [AtomicU64; 3] = [const { AtomicU64::new(0) }; 3];
static CALLS: [AtomicU64; 3] = [const { AtomicU64::new(0) }; 3];
static EVENTS: [AtomicU64; 3] = [const { AtomicU64::new(0) }; 3];

/// Whether `DITMEM_PROFILE` is set (to anything but `0` or empty).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("DITMEM_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0"))
}

/// `f()`, timed under `phase` when profiling; `events` counts what it walked.
pub fn time<R>(phase: Phase, events: impl FnOnce(&R) -> u64, f: impl FnOnce() -> R) -> R {
    if !enabled() {
        return f();
    }
    let t = Instant::now();
    let r = f();
    let i = phase as usize;
    NANOS[i].fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
    CALLS[i].fetch_add(1, Relaxed);
    EVENTS[i].fetch_add(events(&r), Relaxed);
    r
}

/// Print the phases to stderr (when profiling), with the command's own wall time.
pub fn report(command: &str, wall_s: f64) {
    if !enabled() {
        return;
    }
    eprintln!("ditmem profile: {command} {wall_s:.3} s wall");
    for (p, name) in PHASES {
        let i = p as usize;
        eprintln!(
            "  {name:<20} {:>6} calls {:>10} events {:>8.3} s",
            CALLS[i].load(Relaxed),
            EVENTS[i].load(Relaxed),
            NANOS[i].load(Relaxed) as f64 * 1e-9
        );
    }
}
