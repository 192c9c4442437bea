//! One device's trace replayed into the allocator's counters, event by event.
//!
//! - allocated (`memory_allocated`): `alloc` adds its block — the request rounded as the
//!   allocator rounds it (`round_size`, with the snapshot's `roundup_power2_divisions`), or the
//!   whole free block it was cut from when the rest is too small to split (a large-pool rest of
//!   1 MiB or less), found from the segments and blocks around its address; `free_requested` takes it
//!   away (`DeviceCachingAllocator::free` lowers `allocated_bytes` before it records the event);
//!   a `free_completed` (or PyTorch 2.0's `free`) with no `free_requested` before it does so too.
//! - reserved (`memory_reserved`): `segment_alloc` / `segment_map` add their size,
//!   `segment_free` / `segment_unmap` take it away.
//! - what was there before the trace begins (blocks allocated before recording, or whose alloc
//!   fell out of the ring buffer) is the state in `segments` less what the trace adds up to:
//!   the counters at the end of the trace equal the state the snapshot lists.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::Serialize;

use crate::runtime::pytorch::caching_allocator::{
    round_size, AllocConf, MIN_BLOCK_SIZE, SMALL_SIZE,
};
use crate::snapshot::{Action, BlockState, Origin, Snapshot, TraceEvent};

/// The counters after one trace event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TimelinePoint {
    /// Index of the event in the device's trace.
    pub event: usize,
    pub allocated: u64,
    pub reserved: u64,
}

/// Bytes alive at the allocated peak, by what made them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OriginBytes {
    pub origin: Origin,
    pub label: &'static str,
    pub bytes: u64,
    pub blocks: u64,
}

/// Blocks alive at the allocated peak of one (rounded) size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BlockSizeCount {
    pub size: u64,
    pub count: u64,
}

/// An `oom` entry of the trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct OomEvent {
    pub event: usize,
    /// The (rounded) request that failed.
    pub size: u64,
    /// What CUDA reported free.
    pub device_free: u64,
    pub allocated: u64,
    pub reserved: u64,
}

/// A device's trace replayed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Replay {
    pub device: u32,
    /// Trace entries of the device.
    pub events: usize,
    pub alloc_events: usize,
    /// Allocated and reserved bytes before the first event.
    pub allocated_before: u64,
    pub reserved_before: u64,
    /// `max_memory_allocated` over the trace (rounded blocks) and the event where it is reached.
    pub max_allocated: u64,
    pub max_allocated_event: Option<usize>,
    /// Peak of the requested bytes of the traced allocations, above `allocated_before`.
    pub max_requested_traced: u64,
    pub max_reserved: u64,
    pub max_reserved_event: Option<usize>,
    /// The state the snapshot lists (its `segments` on this device).
    pub final_allocated: u64,
    pub final_reserved: u64,
    pub final_segments: usize,
    pub final_expandable_segments: usize,
    /// Reserved − allocated when allocated peaks.
    pub fragmentation_at_peak: u64,
    /// Alive at the allocated peak, by origin (largest first), and by block size (the ten most
    /// bytes).
    pub at_peak: Vec<OriginBytes>,
    pub at_peak_by_size: Vec<BlockSizeCount>,
    /// Frees of blocks the trace never saw allocated.
    pub frees_without_alloc: usize,
    pub ooms: Vec<OomEvent>,
    /// After each trace event (not in JSON: `compare --snapshot --json` gives the thinned
    /// timelines).
    #[serde(skip)]
    pub points: Vec<TimelinePoint>,
}

/// The allocator settings a snapshot was recorded with, as far as they change rounding.
pub(crate) fn conf_of(s: &Snapshot) -> AllocConf {
    let mut conf = AllocConf::default();
    if let Some(st) = &s.allocator_settings {
        for (k, d) in st.roundup_power2_divisions.iter().enumerate() {
            if k < conf.roundup_power2_divisions.len() {
                conf.roundup_power2_divisions[k] = *d;
            }
        }
        conf.expandable_segments = st.expandable_segments.unwrap_or(false);
        if let Some(m) = st.max_split_size {
            conf.max_split_size = m;
        }
    }
    conf
}

/// Where blocks sit, as far as the snapshot tells: the reserved address ranges (segments the
/// state lists and the trace never allocates, and those the trace allocates or maps) and the
/// blocks alive (those the state lists and the trace never touches, and the traced ones), so that
/// an alloc's block is sized as `alloc_found_block` sizes it: the request rounded, or the whole
/// free block when the rest is too small to split (`should_split`). Where the snapshot does not
/// tell (a segment freed before its end, unknown blocks), the block is the rounded request.
struct Layout {
    /// Start → end of reserved ranges.
    ranges: BTreeMap<u64, u64>,
    /// Start → end of blocks alive.
    blocks: BTreeMap<u64, u64>,
}

impl Layout {
    fn new(s: &Snapshot, device: u32, trace: &[TraceEvent]) -> Layout {
        let mut touched = HashSet::new();
        let mut seg_events = HashSet::new();
        for e in trace {
            match e.action {
                Action::SegmentAlloc
                | Action::SegmentMap
                | Action::SegmentFree
                | Action::SegmentUnmap => {
                    seg_events.insert(e.addr);
                }
                Action::Alloc | Action::FreeRequested | Action::FreeCompleted | Action::Free => {
                    touched.insert(e.addr);
                }
                _ => {}
            }
        }
        let mut l = Layout {
            ranges: BTreeMap::new(),
            blocks: BTreeMap::new(),
        };
        for g in s.segments.iter().filter(|g| g.device == device) {
            if !seg_events.contains(&g.address) {
                l.ranges
                    .insert(g.address, g.address.saturating_add(g.total_size));
            }
            for b in &g.blocks {
                if b.state != BlockState::Inactive && !touched.contains(&b.address) {
                    l.blocks.insert(b.address, b.address.saturating_add(b.size));
                }
            }
        }
        l
    }

    /// The bytes the block of an alloc at `addr` of `rounded` bytes takes.
    fn block_size(&self, addr: u64, rounded: u64, conf: &AllocConf) -> u64 {
        let Some((_, &end)) = self.ranges.range(..=addr).next_back() else {
            return rounded;
        };
        if end <= addr {
            return rounded;
        }
        let next = self
            .blocks
            .range(addr + 1..)
            .next()
            .map_or(end, |(&b, _)| b.min(end));
        let free = next - addr;
        if free < rounded {
            return rounded;
        }
        let rest = free - rounded;
        let split = if rounded <= SMALL_SIZE || conf.expandable_segments {
            rest >= MIN_BLOCK_SIZE
        } else {
            rounded < conf.max_split_size && rest > SMALL_SIZE
        };
        if split {
            rounded
        } else {
            free
        }
    }

    fn segment(&mut self, e: &TraceEvent) {
        let (a, end) = (e.addr, e.addr.saturating_add(e.size));
        match e.action {
            Action::SegmentAlloc => {
                self.ranges.insert(a, end);
            }
            Action::SegmentMap => {
                // Pages mapped at the end of an expandable segment extend it.
                let prev = self
                    .ranges
                    .range(..=a)
                    .next_back()
                    .filter(|(_, &x)| x == a)
                    .map(|(&s, _)| s);
                match prev {
                    Some(s) => {
                        self.ranges.insert(s, end);
                    }
                    None => {
                        self.ranges.insert(a, end);
                    }
                }
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                let hit = self
                    .ranges
                    .range(..=a)
                    .next_back()
                    .filter(|(_, &x)| x > a)
                    .map(|(&s, &x)| (s, x));
                if let Some((s, x)) = hit {
                    self.ranges.remove(&s);
                    if s < a {
                        self.ranges.insert(s, a);
                    }
                    if end < x {
                        self.ranges.insert(end, x);
                    }
                }
            }
            _ => {}
        }
    }
}

/// The device a replay should look at: the one with the most trace events (then the lowest).
pub(crate) fn busiest_device(s: &Snapshot) -> u32 {
    let mut best = (0usize, 0u32);
    for (d, t) in s.device_traces.iter().enumerate() {
        if t.len() > best.0 {
            best = (t.len(), d as u32);
        }
    }
    if best.0 == 0 {
        if let Some(seg) = s.segments.iter().min_by_key(|g| g.device) {
            return seg.device;
        }
    }
    best.1
}

struct Live {
    rounded: u64,
    requested: u64,
    origin: Origin,
}

/// Replay the trace of `device` (None: the busiest one): a first pass for the counters' net
/// change after each event, anchored to the state the snapshot lists; a second up to the
/// allocated peak for what is alive there.
pub fn replay(s: &Snapshot, device: Option<u32>) -> Replay {
    let device = device.unwrap_or_else(|| busiest_device(s));
    let conf = conf_of(s);
    let empty = Vec::new();
    let trace: &Vec<TraceEvent> = s.device_traces.get(device as usize).unwrap_or(&empty);
    let listed = Listed::of(s, device);
    let net = NetChanges::of(s, device, trace, &conf);
    let before_alloc = (listed.allocated as i128 - net.alloc)
        .max(-net.low_alloc)
        .max(0);
    let before_res = (listed.reserved as i128 - net.reserved)
        .max(-net.low_res)
        .max(0);
    let peaks = Peaks::of(trace, &net.deltas, before_alloc, before_res);
    // Pass 2: what is alive at the allocated peak.
    let mut tracker = Tracker::new(s, device, trace, &conf);
    let end = peaks.max_a_at.map_or(0, |k| k + 1);
    for e in &trace[..end] {
        tracker.step(e);
    }
    let (at_peak, at_peak_by_size) = alive_at_peak(&tracker.live, peaks.max_a as u64);
    Replay {
        device,
        events: trace.len(),
        alloc_events: net.alloc_events,
        allocated_before: before_alloc as u64,
        reserved_before: before_res as u64,
        max_allocated: peaks.max_a as u64,
        max_allocated_event: peaks.max_a_at,
        max_requested_traced: net.max_requested.max(0) as u64,
        max_reserved: peaks.max_r as u64,
        max_reserved_event: peaks.max_r_at,
        final_allocated: listed.allocated,
        final_reserved: listed.reserved,
        final_segments: listed.segments,
        final_expandable_segments: listed.expandable,
        fragmentation_at_peak: peaks.frag as u64,
        at_peak,
        at_peak_by_size,
        frees_without_alloc: net.frees_without_alloc,
        ooms: peaks.ooms,
        points: peaks.points,
    }
}

/// The state the snapshot lists for one device (its `segments`): bytes of active blocks,
/// bytes reserved, segments and expandable segments.
struct Listed {
    allocated: u64,
    reserved: u64,
    segments: usize,
    expandable: usize,
}

impl Listed {
    fn of(s: &Snapshot, device: u32) -> Listed {
        let mut l = Listed {
            allocated: 0,
            reserved: 0,
            segments: 0,
            expandable: 0,
        };
        for g in s.segments.iter().filter(|g| g.device == device) {
            l.reserved += g.total_size;
            l.segments += 1;
            l.expandable += usize::from(g.is_expandable);
            l.allocated += g
                .blocks
                .iter()
                .filter(|b| b.state == BlockState::ActiveAllocated)
                .map(|b| b.size)
                .sum::<u64>();
        }
        l
    }
}

/// Pass 1: the counters' net change after each event (blocks that were there before the trace
/// counted as they go), their lows and the requested bytes' high.
struct NetChanges {
    /// (allocated, reserved) after each event, relative to before the trace.
    deltas: Vec<(i128, i128)>,
    /// After the last event.
    alloc: i128,
    reserved: i128,
    low_alloc: i128,
    low_res: i128,
    max_requested: i128,
    alloc_events: usize,
    frees_without_alloc: usize,
}

impl NetChanges {
    fn of(s: &Snapshot, device: u32, trace: &[TraceEvent], conf: &AllocConf) -> NetChanges {
        let mut tracker = Tracker::new(s, device, trace, conf);
        let mut n = NetChanges {
            deltas: Vec::with_capacity(trace.len()),
            alloc: 0,
            reserved: 0,
            low_alloc: 0,
            low_res: 0,
            max_requested: 0,
            alloc_events: 0,
            frees_without_alloc: 0,
        };
        for e in trace {
            let (da, dr) = tracker.step(e);
            n.alloc_events += usize::from(e.action == Action::Alloc);
            n.alloc += da;
            n.reserved += dr;
            n.max_requested = n.max_requested.max(tracker.requested);
            n.low_alloc = n.low_alloc.min(n.alloc);
            n.low_res = n.low_res.min(n.reserved);
            n.deltas.push((n.alloc, n.reserved));
        }
        n.frees_without_alloc = tracker.frees_without_alloc;
        n
    }
}

/// The counters after each event (from the bytes there before the trace), their highs and the
/// events where they are reached, the fragmentation at the allocated high, and the trace's OOMs.
struct Peaks {
    points: Vec<TimelinePoint>,
    max_a: i128,
    max_a_at: Option<usize>,
    max_r: i128,
    max_r_at: Option<usize>,
    frag: i128,
    ooms: Vec<OomEvent>,
}

impl Peaks {
    fn of(
        trace: &[TraceEvent],
        deltas: &[(i128, i128)],
        before_alloc: i128,
        before_res: i128,
    ) -> Peaks {
        let mut p = Peaks {
            points: Vec::with_capacity(trace.len()),
            max_a: before_alloc,
            max_a_at: None,
            max_r: before_res,
            max_r_at: None,
            frag: (before_res - before_alloc).max(0),
            ooms: Vec::new(),
        };
        for (k, (a, r)) in deltas.iter().enumerate() {
            let a = before_alloc + a;
            let r = before_res + r;
            if a > p.max_a {
                p.max_a = a;
                p.max_a_at = Some(k);
                p.frag = (r - a).max(0);
            }
            if r > p.max_r {
                p.max_r = r;
                p.max_r_at = Some(k);
            }
            if trace[k].action == Action::Oom {
                p.ooms.push(OomEvent {
                    event: k,
                    size: trace[k].size,
                    device_free: trace[k].addr,
                    allocated: a as u64,
                    reserved: r as u64,
                });
            }
            p.points.push(TimelinePoint {
                event: k,
                allocated: a as u64,
                reserved: r as u64,
            });
        }
        p
    }
}

/// The blocks `live` at the allocated peak of `max_allocated` bytes, by origin (largest first;
/// what the traced blocks leave of the peak was there before the trace) and by block size (the
/// ten most bytes).
fn alive_at_peak(
    live: &HashMap<u64, Live>,
    max_allocated: u64,
) -> (Vec<OriginBytes>, Vec<BlockSizeCount>) {
    let mut by: HashMap<Origin, (u64, u64)> = HashMap::new();
    let mut sizes: HashMap<u64, u64> = HashMap::new();
    let traced: u64 = live.values().map(|l| l.rounded).sum();
    for l in live.values() {
        let e = by.entry(l.origin).or_default();
        e.0 += l.rounded;
        e.1 += 1;
        *sizes.entry(l.rounded).or_default() += 1;
    }
    // Whatever the peak holds beyond the traced blocks was there before the trace.
    let before = max_allocated.saturating_sub(traced);
    if before > 0 {
        by.entry(Origin::BeforeTrace).or_default().0 += before;
    }
    let mut at_peak: Vec<OriginBytes> = by
        .into_iter()
        .map(|(origin, (bytes, blocks))| OriginBytes {
            origin,
            label: origin.name(),
            bytes,
            blocks,
        })
        .collect();
    at_peak.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.origin.cmp(&b.origin)));
    let mut by_size: Vec<BlockSizeCount> = sizes
        .into_iter()
        .map(|(size, count)| BlockSizeCount { size, count })
        .collect();
    by_size.sort_by(|a, b| {
        (b.size * b.count)
            .cmp(&(a.size * a.count))
            .then(b.size.cmp(&a.size))
    });
    by_size.truncate(10);
    (at_peak, by_size)
}

/// The blocks alive as the events go: where they sit, which are alive (and which are freed but
/// not yet completed), the requested bytes of the traced ones, and the frees of blocks the
/// trace never saw allocated.
struct Tracker<'c> {
    conf: &'c AllocConf,
    layout: Layout,
    live: HashMap<u64, Live>,
    pending: HashMap<u64, Live>,
    requested: i128,
    frees_without_alloc: usize,
}

impl<'c> Tracker<'c> {
    fn new(s: &Snapshot, device: u32, trace: &[TraceEvent], conf: &'c AllocConf) -> Tracker<'c> {
        Tracker {
            conf,
            layout: Layout::new(s, device, trace),
            live: HashMap::new(),
            pending: HashMap::new(),
            requested: 0,
            frees_without_alloc: 0,
        }
    }

    /// A block leaves the layout and the live set.
    fn take(&mut self, addr: u64) -> Option<Live> {
        self.layout.blocks.remove(&addr);
        self.live.remove(&addr)
    }

    /// One event's change of (allocated, reserved), tracking which blocks are alive.
    fn step(&mut self, e: &TraceEvent) -> (i128, i128) {
        let conf = self.conf;
        match e.action {
            Action::Alloc => {
                let rounded = self
                    .layout
                    .block_size(e.addr, round_size(e.size, conf), conf);
                self.layout
                    .blocks
                    .insert(e.addr, e.addr.saturating_add(rounded));
                let old = self.live.insert(
                    e.addr,
                    Live {
                        rounded,
                        requested: e.size,
                        origin: e.origin,
                    },
                );
                self.pending.remove(&e.addr);
                self.requested += e.size as i128;
                // An address allocated twice without a free: the first block's free was lost.
                let back = old.map_or(0, |o| {
                    self.requested -= o.requested as i128;
                    o.rounded as i128
                });
                (rounded as i128 - back, 0)
            }
            Action::FreeRequested => match self.take(e.addr) {
                Some(l) => {
                    self.requested -= l.requested as i128;
                    let r = l.rounded as i128;
                    self.pending.insert(e.addr, l);
                    (-r, 0)
                }
                None => {
                    self.frees_without_alloc += 1;
                    // Mark it so that its free_completed does not count it again.
                    self.pending.insert(
                        e.addr,
                        Live {
                            rounded: 0,
                            requested: 0,
                            origin: Origin::BeforeTrace,
                        },
                    );
                    (-(round_size(e.size, conf) as i128), 0)
                }
            },
            Action::FreeCompleted | Action::Free => {
                self.layout.blocks.remove(&e.addr);
                if self.pending.remove(&e.addr).is_some() {
                    return (0, 0);
                }
                match self.live.remove(&e.addr) {
                    Some(l) => {
                        self.requested -= l.requested as i128;
                        (-(l.rounded as i128), 0)
                    }
                    None => {
                        self.frees_without_alloc += 1;
                        (-(round_size(e.size, conf) as i128), 0)
                    }
                }
            }
            Action::SegmentAlloc | Action::SegmentMap => {
                self.layout.segment(e);
                (0, e.size as i128)
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                self.layout.segment(e);
                (0, -(e.size as i128))
            }
            Action::Snapshot | Action::Oom | Action::Annotate => (0, 0),
        }
    }
}
