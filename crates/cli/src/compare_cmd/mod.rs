//! `ditmem compare` (one spec: the budget's prediction beside the engine's measurement, and the
//! timeline SVG; `--runtime pytorch` beside the PyTorch peer's; `--snapshot` beside a CUDA
//! memory snapshot, in `snapshot_cmd.rs`) and `ditmem agree` (the agreement grid).

mod agree;
mod pytorch;
mod timeline;

use std::path::PathBuf;

use clap::Args;
use ditmem_budget::fmt_bytes;
use ditmem_budget::{Budget, Runtime};
use ditmem_conformance::agree::Agreement;
use ditmem_engine::MemoryProbe;
use serde::Serialize;

use crate::args::SpecArgs;
use crate::conditions::Conditions;
use crate::render::{breakdown_table, fmt_count, recipe_line, rel_err_pct, spec_line, Table};
use crate::CliError;

pub(crate) use agree::{agree_grid, AgreeArgs};
use pytorch::compare_pytorch;
pub(crate) use timeline::timeline_svg;

#[derive(Debug, Clone, Args)]
pub(crate) struct CompareArgs {
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

#[derive(Debug, Clone, Serialize)]
struct CompareReport {
    #[serde(flatten)]
    agreement: Agreement,
    breakdown_at_peak: ditmem_budget::Breakdown,
    conditions: Conditions,
}

pub(crate) fn compare(args: CompareArgs, probe: &dyn MemoryProbe) -> Result<(), CliError> {
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
        return compare_pytorch(
            &spec,
            args.python.as_deref(),
            args.steps,
            args.force,
            args.json,
        );
    }
    crate::guard::check_spec(&spec, args.force)?;
    let (a, budget, m) =
        ditmem_conformance::agree::measure_and_compare(&spec.model.name, &spec, args.steps, probe)
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
