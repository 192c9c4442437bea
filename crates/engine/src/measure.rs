//! Memory measurement: a counting global allocator and the probe the trainer reads.
//!
//! [`CountingAlloc`] wraps [`std::alloc::System`] and tracks the bytes currently allocated and the
//! high-water mark with atomics (alloc, alloc_zeroed, realloc and dealloc all count). The binary
//! and the tests install it themselves:
//!
//! ```ignore
//! #[global_allocator]
//! static A: ditmem_engine::CountingAlloc = ditmem_engine::CountingAlloc::new();
//! ```
//!
//! The library only sees a [`MemoryProbe`], so it runs the same with or without the allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// CPU seconds this process has run so far, every thread's user and system time together
/// (`CLOCK_PROCESS_CPUTIME_ID`). A step's CPU time is what load from other processes moves
/// least: wall time grows with time slices lost to them, CPU time only with their cache
/// pressure (and with spin-waiting, which counts here). NaN where the clock cannot be read.
pub(crate) fn process_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through the valid pointer it is given.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Something that reports live bytes and a resettable high-water mark.
pub trait MemoryProbe: Sync {
    /// Bytes allocated now.
    fn live(&self) -> u64;
    /// Highest `live` since the last [`MemoryProbe::reset_peak`].
    fn peak(&self) -> u64;
    /// Start a new high-water mark at the current live bytes.
    fn reset_peak(&self);
}

/// A `GlobalAlloc` over the system allocator that counts live bytes and their peak.
#[derive(Debug)]
pub struct CountingAlloc {
    live: AtomicU64,
    peak: AtomicU64,
}

impl CountingAlloc {
    pub const fn new() -> Self {
        CountingAlloc {
            live: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        }
    }

    pub fn live(&self) -> u64 {
        self.live.load(Ordering::Relaxed)
    }

    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    pub fn reset_peak(&self) {
        self.peak
            .store(self.live.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    fn grow(&self, bytes: u64) {
        let now = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn shrink(&self, bytes: u64) {
        self.live.fetch_sub(bytes, Ordering::Relaxed);
    }
}

impl Default for CountingAlloc {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: every method forwards its arguments to `System`, a sound `GlobalAlloc`, unchanged and
// returns its result unchanged, so the trait's contract (layouts, pointers, zeroing, realloc's
// copy) is `System`'s; the counters around the calls are atomics that never allocate.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract (a non-zero-size layout),
        // which is passed on to `System` as is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            self.grow(layout.size() as u64);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`: the caller's layout satisfies `alloc_zeroed`'s contract.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            self.grow(layout.size() as u64);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by this allocator with `layout` (the caller's contract), and
        // every allocation of this allocator is `System`'s, so `System` may free it.
        unsafe { System.dealloc(ptr, layout) };
        self.shrink(layout.size() as u64);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` is a block of this allocator (hence of `System`) allocated with `layout`,
        // and `new_size` is valid for it (the caller's contract), passed on unchanged.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            let old = layout.size() as u64;
            let new = new_size as u64;
            if new > old {
                self.grow(new - old);
            } else {
                self.shrink(old - new);
            }
        }
        p
    }
}

impl MemoryProbe for CountingAlloc {
    fn live(&self) -> u64 {
        CountingAlloc::live(self)
    }
    fn peak(&self) -> u64 {
        CountingAlloc::peak(self)
    }
    fn reset_peak(&self) {
        CountingAlloc::reset_peak(self)
    }
}

/// The phase of a training step a measurement belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Forward,
    Backward,
    Optimizer,
}

impl Phase {
    pub const ALL: [Phase; 3] = [Phase::Forward, Phase::Backward, Phase::Optimizer];

    pub const fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
        }
    }
}

/// Live bytes at one segment boundary of a step, and when it was reached.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TimelinePoint {
    pub phase: Phase,
    /// What just finished: `embed`, `block 3`, `final`, `optimizer`, ….
    pub label: String,
    pub live_bytes: u64,
    /// Wall-clock seconds since the step began: the difference between two points is the time
    /// the segments between them took (a block's forward, its recompute and backward …).
    pub at_s: f64,
}

/// Highest live bytes seen in each phase of a step (0 when no probe was given).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PhasePeaks {
    pub forward: u64,
    pub backward: u64,
    pub optimizer: u64,
}

impl PhasePeaks {
    pub fn max(&self) -> u64 {
        self.forward.max(self.backward).max(self.optimizer)
    }

    pub fn get(&self, phase: Phase) -> u64 {
        match phase {
            Phase::Forward => self.forward,
            Phase::Backward => self.backward,
            Phase::Optimizer => self.optimizer,
        }
    }

    pub(crate) fn set(&mut self, phase: Phase, v: u64) {
        match phase {
            Phase::Forward => self.forward = self.forward.max(v),
            Phase::Backward => self.backward = self.backward.max(v),
            Phase::Optimizer => self.optimizer = self.optimizer.max(v),
        }
    }

    /// Element-wise maximum.
    pub(crate) fn merge(&mut self, other: &PhasePeaks) {
        for p in Phase::ALL {
            self.set(p, other.get(p));
        }
    }
}

/// Records the timeline and per-phase peaks of one step through an optional probe.
pub(crate) struct Recorder<'a> {
    probe: Option<&'a dyn MemoryProbe>,
    phase: Phase,
    start: std::time::Instant,
    pub timeline: Vec<TimelinePoint>,
    pub peaks: PhasePeaks,
}

impl<'a> Recorder<'a> {
    pub(crate) fn new(probe: Option<&'a dyn MemoryProbe>) -> Self {
        if let Some(p) = probe {
            p.reset_peak();
        }
        Recorder {
            probe,
            phase: Phase::Forward,
            start: std::time::Instant::now(),
            timeline: Vec::new(),
            peaks: PhasePeaks::default(),
        }
    }

    /// Close the current phase (record its peak) and start `phase` with a fresh high-water mark.
    pub(crate) fn enter(&mut self, phase: Phase) {
        if let Some(p) = self.probe {
            self.peaks.set(self.phase, p.peak());
            p.reset_peak();
        }
        self.phase = phase;
    }

    /// Record live bytes after the segment `label`.
    pub(crate) fn mark(&mut self, label: impl Into<String>) {
        if let Some(p) = self.probe {
            self.timeline.push(TimelinePoint {
                phase: self.phase,
                label: label.into(),
                live_bytes: p.live(),
                at_s: self.start.elapsed().as_secs_f64(),
            });
        }
    }

    /// Close the last phase.
    pub(crate) fn finish(mut self) -> (Vec<TimelinePoint>, PhasePeaks) {
        if let Some(p) = self.probe {
            self.peaks.set(self.phase, p.peak());
        }
        (self.timeline, self.peaks)
    }
}
