//! What a plan is: the allowed levers, the limits, the answer and its parts, the search's
//! bounds and progress.

use std::time::Duration;

use serde::Serialize;

use crate::cost::{DeviceProfile, StepTime};
use crate::events::Breakdown;
use crate::spec::Spec;

/// Levers the user must allow explicitly.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Allow {
    /// LoRA: the base model is frozen, only adapters train (changes what is trained).
    pub lora: bool,
    /// 8-bit AdamW (block-wise quantised m and v; changes the optimizer's numerics).
    pub eight_bit: bool,
    /// ZeRO stages 1–3 over the base's ranks (needs several devices and their link).
    pub sharding: bool,
    /// bf16-pure: weights stored in bf16 (updates below bf16's resolution are lost).
    pub bf16_pure: bool,
    /// A precision other than the base's (fp32 → bf16-mixed, bf16-mixed ↔ fp16-mixed, …): off,
    /// a requested precision is kept (fp16 on a GPU without bf16, fp32 for a reference run).
    /// bf16-pure additionally needs [`Allow::bf16_pure`], which allows it on its own too.
    pub precision: bool,
    /// A LoRA base stored quantized (NF4 as QLoRA, bitsandbytes; the `pytorch` runtime):
    /// changes the frozen weights' numerics, so it comes after every other lever.
    pub quant: bool,
}

impl Allow {
    pub fn all() -> Allow {
        Allow {
            lora: true,
            eight_bit: true,
            sharding: true,
            bf16_pure: true,
            precision: true,
            quant: true,
        }
    }
}

/// Limits of a plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Limits {
    /// Memory available to one rank, in bytes.
    pub budget_bytes: u64,
    /// Share of the budget kept free for fragmentation and what the model does not see
    /// (default [`DEFAULT_HEADROOM`]).
    pub headroom: f64,
    pub allow: Allow,
}

/// Default headroom: the engine's peaks are exact, but a real allocator fragments and a runtime
/// holds buffers the budget does not model; 5 % keeps a plan from sitting on the edge.
pub const DEFAULT_HEADROOM: f64 = 0.05;

/// LoRA rank the planner tries when LoRA is allowed and the base has none. Rank changes the
/// quality of what is learnt, which the planner cannot judge, and barely moves the peak; to plan
/// with another rank, give it in the base spec (`--lora-rank`).
pub(crate) const PLAN_LORA_RANK: u32 = 16;

impl Limits {
    pub fn usable(&self) -> u64 {
        (self.budget_bytes as f64 * (1.0 - self.headroom)).floor() as u64
    }
}

/// One evaluated recipe.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Candidate {
    pub spec: Spec,
    pub peak_bytes: u64,
    pub breakdown: Breakdown,
    pub time: StepTime,
    /// The changes from the base, in words.
    pub changes: Vec<String>,
}

/// The planner's answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    pub feasible: bool,
    /// The best plan when feasible; otherwise the smallest-peak recipe in the allowed space.
    pub plan: Spec,
    pub predicted_peak_bytes: u64,
    pub predicted_step_time_s: f64,
    /// Live bytes by category at the plan's peak.
    pub breakdown: Breakdown,
    /// The plan's predicted time by part.
    pub time: StepTime,
    pub changes: Vec<String>,
    /// The largest consumer at the plan's peak (the floor's, when infeasible) and its bytes.
    pub dominant: String,
    pub dominant_bytes: u64,
    /// Why, in words.
    pub reason: String,
    /// True when the base fits the usable budget as it is.
    pub base_fits: bool,
    pub base_peak_bytes: u64,
    pub base_step_time_s: f64,
    pub budget_bytes: u64,
    pub headroom: f64,
    pub usable_bytes: u64,
    /// Whether `ditmem run` can execute the plan (it runs neither 8-bit AdamW, ZeRO nor the VAE).
    pub engine_runnable: bool,
    pub allow: Allow,
    /// For each allowed lever that changes what is trained (LoRA, 8-bit AdamW, bf16-pure) or
    /// needs devices (sharding) and that the plan uses: the plan without it (for LoRA and 8-bit
    /// AdamW always infeasible, with its floor: they are used only when needed), so that a lever
    /// chosen for speed rather than need is visible.
    pub alternatives: Vec<Alternative>,
    /// Memory vs time Pareto front over every evaluated point, fastest first.
    pub pareto: Vec<Candidate>,
    /// Combinations of levers (all but recompute) in the allowed space.
    pub combinations: usize,
    /// Combinations skipped as dominated before or after their first timeline.
    pub pruned: usize,
    /// Timelines simulated (a point an earlier stage simulated is taken from its cache).
    pub evaluated: usize,
    pub profile: DeviceProfile,
    /// What the search left out when it reached its time limit; `None` when it searched every
    /// stage, combination and alternative.
    pub not_searched: Option<NotSearched>,
}

/// What a search stopped by its time limit did not search ([`Plan::not_searched`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NotSearched {
    /// The time limit, in seconds.
    pub time_limit_s: f64,
    /// Combinations of the stage that was cut that were never visited (the slowest by their
    /// fastest time: combinations are visited fastest first).
    pub combinations: usize,
    /// The stage that was cut, in words (e.g. "with 8-bit AdamW"); `None` when the cut fell
    /// between stages.
    pub stage: Option<String>,
    /// Later stages never started, in words.
    pub stages: Vec<String>,
    /// Alternatives (the plan without a lever) not computed: `sharding`, `bf16-pure`.
    pub alternatives: Vec<String>,
}

impl NotSearched {
    /// One line for a report.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if self.combinations > 0 {
            parts.push(format!(
                "{} combinations{}",
                self.combinations,
                self.stage
                    .as_ref()
                    .map(|s| format!(" of the space {s}"))
                    .unwrap_or_default()
            ));
        }
        for s in &self.stages {
            parts.push(format!("the space {s}"));
        }
        for a in &self.alternatives {
            parts.push(format!("the plan without {a}"));
        }
        let list = match parts.split_last() {
            Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
            _ => parts.concat(),
        };
        format!(
            "the search stopped at its time limit ({} s) with {list} not searched; a faster \
             recipe{} may be there",
            self.time_limit_s,
            if self.stages.is_empty() && self.combinations == 0 {
                ""
            } else {
                " (or one that fits)"
            }
        )
    }
}

/// How far a running search is ([`SearchControl::progress`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// The stage being searched, from 1, of `stages` at most ([`search_stages`](stages::search_stages)); the
    /// alternatives count as stages after them.
    pub stage: usize,
    pub stages: usize,
    /// Combinations of this stage visited (searched or pruned), of `combinations`.
    pub done: usize,
    pub combinations: usize,
    /// Timelines simulated so far, every stage together.
    pub timelines: usize,
    /// Seconds since the search began.
    pub elapsed_s: f64,
}

/// Bounds and observers of a search ([`plan_with`]).
#[derive(Clone, Copy, Default)]
pub struct SearchControl<'a> {
    /// Start no combination, stage or alternative after this long; `None`: no limit.
    pub time_limit: Option<Duration>,
    /// Called after every combination.
    pub progress: Option<&'a dyn Fn(&Progress)>,
    /// The launcher's abilities and the user's pinned fields, as constraints of the space
    /// ([`crate::launch`]); `None`: your own script, nothing pinned.
    pub launch: Option<&'a crate::launch::Launch>,
}

/// The best plan when one allowed lever is taken away again.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Alternative {
    /// The lever taken away (`lora`, `8bit`, `sharding`, `bf16-pure`).
    pub without: String,
    pub feasible: bool,
    pub predicted_peak_bytes: u64,
    pub predicted_step_time_s: f64,
    pub changes: Vec<String>,
}

/// Whether the engine can execute a spec's recipe
/// ([`not_executed`](crate::runtime::ditmem_cpu::step::not_executed) is empty).
pub fn engine_runnable(spec: &Spec) -> bool {
    crate::runtime::ditmem_cpu::step::not_executed(spec).is_empty()
}

/// Seconds with a unit that suits them.
pub fn fmt_secs(s: f64) -> String {
    if s >= 100.0 {
        format!("{s:.0} s")
    } else if s >= 1.0 {
        format!("{s:.2} s")
    } else {
        format!("{:.1} ms", s * 1e3)
    }
}
