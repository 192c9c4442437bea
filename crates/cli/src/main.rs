//! `ditmem`: budget, plan, run and verify the memory of a DiT training step.
//!
//! The binary is thin: it parses flags into a [`ditmem_budget::Spec`], calls the library crates,
//! and renders tables or JSON. Every error becomes one line on stderr and the exit code of the
//! README's table: 0 ok, 1 internal error, 2 bad input (flags, files, output paths), 3 does not
//! fit / refused for memory, 4 verify failed, 5 a needed external tool missing, 130 interrupted.

mod args;
mod compare_cmd;
mod conditions;
mod flags;
mod gpus_cmd;
mod guard;
mod input;
mod oom_cmd;
mod output;
mod params_cmd;
mod plan_cmd;
mod plot;
mod render;
mod run_cmd;
mod snapshot_cmd;
mod stats;
mod verify_cmd;

/// Counts every heap byte of the process, so `run` measures exact live bytes and peaks.
#[global_allocator]
static ALLOC: ditmem_engine::CountingAlloc = ditmem_engine::CountingAlloc::new();

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
    Estimate {
        #[command(flatten)]
        spec: SpecArgs,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Print every op of each segment with the buffer it keeps.
        #[arg(long)]
        inventory: bool,
        /// Also print the details: parameters, the breakdown at the peak and per phase, the
        /// caching allocator, what a block keeps.
        #[arg(long, short)]
        verbose: bool,
        /// Also print the whole simulated timeline.
        #[arg(long)]
        timeline: bool,
        /// Write the timeline as an SVG (live bytes over the step, categories at the peak).
        #[arg(long, value_name = "FILE")]
        plot: Option<std::path::PathBuf>,
    },
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
    Spec {
        #[command(flatten)]
        spec: SpecArgs,
        #[arg(long)]
        json: bool,
    },
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

fn run(cli: Cli) -> Result<(), CliError> {
    let command = cli.command.unwrap_or(Command::Estimate {
        spec: SpecArgs::default(),
        json: false,
        inventory: false,
        verbose: false,
        timeline: false,
        plot: None,
    });
    match command {
        Command::Estimate {
            spec,
            json,
            inventory,
            verbose,
            timeline,
            plot,
        } => {
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
        }
        Command::Run(args) => run_cmd::run(args, &ALLOC)?,
        Command::Compare(args) => compare_cmd::compare(args, &ALLOC)?,
        Command::Agree(args) => compare_cmd::agree_grid(args, &ALLOC)?,
        Command::Verify(args) => verify_cmd::run(args)?,
        Command::Plan(args) => plan_cmd::run(args)?,
        Command::Params(args) => params_cmd::run(args)?,
        Command::Gpus(args) => gpus_cmd::run(args)?,
        Command::Oom(args) => oom_cmd::run(args)?,
        Command::Spec { spec, json } => {
            // The runtime `estimate` and `plan` default to (pytorch:cuda), so that `spec … >
            // s.toml; estimate --config s.toml` answers as `estimate …` does.
            let spec = spec.to_gpu_spec()?;
            if json {
                output::print_json(&spec)?;
            } else {
                output::say(&spec.to_toml()?)?;
            }
        }
    }
    Ok(())
}

/// The subcommand named on the command line, for "see `ditmem CMD --help`".
fn command_name() -> String {
    const NAMES: [&str; 10] = [
        "estimate", "plan", "run", "compare", "agree", "verify", "spec", "params", "gpus", "oom",
    ];
    std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .filter(|a| NAMES.contains(&a.as_str()))
        .unwrap_or_default()
}

fn main() -> ExitCode {
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
    let (code, line) = match run(cli) {
        Ok(()) => return ExitCode::SUCCESS,
        Err(CliError::Spec(e)) => (2, format!("invalid input: {e}")),
        Err(CliError::Refused(msg)) => (3, format!("refused: {msg}")),
        Err(CliError::Missing(msg)) => (5, format!("missing: {msg}")),
        Err(CliError::Interrupted(steps)) => (
            130,
            format!("interrupted after {steps} steps; no output written"),
        ),
        Err(CliError::Other(e)) => (1, format!("{e:#}")),
    };
    output::note(&format!("ditmem: {}\n", flags::tidy(&line)));
    ExitCode::from(code)
}
