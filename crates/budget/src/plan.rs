//! The planner: the fastest recipe that fits a memory budget, and why.
//!
//! Candidates start from the base spec and only move levers in the direction that saves memory:
//! lower precision, recompute of the first `k` blocks, memory-efficient attention, a smaller
//! microbatch with more accumulation (the effective batch is kept), cached latents and — only when
//! allowed, because they change what is trained or need more devices — LoRA, 8-bit AdamW and ZeRO
//! sharding over the base's ranks. Each candidate's peak is the budget's timeline (never a factor);
//! its time is the [`crate::cost`] model. Plans are ranked by predicted step time.
//!
//! Block recompute is exact without enumerating subsets: blocks are identical, so only the number
//! recomputed matters, and recomputing the first `k` is optimal — the last block is rebuilt on top
//! of all stored graphs at the start of backward, so recomputing it saves nothing at the peak
//! unless every block is recomputed. The peak falls monotonically with `k`, so the smallest `k`
//! that fits is found by bisection.

use std::collections::HashMap;

use serde::Serialize;

use crate::cost::{step_time, DeviceProfile, StepTime};
use crate::params::{param_table, ParamTensor};
use crate::spec::{AttentionMode, Latents, LoraSpec, Optimizer, Precision, Recompute, Spec};
use crate::timeline::{
    segment_costs, simulate_step_with, static_bytes, Breakdown, SegmentCosts, StaticBytes,
};
use crate::units::fmt_bytes;

/// Levers the user must allow explicitly.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Allow {
    pub lora: bool,
    pub eight_bit: bool,
    pub sharding: bool,
}

/// Limits of a plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Limits {
    /// Memory available to one rank, in bytes.
    pub budget_bytes: u64,
    /// Share of the budget kept free for fragmentation and what the model does not see
    /// (default 5 %).
    pub headroom: f64,
    pub allow: Allow,
}

/// Default headroom: the engine's peaks are exact, but a real allocator fragments and a runtime
/// holds buffers the budget does not model; 5 % keeps a plan from sitting on the edge.
pub const DEFAULT_HEADROOM: f64 = 0.05;

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
    pub breakdown: Breakdown,
    pub changes: Vec<String>,
    /// Why, in words.
    pub reason: String,
    pub base_peak_bytes: u64,
    pub base_step_time_s: f64,
    pub usable_bytes: u64,
    /// Memory vs time Pareto front over every evaluated candidate, fastest first.
    pub pareto: Vec<Candidate>,
    pub evaluated: usize,
    pub profile: DeviceProfile,
}

/// Caches the parts of the budget that many candidates share.
#[derive(Default)]
struct Evaluator {
    tables: HashMap<String, (Vec<ParamTensor>, StaticBytes)>,
    segments: HashMap<String, SegmentCosts>,
    evaluated: usize,
}

impl Evaluator {
    fn peak(&mut self, spec: &Spec) -> (u64, Breakdown) {
        self.evaluated += 1;
        let r = &spec.recipe;
        let tkey = format!(
            "{:?}|{:?}|{:?}|{:?}|{}|{:?}|{}|{}",
            r.lora,
            r.precision,
            r.optimizer,
            r.ema,
            r.zero_stage,
            r.latents,
            spec.workload.ranks,
            spec.workload.height * 65536 + spec.workload.width
        );
        let (table, st) = self
            .tables
            .entry(tkey)
            .or_insert_with(|| {
                let t = param_table(spec);
                let st = static_bytes(spec, &t);
                (t, st)
            })
            .clone();
        let skey = format!(
            "{:?}|{:?}|{:?}|{}|{}",
            r.lora,
            r.precision,
            r.attention,
            r.recompute == Recompute::AttentionOnly,
            spec.workload.microbatch
        );
        let costs = *self
            .segments
            .entry(skey)
            .or_insert_with(|| segment_costs(spec));
        let tl = simulate_step_with(spec, &table, &st, &costs, 2);
        let e = tl.peak();
        (e.total(), e.live)
    }
}

fn recompute_first(k: u32, depth: u32) -> Recompute {
    if k == 0 {
        Recompute::None
    } else if k >= depth {
        Recompute::All
    } else {
        Recompute::Blocks((0..k).collect())
    }
}

/// Precisions at or below the base's footprint, in order of preference at equal time
/// (bf16 before fp16: no loss scaling needed).
fn precisions_from(base: Precision) -> Vec<Precision> {
    use Precision::*;
    match base {
        Fp64 => vec![Fp64, Fp32, Bf16Mixed, Fp16Mixed, Bf16Pure],
        Fp32 => vec![Fp32, Bf16Mixed, Fp16Mixed, Bf16Pure],
        Bf16Mixed => vec![Bf16Mixed, Fp16Mixed, Bf16Pure],
        Fp16Mixed => vec![Fp16Mixed, Bf16Mixed, Bf16Pure],
        Bf16Pure => vec![Bf16Pure],
    }
}

fn describe_changes(base: &Spec, s: &Spec) -> Vec<String> {
    let (b, r) = (&base.recipe, &s.recipe);
    let mut out = Vec::new();
    if b.precision != r.precision {
        out.push(format!("precision {} → {}", b.precision, r.precision));
    }
    if b.recompute != r.recompute {
        let what = match &r.recompute {
            Recompute::Blocks(v) => format!(
                "recompute the first {} of {} blocks",
                v.len(),
                s.model.depth
            ),
            other => format!("recompute {other}"),
        };
        out.push(what);
    }
    if b.attention != r.attention {
        out.push(format!(
            "attention {} → {}",
            b.attention.name(),
            r.attention.name()
        ));
    }
    if base.workload.microbatch != s.workload.microbatch {
        out.push(format!(
            "microbatch {} → {} with accumulation {}",
            base.workload.microbatch, s.workload.microbatch, s.workload.accumulation
        ));
    }
    if b.latents != r.latents {
        out.push("cache the latents (no VAE in the step)".into());
    }
    if b.lora != r.lora {
        if let Some(l) = &r.lora {
            out.push(format!("LoRA rank {} (base frozen)", l.rank));
        }
    }
    if b.optimizer != r.optimizer {
        out.push(format!(
            "optimizer {} → {}",
            b.optimizer.name(),
            r.optimizer.name()
        ));
    }
    if b.zero_stage != r.zero_stage {
        out.push(format!(
            "ZeRO stage {} over {} ranks",
            r.zero_stage, s.workload.ranks
        ));
    }
    out
}

/// Search the recipes for the fastest one whose peak fits `limits`.
pub fn plan(
    base: &Spec,
    limits: &Limits,
    profile: &DeviceProfile,
) -> Result<Plan, crate::error::SpecError> {
    base.validate()?;
    if !(0.0..0.9).contains(&limits.headroom) {
        return Err(crate::error::SpecError::invalid(
            "plan.headroom",
            format!(
                "{} is out of range; allowed: 0 ≤ headroom < 0.9",
                limits.headroom
            ),
        ));
    }
    let usable = limits.usable();
    let mut ev = Evaluator::default();
    let depth = base.model.depth;
    let w = &base.workload;
    let per_rank = w.batch / w.ranks;
    let micros: Vec<u32> = (1..=w.microbatch)
        .filter(|m| per_rank.is_multiple_of(*m))
        .collect();
    let loras: Vec<Option<LoraSpec>> = if limits.allow.lora && base.recipe.lora.is_none() {
        let mut v = vec![None];
        for r in [4u32, 8, 16, 32, 64, 128] {
            if r <= base.model.hidden {
                v.push(Some(LoraSpec {
                    rank: r,
                    targets: crate::spec::default_lora_targets(),
                }));
            }
        }
        v
    } else {
        vec![base.recipe.lora.clone()]
    };
    let optimizers: Vec<Optimizer> =
        if limits.allow.eight_bit && base.recipe.optimizer == Optimizer::AdamW {
            vec![Optimizer::AdamW, Optimizer::AdamW8bit]
        } else {
            vec![base.recipe.optimizer]
        };
    let zeros: Vec<u8> = if limits.allow.sharding && w.ranks > 1 {
        (base.recipe.zero_stage..=3).collect()
    } else {
        vec![base.recipe.zero_stage]
    };
    let latents: Vec<Latents> = if base.recipe.latents == Latents::Encode {
        vec![Latents::Encode, Latents::Cached]
    } else {
        vec![Latents::Cached]
    };
    let attentions: Vec<AttentionMode> = match base.recipe.attention {
        AttentionMode::Materialized => {
            vec![AttentionMode::Materialized, AttentionMode::MemoryEfficient]
        }
        AttentionMode::MemoryEfficient => vec![AttentionMode::MemoryEfficient],
    };

    let mut all: Vec<Candidate> = Vec::new();
    let consider = |ev: &mut Evaluator, s: Spec, all: &mut Vec<Candidate>| -> u64 {
        let (peak, breakdown) = ev.peak(&s);
        let time = step_time(&s, profile);
        all.push(Candidate {
            changes: describe_changes(base, &s),
            spec: s,
            peak_bytes: peak,
            breakdown,
            time,
        });
        peak
    };
    // The base itself, exactly as given.
    let base_peak = consider(&mut ev, base.clone(), &mut all);

    for &precision in &precisions_from(base.recipe.precision) {
        for &attention in &attentions {
            for &micro in &micros {
                for &lat in &latents {
                    for lora in &loras {
                        for &opt in &optimizers {
                            for &z in &zeros {
                                let mut s = base.clone();
                                s.recipe.precision = precision;
                                s.recipe.attention = attention;
                                s.recipe.latents = lat;
                                s.recipe.lora = lora.clone();
                                s.recipe.optimizer = opt;
                                s.recipe.zero_stage = z;
                                s.workload.microbatch = micro;
                                s.workload.accumulation = per_rank / micro;
                                // Block recompute: bisection on k (peak falls with k).
                                let with_k = |k: u32| {
                                    let mut t = s.clone();
                                    t.recipe.recompute = recompute_first(k, depth);
                                    t
                                };
                                let peak_k0 = consider(&mut ev, with_k(0), &mut all);
                                if peak_k0 > usable {
                                    let peak_all = consider(&mut ev, with_k(depth), &mut all);
                                    if peak_all <= usable {
                                        let (mut lo, mut hi) = (0u32, depth);
                                        while hi - lo > 1 {
                                            let mid = (lo + hi) / 2;
                                            if ev.peak(&with_k(mid)).0 <= usable {
                                                hi = mid;
                                            } else {
                                                lo = mid;
                                            }
                                        }
                                        if hi < depth {
                                            consider(&mut ev, with_k(hi), &mut all);
                                        }
                                    }
                                    let mut t = s.clone();
                                    t.recipe.recompute = Recompute::AttentionOnly;
                                    consider(&mut ev, t, &mut all);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    let mut feasible: Vec<&Candidate> = all.iter().filter(|c| c.peak_bytes <= usable).collect();
    // Fastest first; at equal time fewer changes, then the smaller peak.
    let order = |a: &&Candidate, b: &&Candidate| {
        a.time
            .total_s
            .total_cmp(&b.time.total_s)
            .then(a.changes.len().cmp(&b.changes.len()))
            .then(a.peak_bytes.cmp(&b.peak_bytes))
    };
    feasible.sort_by(order);
    let pareto = pareto_front(&all);
    let base_time = all[0].time.total_s;
    let evaluated = ev.evaluated;
    match feasible.first() {
        Some(best) => {
            // The base unchanged when it fits and nothing that fits is faster. A candidate that is
            // faster *and* fits (it dominates the base) wins even then: returning the slower base
            // would make a smaller budget yield a faster plan.
            let base_c = &all[0];
            let chosen = if base_c.peak_bytes <= usable && best.time.total_s >= base_time {
                base_c
            } else {
                best
            };
            let reason = explain(base, base_c, chosen, usable);
            Ok(Plan {
                feasible: true,
                plan: chosen.spec.clone(),
                predicted_peak_bytes: chosen.peak_bytes,
                predicted_step_time_s: chosen.time.total_s,
                breakdown: chosen.breakdown,
                changes: chosen.changes.clone(),
                reason,
                base_peak_bytes: base_peak,
                base_step_time_s: base_time,
                usable_bytes: usable,
                pareto,
                evaluated,
                profile: profile.clone(),
            })
        }
        None => {
            let floor = all
                .iter()
                .min_by(|a, b| {
                    a.peak_bytes
                        .cmp(&b.peak_bytes)
                        .then(a.time.total_s.total_cmp(&b.time.total_s))
                })
                .expect("the base is always evaluated");
            let (dom, dom_bytes) = floor.breakdown.dominant();
            let reason = format!(
                "no recipe in the allowed space fits {} usable ({} budget less headroom): the smallest peak is {} ({}), \
                 where {} dominate with {}{}",
                fmt_bytes(usable),
                fmt_bytes(limits.budget_bytes),
                fmt_bytes(floor.peak_bytes),
                if floor.changes.is_empty() { "the base".to_string() } else { floor.changes.join(", ") },
                dom.replace('_', " "),
                fmt_bytes(dom_bytes),
                if limits.allow.lora && limits.allow.eight_bit && limits.allow.sharding {
                    String::new()
                } else {
                    "; --allow lora,8bit,sharding widens the search".into()
                }
            );
            Ok(Plan {
                feasible: false,
                plan: floor.spec.clone(),
                predicted_peak_bytes: floor.peak_bytes,
                predicted_step_time_s: floor.time.total_s,
                breakdown: floor.breakdown,
                changes: floor.changes.clone(),
                reason,
                base_peak_bytes: base_peak,
                base_step_time_s: base_time,
                usable_bytes: usable,
                pareto,
                evaluated,
                profile: profile.clone(),
            })
        }
    }
}

/// Candidates not dominated in (peak, time), fastest first.
fn pareto_front(all: &[Candidate]) -> Vec<Candidate> {
    let mut sorted: Vec<&Candidate> = all.iter().collect();
    sorted.sort_by(|a, b| {
        a.time
            .total_s
            .total_cmp(&b.time.total_s)
            .then(a.peak_bytes.cmp(&b.peak_bytes))
            .then(a.changes.len().cmp(&b.changes.len()))
    });
    let mut front: Vec<Candidate> = Vec::new();
    let mut best_peak = u64::MAX;
    for c in sorted {
        if c.peak_bytes < best_peak {
            best_peak = c.peak_bytes;
            front.push(c.clone());
        }
    }
    front
}

fn explain(base: &Spec, base_c: &Candidate, chosen: &Candidate, usable: u64) -> String {
    let (dom, dom_bytes) = base_c.breakdown.dominant();
    let share = 100.0 * dom_bytes as f64 / base_c.peak_bytes.max(1) as f64;
    let w = &base.workload;
    if chosen.changes.is_empty() {
        return format!(
            "the base spec already fits: its peak {} is within {} usable; nothing to change",
            fmt_bytes(base_c.peak_bytes),
            fmt_bytes(usable)
        );
    }
    let mut s = format!(
        "{} are {:.0} % of the base peak ({} of {}) at {}×{}, over {} usable: {}",
        dom.replace('_', " "),
        share,
        fmt_bytes(dom_bytes),
        fmt_bytes(base_c.peak_bytes),
        w.height,
        w.width,
        fmt_bytes(usable),
        chosen.changes.join("; ")
    );
    s.push_str(&format!(
        " → peak {}, predicted step {:.3} s (base {:.3} s)",
        fmt_bytes(chosen.peak_bytes),
        chosen.time.total_s,
        base_c.time.total_s
    ));
    let r = &chosen.spec.recipe;
    if r.precision == Precision::Bf16Mixed && base.recipe.precision != Precision::Fp16Mixed {
        s.push_str("; fp16 was not needed");
    }
    if chosen.spec.workload.microbatch == base.workload.microbatch && w.microbatch > 1 {
        s.push_str("; the microbatch is kept");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::ModelSpec;

    fn small() -> Spec {
        let mut s = Spec::default_xl();
        s.model = ModelSpec::preset("dit-s-2").unwrap();
        s.workload.batch = 8;
        s.workload.microbatch = 8;
        s.recipe.precision = Precision::Fp32;
        s
    }

    fn limits(bytes: u64) -> Limits {
        Limits {
            budget_bytes: bytes,
            headroom: DEFAULT_HEADROOM,
            allow: Allow::default(),
        }
    }

    #[test]
    fn base_that_fits_is_returned_unchanged() {
        // A base that is already the fastest recipe of its space (memory-efficient attention is
        // predicted faster than the composed materialized softmax on the CPU profile).
        let mut s = small();
        s.recipe.attention = AttentionMode::MemoryEfficient;
        let p = plan(&s, &limits(1 << 40), &DeviceProfile::cpu_default()).unwrap();
        assert!(p.feasible);
        assert_eq!(p.plan, s);
        assert!(p.changes.is_empty());
    }

    #[test]
    fn smaller_budget_never_faster() {
        let s = small();
        let prof = DeviceProfile::cpu_default();
        let base_peak = plan(&s, &limits(1 << 40), &prof).unwrap().base_peak_bytes;
        let mut last_time = 0.0;
        for frac in [1.2, 1.0, 0.8, 0.6, 0.45, 0.3, 0.2] {
            let p = plan(&s, &limits((base_peak as f64 * frac) as u64), &prof).unwrap();
            if !p.feasible {
                break;
            }
            assert!(p.predicted_peak_bytes <= p.usable_bytes);
            assert!(
                p.predicted_step_time_s >= last_time - 1e-12,
                "budget × {frac}: faster than a bigger budget"
            );
            last_time = p.predicted_step_time_s;
        }
    }

    #[test]
    fn a_faster_recipe_that_fits_replaces_the_base() {
        let s = small();
        let p = plan(&s, &limits(1 << 40), &DeviceProfile::cpu_default()).unwrap();
        assert!(p.predicted_step_time_s <= p.base_step_time_s);
        if p.plan != s {
            assert!(p.predicted_step_time_s < p.base_step_time_s);
            assert!(!p.changes.is_empty());
        }
    }

    #[test]
    fn infeasible_reports_the_floor() {
        let s = small();
        let p = plan(&s, &limits(1 << 20), &DeviceProfile::cpu_default()).unwrap();
        assert!(!p.feasible);
        assert!(p.predicted_peak_bytes > 1 << 20);
        assert!(p.reason.contains("smallest peak"));
        // The floor is no larger than the base.
        assert!(p.predicted_peak_bytes <= p.base_peak_bytes);
    }

    #[test]
    fn recomputing_the_last_block_alone_saves_nothing() {
        let mut s = small();
        let none = crate::estimate::estimate(&s).unwrap().peak_bytes;
        s.recipe.recompute = Recompute::Blocks(vec![11]);
        let last = crate::estimate::estimate(&s).unwrap().peak_bytes;
        s.recipe.recompute = Recompute::Blocks(vec![0]);
        let first = crate::estimate::estimate(&s).unwrap().peak_bytes;
        assert!(last >= none - none / 100, "last {last} vs none {none}");
        assert!(first < last);
    }
}
