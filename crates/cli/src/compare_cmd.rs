//! `ditmem compare` (one spec: the budget's prediction beside the engine's measurement, and the
//! timeline SVG) and `ditmem agree` (the agreement grid).

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use ditmem_budget::fmt_bytes;
use ditmem_budget::{Budget, Runtime};
use ditmem_conformance::agree::{self, Agreement, GridSummary};
use ditmem_engine::{Measurement, MemoryProbe};
use serde::Serialize;

use crate::args::SpecArgs;
use crate::conditions::Conditions;
use crate::plot::{timeline_chart, Rule, Span, TimelineChart};
use crate::render::{breakdown_table, fmt_count, recipe_line, rel_err_pct, spec_line, Table};
use crate::CliError;

#[derive(Debug, Clone, Args)]
pub struct CompareArgs {
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Measured steps after the warm-up step.
    #[arg(long, default_value_t = 1, value_parser = crate::flags::positive_u32, allow_hyphen_values = true)]
    pub steps: u32,
    /// Write the timeline SVG (predicted and measured live bytes, categories at the peak).
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    /// Run even when the budget's peak exceeds MemAvailable (never past the address-space or
    /// cgroup limit).
    #[arg(long)]
    pub force: bool,
    /// For `--runtime pytorch`: the peer's Python (default bench/torch_peer/.venv/bin/python).
    #[arg(long, value_name = "PATH")]
    pub python: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
    /// A PyTorch CUDA memory snapshot of your own run (`torch.cuda.memory._dump_snapshot(FILE)`
    /// after `_record_memory_history(max_entries=…)`): its trace replayed into allocated and
    /// reserved timelines beside the pytorch:cuda prediction of the spec (peaks, what is alive at
    /// the peak, where they part; `--plot` draws both). Nothing is run. The spec moves to
    /// pytorch:cuda unless --runtime says otherwise; give --gpu and --alloc-conf as in the run.
    /// Refused (exit 2): files over 1 GiB, or over 25,000,000 values (about 3 GiB of memory while
    /// read), 3,000,000 trace events or 3,000,000 segments and blocks.
    #[arg(long, value_name = "FILE")]
    pub snapshot: Option<PathBuf>,
    /// With --snapshot: the device whose trace is read (default: the one with most events).
    #[arg(long, value_name = "N", requires = "snapshot",
          value_parser = crate::flags::count_u32, allow_hyphen_values = true)]
    pub device: Option<u32>,
}

#[derive(Debug, Clone, Args)]
pub struct AgreeArgs {
    /// Run only every N-th spec of the grid (1 = all).
    #[arg(long, default_value_t = 1, value_parser = crate::flags::positive_usize, allow_hyphen_values = true)]
    pub every: usize,
    /// Which grid: the original DiT's, or a family's (PixArt, SD3, Flux, Sana, Wan, diffusers' DiT), or all (each
    /// summarised on its own).
    #[arg(long, value_enum, default_value_t = AgreeFamily::All)]
    pub family: AgreeFamily,
    #[arg(long)]
    pub json: bool,
}

/// The model families `ditmem agree` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AgreeFamily {
    Dit,
    Pixart,
    Sd3,
    Flux,
    Sana,
    Wan,
    DitDiffusers,
    All,
}

#[derive(Debug, Clone, Serialize)]
struct CompareReport {
    #[serde(flatten)]
    agreement: Agreement,
    breakdown_at_peak: ditmem_budget::Breakdown,
    conditions: Conditions,
}

pub fn compare(args: CompareArgs, probe: &dyn MemoryProbe) -> Result<(), CliError> {
    crate::output::check_outputs(&[("--plot", args.plot.as_deref())])?;
    crate::guard::check_process("compare", 0)?;
    if let Some(path) = &args.snapshot {
        return crate::snapshot_cmd::run(
            &args.spec,
            path,
            args.device,
            args.plot.as_deref(),
            args.json,
        );
    }
    let spec = args.spec.to_spec()?;
    if let Runtime::Pytorch { .. } = spec.runtime {
        return compare_pytorch(&spec, &args);
    }
    crate::guard::check_spec(&spec, args.force)?;
    let (a, budget, m) = agree::measure_and_compare(&spec.model.name, &spec, args.steps, probe)
        .map_err(crate::run_cmd::engine_err)?;
    let report = CompareReport {
        breakdown_at_peak: budget.breakdown,
        conditions: Conditions::capture(&spec, 1, args.steps),
        agreement: a,
    };
    if let Some(path) = &args.plot {
        let svg = timeline_svg(&budget, Some((&m, &report.agreement)))?;
        crate::output::write_output("--plot", path, svg.as_bytes())?;
    }
    if args.json {
        crate::output::print_json(&report)?;
    } else {
        crate::output::say(&render_compare(&budget, &report))?;
    }
    Ok(())
}

fn render_compare(b: &Budget, r: &CompareReport) -> String {
    let a = &r.agreement;
    let mut o = String::new();
    o.push_str(&format!("ditmem compare — {}\n", spec_line(&b.spec)));
    o.push_str(&format!("recipe: {}\n", recipe_line(&b.spec)));
    o.push_str(&format!("conditions: {}\n\n", r.conditions.line()));
    let mut t = Table::new(&[
        "step memory above its start",
        "predicted",
        "measured",
        "error",
    ]);
    let err = |p: u64, q: u64| rel_err_pct(p, q, 3);
    t.row(vec![
        "peak".into(),
        fmt_bytes(a.predicted_peak_bytes),
        fmt_bytes(a.measured_peak_bytes),
        err(a.predicted_peak_bytes, a.measured_peak_bytes),
    ]);
    for (ph, p, q) in &a.phase_peaks {
        t.row(vec![
            format!("  {ph}"),
            fmt_bytes(*p),
            fmt_bytes(*q),
            err(*p, *q),
        ]);
    }
    o.push_str(&t.render());
    o.push_str(&format!(
        "exact: predicted {} B, measured {} B; predicted peak at {}\n",
        fmt_count(a.predicted_peak_bytes),
        fmt_count(a.measured_peak_bytes),
        a.predicted_peak_label
    ));
    o.push_str(&format!(
        "boundaries compared: {} (largest gap {:.3} % of the peak)\n",
        a.boundaries.len(),
        100.0 * a.boundary_max_rel_error
    ));
    o.push_str(&format!(
        "before the step: predicted {} (model states, batch, candle's matmul packing buffers), measured {}; \
         the {} between them is the trainer's own bookkeeping (names, maps) and allocator slack\n\n",
        fmt_bytes(a.predicted_resident_bytes),
        fmt_bytes(a.measured_resident_bytes),
        fmt_bytes(a.runtime_overhead_bytes.unsigned_abs())
    ));
    o.push_str(
        &breakdown_table("predicted at the peak", &r.breakdown_at_peak, b.peak_bytes).render(),
    );
    o
}

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
pub fn event_times(
    events: &[ditmem_budget::Event],
    time: &ditmem_budget::StepTime,
    microbatches: u32,
) -> (Vec<f64>, Vec<(f64, f64, ditmem_budget::Phase)>) {
    use ditmem_budget::Phase;
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

/// The step's live bytes over its predicted time (the measured boundaries beside them when there
/// is a measurement), phases shaded, the GPU's capacity and usable bytes as lines (with a GPU),
/// the peak marked, and the categories at the peak as a bar on the same scale.
pub fn timeline_svg(
    b: &Budget,
    measured: Option<(&Measurement, &Agreement)>,
) -> anyhow::Result<String> {
    use ditmem_budget::Phase;
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
    let v = |x: u64| x as f64 / div;
    let start = events.first().map_or(0, |e| e.total());
    let pred: Vec<(f64, f64)> = events
        .iter()
        .zip(&times)
        .map(|(e, t)| (t * tscale, v(e.total())))
        .collect();
    let peak_index = events
        .iter()
        .position(|e| e.total() == b.peak_bytes)
        .unwrap_or(b.timeline.peak_index.min(events.len().saturating_sub(1)));
    let measured_pts = measured.map(|(m, _)| {
        // Measured boundaries sit on the predicted boundary events of the same order.
        let idx: Vec<usize> = events
            .iter()
            .enumerate()
            .filter(|(_, e)| !e.inside && e.phase != Phase::Start && e.phase != Phase::Encode)
            .map(|(i, _)| i)
            .collect();
        let mut pts = vec![(0.0, v(start))];
        if idx.len() == m.timeline.len() {
            for (i, p) in idx.iter().zip(&m.timeline) {
                pts.push((
                    times[*i] * tscale,
                    v(start + p.live_bytes.saturating_sub(m.resident_bytes)),
                ));
            }
        }
        (
            "measured at boundaries (engine; drawn at their predicted time)".to_string(),
            pts,
        )
    });
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
    let spans = spans
        .iter()
        .map(|&(t0, t1, p)| Span {
            t0: t0 * tscale,
            t1: t1 * tscale,
            name: p.name().into(),
            short: short(p).into(),
            fill: fill(p),
        })
        .collect();
    let mut rules = Vec::new();
    if let Some(g) = gpu {
        rules.push(Rule {
            at: v(g.capacity_bytes()),
            label: format!(
                "{} capacity {} (CUDA total_memory)",
                g.name,
                fmt_bytes(g.capacity_bytes())
            ),
            color: "#b22222",
        });
        rules.push(Rule {
            at: v(g.allocator_bytes()),
            label: format!(
                "usable {} (less the CUDA context, {})",
                fmt_bytes(g.allocator_bytes()),
                fmt_bytes(g.context_bytes)
            ),
            color: "#d2691e",
        });
    }
    let title = match measured {
        Some((_, a)) => format!(
            "Live bytes over one step: predicted vs measured ({:+.3} % at the peak)",
            100.0 * a.rel_error
        ),
        None => format!("Live bytes over one step, predicted ({})", b.runtime),
    };
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
    let chart = TimelineChart {
        title,
        subtitles,
        x_desc: format!(
            "predicted time into the step, {tunit} ({device}; phases by predicted duration, events spread evenly in each)"
        ),
        y_desc: format!("live {unit}"),
        predicted: pred,
        predicted_name: "predicted live bytes (budget)".into(),
        measured: measured_pts,
        spans,
        rules,
        peak: pred_peak(&times, peak_index, tscale, v(b.peak_bytes), b),
        bar: b
            .breakdown
            .entries()
            .iter()
            .filter(|(_, x)| *x > 0)
            .map(|(n, x)| (n.replace('_', " "), v(*x)))
            .collect(),
        bar_title: format!("at the peak ({unit})"),
    };
    Ok(timeline_chart(&chart))
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

/// The folder of the PyTorch peer (`bench/torch_peer`): `$DITMEM_TORCH_PEER` when set, else the
/// first of the binary's folder's ancestors (`target/release/ditmem` of a checkout) and the
/// working folder's ancestors that holds `bench/torch_peer/family_peer.py`. None: not found.
fn peer_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("DITMEM_TORCH_PEER") {
        return Some(PathBuf::from(d));
    }
    let holds = |root: &std::path::Path| {
        let d = root.join("bench").join("torch_peer");
        d.join("family_peer.py").is_file().then_some(d)
    };
    let exe = std::env::current_exe()
        .ok()
        .and_then(|e| std::fs::canonicalize(e).ok());
    let cwd = std::env::current_dir().ok();
    [exe, cwd]
        .into_iter()
        .flatten()
        .find_map(|start| start.ancestors().find_map(holds))
}

/// What the peer needs: its folder (`DITMEM_TORCH_PEER`, or found beside the binary or above
/// the working folder) and its Python, checked before any work: the default one missing is a
/// missing tool (exit 5); a `--python` that is not an executable regular file (a link to one is
/// fine) is bad input (exit 2), never "Permission denied" from the spawn after the budget ran.
fn check_python(flag: Option<&std::path::Path>) -> Result<(PathBuf, PathBuf), CliError> {
    use std::os::unix::fs::PermissionsExt;
    let Some(dir) = peer_dir() else {
        return Err(CliError::Missing(
            "the PyTorch peer (bench/torch_peer of a ditmem checkout) was not found beside the \
             binary nor above the working folder: set DITMEM_TORCH_PEER to its folder, then run \
             its setup.sh"
                .into(),
        ));
    };
    if !dir.join("family_peer.py").is_file() || !dir.join("peer.py").is_file() {
        return Err(CliError::Missing(format!(
            "the PyTorch peer's folder {} holds no family_peer.py and peer.py: set \
             DITMEM_TORCH_PEER to bench/torch_peer of a ditmem checkout",
            crate::flags::show(&dir.display().to_string())
        )));
    }
    let Some(path) = flag else {
        let python = dir.join(".venv/bin/python");
        return match std::fs::metadata(&python) {
            Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => Ok((dir, python)),
            _ => Err(CliError::Missing(format!(
                "the PyTorch peer is not installed ({} is missing): run \
                 bench/torch_peer/setup_diffusers.sh (setup.sh for the DiT peer alone) first, \
                 or name its Python with --python",
                crate::flags::show(&python.display().to_string())
            ))),
        };
    };
    let shown = crate::flags::show(&path.display().to_string());
    let bad = |why: String| {
        CliError::Spec(ditmem_budget::SpecError::invalid(
            "--python",
            format!("{shown} {why}; allowed: an executable Python interpreter (a regular file)"),
        ))
    };
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => Err(bad(format!(
            "is {}",
            crate::output::file_kind(m.file_type())
        ))),
        Ok(m) if m.permissions().mode() & 0o111 == 0 => Err(bad("is not executable".into())),
        Ok(_) => Ok((dir, path.to_path_buf())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(CliError::Missing(format!(
            "the PyTorch peer's Python (--python {shown}) does not exist: run \
             bench/torch_peer/setup.sh first, or name the peer's Python"
        ))),
        Err(e) => Err(bad(format!("cannot be read ({e})"))),
    }
}

/// Which peer runs the spec: `family_peer.py` (the real diffusers class of `model.diffusers`,
/// LoRA through PEFT) for a family spec, `peer.py` (the original DiT written out) otherwise. What
/// that peer does not run is refused here, by name (exit 2), before Python starts; the list is
/// the one each script refuses (bench/torch_peer/README.md).
fn peer_for(spec: &ditmem_budget::Spec) -> Result<&'static str, CliError> {
    use ditmem_budget::{BaseQuant, Optimizer, OptimizerImpl, Precision, Recompute};
    let r = &spec.recipe;
    let family = spec.model.diffusers.is_some();
    let refuse = |field: &str, what: String| {
        Err(CliError::Spec(ditmem_budget::SpecError::invalid(
            field,
            format!(
                "{what}: the PyTorch peer ({}) does not run it",
                if family { "family_peer.py" } else { "peer.py" }
            ),
        )))
    };
    if spec.workload.ranks > 1 {
        return refuse(
            "workload.ranks",
            format!("{} ranks (the peer runs one process)", spec.workload.ranks),
        );
    }
    if r.zero_stage > 0 {
        return refuse("recipe.zero_stage", format!("ZeRO stage {}", r.zero_stage));
    }
    if r.latents == ditmem_budget::Latents::Encode {
        return refuse(
            "recipe.latents",
            "encode (the peer has no VAE; use cached)".into(),
        );
    }
    if !r.text_encoders.is_cached() {
        return refuse(
            "recipe.text_encoders",
            format!(
                "{} (the peer reads cached text embeddings)",
                r.text_encoders.name()
            ),
        );
    }
    if r.base_quant != BaseQuant::default() {
        return refuse(
            "recipe.base_quant",
            format!(
                "{} (a quantized base needs bitsandbytes on CUDA)",
                r.base_quant.name()
            ),
        );
    }
    if r.optimizer == Optimizer::AdamW8bit || r.paged_optimizer {
        return refuse(
            "recipe.optimizer",
            "adamw-8bit (bitsandbytes runs on CUDA)".into(),
        );
    }
    if r.optimizer_impl == Some(OptimizerImpl::Fused) {
        return refuse(
            "recipe.optimizer_impl",
            "fused (the peer runs for-loop and foreach)".into(),
        );
    }
    if family {
        if !matches!(r.precision, Precision::Fp32 | Precision::Bf16Mixed) {
            return refuse(
                "recipe.precision",
                format!(
                    "{} (the family peer runs fp32, bf16-mixed)",
                    r.precision.name()
                ),
            );
        }
        if !matches!(r.recompute, Recompute::None | Recompute::All) {
            return refuse(
                "recipe.recompute",
                "a subset of the blocks (diffusers checkpoints every block or none)".into(),
            );
        }
        Ok("family_peer.py")
    } else {
        if r.lora.is_some() {
            return refuse(
                "recipe.lora",
                "LoRA on the original DiT (give a diffusers class in model.diffusers: family_peer.py runs LoRA)".into(),
            );
        }
        if matches!(r.precision, Precision::Bf16Pure) {
            return refuse("recipe.precision", "bf16-pure".into());
        }
        if r.recompute == Recompute::AttentionOnly {
            return refuse("recipe.recompute", "attention-only".into());
        }
        Ok("peer.py")
    }
}

fn compare_pytorch(spec: &ditmem_budget::Spec, args: &CompareArgs) -> Result<(), CliError> {
    let script = peer_for(spec)?;
    let (dir, python) = check_python(args.python.as_deref())?;
    let budget = ditmem_budget::estimate(spec)?;
    crate::guard::check("the PyTorch step", budget.peak_bytes, args.force)?;
    let tmp = std::env::temp_dir().join(format!("ditmem-compare-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).context("creating a temporary folder")?;
    let spec_path = tmp.join("spec.json");
    crate::output::write_atomic(
        &spec_path,
        serde_json::to_string(spec)
            .context("spec to JSON")?
            .as_bytes(),
    )?;
    let out = std::process::Command::new(&python)
        .arg(dir.join(script))
        .arg("--spec")
        .arg(&spec_path)
        .args(["--warmup", "1", "--steps", &args.steps.max(1).to_string()])
        .env("OMP_WAIT_POLICY", "PASSIVE")
        .output();
    // The spec file's folder goes whatever the peer did.
    let _ = std::fs::remove_dir_all(&tmp);
    let out = out.context("running the PyTorch peer")?;
    let not_the_peer = |what: String| {
        CliError::Missing(format!(
            "{} {what}, so it is not the PyTorch peer's Python; allowed: the interpreter \
             bench/torch_peer/setup_diffusers.sh installs (bench/torch_peer/.venv/bin/python)",
            crate::flags::show(&python.display().to_string())
        ))
    };
    if !out.status.success() {
        let msg = String::from_utf8_lossy(&out.stderr)
            .trim()
            .lines()
            .last()
            .unwrap_or("")
            .to_string();
        if msg.is_empty() {
            return Err(not_the_peer(format!(
                "exited with {} and said nothing",
                out.status
            )));
        }
        if msg.contains("ModuleNotFoundError") {
            return Err(CliError::Missing(format!(
                "the PyTorch peer's Python lacks a module ({msg}): run \
                 bench/torch_peer/setup_diffusers.sh"
            )));
        }
        if out.status.code() == Some(2) {
            // The peer's own refusal: one line naming what it does not run.
            return Err(CliError::Spec(ditmem_budget::SpecError::invalid(
                "spec",
                format!("the PyTorch peer does not run it: {msg}"),
            )));
        }
        return Err(CliError::Other(anyhow::anyhow!(
            "the PyTorch peer failed: {msg}"
        )));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| not_the_peer(format!("printed no peer JSON ({e})")))?;
    let measured = v["peak_bytes"]
        .as_u64()
        .context("peer JSON has no peak_bytes")?;
    let rel = budget.peak_bytes as f64 / measured.max(1) as f64 - 1.0;
    let params = serde_json::json!({
        "predicted": {"total": budget.params.total, "trained": budget.params.trained},
        "measured": {
            "total": v["params"]["reported"],
            "trained": v["params"]["trainable"],
        },
    });
    let report = serde_json::json!({
        "runtime": "pytorch",
        "peer": script,
        "predicted_peak_bytes": budget.peak_bytes,
        "measured_peak_bytes": measured,
        "rel_error": rel,
        "params": params,
        "measurement": v,
    });
    if args.json {
        crate::output::print_json(&report)?;
    } else {
        crate::output::say(&format!(
            "ditmem compare --runtime pytorch — {}\n",
            spec_line(spec)
        ))?;
        crate::output::say(&format!("recipe: {}\n", recipe_line(spec)))?;
        let class = v["conditions"]["class"]
            .as_str()
            .unwrap_or("the original DiT");
        crate::output::say(&format!("peer: {script} ({class})\n"))?;
        let mut t = Table::new(&["", "predicted", "measured (PyTorch)", "error"]);
        t.row(vec![
            "peak".into(),
            fmt_bytes(budget.peak_bytes),
            fmt_bytes(measured),
            format!("{:+.3} %", 100.0 * rel),
        ]);
        let count = |x: &serde_json::Value| x.as_u64().map_or("-".to_string(), fmt_count);
        t.row(vec![
            "parameters".into(),
            fmt_count(budget.params.total),
            count(&v["params"]["reported"]),
            String::new(),
        ]);
        t.row(vec![
            "  trained".into(),
            fmt_count(budget.params.trained),
            count(&v["params"]["trainable"]),
            String::new(),
        ]);
        crate::output::say(&t.render())?;
        crate::output::say(&format!("peer conditions: {}\n", v["conditions"]))?;
    }
    Ok(())
}

pub fn agree_grid(args: AgreeArgs, probe: &dyn MemoryProbe) -> Result<(), CliError> {
    crate::guard::check_process("agree", 0)?;
    if args.every == 0 {
        return Err(CliError::Spec(ditmem_budget::SpecError::invalid(
            "--every",
            "is 0; allowed: 1 or more",
        )));
    }
    let mut grid: Vec<(String, ditmem_budget::Spec)> = Vec::new();
    // (json key, label, specs) of each family's part of the grid, in order.
    let mut parts: Vec<(&str, &str, usize)> = Vec::new();
    let wants = |f: AgreeFamily| args.family == f || args.family == AgreeFamily::All;
    if wants(AgreeFamily::Dit) {
        let n = grid.len();
        grid.extend(agree::grid().into_iter().step_by(args.every));
        parts.push(("dit", "DiT", grid.len() - n));
    }
    if wants(AgreeFamily::Pixart) {
        let pixart = agree::pixart_grid().map_err(crate::run_cmd::engine_err)?;
        let n = grid.len();
        grid.extend(pixart.into_iter().step_by(args.every));
        parts.push(("pixart", "PixArt", grid.len() - n));
    }
    type FamilyGrid = fn() -> ditmem_engine::Result<Vec<(String, ditmem_budget::Spec)>>;
    let families: [(AgreeFamily, &str, &str, FamilyGrid); 5] = [
        (AgreeFamily::Sd3, "sd3", "SD3", agree::sd3_grid),
        (AgreeFamily::Flux, "flux", "Flux", agree::flux_grid),
        (AgreeFamily::Sana, "sana", "Sana", agree::sana_grid),
        (AgreeFamily::Wan, "wan", "Wan", agree::wan_grid),
        (
            AgreeFamily::DitDiffusers,
            "dit_diffusers",
            "DiT (diffusers)",
            agree::dit_diffusers_grid,
        ),
    ];
    for (fam, key, label, make) in families {
        if !wants(fam) {
            continue;
        }
        let specs = make().map_err(crate::run_cmd::engine_err)?;
        let n = grid.len();
        grid.extend(specs.into_iter().step_by(args.every));
        parts.push((key, label, grid.len() - n));
    }
    let mut largest = 0;
    for (_, spec) in &grid {
        largest = largest.max(ditmem_budget::estimate(spec)?.peak_bytes);
    }
    crate::guard::check("the largest spec of the grid", largest, false)?;
    let bar = if args.json || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(grid.len() as u64)
    };
    let mut results = Vec::new();
    for (name, spec) in &grid {
        bar.set_message(name.clone());
        let (a, _, _) =
            agree::measure_and_compare(name, spec, 1, probe).map_err(crate::run_cmd::engine_err)?;
        results.push(a);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let summary: GridSummary = agree::summarize(&results);
    let mut split: Vec<(&str, &str, &[Agreement])> = Vec::new();
    let mut rest = results.as_slice();
    for (key, label, n) in &parts {
        let (part, r) = rest.split_at((*n).min(rest.len()));
        split.push((key, label, part));
        rest = r;
    }
    let mut families = serde_json::Map::new();
    for &(name, _, part) in &split {
        if !part.is_empty() {
            let s = serde_json::to_value(agree::summarize(part)).map_err(anyhow::Error::from)?;
            families.insert(name.into(), s);
        }
    }
    if args.json {
        crate::output::print_json(&serde_json::json!({
            "summary": summary,
            "families": families,
            "specs": results
        }))?;
    } else {
        let mut t = Table::new(&["spec", "predicted", "measured", "error"]);
        for a in &results {
            t.row(vec![
                a.name.clone(),
                fmt_count(a.predicted_peak_bytes),
                fmt_count(a.measured_peak_bytes),
                format!("{:+.3} %", 100.0 * a.rel_error),
            ]);
        }
        crate::output::say(&t.render())?;
        for &(_, name, part) in &split {
            if !part.is_empty() && part.len() < results.len() {
                let s = agree::summarize(part);
                crate::output::say(&format!(
                    "{name}: {} specs, max {:.3} % ({}), median {:.3} %\n",
                    s.specs,
                    100.0 * s.max_abs_rel_error,
                    s.worst,
                    100.0 * s.median_abs_rel_error
                ))?;
            }
        }
        crate::output::say(&format!(
            "{} specs: max |pred/meas − 1| = {:.3} % ({}), median {:.3} %\n",
            summary.specs,
            100.0 * summary.max_abs_rel_error,
            summary.worst,
            100.0 * summary.median_abs_rel_error
        ))?;
        crate::output::say(
            "(step memory above the live bytes before the step, after one warm-up step; counting allocator)\n",
        )?;
    }
    Ok(())
}
