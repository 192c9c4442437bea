//! `ditmem plan`: the fastest recipe that fits a memory budget, and why.
//!
//! Prints the base and the plan side by side, the plan's peak by category, the reason in words,
//! and the memory-vs-time Pareto front; `--out` writes the plan as a spec that `ditmem run
//! --config` executes exactly, `--plot` the front as SVG, `--emit` the plan for accelerate,
//! DeepSpeed or the diffusers scripts. An infeasible budget prints the floor and exits 3.

mod parse;
mod report;

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use ditmem_budget::fmt_bytes;
use ditmem_budget::launch::{Launch, Launcher};
use ditmem_budget::DeviceProfile;
use ditmem_budget::SpecError;
use ditmem_budget::{export, Export, ExportOptions, Family, Offload, Sharder, Target};
use ditmem_budget::{fmt_secs, plan_with, Limits, SearchControl, DEFAULT_HEADROOM};

use crate::args::SpecArgs;
use crate::flags::fmt_float;
use crate::output::{print_json, write_output};
use crate::CliError;
pub(crate) use parse::parse_allow;
use parse::{
    parse_budget, parse_family, pinned, precision_requested, time_limit, DEFAULT_TIME_LIMIT_S,
};
use report::{pareto_svg, report, PlanReport};

#[derive(Debug, Clone, Args)]
pub(crate) struct PlanArgs {
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Memory of one rank, binary units: 24GiB, 40G, 81920MiB, or bytes (default with --gpu:
    /// the card's capacity as CUDA reports it; the plan then fits what nvidia-smi would show).
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    pub budget: Option<String>,
    /// Share of the budget kept free for fragmentation and what the budget does not model.
    #[arg(long, default_value_t = DEFAULT_HEADROOM, value_name = "FRACTION",
          value_parser = crate::flags::headroom, allow_hyphen_values = true)]
    pub headroom: f64,
    /// Levers that change what is trained or need more devices, comma-separated:
    /// lora, 8bit, sharding, bf16-pure, precision, quant (or all). LoRA and 8bit are used only
    /// when no recipe without them fits; quant (a LoRA base stored NF4, QLoRA; the pytorch
    /// runtime) only when nothing fits without it either. precision lets the planner change a precision you asked for
    /// (--precision, or recipe.precision in --config); without either, the default bf16-mixed may
    /// change without it.
    #[arg(long, value_delimiter = ',', value_name = "LEVERS")]
    pub allow: Vec<String>,
    /// Export the plan for a training stack (repeatable, or comma-separated): accelerate
    /// (accelerate_config.yaml) | deepspeed (ds_config.json for accelerate) |
    /// deepspeed-standalone (fixed values, plan's world size) | diffusers (the accelerate launch
    /// command of the family's diffusers script). The target's launcher constrains the search
    /// (see --launcher).
    #[arg(long, value_name = "TARGET", value_delimiter = ',')]
    pub emit: Vec<String>,
    /// Write every file the plan's launch needs into DIR (the --emit targets, ds_config.json
    /// beside a DeepSpeed accelerate config, ditmem_recipe.py for --launcher custom).
    #[arg(long, value_name = "DIR")]
    pub emit_dir: Option<PathBuf>,
    /// Who launches the plan: diffusers | accelerate | deepspeed (the family's diffusers script:
    /// its all-or-none checkpointing, its caching flags, no quantized base, what it keeps
    /// resident) | custom (your own script: the whole space, and the export carries the code).
    /// Default: from --emit (deepspeed-standalone and no --emit: custom).
    #[arg(long, value_name = "LAUNCHER")]
    pub launcher: Option<String>,
    /// GPUs per node of the launch: the plan's ranks over ceil(ranks / N) nodes
    /// (num_machines, machine_rank and the multi-node launch lines). Default 8.
    #[arg(long, value_name = "N", default_value_t = 8,
          value_parser = crate::flags::positive_u32, allow_hyphen_values = true)]
    pub gpus_per_node: u32,
    /// The model family the export targets: dit, dit-diffusers, pixart, sd3, flux, sana, wan
    /// (picks the diffusers script and the block FSDP wraps; default dit).
    #[arg(long, value_name = "FAMILY")]
    pub emit_family: Option<String>,
    /// How the export launches a sharded plan: deepspeed (ZeRO at the plan's stage, default) |
    /// fsdp (FSDP2: stage 3 reshards after forward, stage 2 does not; no stage 1); the same as
    /// --sharder (the plan's budget counts it).
    #[arg(long, value_name = "SHARDER")]
    pub emit_sharder: Option<String>,
    /// What the export offloads to CPU for a sharded plan: none (default) | optimizer |
    /// optimizer+params; the same as --offload (the plan's budget counts it).
    #[arg(long, value_name = "OFFLOAD")]
    pub emit_offload: Option<String>,
    /// Write the export to this file (atomically) instead of printing it.
    #[arg(long, value_name = "FILE", requires = "emit")]
    pub emit_out: Option<PathBuf>,
    /// Write the plan as a spec (TOML) for `ditmem run --config` (atomically).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Draw the Pareto front (peak vs predicted step time) as SVG.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    /// Device profile for the time model (TOML or JSON with every DeviceProfile field, a regular
    /// file of at most 1 MiB; rates 1e3–1e18 per second); default: the measured 2-core CPU profile.
    #[arg(long, value_name = "FILE")]
    pub profile: Option<PathBuf>,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Also print the whole reason, the plan's breakdown and the time model's profile.
    #[arg(long, short)]
    pub verbose: bool,
    /// Most seconds the search runs (0.1 to 86400): past it no further recipe, stage or
    /// alternative is searched, and the plan says what was not (a line, and `not_searched` in
    /// --json). The recipes are searched fastest first.
    #[arg(long, value_name = "SECONDS", default_value_t = DEFAULT_TIME_LIMIT_S,
          value_parser = time_limit, allow_hyphen_values = true)]
    pub time_limit: f64,
}

/// The search's progress on stderr: one line, rewritten in place (`\r`) at most ten times a
/// second once the search has run a second, and cleared when it ends. Only when stderr is a
/// terminal and the output is not JSON: a pipe, a file or a test sees nothing.
struct Ticker {
    on: bool,
    last: std::cell::Cell<Option<Instant>>,
}

impl Ticker {
    fn new(json: bool) -> Ticker {
        use std::io::IsTerminal;
        Ticker {
            on: !json && std::io::stderr().is_terminal(),
            last: std::cell::Cell::new(None),
        }
    }

    fn show(&self, p: &ditmem_budget::Progress) {
        if !self.on || p.elapsed_s < 1.0 {
            return;
        }
        let now = Instant::now();
        if self
            .last
            .get()
            .is_some_and(|t| now.duration_since(t).as_secs_f64() < 0.1)
        {
            return;
        }
        self.last.set(Some(now));
        use std::io::Write;
        // Progress is a courtesy: a stderr that fails to take it changes nothing.
        let _ = write!(
            std::io::stderr(),
            "\rplan: stage {}/{}, {}/{} combinations, {} timelines, {:.0} s\x1b[K",
            p.stage,
            p.stages,
            p.done,
            p.combinations,
            p.timelines,
            p.elapsed_s
        );
    }

    fn clear(&self) {
        if self.last.get().is_some() {
            use std::io::Write;
            let _ = write!(std::io::stderr(), "\r\x1b[K");
        }
    }
}

pub(crate) fn run(args: PlanArgs) -> Result<(), CliError> {
    // Every flag and output path is checked before any work or any file is written.
    let flags = check_flags(&args)?;
    let pinned = pinned(&args.spec)?;
    let (base, options) = base_and_options(&args, flags.launcher)?;
    let (profile, budget) = profile_and_budget(&args, &base, flags.budget)?;
    let limits = Limits {
        budget_bytes: budget,
        headroom: args.headroom,
        allow: flags.allow,
    };
    let launch = Launch {
        launcher: flags.launcher,
        family: options.family,
        pinned,
    };
    let t0 = Instant::now();
    let ticker = Ticker::new(args.json);
    let show_progress = |p: &ditmem_budget::Progress| ticker.show(p);
    let control = SearchControl {
        time_limit: Some(std::time::Duration::from_secs_f64(args.time_limit)),
        progress: Some(&show_progress),
        launch: Some(&launch),
    };
    let p = plan_with(&base, &limits, &profile, control);
    ticker.clear();
    let mut p = p?;
    let search_ms = t0.elapsed().as_secs_f64() * 1e3;
    let exported: Vec<Export> = if p.feasible {
        flags
            .targets
            .iter()
            .map(|&t| export(&p.plan, t, &options))
            .collect::<Result<_, _>>()?
    } else {
        Vec::new()
    };
    if let Some(e) = exported.first() {
        if !e.cannot.is_empty() {
            // What the named train script cannot do is part of why the plan may not run as
            // predicted.
            p.reason.push_str(&format!(
                "; the exported script cannot: {}",
                e.cannot.join("; ")
            ));
        }
    }
    print_plan(&args, &p, &base, search_ms, flags.launcher, &exported)?;
    if let Some(path) = &args.plot {
        write_output("--plot", path, pareto_svg(&p, &base)?.as_bytes())?;
        if !args.json {
            crate::output::say(&format!("wrote the Pareto front to {}\n", path.display()))?;
        }
    }
    if !p.feasible {
        return Err(refusal(&p, args.json));
    }
    write_plan_files(&args, &p, &exported, &options)
}

/// What `plan`'s flags say before any work: the budget flag, the levers allowed, the export
/// targets (deduplicated) and the launcher they imply.
struct PlanFlags {
    budget: Option<u64>,
    allow: ditmem_budget::Allow,
    targets: Vec<Target>,
    launcher: Launcher,
}

fn check_flags(args: &PlanArgs) -> Result<PlanFlags, CliError> {
    crate::output::check_outputs(&[
        ("--out", args.out.as_deref()),
        ("--emit-out", args.emit_out.as_deref()),
        ("--plot", args.plot.as_deref()),
    ])?;
    let budget = args.budget.as_deref().map(parse_budget).transpose()?;
    if !(0.0..0.9).contains(&args.headroom) {
        return Err(SpecError::invalid(
            "--headroom",
            format!(
                "{} is out of range; allowed: 0 ≤ headroom < 0.9",
                fmt_float(args.headroom)
            ),
        )
        .into());
    }
    let mut allow = parse_allow(&args.allow)?;
    // A precision the user asked for is kept unless `--allow precision`; with none asked, the
    // default may change.
    if !precision_requested(&args.spec)? {
        allow.precision = true;
    }
    let mut targets: Vec<Target> = Vec::new();
    for s in args.emit.iter().filter(|s| !s.trim().is_empty()) {
        let t = s.parse::<Target>()?;
        if !targets.contains(&t) {
            targets.push(t);
        }
    }
    if args.emit_out.is_some() && targets.len() != 1 {
        return Err(SpecError::invalid(
            "--emit-out",
            "writes one export; allowed: with exactly one --emit target (--emit-dir for several)",
        )
        .into());
    }
    let launcher = match &args.launcher {
        Some(l) => l.parse::<Launcher>()?,
        None => default_launcher(&targets),
    };
    Ok(PlanFlags {
        budget,
        allow,
        targets,
        launcher,
    })
}

/// The spec to plan from (with `--emit-sharder` / `--emit-offload`, which the budget counts as
/// the export launches them) and the export's options.
fn base_and_options(
    args: &PlanArgs,
    launcher: Launcher,
) -> Result<(ditmem_budget::Spec, ExportOptions), CliError> {
    let mut options = ExportOptions {
        family: match &args.emit_family {
            Some(f) => parse_family(f)?,
            None => Family::Dit,
        },
        sharder: args
            .emit_sharder
            .as_deref()
            .map(|x| Sharder::parse(x, "plan.emit-sharder"))
            .transpose()?
            .unwrap_or_default(),
        offload: args
            .emit_offload
            .as_deref()
            .map(|x| Offload::parse(x, "plan.emit-offload"))
            .transpose()?
            .unwrap_or_default(),
        launcher,
        gpus_per_node: args.gpus_per_node,
    };
    let mut base = args.spec.to_gpu_spec()?;
    if args.emit_sharder.is_some() {
        base.recipe.sharder = options.sharder;
    }
    if args.emit_offload.is_some() {
        base.recipe.offload = options.offload;
    }
    base.validate()?;
    if args.emit_family.is_none() {
        // The script that trains the spec's model.
        if let Some(fm) = ditmem_budget::denoiser::family(&base)? {
            options.family = fm.family;
        }
    }
    Ok((base, options))
}

/// Times on the device the spec runs on (a CUDA spec on its GPU, an A100 80 GB when it names
/// none; the ditmem engine on this CPU's measured profile; or `--profile`), and the budget:
/// `--budget`, else the card's capacity as CUDA reports it.
fn profile_and_budget(
    args: &PlanArgs,
    base: &ditmem_budget::Spec,
    budget_flag: Option<u64>,
) -> Result<(DeviceProfile, u64), CliError> {
    let gpu = base.cuda.as_ref().and_then(|c| c.gpu.as_deref());
    let on_cuda = matches!(
        base.runtime,
        ditmem_budget::Runtime::Pytorch {
            device: ditmem_budget::TorchDevice::Cuda,
            ..
        }
    );
    let profile = match (&args.profile, on_cuda) {
        (Some(path), _) => crate::input::load_profile(path)?,
        (None, true) => DeviceProfile::for_gpu(
            ditmem_budget::gpu::lookup(gpu.unwrap_or("a100-80gb"))
                .map_err(|e| SpecError::invalid("--gpu", e.to_string()))?,
        ),
        (None, false) => DeviceProfile::cpu_default(),
    };
    let gpu_memory = base.cuda.as_ref().and_then(|c| c.gpu_memory);
    let budget = match (budget_flag, gpu) {
        (Some(b), _) => b,
        (None, Some(name)) => ditmem_budget::gpu::with_memory(
            ditmem_budget::gpu::lookup(name)
                .map_err(|e| SpecError::invalid("--gpu", e.to_string()))?,
            gpu_memory,
        )
        .capacity_bytes(),
        (None, None) => {
            return Err(SpecError::invalid(
                "--budget",
                "required: a size such as 24GiB, or --gpu NAME for that card's capacity",
            )
            .into())
        }
    };
    Ok((profile, budget))
}

/// The plan as JSON or as the report in words (with what was not searched).
fn print_plan(
    args: &PlanArgs,
    p: &ditmem_budget::Plan,
    base: &ditmem_budget::Spec,
    search_ms: f64,
    launcher: Launcher,
    exported: &[Export],
) -> Result<(), CliError> {
    if args.json {
        return print_json(&PlanReport {
            plan: p,
            base,
            search_ms,
            launcher,
            export: exported.first(),
            exports: exported,
        })
        .map_err(Into::into);
    }
    crate::output::say(&report(
        p,
        base,
        search_ms,
        args.verbose,
        crate::render::width(),
    ))?;
    if let Some(n) = &p.not_searched {
        crate::output::say(&crate::render::fit_lines(
            &format!(
                "not searched: {} (--time-limit to search longer)\n",
                n.describe()
            ),
            crate::render::width(),
        ))?;
    }
    Ok(())
}

/// The error line of an infeasible plan; the report (or the JSON) above holds the reason, this
/// says it short.
fn refusal(p: &ditmem_budget::Plan, json: bool) -> CliError {
    CliError::Refused(match &p.not_searched {
        // Nothing that fits was found in the time given: the budget may still be feasible.
        Some(n) => format!(
            "nothing that fits was found before the time limit; the smallest found needs {}; \
             {} (--time-limit to search longer)",
            fmt_bytes(p.predicted_peak_bytes),
            n.describe()
        ),
        None => format!(
            "the budget is infeasible: nothing fits {} usable; the smallest found needs {}{}{}",
            fmt_bytes(p.usable_bytes),
            fmt_bytes(p.predicted_peak_bytes),
            // What to try next, when the reason names it.
            crate::render::clauses(&p.reason)
                .into_iter()
                .filter(|c| c.starts_with("--allow")
                    || c.contains("--ranks")
                    || c.contains("--launcher"))
                .map(|c| format!("; {c}"))
                .collect::<String>(),
            if json {
                "; the JSON's reason says why"
            } else {
                "; why: above"
            }
        ),
    })
}

/// `--out` (the plan as a spec file), `--emit-dir` (every file the plan needs), `--emit-out` or
/// the exports printed, and what each export cannot express.
fn write_plan_files(
    args: &PlanArgs,
    p: &ditmem_budget::Plan,
    exported: &[Export],
    options: &ExportOptions,
) -> Result<(), CliError> {
    if let Some(path) = &args.out {
        let toml = p.plan.to_toml()?;
        let text = format!(
            "# ditmem plan: {} budget, {:.0} % headroom; predicted peak {}, step {} on '{}'\n# run it: ditmem run --config {}\n{}",
            fmt_bytes(p.budget_bytes),
            100.0 * p.headroom,
            fmt_bytes(p.predicted_peak_bytes),
            fmt_secs(p.predicted_step_time_s),
            p.profile.name,
            path.display(),
            toml
        );
        write_output("--out", path, text.as_bytes())?;
        if !args.json {
            crate::output::say(&format!("wrote the plan to {}\n", path.display()))?;
        }
    }
    if let Some(dir) = &args.emit_dir {
        let files = ditmem_budget::export_files(&p.plan, exported, options)?;
        std::fs::create_dir_all(dir).map_err(|e| {
            SpecError::invalid(
                "--emit-dir",
                format!("cannot create '{}': {e}", dir.display()),
            )
        })?;
        for (name, text) in &files {
            write_output("--emit-dir", &dir.join(name), text.as_bytes())?;
        }
        if !args.json {
            crate::output::say(&format!(
                "wrote {} to {}\n",
                files
                    .iter()
                    .map(|(n, _)| n.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                dir.display()
            ))?;
        }
    }
    for e in exported {
        match &args.emit_out {
            Some(path) => {
                write_output("--emit-out", path, e.text.as_bytes())?;
                if !args.json {
                    crate::output::say(&format!(
                        "wrote the {} export to {}\n",
                        e.target,
                        path.display()
                    ))?;
                }
            }
            None if !args.json && args.emit_dir.is_none() => {
                crate::output::say(&format!(
                    "\n--- {} ({}) ---\n{}",
                    e.target, e.file_name, e.text
                ))?;
            }
            None => {}
        }
        if !args.json {
            crate::output::say(&export_lists(e))?;
        }
    }
    Ok(())
}

/// What an export cannot do as planned (the run will differ from the plan), then its notes,
/// each as a list under its heading; empty when it has neither.
fn export_lists(e: &Export) -> String {
    let mut text = String::new();
    for (items, heading) in [
        (
            &e.cannot,
            format!("what the {} export cannot do as planned", e.target),
        ),
        (&e.notes, format!("notes on the {} export", e.target)),
    ] {
        if !items.is_empty() {
            text.push_str(&format!("\n{heading}:\n"));
            for n in items {
                text.push_str(&format!("  - {n}\n"));
            }
        }
    }
    text
}

/// The launcher an --emit list implies: the first target that runs a diffusers script.
fn default_launcher(targets: &[Target]) -> Launcher {
    for t in targets {
        match t {
            Target::Diffusers => return Launcher::Diffusers,
            Target::Accelerate => return Launcher::Accelerate,
            Target::Deepspeed => return Launcher::Deepspeed,
            Target::DeepspeedStandalone => {}
        }
    }
    Launcher::Custom
}

#[cfg(test)]
mod tests {
    use super::*;
    use ditmem_budget::Allow;

    #[test]
    fn budgets_parse_or_name_the_flag() {
        assert_eq!(parse_budget("24GiB").unwrap(), 24 << 30);
        for bad in [
            "",
            "0",
            "lots",
            "-3G",
            "24 parsecs",
            "18446744073709551616",
            "16EiB",
            "1e30TiB",
        ] {
            let e = parse_budget(bad).unwrap_err();
            assert_eq!(e.field(), Some("--budget"), "{bad}");
        }
    }

    #[test]
    fn allow_lists() {
        let a = parse_allow(&["lora".into(), "8bit".into()]).unwrap();
        assert!(a.lora && a.eight_bit && !a.sharding && !a.bf16_pure && !a.precision);
        assert!(parse_allow(&["precision".into()]).unwrap().precision);
        assert_eq!(parse_allow(&["all".into()]).unwrap(), Allow::all());
        assert_eq!(
            parse_allow(&["fp8".into()]).unwrap_err().field(),
            Some("--allow")
        );
    }

    #[test]
    fn families_parse_or_name_the_flag() {
        assert_eq!(parse_family("Flux").unwrap(), Family::Flux);
        assert_eq!(parse_family("dit-diffusers").unwrap(), Family::DitDiffusers);
        let e = parse_family("unet").unwrap_err();
        assert_eq!(e.field(), Some("--emit-family"));
    }
}
