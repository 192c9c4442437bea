//! The timeline SVG of `compare --plot` and `estimate --plot`: live bytes over the step's
//! predicted time, phases shaded, the measurement beside it when there is one.

use ditmem_budget::{fmt_bytes, Budget, Phase};
use ditmem_conformance::agree::Agreement;
use ditmem_engine::Measurement;

use crate::plot::{timeline_chart, Rule, Span, TimelineChart};
use crate::render::{recipe_line, spec_line};

/// Where a timeline's times come from: the device the spec runs on (a CUDA spec on its GPU, an
/// A100 80 GB when it names none; the engine on this project's measured CPU profile), and the
/// words naming it on the axis.
fn time_profile(spec: &ditmem_budget::Spec) -> (ditmem_budget::DeviceProfile, String) {
    use ditmem_budget::{DeviceProfile, Runtime, TorchDevice};
    if let Runtime::Pytorch {
        device: TorchDevice::Cuda,
        ..
    } = spec.runtime
    {
        let named = spec.cuda.as_ref().and_then(|c| c.gpu.as_deref());
        if let Ok(g) = ditmem_budget::gpu::lookup(named.unwrap_or("a100-80gb")) {
            let how = if named.is_some() { "" } else { ", no --gpu" };
            return (
                DeviceProfile::for_gpu(g),
                format!("{} roofline{how}", g.name),
            );
        }
    }
    let p = DeviceProfile::cpu_default();
    let name = p.name.split(" (").next().unwrap_or("cpu").to_string();
    (p, format!("{name} profile"))
}

/// The predicted time of each event: the step's phases laid end to end with the durations the
/// time model predicts (per microbatch: encode, forward, backward with its recompute; then the
/// optimizer with the gradients' communication), the events of a phase spread evenly over it.
/// Returns the times and the phases' spans (t0, t1, phase).
fn event_times(
    events: &[ditmem_budget::Event],
    time: &ditmem_budget::StepTime,
    microbatches: u32,
) -> (Vec<f64>, Vec<(f64, f64, ditmem_budget::Phase)>) {
    let acc = f64::from(microbatches.max(1));
    let dur = |p: Phase| match p {
        Phase::Start => 0.0,
        Phase::Encode => time.encode_s / acc,
        // The launch overhead is per forward and backward pass: half to each.
        Phase::Forward => (time.forward_s + time.overhead_s / 2.0) / acc,
        Phase::Backward => (time.backward_s + time.recompute_s + time.overhead_s / 2.0) / acc,
        Phase::Optimizer => time.optimizer_s + time.communication_s,
    };
    // A phase the model gives no time still gets a sliver, so its events do not stack.
    let floor = 0.004 * time.total_s.max(f64::MIN_POSITIVE);
    let mut times = vec![0.0; events.len()];
    let mut spans = Vec::new();
    let mut t = 0.0;
    let mut i = 0;
    while i < events.len() {
        let (ph, mb) = (events[i].phase, events[i].microbatch);
        let mut j = i;
        while j < events.len() && events[j].phase == ph && events[j].microbatch == mb {
            j += 1;
        }
        if ph != Phase::Start {
            let d = dur(ph).max(floor);
            let n = (j - i) as f64;
            for (k, ti) in times[i..j].iter_mut().enumerate() {
                *ti = t + d * (k as f64 + 1.0) / n;
            }
            spans.push((t, t + d, ph));
            t += d;
        }
        i = j;
    }
    (times, spans)
}

/// Bytes in the unit a chart shows them in: GiB from 2 GiB up, else MiB.
fn chart_unit(max_bytes: u64) -> (f64, &'static str) {
    if max_bytes >= 2 << 30 {
        ((1u64 << 30) as f64, "GiB")
    } else {
        ((1u64 << 20) as f64, "MiB")
    }
}

/// The scales of a timeline chart: seconds into the step as the time axis shows them (ms or s),
/// bytes in the unit the byte axis shows them in.
#[derive(Clone, Copy)]
struct Axes {
    tscale: f64,
    div: f64,
}

impl Axes {
    fn t(self, seconds: f64) -> f64 {
        seconds * self.tscale
    }

    fn v(self, bytes: u64) -> f64 {
        bytes as f64 / self.div
    }
}

/// The step's live bytes over its predicted time (the measured boundaries beside them when there
/// is a measurement), phases shaded, the GPU's capacity and usable bytes as lines (with a GPU),
/// the peak marked, and the categories at the peak as a bar on the same scale.
pub(crate) fn timeline_svg(
    b: &Budget,
    measured: Option<(&Measurement, &Agreement)>,
) -> anyhow::Result<String> {
    // The whole step, every microbatch laid out, so the time axis is the step's.
    let events = b.timeline.expanded_events();
    let (profile, device) = time_profile(&b.spec);
    let step = ditmem_budget::step_time(&b.spec, &profile);
    let (times, spans) = event_times(&events, &step, b.timeline.microbatches);
    let total = spans.last().map_or(0.0, |s| s.1);
    let (tscale, tunit) = if total < 1.0 { (1e3, "ms") } else { (1.0, "s") };
    let gpu = b
        .spec
        .cuda
        .as_ref()
        .and_then(|c| c.gpu.as_deref())
        .and_then(|g| ditmem_budget::gpu::lookup(g).ok());
    let top = b.peak_bytes.max(gpu.map_or(0, |g| g.capacity_bytes()));
    let (div, unit) = chart_unit(top);
    let ax = Axes { tscale, div };
    let pred: Vec<(f64, f64)> = events
        .iter()
        .zip(&times)
        .map(|(e, t)| (ax.t(*t), ax.v(e.total())))
        .collect();
    let peak_index = events
        .iter()
        .position(|e| e.total() == b.peak_bytes)
        .unwrap_or(b.timeline.peak_index.min(events.len().saturating_sub(1)));
    let title = match measured {
        Some((_, a)) => format!(
            "Live bytes over one step: predicted vs measured ({:+.3} % at the peak)",
            100.0 * a.rel_error
        ),
        None => format!("Live bytes over one step, predicted ({})", b.runtime),
    };
    let chart = TimelineChart {
        title,
        subtitles: subtitles(b),
        x_desc: format!(
            "predicted time into the step, {tunit} ({device}; phases by predicted duration, events spread evenly in each)"
        ),
        y_desc: format!("live {unit}"),
        predicted: pred,
        predicted_name: "predicted live bytes (budget)".into(),
        measured: measured.map(|(m, _)| measured_line(&events, &times, ax, m)),
        spans: phase_spans(&spans, ax),
        rules: gpu.map_or_else(Vec::new, |g| gpu_rules(g, ax)),
        peak: pred_peak(&times, peak_index, tscale, ax.v(b.peak_bytes), b),
        bar: b
            .breakdown
            .entries()
            .iter()
            .filter(|(_, x)| *x > 0)
            .map(|(n, x)| (n.replace('_', " "), ax.v(*x)))
            .collect(),
        bar_title: format!("at the peak ({unit})"),
    };
    Ok(timeline_chart(&chart))
}

/// The measured live bytes at the step's boundaries, each drawn at the predicted time of the
/// boundary event of the same order (none but the start when the counts differ).
fn measured_line(
    events: &[ditmem_budget::Event],
    times: &[f64],
    ax: Axes,
    m: &Measurement,
) -> (String, Vec<(f64, f64)>) {
    let start = events.first().map_or(0, |e| e.total());
    // Measured boundaries sit on the predicted boundary events of the same order.
    let idx: Vec<usize> = events
        .iter()
        .enumerate()
        .filter(|(_, e)| !e.inside && e.phase != Phase::Start && e.phase != Phase::Encode)
        .map(|(i, _)| i)
        .collect();
    let mut pts = vec![(0.0, ax.v(start))];
    if idx.len() == m.timeline.len() {
        for (i, p) in idx.iter().zip(&m.timeline) {
            pts.push((
                ax.t(times[*i]),
                ax.v(start + p.live_bytes.saturating_sub(m.resident_bytes)),
            ));
        }
    }
    (
        "measured at boundaries (engine; drawn at their predicted time)".to_string(),
        pts,
    )
}

/// The phases' shaded spans, each with its name, a short label and its colour.
fn phase_spans(spans: &[(f64, f64, Phase)], ax: Axes) -> Vec<Span> {
    let fill = |p: Phase| match p {
        Phase::Encode => "#e8dff5",
        Phase::Forward => "#dce8f6",
        Phase::Backward => "#fbe6cf",
        _ => "#dcefdd",
    };
    let short = |p: Phase| match p {
        Phase::Encode => "enc",
        Phase::Forward => "fwd",
        Phase::Backward => "bwd",
        Phase::Optimizer => "opt",
        Phase::Start => "",
    };
    spans
        .iter()
        .map(|&(t0, t1, p)| Span {
            t0: ax.t(t0),
            t1: ax.t(t1),
            name: p.name().into(),
            short: short(p).into(),
            fill: fill(p),
        })
        .collect()
}

/// A GPU's capacity as CUDA reports it and what its allocator can use, as horizontal lines.
fn gpu_rules(g: &ditmem_budget::gpu::Gpu, ax: Axes) -> Vec<Rule> {
    vec![
        Rule {
            at: ax.v(g.capacity_bytes()),
            label: format!(
                "{} capacity {} (CUDA total_memory)",
                g.name,
                fmt_bytes(g.capacity_bytes())
            ),
            color: "#b22222",
        },
        Rule {
            at: ax.v(g.allocator_bytes()),
            label: format!(
                "usable {} (less the CUDA context, {})",
                fmt_bytes(g.allocator_bytes()),
                fmt_bytes(g.context_bytes)
            ),
            color: "#d2691e",
        },
    ]
}

/// The spec, its recipe and, on CUDA, what the device would show (or where the replay ran out).
fn subtitles(b: &Budget) -> Vec<String> {
    let mut subtitles = vec![
        spec_line(&b.spec),
        format!("recipe: {}", recipe_line(&b.spec)),
    ];
    if let Some(o) = b.cuda.as_ref().and_then(|c| c.oom.as_ref()) {
        subtitles.push(format!(
            "simulated OOM: a {} request fails with {} allocated, {} reserved of {}; the curve is what the step would need",
            fmt_bytes(o.rounded),
            fmt_bytes(o.allocated),
            fmt_bytes(o.reserved),
            fmt_bytes(o.capacity)
        ));
    } else if let Some(c) = &b.cuda {
        subtitles.push(format!(
            "the device would show {} at the peak (CUDA context + max reserved {})",
            fmt_bytes(c.device_bytes),
            fmt_bytes(c.max_reserved_bytes)
        ));
    }
    subtitles
}

fn pred_peak(
    times: &[f64],
    i: usize,
    tscale: f64,
    y: f64,
    b: &Budget,
) -> Option<(f64, f64, String)> {
    let t = *times.get(i)?;
    Some((
        t * tscale,
        y,
        format!(
            "peak {} {}",
            fmt_bytes(b.peak_bytes),
            crate::render::where_words(&b.peak.label)
        ),
    ))
}
