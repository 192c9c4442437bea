//! The search stages (LoRA, 8-bit AdamW and a quantized base only when needed) and the
//! alternatives (the plan without a lever chosen for speed), around [`super::search`].

use std::collections::HashMap;
use std::time::Instant;

use crate::cost::DeviceProfile;
use crate::denoiser::param_table;
use crate::spec::{Optimizer, Precision, Spec};
use crate::units::fmt_bytes;

use super::evaluate::*;
use super::explain::*;
use super::search::*;
use super::types::*;

/// Say so when the plan fits only with `expandable_segments:True`: the allocated peak and the
/// reserved segments without it.
pub(super) fn expandable_reason(base: &Spec, p: &mut Plan) {
    let has = |s: &Spec| {
        s.cuda
            .as_ref()
            .and_then(|c| {
                crate::runtime::pytorch::caching_allocator::AllocConf::parse(&c.alloc_conf).ok()
            })
            .is_some_and(|c| c.expandable_segments)
    };
    if !has(&p.plan) || has(base) {
        return;
    }
    let mut without = p.plan.clone();
    if let Some(c) = without.cuda.as_mut() {
        c.alloc_conf = c
            .alloc_conf
            .split(',')
            .map(str::trim)
            .filter(|kv| !kv.is_empty() && !kv.starts_with("expandable_segments"))
            .collect::<Vec<_>>()
            .join(",");
    }
    let table = param_table(&without);
    if let Ok(Some(r)) = crate::runtime::pytorch::cuda::cuda_report(&without, &table) {
        p.reason.push_str(&format!(
            "; fragmentation breaks the fit without {EXPANDABLE_SEGMENTS}: allocated peaks at {} \
             (+ {} CUDA context) but the cached segments need {} on the device, over {} usable; \
             with expandable segments (grown by mapped pages) it needs {} — launch with \
             PYTORCH_CUDA_ALLOC_CONF={}",
            fmt_bytes(r.max_allocated_bytes),
            fmt_bytes(r.context_bytes),
            fmt_bytes(r.device_bytes),
            fmt_bytes(p.usable_bytes),
            fmt_bytes(p.predicted_peak_bytes),
            p.plan
                .cuda
                .as_ref()
                .map(|c| c.alloc_conf.as_str())
                .unwrap_or(EXPANDABLE_SEGMENTS)
        ));
    }
}

/// The allowed spaces the planner searches in turn: LoRA and 8-bit AdamW change what is trained
/// or how, so they are used only when no recipe without them fits — first neither, then 8-bit
/// AdamW (the optimizer's numerics), then LoRA (what is trained), then both, then a quantized
/// base under LoRA (the frozen weights' numerics), and 8-bit AdamW with it only when that alone
/// does not fit either (a stage that allows both would take 8-bit AdamW for a 1 % faster step).
/// Each space keeps every other allowed lever.
pub(crate) fn search_stages(allow: Allow) -> Vec<Allow> {
    let mut out: Vec<Allow> = Vec::new();
    for (lora, eight_bit, quant) in [
        (false, false, false),
        (false, true, false),
        (true, false, false),
        (true, true, false),
        (true, false, true),
        (true, true, true),
    ] {
        let a = Allow {
            lora: lora && allow.lora,
            eight_bit: eight_bit && allow.eight_bit,
            quant: quant && allow.quant,
            ..allow
        };
        if !out.contains(&a) {
            out.push(a);
        }
    }
    out
}

/// Search the recipes for the fastest one whose peak fits `limits`, using LoRA and 8-bit AdamW
/// only when needed to fit (`search_stages`); no time limit (see [`plan_with`]).
pub fn plan(
    base: &Spec,
    limits: &Limits,
    profile: &DeviceProfile,
) -> Result<Plan, crate::error::SpecError> {
    plan_with(base, limits, profile, SearchControl::default())
}

/// The space a search stage adds, in words (for [`NotSearched`]).
pub(super) fn stage_name(a: &Allow) -> String {
    let on: Vec<&str> = [
        (a.eight_bit, "8-bit AdamW"),
        (a.lora, "LoRA"),
        (a.quant, "a quantized LoRA base"),
    ]
    .into_iter()
    .filter_map(|(on, name)| on.then_some(name))
    .collect();
    if on.is_empty() {
        "without LoRA or 8-bit AdamW".into()
    } else {
        format!("with {}", on.join(" + "))
    }
}

/// [`plan`] under `control`: a time limit (what it cuts is in [`Plan::not_searched`]) and a
/// progress callback.
pub fn plan_with(
    base: &Spec,
    limits: &Limits,
    profile: &DeviceProfile,
    control: SearchControl<'_>,
) -> Result<Plan, crate::error::SpecError> {
    // The base as the launcher runs it (what the script keeps resident, what its flags allow).
    let given = base;
    let realised = match control.launch {
        Some(l) => l
            .realise(base)
            .map_err(|e| crate::error::SpecError::invalid("plan.launcher", e))?,
        None => base.clone(),
    };
    let base = &realised;
    let stages = search_stages(limits.allow);
    let start = Instant::now();
    let mut run = Run {
        control,
        start,
        deadline: control.time_limit.and_then(|d| start.checked_add(d)),
        stage: 0,
        stages: stages.len(),
        cache: HashMap::new(),
        simulated: 0,
    };
    let mut not_searched = NotSearched {
        time_limit_s: control.time_limit.map_or(0.0, |d| d.as_secs_f64()),
        combinations: 0,
        stage: None,
        stages: Vec::new(),
        alternatives: Vec::new(),
    };
    let mut tried = run_stages(base, limits, profile, &stages, &mut run, &mut not_searched)?;
    let mut p = last_with_totals(&mut tried, limits.allow);
    if !p.feasible {
        // Only the last stage (every allowed lever) ran out: its floor is the answer. A search
        // cut short found no recipe that fits in what it searched, which is all it can say.
        if not_searched.combinations > 0 || !not_searched.stages.is_empty() {
            p.reason = cut_reason(&p);
        } else if let Some(script) = control.launch.and_then(|l| l.script(&p.plan)) {
            // The last stage's reason, told what the floor's script cannot run.
            let floor = Floor {
                peak: p.predicted_peak_bytes,
                breakdown: &p.breakdown,
                changes: &p.changes,
            };
            p.reason = infeasible_reason(limits, base, p.usable_bytes, floor, Some(&script));
        }
        launcher_note(given, base, &mut p);
        return Ok(with_not_searched(p, not_searched));
    }
    expandable_reason(base, &mut p);
    launcher_note(given, base, &mut p);
    if let Some(prev) = tried.last() {
        needed_levers(base, prev, &mut p);
    }
    let stage_allow = stages[run.stage - 1];
    speed_alternatives(
        base,
        limits,
        profile,
        &mut run,
        stage_allow,
        &mut p,
        &mut not_searched,
    )?;
    Ok(with_not_searched(p, not_searched))
}

/// What the launcher changed of the `given` base to run it (`base`), at the end of the reason.
fn launcher_note(given: &Spec, base: &Spec, p: &mut Plan) {
    let changes = describe_changes(given, base);
    if !changes.is_empty() {
        p.reason.push_str(&format!(
            "; the launcher runs the base as: {}",
            changes.join(", ")
        ));
    }
}

/// Each stage's search in turn, until one finds a plan that fits; past the time limit the
/// stages left are recorded in `not_searched`. The plans of the stages searched, in order.
fn run_stages(
    base: &Spec,
    limits: &Limits,
    profile: &DeviceProfile,
    stages: &[Allow],
    run: &mut Run<'_>,
    not_searched: &mut NotSearched,
) -> Result<Vec<Plan>, crate::error::SpecError> {
    let mut tried: Vec<Plan> = Vec::new();
    for a in stages {
        if !tried.is_empty() && run.over() {
            not_searched.stages.push(stage_name(a));
            continue;
        }
        let l = Limits {
            allow: *a,
            ..limits.clone()
        };
        run.stage += 1;
        let (p, left) = search(base, &l, profile, run)?;
        if left > 0 {
            not_searched.combinations = left;
            not_searched.stage = Some(stage_name(a));
        }
        let done = p.feasible;
        tried.push(p);
        if done {
            break;
        }
    }
    Ok(tried)
}

/// The last stage's plan, taken from `tried`, with the levers asked for and the counts of
/// every stage.
fn last_with_totals(tried: &mut Vec<Plan>, allow: Allow) -> Plan {
    let (combinations, pruned, evaluated) = tried.iter().fold((0, 0, 0), |acc, t| {
        (
            acc.0 + t.combinations,
            acc.1 + t.pruned,
            acc.2 + t.evaluated,
        )
    });
    let mut p = tried.pop().expect("at least one stage");
    p.allow = allow;
    p.combinations = combinations;
    p.pruned = pruned;
    p.evaluated = evaluated;
    p
}

/// `p` with what the search did not reach, when it missed anything.
fn with_not_searched(mut p: Plan, n: NotSearched) -> Plan {
    if n.combinations > 0 || !n.stages.is_empty() || !n.alternatives.is_empty() {
        p.not_searched = Some(n);
    }
    p
}

/// Why a search cut by its time limit has no plan: what it found, not what the space holds.
pub(super) fn cut_reason(p: &Plan) -> String {
    format!(
        "no recipe found before the time limit fits {} usable ({} budget less {:.0} % \
         headroom): the smallest peak found is {} ({}), where {} {} with {} ({:.0} %)",
        fmt_bytes(p.usable_bytes),
        fmt_bytes(p.budget_bytes),
        100.0 * p.headroom,
        fmt_bytes(p.predicted_peak_bytes),
        changes_or_base(&p.changes),
        p.dominant.replace('_', " "),
        verb(&p.dominant, "dominate", "dominates"),
        fmt_bytes(p.dominant_bytes),
        100.0 * p.dominant_bytes as f64 / p.predicted_peak_bytes.max(1) as f64,
    )
}

/// LoRA, a quantized base and 8-bit AdamW are used only when needed: say so in `p`'s reason,
/// with the floor of the stage before (`prev`, where none fitted), and list each as an
/// alternative that does not fit.
fn needed_levers(base: &Spec, prev: &Plan, p: &mut Plan) {
    let (b, r) = (&base.recipe, &p.plan.recipe);
    let mut used = Vec::new();
    if r.lora != b.lora {
        used.push("LoRA");
    }
    if r.base_quant != b.base_quant {
        used.push("a quantized base");
    }
    if r.optimizer != b.optimizer && r.optimizer == Optimizer::AdamW8bit {
        used.push("8-bit AdamW");
    }
    if !used.is_empty() {
        p.reason.push_str(&format!(
            "; {} {} used because nothing fits without: the smallest peak without is {} ({} \
             usable)",
            used.join(" and "),
            if used.len() == 1 { "is" } else { "are" },
            fmt_bytes(prev.predicted_peak_bytes),
            fmt_bytes(prev.usable_bytes)
        ));
    }
    for (name, on) in [
        ("lora", r.lora != b.lora),
        ("quant", r.base_quant != b.base_quant),
        (
            "8bit",
            r.optimizer != b.optimizer && r.optimizer == Optimizer::AdamW8bit,
        ),
    ] {
        if on {
            p.alternatives.push(Alternative {
                without: name.into(),
                feasible: false,
                predicted_peak_bytes: prev.predicted_peak_bytes,
                predicted_step_time_s: prev.predicted_step_time_s,
                changes: prev.changes.clone(),
            });
        }
    }
}

/// Sharding and bf16-pure may be chosen for speed: say so, with the plan without them (each a
/// search of the stage's space less that lever; one the time limit cuts or leaves out is named
/// in `not_searched`).
fn speed_alternatives(
    base: &Spec,
    limits: &Limits,
    profile: &DeviceProfile,
    run: &mut Run<'_>,
    stage_allow: Allow,
    p: &mut Plan,
    not_searched: &mut NotSearched,
) -> Result<(), crate::error::SpecError> {
    let (b, r) = (&base.recipe, &p.plan.recipe);
    let used = [
        (
            "sharding",
            stage_allow.sharding && r.zero_stage != b.zero_stage,
        ),
        (
            "bf16-pure",
            stage_allow.bf16_pure
                && r.precision == Precision::Bf16Pure
                && b.precision != Precision::Bf16Pure,
        ),
    ];
    for (name, on) in used {
        if !on {
            continue;
        }
        if run.over() {
            not_searched.alternatives.push(name.into());
            continue;
        }
        let mut l = Limits {
            allow: stage_allow,
            ..limits.clone()
        };
        match name {
            "sharding" => l.allow.sharding = false,
            _ => l.allow.bf16_pure = false,
        }
        run.stage += 1;
        run.stages = run.stages.max(run.stage);
        let (alt, left) = search(base, &l, profile, run)?;
        if left > 0 {
            // A cut alternative is not the plan without the lever: say so rather than show it.
            not_searched.alternatives.push(name.into());
            continue;
        }
        if alt.feasible {
            p.reason.push_str(&format!(
                "; {name} is used for speed, not needed to fit: without it the fastest plan is \
                 predicted {} ({:+.1} %) at {}",
                fmt_secs(alt.predicted_step_time_s),
                100.0 * (alt.predicted_step_time_s / p.predicted_step_time_s - 1.0),
                fmt_bytes(alt.predicted_peak_bytes)
            ));
        }
        p.alternatives.push(Alternative {
            without: name.into(),
            feasible: alt.feasible,
            predicted_peak_bytes: alt.predicted_peak_bytes,
            predicted_step_time_s: alt.predicted_step_time_s,
            changes: alt.changes,
        });
    }
    Ok(())
}
