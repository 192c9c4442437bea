//! The keys of a snapshot dict into [`Snapshot`], with one message per wrong key that names its
//! path (`device_traces[0][17].size: expected an int, got str`).

use std::rc::Rc;

use crate::snapshot::pickle::{decode, Py};
use crate::snapshot::{
    Action, AllocatorSettings, BlockInfo, BlockState, Origin, SegmentInfo, Snapshot, SnapshotError,
    TraceEvent, MAX_BLOCKS, MAX_SNAPSHOT_FILE_BYTES, MAX_TRACE_EVENTS,
};

/// Read the bytes of a `_dump_snapshot` file.
pub fn read_snapshot(bytes: &[u8]) -> Result<Snapshot, SnapshotError> {
    if bytes.len() as u64 > MAX_SNAPSHOT_FILE_BYTES {
        return Err(SnapshotError::TooLarge {
            what: format!("the file ({} bytes)", bytes.len()),
            limit: format!("{} MiB", MAX_SNAPSHOT_FILE_BYTES >> 20),
        });
    }
    // Every pickle of protocol 2 or later starts with PROTO; protocol 0/1 ones with an opcode.
    if bytes.is_empty() {
        return Err(SnapshotError::NotPickle {
            message: "the file is empty".into(),
        });
    }
    let root = decode(bytes)?;
    from_tree(&root)
}

pub(crate) fn from_tree(root: &Py) -> Result<Snapshot, SnapshotError> {
    if !matches!(root, Py::Dict(_)) {
        return Err(SnapshotError::schema(
            "top level",
            format!(
                "expected a dict with 'segments' and 'device_traces', got {}",
                root.type_name()
            ),
        ));
    }
    let segments = segments(root)?;
    let device_traces = device_traces(root)?;
    let allocator_settings = match root.get("allocator_settings") {
        None | Some(Py::None) => None,
        Some(s) => Some(settings(s)?),
    };
    Ok(Snapshot {
        segments,
        device_traces,
        allocator_settings,
    })
}

/// The `segments` list, at most [`MAX_BLOCKS`] segments and blocks together.
fn segments(root: &Py) -> Result<Vec<SegmentInfo>, SnapshotError> {
    let segs = list(req(root, "segments", "")?, "segments")?;
    let mut blocks_seen = segs.len();
    let mut segments = Vec::with_capacity(segs.len().min(MAX_BLOCKS));
    for (i, s) in segs.iter().enumerate() {
        segments.push(segment(s, &format!("segments[{i}]"), &mut blocks_seen)?);
    }
    Ok(segments)
}

/// One segment at path `p`, its blocks counted into `blocks_seen`.
fn segment(s: &Py, p: &str, blocks_seen: &mut usize) -> Result<SegmentInfo, SnapshotError> {
    let blocks = list(req(s, "blocks", p)?, &format!("{p}.blocks"))?;
    *blocks_seen += blocks.len();
    if *blocks_seen > MAX_BLOCKS {
        return Err(SnapshotError::TooLarge {
            what: "segments and blocks".into(),
            limit: format!("{MAX_BLOCKS}"),
        });
    }
    let mut bs = Vec::with_capacity(blocks.len());
    for (k, b) in blocks.iter().enumerate() {
        bs.push(block(b, &format!("{p}.blocks[{k}]"))?);
    }
    let segment_type = string(req(s, "segment_type", p)?, &format!("{p}.segment_type"))?;
    let small = match segment_type {
        "small" => true,
        "large" => false,
        other => {
            return Err(SnapshotError::schema(
                format!("{p}.segment_type"),
                format!("'{}': expected small or large", short(other)),
            ))
        }
    };
    let device = uint(req(s, "device", p)?, &format!("{p}.device"))?;
    Ok(SegmentInfo {
        device: u32::try_from(device).map_err(|_| {
            SnapshotError::schema(format!("{p}.device"), format!("{device} is not a device"))
        })?,
        address: uint(req(s, "address", p)?, &format!("{p}.address"))?,
        total_size: uint(req(s, "total_size", p)?, &format!("{p}.total_size"))?,
        allocated_size: opt_uint(s, "allocated_size", p)?.unwrap_or(0),
        active_size: opt_uint(s, "active_size", p)?.unwrap_or(0),
        requested_size: opt_uint(s, "requested_size", p)?.unwrap_or(0),
        stream: opt_uint(s, "stream", p)?.unwrap_or(0),
        small,
        is_expandable: match s.get("is_expandable") {
            None => false,
            Some(Py::Bool(b)) => *b,
            Some(v) => {
                return Err(SnapshotError::schema(
                    format!("{p}.is_expandable"),
                    format!("expected a bool, got {}", v.type_name()),
                ))
            }
        },
        blocks: bs,
    })
}

/// One block of a segment, at path `q`.
fn block(b: &Py, q: &str) -> Result<BlockInfo, SnapshotError> {
    let state = match string(req(b, "state", q)?, &format!("{q}.state"))? {
        "active_allocated" => BlockState::ActiveAllocated,
        "active_pending_free" | "active_awaiting_free" => BlockState::ActivePendingFree,
        "inactive" => BlockState::Inactive,
        other => {
            return Err(SnapshotError::schema(
                format!("{q}.state"),
                format!(
                    "'{}': expected active_allocated, active_pending_free or inactive",
                    short(other)
                ),
            ))
        }
    };
    let size = uint(req(b, "size", q)?, &format!("{q}.size"))?;
    Ok(BlockInfo {
        address: uint(req(b, "address", q)?, &format!("{q}.address"))?,
        size,
        requested_size: opt_uint(b, "requested_size", q)?.unwrap_or(size),
        state,
    })
}

/// The `device_traces` list (one list of events per device), at most [`MAX_TRACE_EVENTS`]
/// events in all.
fn device_traces(root: &Py) -> Result<Vec<Vec<TraceEvent>>, SnapshotError> {
    let traces = list(req(root, "device_traces", "")?, "device_traces")?;
    let total: usize = traces
        .iter()
        .map(|t| match &**t {
            Py::List(v) => v.len(),
            _ => 0,
        })
        .sum();
    if total > MAX_TRACE_EVENTS {
        return Err(SnapshotError::TooLarge {
            what: format!("device_traces ({total} events)"),
            limit: format!("{MAX_TRACE_EVENTS} events"),
        });
    }
    let mut device_traces = Vec::with_capacity(traces.len());
    for (d, t) in traces.iter().enumerate() {
        let p = format!("device_traces[{d}]");
        let entries = list(t, &p)?;
        let mut evs = Vec::with_capacity(entries.len());
        for (k, e) in entries.iter().enumerate() {
            evs.push(event(e, &format!("{p}[{k}]"))?);
        }
        device_traces.push(evs);
    }
    Ok(device_traces)
}

fn event(e: &Py, p: &str) -> Result<TraceEvent, SnapshotError> {
    let a = string(req(e, "action", p)?, &format!("{p}.action"))?;
    let action = Action::parse(a).ok_or_else(|| {
        SnapshotError::schema(
            format!("{p}.action"),
            format!(
                "unknown action '{}' (expected alloc, free_requested, free_completed, \
                 segment_alloc, segment_free, segment_map, segment_unmap, snapshot, oom)",
                short(a)
            ),
        )
    })?;
    let addr = match action {
        Action::Oom => opt_uint(e, "device_free", p)?.unwrap_or(0),
        Action::Snapshot | Action::Annotate => opt_uint(e, "addr", p)?.unwrap_or(0),
        _ => uint(req(e, "addr", p)?, &format!("{p}.addr"))?,
    };
    let size = match action {
        Action::Snapshot | Action::Annotate => opt_uint(e, "size", p)?.unwrap_or(0),
        _ => uint(req(e, "size", p)?, &format!("{p}.size"))?,
    };
    let time_us = match e.get("time_us") {
        None | Some(Py::None) => None,
        Some(Py::Int(t)) => i64::try_from(*t).ok(),
        Some(v) => {
            return Err(SnapshotError::schema(
                format!("{p}.time_us"),
                format!("expected an int, got {}", v.type_name()),
            ))
        }
    };
    let (origin, frame) = frames(e.get("frames"), &format!("{p}.frames"))?;
    Ok(TraceEvent {
        action,
        addr,
        size,
        stream: opt_uint(e, "stream", p)?.unwrap_or(0),
        time_us,
        origin,
        frame,
    })
}

/// The origin and innermost frame of a `frames` list of `{filename, line, name}`.
fn frames(v: Option<&Py>, p: &str) -> Result<(Origin, Option<String>), SnapshotError> {
    let fs = match v {
        None | Some(Py::None) => return Ok((Origin::Unknown, None)),
        Some(v) => list(v, p)?,
    };
    let mut named = Vec::with_capacity(fs.len());
    for (i, f) in fs.iter().enumerate() {
        let q = format!("{p}[{i}]");
        if !matches!(&**f, Py::Dict(_)) {
            return Err(SnapshotError::schema(
                q,
                format!("expected a frame dict, got {}", f.type_name()),
            ));
        }
        let name = match f.get("name") {
            Some(Py::Str(s)) => s.as_str(),
            _ => "",
        };
        let file = match f.get("filename") {
            Some(Py::Str(s)) => s.as_str(),
            _ => "",
        };
        let line = match f.get("line") {
            Some(Py::Int(l)) => *l,
            _ => 0,
        };
        named.push((file, name, line));
    }
    let origin = Origin::of_frames(named.iter().map(|(f, n, _)| (*f, *n)));
    // The innermost Python frame (C++ frames have no `.py` file).
    let top = named
        .iter()
        .find(|(f, _, _)| f.ends_with(".py"))
        .or(named.first())
        .map(|(f, n, l)| format!("{} ({}:{l})", short(n), short(f)));
    Ok((origin, top))
}

fn settings(s: &Py) -> Result<AllocatorSettings, SnapshotError> {
    let p = "allocator_settings";
    if !matches!(s, Py::Dict(_)) {
        return Err(SnapshotError::schema(
            p,
            format!("expected a dict, got {}", s.type_name()),
        ));
    }
    let alloc_conf = match s.get("PYTORCH_CUDA_ALLOC_CONF") {
        Some(Py::Str(c)) => Some(c.chars().take(400).collect()),
        _ => None,
    };
    let expandable_segments = match s.get("expandable_segments") {
        Some(Py::Bool(b)) => Some(*b),
        _ => None,
    };
    let max_split_size = match s.get("max_split_size") {
        Some(Py::Int(v)) => Some(u64::try_from(*v).unwrap_or(u64::MAX)),
        _ => None,
    };
    // `{"1": d, "2": d, "4": d, …}` keyed by the interval's MiB.
    let mut roundup = Vec::new();
    if let Some(Py::Dict(kv)) = s.get("roundup_power2_divisions") {
        let mut v: Vec<(u64, u64)> = kv
            .iter()
            .filter_map(|(k, d)| {
                let k = match &**k {
                    Py::Str(k) => k.parse().ok()?,
                    Py::Int(k) => u64::try_from(*k).ok()?,
                    _ => return None,
                };
                let d = match &**d {
                    Py::Int(d) => u64::try_from(*d).ok()?,
                    _ => return None,
                };
                Some((k, d))
            })
            .collect();
        v.sort_unstable();
        roundup = v.into_iter().map(|(_, d)| d).take(64).collect();
    }
    Ok(AllocatorSettings {
        alloc_conf,
        expandable_segments,
        max_split_size,
        roundup_power2_divisions: roundup,
    })
}

/// A string cut to 80 characters for messages.
fn short(s: &str) -> String {
    let mut t: String = s.chars().take(80).collect();
    if t.len() < s.len() {
        t.push('…');
    }
    t.replace(['\n', '\r'], " ")
}

fn req<'a>(d: &'a Py, key: &str, p: &str) -> Result<&'a Py, SnapshotError> {
    let at = if p.is_empty() {
        "top level".to_string()
    } else {
        p.to_string()
    };
    if !matches!(d, Py::Dict(_)) {
        return Err(SnapshotError::schema(
            at,
            format!("expected a dict, got {}", d.type_name()),
        ));
    }
    d.get(key)
        .ok_or_else(|| SnapshotError::schema(at, format!("missing key '{key}'")))
}

fn list<'a>(v: &'a Py, p: &str) -> Result<&'a [Rc<Py>], SnapshotError> {
    match v {
        Py::List(l) => Ok(l),
        other => Err(SnapshotError::schema(
            p,
            format!("expected a list, got {}", other.type_name()),
        )),
    }
}

fn string<'a>(v: &'a Py, p: &str) -> Result<&'a str, SnapshotError> {
    match v {
        Py::Str(s) => Ok(s),
        other => Err(SnapshotError::schema(
            p,
            format!("expected a str, got {}", other.type_name()),
        )),
    }
}

fn uint(v: &Py, p: &str) -> Result<u64, SnapshotError> {
    match v {
        Py::Int(i) => u64::try_from(*i).map_err(|_| {
            SnapshotError::schema(p, format!("{i} is not a byte count or address (0 … 2^64)"))
        }),
        other => Err(SnapshotError::schema(
            p,
            format!("expected an int, got {}", other.type_name()),
        )),
    }
}

fn opt_uint(d: &Py, key: &str, p: &str) -> Result<Option<u64>, SnapshotError> {
    match d.get(key) {
        None | Some(Py::None) => Ok(None),
        Some(v) => uint(v, &format!("{p}.{key}")).map(Some),
    }
}
