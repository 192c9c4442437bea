//! Snapshots built by hand as pickles (the keys of `memory_snapshot.cpp`), read and replayed;
//! every expected number follows from the events by the counters' rules.

use std::collections::BTreeMap;

use serde_pickle::{HashableValue as H, SerOptions, Value as V};

use crate::snapshot::predict::{compare, predicted_timeline};
use crate::snapshot::read::read_snapshot;
use crate::snapshot::replay::replay;
use crate::snapshot::{Action, Origin, Replay, Snapshot, SnapshotError};
use crate::spec::{ModelSpec, Spec};

const MIB: u64 = 1 << 20;

fn dict(kv: Vec<(&str, V)>) -> V {
    let mut d = BTreeMap::new();
    for (k, v) in kv {
        d.insert(H::String(k.into()), v);
    }
    V::Dict(d)
}

fn int(v: u64) -> V {
    V::I64(v as i64)
}

fn frames(list: &[(&str, &str)]) -> V {
    V::List(
        list.iter()
            .map(|(f, n)| {
                dict(vec![
                    ("filename", V::String((*f).into())),
                    ("name", V::String((*n).into())),
                    ("line", int(1)),
                ])
            })
            .collect(),
    )
}

fn ev(action: &str, addr: u64, size: u64, fr: &[(&str, &str)]) -> V {
    let key = if action == "oom" {
        "device_free"
    } else {
        "addr"
    };
    dict(vec![
        ("action", V::String(action.into())),
        (key, int(addr)),
        ("size", int(size)),
        ("stream", int(0)),
        ("time_us", int(1)),
        ("frames", frames(fr)),
    ])
}

fn block(address: u64, size: u64, state: &str) -> V {
    dict(vec![
        ("address", int(address)),
        ("size", int(size)),
        ("requested_size", int(size)),
        ("state", V::String(state.into())),
        ("frames", V::List(vec![])),
    ])
}

fn segment(address: u64, total: u64, small: bool, expandable: bool, blocks: Vec<V>) -> V {
    dict(vec![
        ("device", int(0)),
        ("address", int(address)),
        ("total_size", int(total)),
        ("allocated_size", int(0)),
        ("active_size", int(0)),
        ("requested_size", int(0)),
        ("stream", int(0)),
        (
            "segment_type",
            V::String(if small { "small" } else { "large" }.into()),
        ),
        ("segment_pool_id", V::Tuple(vec![int(0), int(0)])),
        ("is_expandable", V::Bool(expandable)),
        ("frames", V::List(vec![])),
        ("blocks", V::List(blocks)),
    ])
}

/// A large-pool segment whose first `used` bytes are one allocated block and the rest one
/// inactive block.
fn segment_in_use(address: u64, total: u64, used: u64, expandable: bool) -> V {
    let mut blocks = Vec::new();
    if used > 0 {
        blocks.push(block(address, used, "active_allocated"));
    }
    if total > used {
        blocks.push(block(address + used, total - used, "inactive"));
    }
    segment(address, total, false, expandable, blocks)
}

/// The snapshot of `segments` and `trace`, written as a pickle and read back.
fn read(segments: Vec<V>, trace: Vec<V>) -> Snapshot {
    read_snapshot(&snapshot(segments, trace)).unwrap()
}

/// The replay of the snapshot of `segments` and `trace`.
fn replayed(segments: Vec<V>, trace: Vec<V>) -> Replay {
    replay(&read(segments, trace), None)
}

fn snapshot(segments: Vec<V>, trace: Vec<V>) -> Vec<u8> {
    let v = dict(vec![
        ("segments", V::List(segments)),
        ("device_traces", V::List(vec![V::List(trace)])),
        (
            "allocator_settings",
            dict(vec![
                (
                    "PYTORCH_CUDA_ALLOC_CONF",
                    V::String("expandable_segments:False".into()),
                ),
                ("expandable_segments", V::Bool(false)),
            ]),
        ),
    ]);
    serde_pickle::value_to_vec(&v, SerOptions::new()).unwrap()
}

const FWD: &[(&str, &str)] = &[("model.py", "forward")];
const BWD: &[(&str, &str)] = &[
    ("model.py", "forward"),
    ("torch/autograd/graph.py", "_engine_run_backward"),
];
const OPT: &[(&str, &str)] = &[("torch/optim/adamw.py", "_init_group")];

#[test]
fn an_empty_trace_replays_to_the_listed_state() {
    let r = replayed(vec![], vec![]);
    assert_eq!((r.events, r.max_allocated, r.max_reserved), (0, 0, 0));
    assert!(r.at_peak.is_empty() && r.ooms.is_empty());
    // A state without a trace: the listed blocks are what was there before.
    let r = replayed(
        vec![segment_in_use(0x1000_0000, 20 * MIB, 3 * MIB, false)],
        vec![],
    );
    assert_eq!((r.max_allocated, r.max_reserved), (3 * MIB, 20 * MIB));
    assert_eq!(r.allocated_before, 3 * MIB);
    assert_eq!(r.at_peak[0].origin, Origin::BeforeTrace);
}

/// Allocs round to 512 B, a requested free lowers allocated before it completes, segments add
/// to reserved; the model block in `segments` that the trace never allocated is "before".
#[test]
fn peaks_follow_the_allocator_counters() {
    let a = 0x7f00_0000_0000u64;
    let trace = vec![
        ev("segment_alloc", a, 20 * MIB, FWD),
        ev("alloc", a, 3_000_000, FWD),
        ev("segment_alloc", a + 20 * MIB, 2 * MIB, FWD),
        ev("alloc", a + 20 * MIB, 1000, BWD),
        ev("alloc", a + 3_000_320, 5 * MIB, OPT),
        ev("free_requested", a, 3_000_000, FWD),
        ev("free_completed", a, 3_000_000, FWD),
        ev("free_requested", a + 20 * MIB, 1000, BWD),
        ev("free_completed", a + 20 * MIB, 1000, BWD),
    ];
    let segs = vec![
        // The model: 4 MiB allocated before recording, in a segment the trace never saw.
        segment_in_use(0x5000_0000, 4 * MIB, 4 * MIB, false),
        segment(
            a,
            20 * MIB,
            false,
            false,
            vec![
                block(a, 3_000_320, "inactive"),
                block(a + 3_000_320, 5 * MIB, "active_allocated"),
                block(
                    a + 3_000_320 + 5 * MIB,
                    20 * MIB - 3_000_320 - 5 * MIB,
                    "inactive",
                ),
            ],
        ),
        segment(
            a + 20 * MIB,
            2 * MIB,
            true,
            false,
            vec![block(a + 20 * MIB, 2 * MIB, "inactive")],
        ),
    ];
    let s = read(segs, trace);
    assert_eq!(s.device_traces[0][1].action, Action::Alloc);
    let r = replay(&s, None);
    assert_eq!(r.allocated_before, 4 * MIB);
    assert_eq!(r.reserved_before, 4 * MIB);
    // 4 MiB + 3,000,320 (3,000,000 rounded) + 1,024 (1,000 rounded) + 5 MiB.
    assert_eq!(r.max_allocated, 4 * MIB + 3_000_320 + 1024 + 5 * MIB);
    assert_eq!(r.max_allocated_event, Some(4));
    assert_eq!(r.max_reserved, 4 * MIB + 22 * MIB);
    assert_eq!(r.max_requested_traced, 3_000_000 + 1000 + 5 * MIB);
    assert_eq!(r.final_allocated, 9 * MIB);
    assert_eq!(r.points.last().unwrap().allocated, 9 * MIB);
    assert_eq!(r.fragmentation_at_peak, 26 * MIB - r.max_allocated);
    let by = |o: Origin| {
        r.at_peak
            .iter()
            .find(|x| x.origin == o)
            .map_or(0, |x| x.bytes)
    };
    assert_eq!(by(Origin::BeforeTrace), 4 * MIB);
    assert_eq!(by(Origin::Forward), 3_000_320);
    assert_eq!(by(Origin::Backward), 1024);
    assert_eq!(by(Origin::OptimizerState), 5 * MIB);
}

/// An `oom` entry is kept with the counters at that moment; `device_free` is read in place of
/// `addr`.
#[test]
fn an_oom_event_is_reported() {
    let a = 0x7f00_0000_0000u64;
    let trace = vec![
        ev("segment_alloc", a, 40 * MIB, FWD),
        ev("alloc", a, 40 * MIB, FWD),
        ev("oom", 12_345, 80 * MIB, FWD),
    ];
    let r = replayed(vec![segment_in_use(a, 40 * MIB, 40 * MIB, false)], trace);
    assert_eq!(r.ooms.len(), 1);
    let o = r.ooms[0];
    assert_eq!((o.event, o.size, o.device_free), (2, 80 * MIB, 12_345));
    assert_eq!((o.allocated, o.reserved), (40 * MIB, 40 * MIB));
}

/// Expandable segments: reserved grows by mapped pages and shrinks by unmapped ones.
#[test]
fn expandable_segments_map_and_unmap() {
    let a = 0x7e00_0000_0000u64;
    let trace = vec![
        ev("segment_map", a, 20 * MIB, FWD),
        ev("alloc", a, 15 * MIB, FWD),
        ev("segment_map", a + 20 * MIB, 20 * MIB, FWD),
        ev("alloc", a + 15 * MIB, 15 * MIB, FWD),
        ev("free_requested", a + 15 * MIB, 15 * MIB, FWD),
        ev("free_completed", a + 15 * MIB, 15 * MIB, FWD),
        ev("segment_unmap", a + 20 * MIB, 20 * MIB, FWD),
    ];
    let s = read(vec![segment_in_use(a, 20 * MIB, 15 * MIB, true)], trace);
    assert!(s.segments[0].is_expandable);
    let r = replay(&s, None);
    assert_eq!(r.max_reserved, 40 * MIB);
    assert_eq!(r.max_reserved_event, Some(2));
    assert_eq!(r.max_allocated, 30 * MIB);
    assert_eq!(r.points.last().unwrap().reserved, 20 * MIB);
    assert_eq!((r.allocated_before, r.reserved_before), (0, 0));
    assert_eq!(r.final_expandable_segments, 1);
}

/// The ring buffer dropped the alloc of a block the trace frees: it counts as there before.
#[test]
fn a_free_without_its_alloc_was_there_before() {
    let a = 0x7f00_0000_0000u64;
    let trace = vec![
        ev("free_requested", a, 10 * MIB, FWD),
        ev("free_completed", a, 10 * MIB, FWD),
        ev("alloc", a, 4 * MIB, FWD),
    ];
    let r = replayed(vec![segment_in_use(a, 20 * MIB, 4 * MIB, false)], trace);
    assert_eq!(r.frees_without_alloc, 1);
    assert_eq!(r.allocated_before, 10 * MIB);
    assert_eq!(r.max_allocated, 10 * MIB);
    assert_eq!(r.points[0].allocated, 0);
    assert_eq!(r.points[2].allocated, 4 * MIB);
}

#[test]
fn wrong_keys_are_named() {
    let bad = |v: V| {
        read_snapshot(&serde_pickle::value_to_vec(&v, SerOptions::new()).unwrap()).unwrap_err()
    };
    let e = bad(V::List(vec![]));
    assert!(e.to_string().contains("expected a dict"), "{e}");
    let e = bad(dict(vec![("segments", V::List(vec![]))]));
    assert!(e.to_string().contains("missing key 'device_traces'"), "{e}");
    let e = bad(dict(vec![
        ("segments", V::List(vec![])),
        (
            "device_traces",
            V::List(vec![V::List(vec![ev("explode", 1, 2, FWD)])]),
        ),
    ]));
    assert!(e.to_string().contains("device_traces[0][0].action"), "{e}");
    let mut e0 = ev("alloc", 1, 2, FWD);
    if let V::Dict(d) = &mut e0 {
        d.insert(H::String("size".into()), V::String("big".into()));
    }
    let e = bad(dict(vec![
        ("segments", V::List(vec![])),
        ("device_traces", V::List(vec![V::List(vec![e0])])),
    ]));
    assert_eq!(
        e,
        SnapshotError::Schema {
            path: "device_traces[0][0].size".into(),
            message: "expected an int, got str".into()
        }
    );
    let e = read_snapshot(b"").unwrap_err();
    assert!(matches!(e, SnapshotError::NotPickle { .. }));
}

fn small_cuda_spec() -> Spec {
    let mut s = Spec::default_xl();
    s.model = ModelSpec::preset("dit-s-2").unwrap();
    s.workload.batch = 4;
    s.workload.microbatch = 4;
    s.runtime = "pytorch:cuda".parse().unwrap();
    s
}

/// The blocks a trace written by hand has allocated and not freed: (address, bytes).
#[derive(Default)]
struct LiveBlocks(Vec<(u64, u64)>);

impl LiveBlocks {
    /// An `alloc` of `bytes` at `addr`.
    fn alloc(&mut self, trace: &mut Vec<V>, addr: u64, bytes: u64) {
        trace.push(ev("alloc", addr, bytes, FWD));
        self.0.push((addr, bytes));
    }

    /// Free the first live block of `bytes`: `free_requested`, then `free_completed` when
    /// `completed`.
    fn free(&mut self, trace: &mut Vec<V>, bytes: u64, completed: bool) {
        let i = self.0.iter().position(|&(_, b)| b == bytes).unwrap();
        let (addr, b) = self.0.remove(i);
        trace.push(ev("free_requested", addr, b, FWD));
        if completed {
            trace.push(ev("free_completed", addr, b, FWD));
        }
    }
}

/// A snapshot written from the prediction's own events (its allocs and frees at made-up
/// addresses, its reserved steps as segment_alloc / segment_free, the model as state) agrees
/// with the prediction: same peaks, no parting.
#[test]
fn the_prediction_held_against_its_own_events_agrees() {
    let spec = small_cuda_spec();
    let p = predicted_timeline(&spec).unwrap().unwrap();
    let start = p.setup_events;
    let mut trace = Vec::new();
    let mut live = LiveBlocks::default();
    let mut next = 0x7f00_0000_0000u64;
    let (mut prev_a, mut prev_r) = p.points[start - 1];
    for (k, &(a, r)) in p.points.iter().enumerate().skip(start) {
        if r > prev_r {
            trace.push(ev("segment_alloc", next, r - prev_r, FWD));
            next += r - prev_r;
        }
        let ch = p.changes[k];
        assert_eq!(ch, a as i64 - prev_a as i64);
        if ch > 0 {
            // A block size that rounds to itself.
            live.alloc(&mut trace, next, ch as u64);
            next += ch as u64;
        } else if ch < 0 {
            live.free(&mut trace, (-ch) as u64, true);
        }
        if r < prev_r {
            trace.push(ev("segment_free", next, prev_r - r, FWD));
        }
        prev_a = a;
        prev_r = r;
    }
    let (end_a, end_r) = *p.points.last().unwrap();
    let (base_a, base_r) = p.points[start - 1];
    let s = read(vec![segment_in_use(0x1000, end_r, end_a, false)], trace);
    let r = replay(&s, None);
    assert_eq!((r.allocated_before, r.reserved_before), (base_a, base_r));
    let c = compare(&s, r, p.clone());
    assert_eq!(c.measured.max_allocated, p.max_allocated);
    assert_eq!(c.measured.max_reserved, p.max_reserved);
    assert_eq!(c.parting, None);
    assert_eq!(c.measured_step_events, c.predicted_step_events);
}

/// A measured step that keeps 64 MiB more from its first allocation parts there.
#[test]
fn a_leak_parts_the_timelines_where_it_happens() {
    let spec = small_cuda_spec();
    let p = predicted_timeline(&spec).unwrap().unwrap();
    let start = p.setup_events;
    let base = 0x7f00_0000_0000u64;
    let mut trace = vec![
        ev("segment_alloc", base, 64 * MIB, FWD),
        ev("alloc", base, 64 * MIB, FWD),
    ];
    let mut next = base + 64 * MIB;
    let mut live = LiveBlocks::default();
    for &ch in &p.changes[start..] {
        if ch > 0 {
            trace.push(ev("segment_alloc", next, ch as u64, FWD));
            live.alloc(&mut trace, next, ch as u64);
            next += ch as u64;
        } else if ch < 0 {
            live.free(&mut trace, (-ch) as u64, false);
        }
    }
    let first = p.changes[start];
    let s = read(vec![], trace);
    let r = replay(&s, None);
    let c = compare(&s, r, p);
    let part = c.parting.expect("the timelines part");
    assert_eq!(part.step_event, 0);
    assert_eq!(part.trace_event, 1);
    assert!(
        part.measured.starts_with("alloc 67108864 B"),
        "{}",
        part.measured
    );
    assert_eq!(part.measured_since_start, 64 << 20);
    assert_eq!(part.predicted_since_start, first);
}

#[test]
fn only_cuda_specs_are_predicted() {
    let mut s = small_cuda_spec();
    s.runtime = "pytorch:cpu".parse().unwrap();
    assert!(predicted_timeline(&s).is_err());
}

/// The same hand-built snapshot pickled by Python with protocols 0 to 5
/// (`tests/data/snapshot_protocols/make.py`): one reading, shared frames and a non-ASCII file
/// name included.
#[test]
fn every_pickle_protocol_reads_the_same() {
    let files: [&[u8]; 6] = [
        include_bytes!("../../tests/data/snapshot_protocols/p0.pickle"),
        include_bytes!("../../tests/data/snapshot_protocols/p1.pickle"),
        include_bytes!("../../tests/data/snapshot_protocols/p2.pickle"),
        include_bytes!("../../tests/data/snapshot_protocols/p3.pickle"),
        include_bytes!("../../tests/data/snapshot_protocols/p4.pickle"),
        include_bytes!("../../tests/data/snapshot_protocols/p5.pickle"),
    ];
    let first = read_snapshot(files[0]).unwrap();
    for (p, f) in files.iter().enumerate() {
        let s = read_snapshot(f).unwrap_or_else(|e| panic!("protocol {p}: {e}"));
        assert_eq!(s, first, "protocol {p}");
    }
    let t = &first.device_traces[0];
    assert_eq!(t.len(), 5);
    assert_eq!(t[1].addr, 0x7F12_3456_0000);
    assert_eq!(t[1].origin, Origin::Forward);
    assert_eq!(t[1].frame.as_deref(), Some("forward (train_ä.py:7)"));
    let st = first.allocator_settings.as_ref().unwrap();
    assert_eq!(st.max_split_size, Some(u64::MAX));
    let r = replay(&first, None);
    // 1,000 → 1,024 and 5,000 → 5,120; one 2 MiB small segment.
    assert_eq!((r.max_allocated, r.max_reserved), (1024 + 5120, 2 * MIB));
    assert_eq!((r.allocated_before, r.reserved_before), (0, 0));
    assert_eq!(r.final_allocated, 1024);
}

/// A large-pool block whose rest is 1 MiB or less is not split (`should_split`): allocated
/// counts the whole free block, as `max_memory_allocated` does; a rest above 1 MiB is split off.
#[test]
fn an_unsplit_block_counts_whole() {
    let a = 0x7f00_0000_0000u64;
    let b = a + 64 * MIB;
    let trace = vec![
        ev("segment_alloc", a, 12 * MIB, FWD),
        // 11,744,051 B → 11,744,256 rounded; rest 838,656 B ≤ 1 MiB: not split.
        ev("alloc", a, 11_744_051, FWD),
        ev("segment_alloc", b, 12 * MIB, FWD),
        // 10.5 MiB: rest 1.5 MiB > 1 MiB: split.
        ev("alloc", b, 10 * MIB + MIB / 2, FWD),
        ev("free_requested", a, 11_744_051, FWD),
        ev("free_completed", a, 11_744_051, FWD),
    ];
    let segs = vec![
        segment_in_use(a, 12 * MIB, 0, false),
        segment_in_use(b, 12 * MIB, 10 * MIB + MIB / 2, false),
    ];
    let r = replayed(segs, trace);
    assert_eq!(r.points[1].allocated, 12 * MIB);
    assert_eq!(r.max_allocated, 12 * MIB + 10 * MIB + MIB / 2);
    assert_eq!(r.points.last().unwrap().allocated, 10 * MIB + MIB / 2);
    assert_eq!(r.allocated_before, 0);
}
