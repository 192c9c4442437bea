//! `ditmem agree`: the agreement grid, each family's part summarised on its own.

use clap::Args;
use ditmem_budget::Spec;
use ditmem_conformance::agree::{self, Agreement};
use ditmem_engine::MemoryProbe;

use crate::render::{fmt_count, Table};
use crate::CliError;

#[derive(Debug, Clone, Args)]
pub(crate) struct AgreeArgs {
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
pub(crate) enum AgreeFamily {
    Dit,
    Pixart,
    Sd3,
    Flux,
    Sana,
    Wan,
    DitDiffusers,
    All,
}

/// Specs of the grid, each with its name.
type Grid = Vec<(String, Spec)>;

/// A family's part of the grid: all its specs.
type FamilyGrid = fn() -> ditmem_engine::Result<Grid>;

/// The grid's families in the order they run: which, its JSON key, its label, its specs.
const FAMILIES: [(AgreeFamily, &str, &str, FamilyGrid); 7] = [
    (AgreeFamily::Dit, "dit", "DiT", dit_grid),
    (AgreeFamily::Pixart, "pixart", "PixArt", agree::pixart_grid),
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

/// The original DiT's grid (built without a config to read, so it cannot fail).
fn dit_grid() -> ditmem_engine::Result<Grid> {
    Ok(agree::grid())
}

/// One family's part of the grid: its JSON key, its label and its results (or, before they are
/// measured, how many specs it has).
struct Part<R> {
    key: &'static str,
    label: &'static str,
    results: R,
}

pub(crate) fn agree_grid(args: AgreeArgs, probe: &dyn MemoryProbe) -> Result<(), CliError> {
    crate::guard::check_process("agree", 0)?;
    if args.every == 0 {
        return Err(CliError::Spec(ditmem_budget::SpecError::invalid(
            "--every",
            "is 0; allowed: 1 or more",
        )));
    }
    let (grid, sizes) = select(&args)?;
    let mut largest = 0;
    for (_, spec) in &grid {
        largest = largest.max(ditmem_budget::estimate(spec)?.peak_bytes);
    }
    crate::guard::check("the largest spec of the grid", largest, false)?;
    let results = measure(&grid, args.json, probe)?;
    // Each family's results: the grid holds them in the order of `sizes`.
    let mut parts = Vec::new();
    let mut rest = results.as_slice();
    for size in &sizes {
        let (part, r) = rest.split_at(size.results.min(rest.len()));
        parts.push(Part {
            key: size.key,
            label: size.label,
            results: part,
        });
        rest = r;
    }
    if args.json {
        let mut families = serde_json::Map::new();
        for p in parts.iter().filter(|p| !p.results.is_empty()) {
            let s =
                serde_json::to_value(agree::summarize(p.results)).map_err(anyhow::Error::from)?;
            families.insert(p.key.into(), s);
        }
        crate::output::print_json(&serde_json::json!({
            "summary": agree::summarize(&results),
            "families": families,
            "specs": results
        }))?;
    } else {
        crate::output::say(&render(&results, &parts))?;
    }
    Ok(())
}

/// The specs `--family` and `--every` pick, and each picked family's part of them, in order.
fn select(args: &AgreeArgs) -> Result<(Grid, Vec<Part<usize>>), CliError> {
    let mut grid: Grid = Vec::new();
    let mut sizes = Vec::new();
    for (family, key, label, make) in FAMILIES {
        if args.family != family && args.family != AgreeFamily::All {
            continue;
        }
        let specs = make().map_err(crate::run_cmd::engine_err)?;
        let n = grid.len();
        grid.extend(specs.into_iter().step_by(args.every));
        sizes.push(Part {
            key,
            label,
            results: grid.len() - n,
        });
    }
    Ok((grid, sizes))
}

/// Each spec measured after one warm-up step and held against its budget, a progress bar on a
/// terminal.
fn measure(
    grid: &[(String, Spec)],
    json: bool,
    probe: &dyn MemoryProbe,
) -> Result<Vec<Agreement>, CliError> {
    let bar = if json || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(grid.len() as u64)
    };
    let mut results = Vec::new();
    for (name, spec) in grid {
        bar.set_message(name.clone());
        let (a, _, _) =
            agree::measure_and_compare(name, spec, 1, probe).map_err(crate::run_cmd::engine_err)?;
        results.push(a);
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(results)
}

/// One row per spec, a line per family when there are several, and the grid's summary.
fn render(results: &[Agreement], parts: &[Part<&[Agreement]>]) -> String {
    let mut t = Table::new(&["spec", "predicted", "measured", "error"]);
    for a in results {
        t.row(vec![
            a.name.clone(),
            fmt_count(a.predicted_peak_bytes),
            fmt_count(a.measured_peak_bytes),
            format!("{:+.3} %", 100.0 * a.rel_error),
        ]);
    }
    let mut o = t.render();
    for p in parts {
        if !p.results.is_empty() && p.results.len() < results.len() {
            let s = agree::summarize(p.results);
            o.push_str(&format!(
                "{}: {} specs, max {:.3} % ({}), median {:.3} %\n",
                p.label,
                s.specs,
                100.0 * s.max_abs_rel_error,
                s.worst,
                100.0 * s.median_abs_rel_error
            ));
        }
    }
    let summary = agree::summarize(results);
    o.push_str(&format!(
        "{} specs: max |pred/meas − 1| = {:.3} % ({}), median {:.3} %\n",
        summary.specs,
        100.0 * summary.max_abs_rel_error,
        summary.worst,
        100.0 * summary.median_abs_rel_error
    ));
    o.push_str(
        "(step memory above the live bytes before the step, after one warm-up step; counting allocator)\n",
    );
    o
}
