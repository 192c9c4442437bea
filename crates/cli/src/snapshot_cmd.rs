//! `ditmem compare --snapshot FILE`: a PyTorch CUDA memory snapshot of the user's own run
//! (`torch.cuda.memory._dump_snapshot`) beside the `pytorch:cuda` prediction of the spec —
//! peaks, what is alive at the peak, where the timelines part — as a table, JSON and an SVG.

use std::path::Path;

use ditmem_budget::memory_snapshot::{self as ms, SnapshotComparison};
use ditmem_budget::{fmt_bytes, Budget, Runtime, Spec, SpecError};
use serde::Serialize;

use crate::args::SpecArgs;
use crate::plot::{line_chart, stacked_bar, LineChart, Marker, Series};
use crate::render::{breakdown_table, fmt_count, recipe_line, rel_err_pct, spec_line, Table};
use crate::CliError;

#[derive(Debug, Clone, Serialize)]
struct SnapshotReport<'a> {
    snapshot: String,
    /// `allocator_settings` of the snapshot, when it has them.
    allocator_settings: Option<&'a ms::AllocatorSettings>,
    #[serde(flatten)]
    comparison: &'a SnapshotComparison,
    /// The budget's categories at its (requested-bytes) peak.
    predicted_breakdown_at_peak: ditmem_budget::Breakdown,
    predicted_peak_label: &'a str,
    /// The timelines the SVG draws (allocation event since the trace began, bytes).
    timelines: Curves,
}

/// The spec a snapshot is held against: the flags' spec, on `pytorch:cuda` unless `--runtime`
/// names another runtime (which is then refused). It is built as `estimate` builds it (on
/// `pytorch:cuda` from the start, a config file without `runtime` moved there), so no `cpu`
/// section of this machine is filled in and then left beside a CUDA runtime; a config file
/// that names `ditmem-cpu` moves too, its engine CPU dropped with it. Only the engine's own
/// flags (`--cpu-threads`, `--bf16-products`, `--gemm-l2`) are refused: they describe a run
/// the snapshot is not of.
fn cuda_spec(args: &SpecArgs) -> Result<Spec, SpecError> {
    if args.cpu_threads.is_some() || args.bf16_products.is_some() || args.gemm_l2.is_some() {
        return Err(SpecError::invalid(
            "cpu",
            "--cpu-threads, --bf16-products and --gemm-l2 describe the ditmem-cpu engine's CPU, \
             but a snapshot is held against pytorch:cuda; allowed: these flags without --snapshot",
        ));
    }
    let mut spec = args.to_gpu_spec()?;
    if args.runtime.is_none() && !matches!(spec.runtime, Runtime::Pytorch { .. }) {
        spec.runtime = "pytorch:cuda".parse::<Runtime>()?;
        spec.cpu = None;
        spec.validate()?;
    }
    Ok(spec)
}

/// Read, replay, predict, compare; print and draw.
pub(crate) fn run(
    args: &SpecArgs,
    path: &Path,
    device: Option<u32>,
    plot: Option<&Path>,
    json: bool,
) -> Result<(), CliError> {
    let spec = cuda_spec(args)?;
    let shown = crate::flags::show(&path.display().to_string());
    let bytes = crate::input::read_capped("--snapshot", path, ms::MAX_SNAPSHOT_FILE_BYTES)?;
    let snap = ms::read_snapshot(&bytes)
        .map_err(|e| SpecError::invalid("--snapshot", format!("{shown}: {e}")))?;
    drop(bytes);
    if let Some(d) = device {
        let known =
            snap.device_traces.len() > d as usize || snap.segments.iter().any(|g| g.device == d);
        if !known {
            return Err(SpecError::invalid(
                "--device",
                format!(
                    "{d}: the snapshot has traces for {} device(s) and no segment on device {d}; \
                     allowed: {}",
                    snap.device_traces.len(),
                    {
                        let mut ds: Vec<u32> = (0..snap.device_traces.len() as u32)
                            .chain(snap.segments.iter().map(|g| g.device))
                            .collect();
                        ds.sort_unstable();
                        ds.dedup();
                        ds.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
                    }
                ),
            )
            .into());
        }
    }
    let budget = ditmem_budget::estimate(&spec)?;
    let predicted = ms::predicted_timeline(&spec)?.ok_or_else(|| {
        SpecError::invalid(
            "spec",
            format!(
                "the step makes more than {} allocations: too many to replay on the allocator",
                ditmem_budget::pytorch::MAX_REPLAYED_EVENTS
            ),
        )
    })?;
    let measured = ms::replay(&snap, device);
    let cmp = ms::compare(&snap, measured, predicted);
    if let Some(p) = plot {
        let svg = snapshot_svg(&spec, &snap, &cmp)?;
        crate::output::write_output("--plot", p, svg.as_bytes())?;
    }
    let report = SnapshotReport {
        snapshot: path.display().to_string(),
        allocator_settings: snap.allocator_settings.as_ref(),
        comparison: &cmp,
        predicted_breakdown_at_peak: budget.breakdown,
        predicted_peak_label: &budget.peak.label,
        timelines: curves(&snap, &cmp),
    };
    if json {
        crate::output::print_json(&report)?;
    } else {
        crate::output::say(&render(&budget, &shown, &snap, &cmp))?;
    }
    Ok(())
}

/// What `compare --snapshot` prints: the run's lines, the peaks side by side, the events that
/// stand out, where the timelines part, and what each holds at its peak.
fn render(b: &Budget, shown: &str, snap: &ms::Snapshot, c: &SnapshotComparison) -> String {
    let mut o = run_lines(b, shown, snap, c);
    o.push_str(&peaks_table(c).render());
    o.push_str(&event_lines(c));
    o.push_str(&at_peak_tables(b, &c.measured));
    o
}

/// The spec, its recipe, what the snapshot holds and what the prediction replays.
fn run_lines(b: &Budget, shown: &str, snap: &ms::Snapshot, c: &SnapshotComparison) -> String {
    let m = &c.measured;
    let p = &c.predicted;
    let mut o = String::new();
    o.push_str(&format!(
        "ditmem compare --snapshot {shown} — {}\n",
        spec_line(&b.spec)
    ));
    o.push_str(&format!("recipe: {}\n", recipe_line(&b.spec)));
    let conf = snap
        .allocator_settings
        .as_ref()
        .and_then(|s| s.alloc_conf.clone())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "(defaults)".into());
    o.push_str(&format!(
        "snapshot: device {}, {} trace events ({} allocs), {} segments ({} expandable) at the end; \
         PYTORCH_CUDA_ALLOC_CONF {conf}\n",
        m.device,
        fmt_count(m.events as u64),
        fmt_count(m.alloc_events as u64),
        m.final_segments,
        m.final_expandable_segments
    ));
    o.push_str(&format!(
        "prediction: pytorch:cuda{}{}, model load (and the cuBLAS workspace) + warm-up step + \
         measured step, {} allocation events\n\n",
        p.gpu.map(|g| format!(" on {g}")).unwrap_or_default(),
        if p.alloc_conf.is_empty() {
            String::new()
        } else {
            format!(", PYTORCH_CUDA_ALLOC_CONF {}", p.alloc_conf)
        },
        fmt_count(p.events as u64)
    ));
    o
}

/// The allocator's figures, predicted beside the snapshot's.
fn peaks_table(c: &SnapshotComparison) -> Table {
    let m = &c.measured;
    let p = &c.predicted;
    let mut t = Table::new(&["", "predicted", "snapshot", "error"]);
    for (what, p, m) in [
        ("max allocated", p.max_allocated, m.max_allocated),
        ("max reserved", p.max_reserved, m.max_reserved),
        (
            "allocated before the first step",
            p.allocated_at_step_start,
            m.allocated_before,
        ),
    ] {
        t.row(vec![
            what.into(),
            fmt_bytes(p),
            fmt_bytes(m),
            rel_err_pct(p, m, 2),
        ]);
    }
    t.row(vec![
        "reserved − allocated at the peak".into(),
        "-".into(),
        fmt_bytes(m.fragmentation_at_peak),
        "".into(),
    ]);
    t.row(vec![
        "allocated / reserved at the end".into(),
        match p.points.last() {
            Some(&(a, r)) => format!("{} / {}", fmt_bytes(a), fmt_bytes(r)),
            None => "-".into(),
        },
        format!(
            "{} / {}",
            fmt_bytes(m.final_allocated),
            fmt_bytes(m.final_reserved)
        ),
        "".into(),
    ]);
    t
}

/// The exact peaks, the out-of-memory events of either side, the frees the trace cannot place,
/// and where the cumulative allocations part.
fn event_lines(c: &SnapshotComparison) -> String {
    let m = &c.measured;
    let p = &c.predicted;
    let mut o = format!(
        "exact: max allocated predicted {} B, snapshot {} B; max reserved predicted {} B, snapshot {} B\n",
        fmt_count(p.max_allocated),
        fmt_count(m.max_allocated),
        fmt_count(p.max_reserved),
        fmt_count(m.max_reserved)
    );
    if let Some(oom) = &p.oom {
        o.push_str(&format!(
            "predicted: out of memory at event {} (a {} request) on {}\n",
            oom.event,
            fmt_bytes(oom.requested),
            p.gpu.unwrap_or("the GPU")
        ));
    }
    for oom in &m.ooms {
        o.push_str(&format!(
            "snapshot: out of memory at trace event {} ({} requested, {} free on the device, \
             {} allocated, {} reserved)\n",
            oom.event,
            fmt_bytes(oom.size),
            fmt_bytes(oom.device_free),
            fmt_bytes(oom.allocated),
            fmt_bytes(oom.reserved)
        ));
    }
    if m.frees_without_alloc > 0 {
        o.push_str(&format!(
            "snapshot: {} frees of blocks allocated before the trace began (counted as there before)\n",
            m.frees_without_alloc
        ));
    }
    o.push_str(&format!(
        "\nwhere they part (cumulative allocated since the start differs by more than {}):\n",
        fmt_bytes(c.threshold_bytes)
    ));
    match &c.parting {
        Some(x) => o.push_str(&format!(
            "  at allocation event {} of the step (trace event {}): snapshot {} ({:+} B since the start), \
             prediction {} ({:+} B)\n",
            x.step_event, x.trace_event, x.measured, x.measured_since_start, x.predicted, x.predicted_since_start
        )),
        None => o.push_str(&format!(
            "  they do not part over the {} events compared (snapshot {}, prediction {})\n",
            fmt_count(c.compared_events as u64),
            fmt_count(c.measured_step_events as u64),
            fmt_count(c.predicted_step_events as u64)
        )),
    }
    o
}

/// What the snapshot holds at its allocated peak (by origin, then its traced blocks by size) and
/// the budget's categories at its own peak.
fn at_peak_tables(b: &Budget, m: &ms::Replay) -> String {
    let mut o = String::new();
    let mut t = Table::new(&["snapshot at its allocated peak", "bytes", "blocks", "share"]);
    for x in &m.at_peak {
        t.row(vec![
            x.label.to_string(),
            fmt_bytes(x.bytes),
            if x.origin == ms::Origin::BeforeTrace {
                "-".into()
            } else {
                fmt_count(x.blocks)
            },
            crate::render::pct(x.bytes, m.max_allocated),
        ]);
    }
    o.push('\n');
    o.push_str(&t.render());
    if !m.at_peak_by_size.is_empty() {
        let mut t = Table::new(&["traced blocks at the peak, by size", "count", "bytes"]);
        for s in &m.at_peak_by_size {
            t.row(vec![
                fmt_bytes(s.size),
                fmt_count(s.count),
                fmt_bytes(s.size * s.count),
            ]);
        }
        o.push('\n');
        o.push_str(&t.render());
    }
    o.push('\n');
    o.push_str(
        &breakdown_table(
            "predicted at its peak (requested bytes)",
            &b.breakdown,
            b.peak_bytes,
        )
        .render(),
    );
    o
}

/// At most about 2 × `buckets` points: the lowest and the highest point of each bucket, in order.
fn envelope(points: &[(u64, u64)], buckets: usize) -> Vec<(u64, u64)> {
    if points.len() <= 2 * buckets {
        return points.to_vec();
    }
    let size = points.len().div_ceil(buckets);
    let mut out = Vec::with_capacity(2 * buckets + 1);
    for chunk in points.chunks(size) {
        let lo = chunk
            .iter()
            .copied()
            .min_by_key(|p| p.1)
            .unwrap_or(chunk[0]);
        let hi = chunk
            .iter()
            .copied()
            .max_by_key(|p| p.1)
            .unwrap_or(chunk[0]);
        if lo.0 <= hi.0 {
            out.push(lo);
            out.push(hi);
        } else {
            out.push(hi);
            out.push(lo);
        }
    }
    out
}

/// The four timelines over the allocation events since the trace began (x, bytes), the
/// snapshot's reserved curve also at its segment events; each thinned to its envelope of at most
/// about 2,400 points.
#[derive(Debug, Clone, Serialize)]
struct Curves {
    snapshot_allocated: Vec<(u64, u64)>,
    snapshot_reserved: Vec<(u64, u64)>,
    predicted_allocated: Vec<(u64, u64)>,
    predicted_reserved: Vec<(u64, u64)>,
}

fn curves(snap: &ms::Snapshot, c: &SnapshotComparison) -> Curves {
    let m = &c.measured;
    let p = &c.predicted;
    let trace = snap
        .device_traces
        .get(m.device as usize)
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    // The measured points at its allocation events, indexed as the comparison indexes them.
    let mut ma = vec![(0, m.allocated_before)];
    let mut mr = vec![(0, m.reserved_before)];
    let mut prev = m.allocated_before;
    let mut k = 0u64;
    for pt in &m.points {
        let counts = match trace[pt.event].action {
            ms::Action::Alloc | ms::Action::FreeRequested => true,
            ms::Action::FreeCompleted | ms::Action::Free => pt.allocated != prev,
            _ => false,
        };
        prev = pt.allocated;
        // Reserved moves on segment events between allocation events: follow it there too.
        mr.push((k, pt.reserved));
        if counts {
            k += 1;
            ma.push((k, pt.allocated));
            mr.push((k, pt.reserved));
        }
    }
    let start = p.setup_events.min(p.points.len());
    let (a0, r0) = if start == 0 {
        (0, 0)
    } else {
        p.points[start - 1]
    };
    let mut pa = vec![(0, a0)];
    let mut pr = vec![(0, r0)];
    for (i, &(a, r)) in p.points[start..].iter().enumerate() {
        pa.push((i as u64 + 1, a));
        pr.push((i as u64 + 1, r));
    }
    let thin = |v: &[(u64, u64)]| envelope(v, 1200);
    Curves {
        snapshot_allocated: thin(&ma),
        snapshot_reserved: thin(&mr),
        predicted_allocated: thin(&pa),
        predicted_reserved: thin(&pr),
    }
}

/// Measured and predicted allocated and reserved bytes over the step's allocation events, the
/// parting marked, and what the snapshot holds at its peak.
fn snapshot_svg(
    spec: &Spec,
    snap: &ms::Snapshot,
    c: &SnapshotComparison,
) -> anyhow::Result<String> {
    let m = &c.measured;
    let p = &c.predicted;
    let top = m.max_reserved.max(p.max_reserved).max(1);
    let (unit, div) = if top >= 4 << 30 {
        ("GiB", (1u64 << 30) as f64)
    } else {
        ("MiB", (1u64 << 20) as f64)
    };
    let y = |b: u64| b as f64 / div;
    let cv = curves(snap, c);
    let scale = |v: &[(u64, u64)]| -> Vec<(f64, f64)> {
        v.iter().map(|&(x, b)| (x as f64, y(b))).collect()
    };
    let series = [
        (
            "snapshot allocated",
            m.max_allocated,
            &cv.snapshot_allocated,
        ),
        ("snapshot reserved", m.max_reserved, &cv.snapshot_reserved),
        (
            "predicted allocated",
            p.max_allocated,
            &cv.predicted_allocated,
        ),
        ("predicted reserved", p.max_reserved, &cv.predicted_reserved),
    ]
    .into_iter()
    .map(|(what, max, curve)| Series {
        name: format!("{what} (max {})", fmt_bytes(max)),
        points: scale(curve),
        markers: false,
        line: true,
    })
    .collect();
    let mut markers = Vec::new();
    if let Some(x) = &c.parting {
        markers.push(Marker {
            x: (x.step_event + 1) as f64,
            label: format!("part at event {}", x.step_event),
        });
    }
    let chart = LineChart {
        title: format!(
            "{} — CUDA memory over the recorded steps (snapshot vs ditmem)",
            spec.model.name
        ),
        x_desc: "allocation event (alloc / free) since the trace began".into(),
        y_desc: unit.into(),
        series,
        markers,
        notes: Vec::new(),
        log_y: false,
    };
    let left = line_chart(&chart, (1000, 560))?;
    let segments: Vec<(String, f64)> = m
        .at_peak
        .iter()
        .filter(|x| x.bytes > 0)
        .map(|x| (x.label.to_string(), y(x.bytes)))
        .collect();
    let right = stacked_bar(
        &format!("snapshot at its allocated peak ({unit})"),
        unit,
        &segments,
        (560, 560),
    )?;
    Ok(crate::plot::side_by_side(&left, 1000, &right, 560, 560))
}
