//! `ditmem run`: execute the spec's recipe on a real DiT training step and measure it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use clap::Args;
use ditmem_budget::{fmt_bytes, Runtime, Spec, SpecError};
use ditmem_engine::{EngineError, Measurement, MemoryProbe, RunOptions};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::args::SpecArgs;
use crate::conditions::Conditions;
use crate::flags::show;
use crate::render::{fmt_count, recipe_line, spec_line, Table};
use crate::stats::{summarize, Summary};
use crate::CliError;

#[derive(Debug, Clone, Args)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Warm-up steps (not measured; the optimizer state exists after the first).
    #[arg(long, default_value_t = 1, value_parser = crate::flags::count_u32, allow_hyphen_values = true)]
    pub warmup: u32,
    /// Measured steps.
    #[arg(long, default_value_t = 5, value_parser = crate::flags::positive_u32, allow_hyphen_values = true)]
    pub steps: u32,
    /// Seed of the weights and dropout masks.
    #[arg(long, default_value_t = 0, value_parser = crate::flags::seed_u64, allow_hyphen_values = true)]
    pub seed: u64,
    /// Seed of the synthetic data.
    #[arg(long, default_value_t = 1, value_parser = crate::flags::seed_u64, allow_hyphen_values = true)]
    pub data_seed: u64,
    /// AdamW / SGD learning rate.
    #[arg(long, default_value_t = 1e-4, value_parser = crate::flags::learning_rate, allow_hyphen_values = true)]
    pub lr: f64,
    /// Read latents (.safetensors or .npy) from this directory instead of synthesising them.
    #[arg(long, value_name = "DIR")]
    pub latents_dir: Option<PathBuf>,
    /// Run even when the budget's peak exceeds MemAvailable (never past the address-space or
    /// cgroup limit).
    #[arg(long)]
    pub force: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also write the JSON report to this file (atomically; nothing is written on Ctrl-C).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

/// The report of a run.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RunReport {
    pub spec: Spec,
    /// Highest live heap bytes over the measured steps (after warm-up).
    pub peak_bytes: u64,
    pub phase_peak_bytes: ditmem_engine::PhasePeaks,
    /// Live heap bytes before the trainer existed (the process itself).
    pub baseline_bytes: u64,
    /// Live bytes just before the last measured step (weights, optimizer state, EMA).
    pub resident_bytes: u64,
    /// The budget's prediction for the same spec, for reference.
    pub predicted_peak_bytes: u64,
    pub step_time_s: Summary,
    /// CPU seconds of the process per measured step, all threads (wall time × busy threads on
    /// a quiet machine; on a shared one, the figure other load moves least).
    pub step_cpu_time_s: Summary,
    /// Wall seconds per measured step in each phase (the backward with its recomputed
    /// forwards), from the timeline's points.
    pub phase_time_s: PhaseTimeSummary,
    pub images_per_s: f64,
    pub tokens_per_s: f64,
    pub losses: Vec<f64>,
    pub skipped_steps: u32,
    pub params_total: u64,
    pub params_trained: u64,
    pub timeline: Vec<ditmem_engine::TimelinePoint>,
    pub conditions: Conditions,
}

/// [`RunReport::phase_time_s`]: each phase's wall seconds over the measured steps.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PhaseTimeSummary {
    pub forward: Summary,
    pub backward: Summary,
    pub optimizer: Summary,
}

impl PhaseTimeSummary {
    fn of(steps: &[ditmem_engine::PhaseTimes]) -> PhaseTimeSummary {
        let s = |f: fn(&ditmem_engine::PhaseTimes) -> f64| {
            summarize(&steps.iter().map(f).collect::<Vec<_>>())
        };
        PhaseTimeSummary {
            forward: s(|p| p.forward),
            backward: s(|p| p.backward),
            optimizer: s(|p| p.optimizer),
        }
    }
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Turn Ctrl-C into a clean stop between steps (a second Ctrl-C exits at once).
fn install_ctrlc() {
    let _ = ctrlc::set_handler(|| {
        if INTERRUPTED.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
    });
}

/// Run a spec with the binary's allocator as the probe.
pub(crate) fn measure(
    spec: &Spec,
    opts: &RunOptions,
    probe: &dyn MemoryProbe,
    show_progress: bool,
) -> Result<(Measurement, u64), CliError> {
    let total = u64::from(opts.warmup + opts.steps);
    let bar = if show_progress {
        let b = ProgressBar::new(total);
        b.set_style(
            ProgressStyle::with_template("{spinner} step {pos}/{len} [{bar:30}] {msg}")
                .expect("a valid template")
                .progress_chars("=> "),
        );
        b
    } else {
        ProgressBar::hidden()
    };
    install_ctrlc();
    let baseline = probe.live();
    let result = ditmem_engine::run(spec, opts, Some(probe), &mut |p| {
        bar.set_position(u64::from(p.step));
        bar.set_message(format!(
            "{}loss {:.4}, {:.2} s",
            if p.warmup { "warm-up, " } else { "" },
            p.loss,
            p.step_time_s
        ));
        !INTERRUPTED.load(Ordering::SeqCst)
    });
    bar.finish_and_clear();
    match result {
        Ok(m) => Ok((m, baseline)),
        Err(e) => Err(engine_err(e)),
    }
}

/// An engine error as the CLI reports it: the spec, an unsupported recipe and unreadable latents
/// are bad input (exit 2), Ctrl-C is 130, the rest internal (1).
pub(crate) fn engine_err(e: EngineError) -> CliError {
    match e {
        EngineError::Spec(e) => CliError::Spec(e),
        EngineError::BadInput { what, why } => CliError::Spec(SpecError::invalid(what, why)),
        EngineError::Unsupported { feature, why } => CliError::Spec(SpecError::invalid(
            feature,
            format!("is not supported by the engine; {why}"),
        )),
        EngineError::Data { path, why } => CliError::Spec(SpecError::invalid(
            "--latents-dir",
            format!("cannot read latents from {}: {why}", show(&path)),
        )),
        EngineError::Interrupted { after_steps } => CliError::Interrupted(after_steps),
        e => CliError::Other(anyhow::Error::new(e)),
    }
}

/// `run` and `compare` execute the candle engine: a spec for another runtime (PyTorch) would
/// hold the engine's measurement against a prediction for something else.
pub(crate) fn require_engine_runtime(spec: &Spec, command: &str) -> Result<(), CliError> {
    if spec.runtime == Runtime::DitmemCpu {
        return Ok(());
    }
    Err(CliError::Spec(SpecError::invalid(
        "runtime",
        format!(
            "'{}' is not executed by `ditmem {command}`; allowed: ditmem-cpu (the engine here); \
             to hold the PyTorch runtime against real PyTorch use `ditmem compare --runtime pytorch`",
            spec.runtime
        ),
    )))
}

/// `--latents-dir` must be an existing folder whose latent files are regular files within the
/// engine's cap (`ditmem_engine::diffusion::latent_files`: nothing opened, so a FIFO named
/// `a.npy` cannot block): checked before the model is built.
pub(crate) fn check_latents_dir(dir: Option<&std::path::Path>) -> Result<(), CliError> {
    let Some(dir) = dir else { return Ok(()) };
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => ditmem_engine::diffusion::latent_files(dir)
            .map(drop)
            .map_err(engine_err),
        Ok(m) => Err(CliError::Spec(SpecError::invalid(
            "--latents-dir",
            format!(
                "{} is {}; allowed: a folder of .safetensors or .npy latents",
                show(&dir.display().to_string()),
                crate::output::file_kind(m.file_type())
            ),
        ))),
        Err(e) => Err(CliError::Spec(SpecError::invalid(
            "--latents-dir",
            format!(
                "{} cannot be read ({e}); allowed: a folder of .safetensors or .npy latents",
                show(&dir.display().to_string())
            ),
        ))),
    }
}

pub(crate) fn run(args: RunArgs, probe: &dyn MemoryProbe) -> Result<(), CliError> {
    // Every input and output is checked before the model is built or anything is measured.
    crate::output::check_outputs(&[("--out", args.out.as_deref())])?;
    // Before the thread pools start (reading the spec's CPU starts rayon's).
    crate::guard::check_process("run", 0)?;
    let spec = args.spec.to_spec()?;
    if args.steps == 0 {
        return Err(CliError::Spec(SpecError::invalid(
            "--steps",
            "is 0; allowed: at least one measured step",
        )));
    }
    require_engine_runtime(&spec, "run")?;
    check_latents_dir(args.latents_dir.as_deref())?;
    let predicted = crate::guard::check_spec(&spec, args.force)?;
    let opts = RunOptions {
        warmup: args.warmup,
        steps: args.steps,
        seed: args.seed,
        data_seed: args.data_seed,
        lr: args.lr,
        weight_decay: 0.0,
        latents_dir: args.latents_dir.clone(),
    };
    let (m, baseline) = measure(&spec, &opts, probe, !args.json)?;
    let conditions = Conditions::capture(&spec, args.warmup, args.steps);
    let step = summarize(&m.step_times_s);
    let tokens = spec.tokens().unwrap_or(0);
    let report = RunReport {
        images_per_s: f64::from(spec.workload.batch) / step.p50,
        tokens_per_s: (u64::from(spec.workload.batch) * tokens) as f64 / step.p50,
        peak_bytes: m.peak_bytes,
        phase_peak_bytes: m.phase_peak_bytes,
        baseline_bytes: baseline,
        resident_bytes: m.resident_bytes,
        predicted_peak_bytes: predicted,
        step_time_s: step,
        step_cpu_time_s: summarize(&m.step_cpu_s),
        phase_time_s: PhaseTimeSummary::of(&m.phase_times_s),
        losses: m.losses,
        skipped_steps: m.skipped_steps,
        params_total: m.param_count,
        params_trained: m.trainable_params,
        timeline: m.timeline,
        conditions,
        spec,
    };
    if let Some(path) = &args.out {
        let text = serde_json::to_string_pretty(&report).context("serialising the report")?;
        crate::output::write_output("--out", path, text.as_bytes())?;
    }
    if args.json {
        crate::output::print_json(&report)?;
    } else {
        crate::output::say(&render_run(&report))?;
    }
    Ok(())
}

fn render_run(r: &RunReport) -> String {
    let mut o = String::new();
    o.push_str(&format!("ditmem run — {}\n", spec_line(&r.spec)));
    o.push_str(&format!("recipe: {}\n", recipe_line(&r.spec)));
    o.push_str(&format!("conditions: {}\n", r.conditions.line()));
    o.push_str(&format!(
        "parameters: {} total, {} trained; {} warm-up + {} measured steps\n\n",
        fmt_count(r.params_total),
        fmt_count(r.params_trained),
        r.conditions.warmup_steps,
        r.conditions.measured_steps
    ));
    let mut t = Table::new(&["memory (after warm-up)", "bytes", ""]);
    t.row(vec![
        "peak".into(),
        fmt_bytes(r.peak_bytes),
        fmt_count(r.peak_bytes),
    ]);
    t.row(vec![
        "  forward".into(),
        fmt_bytes(r.phase_peak_bytes.forward),
        String::new(),
    ]);
    t.row(vec![
        "  backward".into(),
        fmt_bytes(r.phase_peak_bytes.backward),
        String::new(),
    ]);
    t.row(vec![
        "  optimizer".into(),
        fmt_bytes(r.phase_peak_bytes.optimizer),
        String::new(),
    ]);
    t.row(vec![
        "resident before a step".into(),
        fmt_bytes(r.resident_bytes),
        String::new(),
    ]);
    t.row(vec![
        "process baseline".into(),
        fmt_bytes(r.baseline_bytes),
        String::new(),
    ]);
    t.row(vec![
        "budget's prediction".into(),
        fmt_bytes(r.predicted_peak_bytes),
        format!(
            "{:+.2} % vs peak − baseline",
            100.0
                * (r.predicted_peak_bytes as f64 / (r.peak_bytes - r.baseline_bytes).max(1) as f64
                    - 1.0)
        ),
    ]);
    o.push_str(&t.render());
    let s = &r.step_time_s;
    o.push_str(&format!(
        "\nstep time over {} steps: p50 {:.3} s, p95 {:.3} s, p99 {:.3} s, mean {:.3} s\n",
        s.n, s.p50, s.p95, s.p99, s.mean
    ));
    let c = &r.step_cpu_time_s;
    o.push_str(&format!(
        "CPU time per step (all threads): p50 {:.3} s, p95 {:.3} s ({:.2} threads busy at p50)\n",
        c.p50,
        c.p95,
        c.p50 / s.p50
    ));
    let ph = &r.phase_time_s;
    o.push_str(&format!(
        "by phase (p50): forward {:.3} s, backward {:.3} s (recomputed forwards included), optimizer {:.3} s\n",
        ph.forward.p50, ph.backward.p50, ph.optimizer.p50
    ));
    o.push_str(&format!(
        "throughput (at p50): {:.2} images/s, {:.0} tokens/s\n",
        r.images_per_s, r.tokens_per_s
    ));
    let losses: Vec<String> = r.losses.iter().map(|l| format!("{l:.4}")).collect();
    o.push_str(&format!("losses: {}\n", losses.join(" ")));
    if r.skipped_steps > 0 {
        o.push_str(&format!(
            "skipped steps (fp16 overflow): {}\n",
            r.skipped_steps
        ));
    }
    o
}
