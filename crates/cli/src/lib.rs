//! The `ditmem` command line as a library: the binary (`main.rs`), the web page (`ditmem serve`)
//! and the Python package call the same commands, so every answer is the CLI's.
//!
//! Every error becomes one line on stderr and the exit code of the README's table: 0 ok, 1
//! internal error, 2 bad input (flags, files, output paths), 3 does not fit / refused for memory,
//! 4 verify failed, 5 a needed external tool missing, 130 interrupted. [`api`] gives the same
//! answers as values (the `--json` output) and typed errors.

// A `pub` item the crate root does not export would read as API and is not: it must say
// `pub(crate)` (issue 45: public items only where another crate can use them).
#![warn(unreachable_pub)]

pub mod api;
pub(crate) mod args;
pub(crate) mod compare_cmd;
pub(crate) mod conditions;
mod error;
pub(crate) mod estimate_cmd;
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
pub(crate) mod spec_cmd;
pub(crate) mod stats;
pub(crate) mod verify_cmd;

use std::process::ExitCode;

pub use crate::error::{error_line, CliError};
use crate::estimate_cmd::EstimateArgs;
use crate::spec_cmd::SpecCmdArgs;
use clap::error::ErrorKind;
use clap::{Parser, Subcommand};

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

fn run(cli: Cli, alloc: &'static ditmem_engine::CountingAlloc) -> Result<(), CliError> {
    let command = cli
        .command
        .unwrap_or(Command::Estimate(EstimateArgs::default()));
    let (t0, name) = (std::time::Instant::now(), command_name());
    match command {
        Command::Estimate(args) => estimate_cmd::estimate(args)?,
        Command::Run(args) => run_cmd::run(args, alloc)?,
        Command::Compare(args) => compare_cmd::compare(args, alloc)?,
        Command::Agree(args) => compare_cmd::agree_grid(args, alloc)?,
        Command::Verify(args) => verify_cmd::run(args, alloc)?,
        Command::Plan(args) => plan_cmd::run(args)?,
        Command::Params(args) => params_cmd::run(args)?,
        Command::Gpus(args) => gpus_cmd::run(args)?,
        Command::Oom(args) => oom_cmd::run(args)?,
        Command::Spec(args) => spec_cmd::spec(args)?,
        Command::Serve(args) => serve::run(args)?,
    }
    ditmem_budget::profile::report(&name, t0.elapsed().as_secs_f64());
    Ok(())
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
