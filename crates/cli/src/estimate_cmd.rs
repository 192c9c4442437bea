//! `ditmem estimate`: the budget of one step, the answer first, and each single-flag lever.

use crate::args::SpecArgs;
use crate::{compare_cmd, output, render, CliError};

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
