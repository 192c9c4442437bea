//! `plan`'s report: the base and the plan side by side, the plan's peak by category, the
//! reason in words, the Pareto front as text ([`report`]) and as SVG ([`pareto_svg`]).

use crate::plot::{pareto_chart, FrontPoint, ParetoChart, Rule};
use crate::render::{
    category_words, change_flags, change_tags, clauses, fit_lines, pct, short_recipe, spec_line,
    top_of, wrap, wrap_at_most, Table,
};
use ditmem_budget::fmt_bytes;
use ditmem_budget::launch::Launcher;
use ditmem_budget::Export;
use ditmem_budget::Spec;
use ditmem_budget::{fmt_secs, Allow, Plan};
use serde::Serialize;

/// What `--json` prints: the plan and the search conditions.
#[derive(Debug, Serialize)]
pub(super) struct PlanReport<'a> {
    #[serde(flatten)]
    pub(super) plan: &'a Plan,
    pub(super) base: &'a Spec,
    pub(super) search_ms: f64,
    /// Who launches the plan (its abilities constrained the search).
    pub(super) launcher: Launcher,
    /// The first export (the only one with one --emit).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) export: Option<&'a Export>,
    /// Every export, in --emit order.
    #[serde(skip_serializing_if = "<[Export]>::is_empty")]
    pub(super) exports: &'a [Export],
}

pub(super) fn allow_line(a: &Allow, ranks: u32) -> String {
    let mut on = Vec::new();
    let mut off = Vec::new();
    for (flag, name) in [
        (a.lora, "lora"),
        (a.eight_bit, "8bit"),
        (a.sharding, "sharding"),
        (a.bf16_pure, "bf16-pure"),
        (a.precision, "precision"),
        (a.quant, "quant"),
    ] {
        if flag {
            on.push(name);
        } else {
            off.push(name);
        }
    }
    let mut s = if on.is_empty() {
        "allowed: the standard levers only".to_string()
    } else {
        format!("allowed: standard levers + {}", on.join(", "))
    };
    if !off.is_empty() {
        s.push_str(&format!(" (not: {}; --allow to add)", off.join(", ")));
    }
    if a.sharding && ranks == 1 {
        s.push_str("; sharding needs --ranks > 1");
    }
    s
}

/// The human report: the answer first (five lines: what was planned, fits, the step's time,
/// the biggest categories, the changes), the reason in at most three lines, the flags that make
/// the plan, then the Pareto front; `--verbose` adds the whole reason and the breakdown.
pub(super) fn report(p: &Plan, base: &Spec, search_ms: f64, verbose: bool, width: usize) -> String {
    let w = width;
    // The profile's short name (its device); `--verbose` names it in full on the times line.
    let profile = p.profile.name.split(" (").next().unwrap_or(&p.profile.name);
    let mut out = answer(p, base, profile, w);
    out.push_str(&why(p, profile, verbose, w));
    let flags = change_flags(base, &p.plan);
    if !flags.is_empty() {
        out.push_str(&wrap(&format!("flags: {}", flags.join(" ")), w, 2));
    }
    let lacks: Vec<&str> = ditmem_budget::ditmem_cpu::not_executed(&p.plan)
        .iter()
        .map(|n| n.what)
        .collect();
    if p.feasible && !lacks.is_empty() {
        out.push_str(&wrap(
            &format!(
                "note: `ditmem run` cannot execute this plan: the engine runs no {}",
                lacks.join(", no ")
            ),
            w,
            2,
        ));
    }
    if verbose {
        out.push_str(&breakdown(p, w));
    }
    out.push_str(&wrap(&allow_line(&p.allow, base.workload.ranks), w, 2));
    out.push_str(&front(p, base, w));
    out.push_str(&format!(
        "searched {} combinations ({} pruned as dominated), {} timelines, in {}\n",
        p.combinations,
        p.pruned,
        p.evaluated,
        fmt_secs(search_ms / 1e3)
    ));
    fit_lines(&out, w)
}

/// The answer's five lines: what was planned, whether it fits, the step's time, the biggest
/// categories at the peak, the changes from the base.
fn answer(p: &Plan, base: &Spec, profile: &str, w: usize) -> String {
    let usable = format!(
        "{} usable ({} less {:.0} % headroom)",
        fmt_bytes(p.usable_bytes),
        fmt_bytes(p.budget_bytes),
        100.0 * p.headroom
    );
    let tags = change_tags(base, &p.plan);
    // With no change of the planner's, what differs from the base is the launcher's (a
    // script's own encoders, adapters, caching): the base as it runs is what fits.
    let as_run = if p.changes.is_empty() && !tags.is_empty() {
        "as the launcher runs it"
    } else {
        "as it is"
    };
    let fits = if p.feasible && p.base_fits && p.changes.is_empty() {
        format!(
            "fits: yes, {as_run} — {} of {usable}",
            fmt_bytes(p.base_peak_bytes)
        )
    } else if p.feasible && p.base_fits {
        format!(
            "fits: yes, as it is — {} of {usable}; the plan is faster, at {}",
            fmt_bytes(p.base_peak_bytes),
            fmt_bytes(p.predicted_peak_bytes)
        )
    } else if p.feasible {
        format!(
            "fits: yes, changed — {} of {usable}; as given it needs {}",
            fmt_bytes(p.predicted_peak_bytes),
            fmt_bytes(p.base_peak_bytes)
        )
    } else {
        format!(
            "fits: no — nothing fits {usable}; the smallest found needs {}",
            fmt_bytes(p.predicted_peak_bytes)
        )
    };
    let step = format!(
        "step: {} predicted (as given {}, {:+.0} %) by the {} time model ({})",
        fmt_secs(p.predicted_step_time_s),
        fmt_secs(p.base_step_time_s),
        100.0 * (p.predicted_step_time_s / p.base_step_time_s.max(f64::MIN_POSITIVE) - 1.0),
        profile,
        ditmem_budget::time_error_note(&p.profile)
    );
    let changes = if tags.is_empty() {
        "none".to_string()
    } else {
        tags.join(" · ")
    };
    [
        format!("plan for {}; {}", spec_line(base), short_recipe(base)),
        fits,
        step,
        format!("biggest: {}", top_of(&p.breakdown, p.predicted_peak_bytes)),
        format!("changes: {changes}"),
    ]
    .iter()
    .map(|line| wrap(line, w, 2))
    .collect()
}

/// The reason, less what the answer's lines already say: whole with `--verbose`; else its
/// first clause (what dominates) and what explains a change, in at most three lines.
fn why(p: &Plan, profile: &str, verbose: bool, w: usize) -> String {
    // The reason without what the lines above already say: the changes, and the peak and
    // step time on the profile (named in full on the step line's model with --verbose).
    let mut why = p.reason.replace(&p.profile.name, profile);
    if verbose {
        return wrap(&format!("why: {why}"), w, 2);
    }
    if !p.changes.is_empty() {
        why = why.replace(&format!(": {}", p.changes.join("; ")), "");
    }
    if let Some(i) = why.find(" → peak ") {
        if let Some(j) = why[i..].find(&format!(" on {profile}")) {
            why.replace_range(i..i + j + 4 + profile.len(), "");
        }
    }
    // The first clause (what dominates), then what explains a change.
    // The fragmentation clause is said in its first words (the flags line names the
    // setting to launch with).
    let mut parts: Vec<&str> = clauses(&why)
        .into_iter()
        .filter(|c| !c.starts_with("with expandable segments"))
        .map(|c| c.split(": allocated peaks at").next().unwrap_or(c))
        .collect();
    // What was not needed is for --verbose.
    let minor = |c: &str| c.ends_with("not needed") || c.ends_with("is kept");
    if parts.len() > 1 {
        let first = parts[0];
        parts.retain(|c| *c == first || !minor(c));
    }
    let why = parts.join("; ");
    wrap_at_most(
        &format!("why: {why}"),
        w,
        2,
        3,
        "(--verbose: the whole reason)",
    )
}

/// `--verbose`: the plan's (or the floor's) peak by category, and the profile named in full.
fn breakdown(p: &Plan, w: usize) -> String {
    let mut out = format!(
        "\n{} at its peak\n",
        if p.feasible { "plan" } else { "floor" }
    );
    let mut b = Table::new(&["category", "bytes", "share"]);
    for (name, v) in p.breakdown.entries() {
        if v > 0 {
            b.row(vec![
                category_words(name),
                fmt_bytes(v),
                pct(v, p.predicted_peak_bytes),
            ]);
        }
    }
    out.push_str(&b.render());
    out.push_str(&wrap(
        &format!("times: the time model on profile '{}'", p.profile.name),
        w,
        2,
    ));
    out
}

/// The Pareto front as a table: at most 12 points spread evenly, the plan always among them.
fn front(p: &Plan, base: &Spec, w: usize) -> String {
    let mut shown = thin(&p.pareto, 12);
    // The plan itself is always on the table.
    if let Some(chosen) = p.pareto.iter().find(|c| c.spec == p.plan) {
        if !shown.iter().any(|c| c.spec == p.plan) {
            shown.push(chosen);
            shown.sort_by(|a, b| a.time.total_s.total_cmp(&b.time.total_s));
        }
    }
    let mut out = format!(
        "\nPareto front ({}; ✓ fits, → the plan)\n",
        if shown.len() == 1 {
            "1 point".to_string()
        } else if shown.len() == p.pareto.len() {
            format!("{} points", p.pareto.len())
        } else {
            format!(
                "{} points, {} of them shown, spread evenly; --json lists all",
                p.pareto.len(),
                shown.len()
            )
        }
    );
    let mut f = Table::new(&["", "peak", "step", "vs base", "changes from the base"]);
    for c in shown {
        let mark = if c.spec == p.plan { "→" } else { "" };
        let fits = if c.peak_bytes <= p.usable_bytes {
            "✓"
        } else {
            ""
        };
        let tags = change_tags(base, &c.spec);
        f.row(vec![
            format!("{mark}{fits}"),
            fmt_bytes(c.peak_bytes),
            fmt_secs(c.time.total_s),
            format!(
                "{:+.0} %",
                100.0 * (c.time.total_s / p.base_step_time_s.max(f64::MIN_POSITIVE) - 1.0)
            ),
            if tags.is_empty() {
                "(as given)".into()
            } else {
                tags.join(" · ")
            },
        ]);
    }
    out.push_str(&f.render_fit(w));
    out
}

/// At most `n` points of the front, evenly spread, always keeping both ends.
pub(super) fn thin(front: &[ditmem_budget::Candidate], n: usize) -> Vec<&ditmem_budget::Candidate> {
    if front.len() <= n || n < 2 {
        return front.iter().collect();
    }
    let mut idx: Vec<usize> = (0..n)
        .map(|i| (i * (front.len() - 1) + (n - 1) / 2) / (n - 1))
        .collect();
    idx.dedup();
    idx.into_iter().map(|i| &front[i]).collect()
}

/// Each point's changes in few words, less those every point of the front shares (returned
/// apart, said once above the chart).
pub(super) fn point_names(
    base: &Spec,
    front: &[ditmem_budget::Candidate],
) -> (Vec<String>, Vec<String>) {
    let short: Vec<Vec<String>> = front.iter().map(|c| change_tags(base, &c.spec)).collect();
    let common: Vec<String> = match short.first() {
        Some(first) if front.len() > 1 => first
            .iter()
            .filter(|x| short.iter().all(|s| s.contains(x)))
            .cloned()
            .collect(),
        _ => Vec::new(),
    };
    let names = short
        .iter()
        .map(|s| {
            let rest: Vec<&str> = s
                .iter()
                .filter(|x| !common.contains(x))
                .map(String::as_str)
                .collect();
            match (rest.is_empty(), s.is_empty()) {
                // The base itself: marked and named "base" on the chart.
                (_, true) => String::new(),
                (true, false) => format!("{} only", common.join(", ")),
                _ => rest.join(", "),
            }
        })
        .collect();
    (names, common)
}

pub(super) fn pareto_svg(p: &Plan, base: &Spec) -> anyhow::Result<String> {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let slowest = p
        .pareto
        .iter()
        .map(|c| c.time.total_s)
        .chain([p.base_step_time_s, p.predicted_step_time_s])
        .fold(0.0, f64::max);
    let (ts, tu) = if slowest < 1.0 {
        (1e3, "ms")
    } else {
        (1.0, "s")
    };
    let (names, common) = point_names(base, &p.pareto);
    let front = p
        .pareto
        .iter()
        .zip(names)
        .map(|(c, label)| FrontPoint {
            x: gib(c.peak_bytes),
            y: c.time.total_s * ts,
            label,
            fits: c.peak_bytes <= p.usable_bytes,
        })
        .collect();
    let device = p.profile.name.split(" (").next().unwrap_or("").to_string();
    let mut subtitles = vec![format!(
        "each point named by its change from the base recipe; times: {}",
        p.profile.name
    )];
    if !common.is_empty() {
        subtitles.push(format!("every point also: {}", common.join(", ")));
    }
    let mut rules = vec![Rule {
        at: gib(p.usable_bytes),
        label: format!(
            "usable {} ({:.0} % headroom)",
            fmt_bytes(p.usable_bytes),
            100.0 * p.headroom
        ),
        color: "#2e7d32",
    }];
    if p.budget_bytes != p.usable_bytes {
        rules.push(Rule {
            at: gib(p.budget_bytes),
            label: format!("budget {}", fmt_bytes(p.budget_bytes)),
            color: "#b22222",
        });
    }
    let chart = ParetoChart {
        title: format!(
            "{}: predicted peak against step time, recipe by recipe",
            p.plan.model.name
        ),
        subtitles,
        x_desc: "predicted peak (GiB)".into(),
        y_desc: format!("predicted step time ({tu}, {device})"),
        front,
        rules,
        marks: vec![
            (
                gib(p.predicted_peak_bytes),
                p.predicted_step_time_s * ts,
                if p.feasible { "plan" } else { "floor" }.into(),
            ),
            (
                gib(p.base_peak_bytes),
                p.base_step_time_s * ts,
                "base".into(),
            ),
        ],
    };
    Ok(pareto_chart(&chart))
}
