//! The prediction a snapshot is held against: the spec's `pytorch:cuda` allocation sequence
//! (`runtime/pytorch/trace.rs`: model load, a warm-up step, a measured step) replayed on the
//! simulated caching allocator (`caching_allocator.rs`) with the cuBLAS workspace first, the
//! counters read after every event, and where the measured and predicted timelines part.

use serde::Serialize;

use crate::error::SpecError;
use crate::gpu;
use crate::runtime::pytorch::caching_allocator::{
    AllocConf, AllocEvent, CachingAllocator, Oom, CUBLAS_WORKSPACE_ID_BASE,
};
use crate::runtime::pytorch::cuda::MAX_REPLAYED_EVENTS;
use crate::runtime::pytorch::trace::{allocation_sequence, setup_allocations};
use crate::snapshot::replay::Replay;
use crate::snapshot::{Action, Snapshot};
use crate::spec::{Runtime, Spec, TorchDevice};

/// The predicted counters of a `pytorch:cuda` spec, event by event.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Predicted {
    pub gpu: Option<&'static str>,
    pub alloc_conf: String,
    /// Events before the warm-up step: the cuBLAS workspace and the model's tensors.
    pub setup_events: usize,
    /// Allocation events in all (setup included).
    pub events: usize,
    pub max_allocated: u64,
    pub max_reserved: u64,
    /// Allocated and reserved bytes when the warm-up step begins.
    pub allocated_at_step_start: u64,
    pub reserved_at_step_start: u64,
    /// The first allocation that failed against the GPU's capacity, when one did.
    pub oom: Option<Oom>,
    /// (allocated, reserved) after each event, setup included.
    #[serde(skip)]
    pub points: Vec<(u64, u64)>,
    /// The change of allocated bytes each event made (+ alloc, − free).
    #[serde(skip)]
    pub changes: Vec<i64>,
}

/// The predicted timeline of a spec on `pytorch:cuda`; None when the step makes more than
/// [`MAX_REPLAYED_EVENTS`] allocations.
pub fn predicted_timeline(spec: &Spec) -> Result<Option<Predicted>, SpecError> {
    if !matches!(
        spec.runtime,
        Runtime::Pytorch {
            device: TorchDevice::Cuda,
            ..
        }
    ) {
        return Err(SpecError::invalid(
            "--runtime",
            format!(
                "'{}': a CUDA memory snapshot is held against the pytorch:cuda runtime",
                spec.runtime
            ),
        ));
    }
    let cs = spec.cuda.clone().unwrap_or_default();
    let conf = AllocConf::parse(&cs.alloc_conf)
        .map_err(|e| SpecError::invalid("cuda.alloc_conf", e.to_string()))?;
    let table = crate::denoiser::param_table(spec);
    let events = allocation_sequence(spec, &table);
    if events.len() > MAX_REPLAYED_EVENTS {
        return Ok(None);
    }
    let (g, capacity, ws) = match &cs.gpu {
        Some(name) => {
            let g = gpu::lookup(name).map_err(|e| SpecError::invalid("cuda.gpu", e.to_string()))?;
            let g = &gpu::with_memory(g, cs.gpu_memory);
            (
                Some(g.name),
                Some(g.allocator_bytes()),
                g.cublas_workspace_bytes(),
            )
        }
        None => (None, None, gpu::CUBLAS_WORKSPACE_DEFAULT),
    };
    let mut all = Vec::with_capacity(events.len() + 1);
    all.push(AllocEvent::Alloc {
        id: CUBLAS_WORKSPACE_ID_BASE,
        bytes: ws,
        stream: 0,
    });
    all.extend_from_slice(&events);
    let setup = 1 + setup_allocations(spec, &table);
    let mut a = CachingAllocator::new(conf, capacity);
    let mut points = Vec::with_capacity(all.len());
    let mut changes = Vec::with_capacity(all.len());
    let mut oom = None;
    for (k, e) in all.iter().enumerate() {
        let before = a.allocated();
        match *e {
            AllocEvent::Alloc { id, bytes, stream } => {
                if let Err(o) = a.malloc(id, bytes, stream) {
                    oom = Some(Oom { event: k, ..o });
                    break;
                }
            }
            AllocEvent::Free { id } => {
                if !a.free(id) {
                    return Err(SpecError::invalid(
                        "runtime",
                        format!("internal allocation sequence: event {k} frees id {id} twice"),
                    ));
                }
            }
        }
        points.push((a.allocated(), a.reserved()));
        changes.push(a.allocated() as i64 - before as i64);
    }
    let r = a.report();
    let at = |k: usize| {
        if k == 0 {
            (0, 0)
        } else {
            points.get(k - 1).copied().unwrap_or((0, 0))
        }
    };
    let (allocated_at_step_start, reserved_at_step_start) = at(setup.min(points.len()));
    Ok(Some(Predicted {
        gpu: g,
        alloc_conf: cs.alloc_conf,
        setup_events: setup,
        events: all.len(),
        max_allocated: r.max_allocated,
        max_reserved: r.max_reserved,
        allocated_at_step_start,
        reserved_at_step_start,
        oom,
        points,
        changes,
    }))
}

/// Where the measured and predicted allocated timelines part: the first allocation event of the
/// step (counted from the first event of the trace and the first of the warm-up step) after
/// which the change of allocated bytes since the start differs by more than the threshold.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Parting {
    /// Allocation event of the step (0-based) in both sequences.
    pub step_event: usize,
    /// Its index in the device's trace.
    pub trace_event: usize,
    /// The measured event: action, size and innermost frame.
    pub measured: String,
    /// The predicted event: alloc or free and its bytes.
    pub predicted: String,
    /// Change of allocated bytes since the start of the step, measured and predicted.
    pub measured_since_start: i64,
    pub predicted_since_start: i64,
}

/// A snapshot beside the prediction.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SnapshotComparison {
    pub measured: Replay,
    pub predicted: Predicted,
    /// Predicted / measured − 1 of the peaks.
    pub allocated_rel_error: f64,
    pub reserved_rel_error: f64,
    /// The parting threshold: 1 % of the measured allocated peak, at least 1 MiB.
    pub threshold_bytes: u64,
    /// Allocation events compared (the shorter of the two sequences).
    pub compared_events: usize,
    pub measured_step_events: usize,
    pub predicted_step_events: usize,
    pub parting: Option<Parting>,
}

fn rel(p: u64, m: u64) -> f64 {
    if m == 0 {
        0.0
    } else {
        p as f64 / m as f64 - 1.0
    }
}

/// Hold a replayed snapshot against a predicted timeline.
pub fn compare(snapshot: &Snapshot, measured: Replay, predicted: Predicted) -> SnapshotComparison {
    let empty = Vec::new();
    let trace = snapshot
        .device_traces
        .get(measured.device as usize)
        .unwrap_or(&empty);
    // The measured allocation events: allocs, requested frees, and completed frees that the
    // counters saw (none was requested before).
    let mut meas: Vec<(usize, u64)> = Vec::new();
    let mut prev = measured.allocated_before;
    for p in &measured.points {
        let e = &trace[p.event];
        let counts = match e.action {
            Action::Alloc | Action::FreeRequested => true,
            Action::FreeCompleted | Action::Free => p.allocated != prev,
            _ => false,
        };
        if counts {
            meas.push((p.event, p.allocated));
        }
        prev = p.allocated;
    }
    let start = predicted.setup_events.min(predicted.points.len());
    let pred = &predicted.points[start..];
    let pred_base = predicted.allocated_at_step_start as i64;
    let meas_base = measured.allocated_before as i64;
    let threshold = (measured.max_allocated / 100).max(1 << 20);
    let n = meas.len().min(pred.len());
    let mut parting = None;
    for k in 0..n {
        let m = meas[k].1 as i64 - meas_base;
        let q = pred[k].0 as i64 - pred_base;
        if (m - q).unsigned_abs() > threshold {
            let e = &trace[meas[k].0];
            let mut measured_desc = format!("{} {} B", e.action.name(), e.size);
            if let Some(f) = &e.frame {
                measured_desc.push_str(&format!(" at {f}"));
            }
            let ch = predicted.changes[start + k];
            let predicted_desc = if ch >= 0 {
                format!("alloc {} B", ch)
            } else {
                format!("free {} B", -ch)
            };
            parting = Some(Parting {
                step_event: k,
                trace_event: meas[k].0,
                measured: measured_desc,
                predicted: predicted_desc,
                measured_since_start: m,
                predicted_since_start: q,
            });
            break;
        }
    }
    SnapshotComparison {
        allocated_rel_error: rel(predicted.max_allocated, measured.max_allocated),
        reserved_rel_error: rel(predicted.max_reserved, measured.max_reserved),
        threshold_bytes: threshold,
        compared_events: n,
        measured_step_events: meas.len(),
        predicted_step_events: pred.len(),
        parting,
        measured,
        predicted,
    }
}
