//! The `ditmem` command line as a library: the binary (`main.rs`), the web page (`ditmem serve`)
//! and the Python package call the same commands, so every answer is the CLI's.
//!
//! Every error becomes one line on stderr and the exit code of the README's table: 0 ok, 1
//! internal error, 2 bad input (flags, files, output paths), 3 does not fit / refused for memory,
//! 4 verify failed, 5 a needed external tool missing, 130 interrupted. [`api`] gives the same
//! answers as values (the `--json` output) and typed errors.

pub mod api;
pub(crate) mod args;
pub(crate) mod compare_cmd;
pub(crate) mod conditions;
pub(crate) mod flags;
pub(crate) mod gpus_cmd;
pub(crate) mod guard;
pub(crate) mod input;
pub(crate) mod oom_cmd;
pub mod output;
pub(crate) mod params_cmd;
pub(crate) mod plan_cmd;
pub(crate) mod plot;
pub(crate) mod render;
pub(crate) mod run_cmd;
pub mod serve;
pub(crate) mod snapshot_cmd;
pub(crate) mod stats;
pub(crate) mod verify_cmd;

use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::{Parser, Subcommand};
use ditmem_budget::SpecError;

use crate::args::SpecArgs;

#[derive(Debug, Parser)]
#[command(
    name = "ditmem",
    version,
    about = "Budget, plan, run and verify the memory of a DiT training step"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Count every byte of one training step and find its peak (analytic, no tensors).
    Estimate(EstimateArgs),
    /// The fastest recipe that fits a memory budget, and why (Pareto front, export, exit 3 when
    /// nothing fits).
    Plan(plan_cmd::PlanArgs),
    /// Execute the recipe on a real DiT training step (candle, CPU) and measure peak and time.
    Run(run_cmd::RunArgs),
    /// Run the engine on a spec and hold the budget's prediction against the measurement; or,
    /// with --snapshot, hold the pytorch:cuda prediction against a PyTorch CUDA memory snapshot.
    Compare(compare_cmd::CompareArgs),
    /// Run the agreement grid (40+ small specs) and report max and median |pred/meas − 1|.
    Agree(compare_cmd::AgreeArgs),
    /// Hold precision / recompute / attention variants against a float64 reference: loss and
    /// gradients on a fixed batch, tolerances by dtype, bitwise recompute twins, drift over K
    /// steps (exit 4 when a variant fails).
    Verify(verify_cmd::VerifyArgs),
    /// The parameter table of a diffusers model (config.json or preset): family, dimensions,
    /// parameters per module group, model state per recipe; `--weights` checks a checkpoint.
    Params(params_cmd::ParamsArgs),
    /// The GPU catalog: capacity CUDA reports, compute capability, dtype support, dense FLOP/s,
    /// bandwidth, CUDA context and cuBLAS workspace, with sources (`ditmem gpus NAME` for one).
    Gpus(gpus_cmd::GpusArgs),
    /// Read a PyTorch out-of-memory message (argument, --file or stdin): fragmentation or a true
    /// shortage, the card as CUDA sees it and, with the run's spec flags, the levers that fit.
    Oom(oom_cmd::OomArgs),
    /// Print the resolved spec (TOML, or JSON with --json), e.g. to edit and pass to --config.
    Spec(SpecCmdArgs),
    /// A local web page and JSON API (the CLI's --json) for estimate, plan, params, gpus, oom
    /// and spec: 127.0.0.1 by default, assets embedded, no file-system access from requests.
    Serve(serve::ServeArgs),
}

/// `ditmem estimate`'s flags.
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct EstimateArgs {
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Print every op of each segment with the buffer it keeps.
    #[arg(long)]
    pub inventory: bool,
    /// Also print the details: parameters, the breakdown at the peak and per phase, the
    /// caching allocator, what a block keeps.
    #[arg(long, short)]
    pub verbose: bool,
    /// Also print the whole simulated timeline.
    #[arg(long)]
    pub timeline: bool,
    /// Write the timeline as an SVG (live bytes over the step, categories at the peak).
    #[arg(long, value_name = "FILE")]
    pub plot: Option<std::path::PathBuf>,
}

/// `ditmem spec`'s flags.
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct SpecCmdArgs {
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Print JSON instead of TOML.
    #[arg(long)]
    pub json: bool,
}

/// `estimate --json`: the budget, what has to fit on the device, and each single-flag lever.
#[derive(serde::Serialize)]
struct EstimateJson<'a> {
    #[serde(flatten)]
    budget: &'a ditmem_budget::Budget,
    need_bytes: u64,
    levers: Vec<LeverJson<'a>>,
}

/// A lever in `estimate --json`, with the flags that pull it.
#[derive(serde::Serialize)]
struct LeverJson<'a> {
    #[serde(flatten)]
    lever: &'a ditmem_budget::levers::Lever,
    flags: String,
}

/// Errors the binary reports; each maps to an exit code.
#[derive(Debug)]
pub enum CliError {
    /// Bad input: exit 2.
    Spec(SpecError),
    /// The step would not fit (a guard refused it): exit 3.
    Refused(String),
    /// A needed external tool is missing (the PyTorch peer's Python): exit 5.
    Missing(String),
    /// Ctrl-C stopped a run after this many steps: exit 130.
    Interrupted(u32),
    /// Anything else that went wrong: exit 1.
    Other(anyhow::Error),
}

impl From<SpecError> for CliError {
    fn from(e: SpecError) -> Self {
        CliError::Spec(e)
    }
}

impl From<anyhow::Error> for CliError {
    fn from(e: anyhow::Error) -> Self {
        CliError::Other(e)
    }
}

fn run(cli: Cli, alloc: &'static ditmem_engine::CountingAlloc) -> Result<(), CliError> {
    let command = cli
        .command
        .unwrap_or(Command::Estimate(EstimateArgs::default()));
    match command {
        Command::Estimate(args) => estimate(args)?,
        Command::Run(args) => run_cmd::run(args, alloc)?,
        Command::Compare(args) => compare_cmd::compare(args, alloc)?,
        Command::Agree(args) => compare_cmd::agree_grid(args, alloc)?,
        Command::Verify(args) => verify_cmd::run(args)?,
        Command::Plan(args) => plan_cmd::run(args)?,
        Command::Params(args) => params_cmd::run(args)?,
        Command::Gpus(args) => gpus_cmd::run(args)?,
        Command::Oom(args) => oom_cmd::run(args)?,
        Command::Spec(args) => spec(args)?,
        Command::Serve(args) => serve::run(args)?,
    }
    Ok(())
}

/// `ditmem estimate`: the budget, the answer first, and each single-flag lever.
pub(crate) fn estimate(args: EstimateArgs) -> Result<(), CliError> {
    let EstimateArgs {
        spec,
        json,
        inventory,
        verbose,
        timeline,
        plot,
    } = args;
    output::check_outputs(&[("--plot", plot.as_deref())])?;
    let spec = spec.to_gpu_spec()?;
    let budget = ditmem_budget::estimate(&spec)?;
    // The answer's last line: each single lever, budgeted and ranked on the spec's card.
    let levers = render::estimate_levers(&spec, &budget)?;
    if let Some(path) = &plot {
        let svg = compare_cmd::timeline_svg(&budget, None)?;
        output::write_output("--plot", path, svg.as_bytes())?;
    }
    if json {
        output::print_json(&EstimateJson {
            budget: &budget,
            need_bytes: ditmem_budget::levers::need_bytes(&budget),
            levers: levers
                .iter()
                .map(|l| LeverJson {
                    flags: render::change_flags(&spec, &l.spec).join(" "),
                    lever: l,
                })
                .collect(),
        })?;
    } else {
        output::say(&render::estimate_report(&render::EstimateView {
            budget: &budget,
            levers: &levers,
            verbose,
            inventory,
            width: render::width(),
        }))?;
        if timeline {
            output::say(&output::timeline_table(&budget.timeline))?;
        }
    }
    Ok(())
}

/// `ditmem spec`: the resolved spec as TOML (or JSON). The runtime `estimate` and `plan`
/// default to (pytorch:cuda), so that `spec … > s.toml; estimate --config s.toml` answers as
/// `estimate …` does.
pub(crate) fn spec(args: SpecCmdArgs) -> Result<(), CliError> {
    let spec = args.spec.to_gpu_spec()?;
    if args.json {
        output::print_json(&spec)?;
    } else {
        output::say(&spec.to_toml()?)?;
    }
    Ok(())
}

/// The exit code and the one line (without the `ditmem: ` prefix) the CLI reports for an error.
pub fn error_line(e: &CliError) -> (u8, String) {
    let (code, line) = match e {
        CliError::Spec(e) => (2, format!("invalid input: {e}")),
        CliError::Refused(msg) => (3, format!("refused: {msg}")),
        CliError::Missing(msg) => (5, format!("missing: {msg}")),
        CliError::Interrupted(steps) => (
            130,
            format!("interrupted after {steps} steps; no output written"),
        ),
        CliError::Other(e) => (1, format!("{e:#}")),
    };
    (code, flags::tidy(&line))
}

/// The subcommand named on the command line, for "see `ditmem CMD --help`".
fn command_name() -> String {
    const NAMES: [&str; 11] = [
        "estimate", "plan", "run", "compare", "agree", "verify", "spec", "params", "gpus", "oom",
        "serve",
    ];
    std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .filter(|a| NAMES.contains(&a.as_str()))
        .unwrap_or_default()
}

/// The binary's `main`: parse the command line, run it, map the outcome to an exit code.
/// `alloc` is the process's counting allocator (`run` measures with it).
pub fn main_with(alloc: &'static ditmem_engine::CountingAlloc) -> ExitCode {
    // Before any thread exists (see `ditmem_engine::threads`).
    ditmem_engine::threads::configure_before_threads();
    ditmem_engine::malloc::one_arena();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => match e.kind() {
            ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            _ => {
                output::note(&format!(
                    "ditmem: invalid input: {}\n",
                    flags::tidy(&flags::clap_line(&e, &command_name()))
                ));
                return ExitCode::from(2);
            }
        },
    };
    let (code, line) = match run(cli, alloc) {
        Ok(()) => return ExitCode::SUCCESS,
        Err(e) => error_line(&e),
    };
    output::note(&format!("ditmem: {line}\n"));
    ExitCode::from(code)
}
