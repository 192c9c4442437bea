//! One stage's search: every combination of the levers but recompute, fastest first, each with
//! its recompute policies, pruned when dominated; the plan and its Pareto front from the points.

use std::collections::HashMap;

use crate::cost::DeviceProfile;
use crate::spec::{
    AttentionMode, BaseQuant, Latents, LoraSpec, Optimizer, Precision, Recompute, Runtime, Spec,
};

use super::evaluate::*;
use super::explain::*;
use super::types::*;

/// Precisions at or below the base's footprint, in order of preference at equal time
/// (bf16 before fp16: no loss scaling needed). Without `allow_change`, the base's alone (and
/// bf16-pure when `allow_pure`).
pub(super) fn precisions_from(
    base: Precision,
    allow_pure: bool,
    allow_change: bool,
) -> Vec<Precision> {
    use Precision::*;
    if !allow_change {
        return if allow_pure && base != Bf16Pure {
            vec![base, Bf16Pure]
        } else {
            vec![base]
        };
    }
    let mut v = match base {
        Fp64 => vec![Fp64, Fp32, Bf16Mixed, Fp16Mixed, Bf16Pure],
        Fp32 => vec![Fp32, Bf16Mixed, Fp16Mixed, Bf16Pure],
        Bf16Mixed => vec![Bf16Mixed, Fp16Mixed, Bf16Pure],
        Fp16Mixed => vec![Fp16Mixed, Bf16Mixed, Bf16Pure],
        Bf16Pure => vec![Bf16Pure],
    };
    if !allow_pure && base != Bf16Pure {
        v.retain(|p| *p != Bf16Pure);
    }
    v
}

/// Whether some point is at least as fast as `time` and at most `peak` (so everything slower
/// and larger is dominated).
pub(super) fn dominated(front: &[(f64, u64)], time: f64, peak: u64) -> bool {
    front.iter().any(|&(t, p)| t <= time && p <= peak)
}

/// Keep `front` as the non-dominated (time, peak) pairs seen so far.
pub(super) fn push_front(front: &mut Vec<(f64, u64)>, time: f64, peak: u64) {
    if dominated(front, time, peak) {
        return;
    }
    front.retain(|&(t, p)| !(time <= t && peak <= p));
    front.push((time, peak));
}

/// The search itself (without the alternatives), and how many combinations the time limit
/// left unvisited.
pub(super) fn search(
    base: &Spec,
    limits: &Limits,
    profile: &DeviceProfile,
    run: &mut Run<'_>,
) -> Result<(Plan, usize), crate::error::SpecError> {
    base.validate()?;
    check_limits(limits)?;
    let usable = limits.usable();
    let mut ev = Evaluator {
        profile,
        run,
        tables: HashMap::new(),
        segments: HashMap::new(),
        evaluated: 0,
        usable,
        expandable: false,
    };
    let depth = base.model.depth;

    // The base itself, exactly as given.
    let base_combo = ev.combo(base.clone(), 0);
    let mut base_point = ev.point(&base_combo, None, base.recipe.recompute.clone());
    base_point.n_changes = 0;
    ev.expandable = true;
    let mut points: Vec<Point> = vec![base_point.clone()];
    let mut front: Vec<(f64, u64)> = vec![(base_point.time.total_s, base_point.peak)];

    let combos = combinations(&mut ev, base, limits);
    let mut pruned = 0usize;
    let mut left = 0usize;
    for (ci, (c, t0)) in combos.iter().enumerate() {
        if ev.run.over() {
            left = combos.len() - ci;
            break;
        }
        let launch = ev.run.control.launch.copied().unwrap_or_default();
        let search = RecomputeSearch {
            combo: c,
            index: ci,
            fastest: *t0,
            depth,
            usable,
            only: if launch.pinned.recompute {
                Some(vec![base.recipe.recompute.clone()])
            } else if launch.whole_model_recompute(&c.spec) {
                Some(vec![Recompute::All, Recompute::None])
            } else {
                None
            },
        };
        if !search.run(&mut ev, &mut points, &mut front) {
            pruned += 1;
        }
        ev.run.report(ci + 1, combos.len());
    }

    Ok((
        conclude(
            base,
            limits,
            profile,
            &combos,
            &points,
            base_point,
            (pruned, ev.evaluated),
        ),
        left,
    ))
}

/// The plan of one stage from its evaluated `points` (the base's first): the fastest that
/// fits, else the smallest peak, with the Pareto front and the reason.
fn conclude(
    base: &Spec,
    limits: &Limits,
    profile: &DeviceProfile,
    combos: &[(Combo, f64)],
    points: &[Point],
    base_point: Point,
    (pruned, evaluated): (usize, usize),
) -> Plan {
    let usable = limits.usable();
    let specs = PointSpecs { base, combos };
    let candidate = |p: &Point| specs.candidate(p);
    let pareto = pareto_front(points, &candidate);
    let base_fits = base_point.peak <= usable;
    let base_c = candidate(&base_point);
    let base_point = if base_fits {
        base_point
    } else {
        replayed(&base_point, base)
    };
    let floor_point;
    let (feasible, chosen) = match fastest_fitting(points, usable) {
        Some(p) => (true, p),
        None => {
            let floor = smallest_peak(points);
            // The floor the plan reports is replayed, so that a budget at the floor
            // (÷ headroom) fits it.
            floor_point = replayed(floor, &candidate(floor).spec);
            (false, &floor_point)
        }
    };
    let mut chosen_c = candidate(chosen);
    if chosen_c.spec == *base {
        // A combination that equals the base is the base: no changes.
        chosen_c.changes.clear();
    }
    let (dom, dom_bytes) = chosen.breakdown.dominant();
    let reason = if feasible {
        explain(base, &base_c, &chosen_c, usable, profile)
    } else {
        let floor = Floor {
            peak: chosen.peak,
            breakdown: &chosen.breakdown,
            changes: &chosen_c.changes,
        };
        infeasible_reason(limits, base, usable, floor, None)
    };
    Plan {
        feasible,
        engine_runnable: engine_runnable(&chosen_c.spec),
        plan: chosen_c.spec.clone(),
        predicted_peak_bytes: chosen.peak,
        predicted_step_time_s: chosen.time.total_s,
        breakdown: chosen.breakdown,
        time: chosen.time,
        changes: chosen_c.changes.clone(),
        dominant: dom.to_string(),
        dominant_bytes: dom_bytes,
        reason,
        base_fits,
        base_peak_bytes: base_point.peak,
        base_step_time_s: base_point.time.total_s,
        budget_bytes: limits.budget_bytes,
        headroom: limits.headroom,
        usable_bytes: usable,
        allow: limits.allow,
        alternatives: Vec::new(),
        pareto,
        combinations: combos.len(),
        pruned,
        evaluated,
        profile: profile.clone(),
        not_searched: None,
    }
}

/// The spec and the candidate of a stage's point: its combination (or the base) with its
/// recompute policy and allocator settings.
struct PointSpecs<'a> {
    base: &'a Spec,
    combos: &'a [(Combo, f64)],
}

impl PointSpecs<'_> {
    fn spec_of(&self, p: &Point) -> Spec {
        let mut s = match p.combo {
            Some(i) => self.combos[i].0.spec.clone(),
            None => self.base.clone(),
        };
        if p.combo.is_some() {
            s.recipe.recompute = p.recompute.clone();
        }
        if p.expandable {
            s = with_expandable_segments(&s).unwrap_or(s);
        }
        s
    }

    fn candidate(&self, p: &Point) -> Candidate {
        let spec = self.spec_of(p);
        Candidate {
            changes: describe_changes(self.base, &spec),
            spec,
            peak_bytes: p.peak,
            breakdown: p.breakdown,
            time: p.time,
        }
    }
}

/// The fastest point that fits `usable`; at equal time fewer changes (the base has none), then
/// the smaller peak. A candidate that is faster *and* fits wins even when the base fits:
/// returning the slower base would let a smaller budget yield a faster plan.
fn fastest_fitting(points: &[Point], usable: u64) -> Option<&Point> {
    points.iter().filter(|p| p.peak <= usable).min_by(|a, b| {
        a.time
            .total_s
            .total_cmp(&b.time.total_s)
            .then(a.n_changes.cmp(&b.n_changes))
            .then(a.peak.cmp(&b.peak))
    })
}

/// The point with the smallest peak (the faster at equal peaks): the floor when none fits.
fn smallest_peak(points: &[Point]) -> &Point {
    points
        .iter()
        .min_by(|a, b| {
            a.peak
                .cmp(&b.peak)
                .then(a.time.total_s.total_cmp(&b.time.total_s))
        })
        .expect("the base is always evaluated")
}

/// The headroom and the budget of `limits` make sense.
pub(super) fn check_limits(limits: &Limits) -> Result<(), crate::error::SpecError> {
    if !(0.0..0.9).contains(&limits.headroom) || limits.headroom.is_nan() {
        return Err(crate::error::SpecError::invalid(
            "plan.headroom",
            format!(
                "{} is out of range; allowed: 0 ≤ headroom < 0.9",
                limits.headroom
            ),
        ));
    }
    if limits.budget_bytes == 0 {
        return Err(crate::error::SpecError::invalid(
            "plan.budget",
            "is 0 bytes; allowed: a positive size such as 24GiB",
        ));
    }
    Ok(())
}

/// Every combination of the levers but recompute, with its fastest time (no recompute), fastest
/// first; at equal time fewer changes (stable: enumeration order breaks the rest).
pub(super) fn combinations(
    ev: &mut Evaluator<'_, '_>,
    base: &Spec,
    limits: &Limits,
) -> Vec<(Combo, f64)> {
    let w = &base.workload;
    let per_rank = w.batch / w.ranks;
    let launch = ev.run.control.launch.copied().unwrap_or_default();
    let pin = launch.pinned;
    let lv = levers(base, limits, pin);

    // Every combination of the levers but recompute, with its fastest time.
    let mut combos: Vec<(Combo, f64)> = Vec::new();
    for &precision in &precisions_from(
        base.recipe.precision,
        limits.allow.bf16_pure,
        limits.allow.precision,
    ) {
        for &attention in &lv.attentions {
            for &micro in &lv.micros {
                for &lat in &lv.latents {
                    for (lora, &quant) in lv
                        .loras
                        .iter()
                        .flat_map(|l| lv.quants.iter().map(move |q| (l, q)))
                        .filter(|(l, q)| l.is_some() || **q == BaseQuant::None)
                    {
                        for &opt in &lv.optimizers {
                            for &z in &lv.zeros {
                                if !crate::sharding::stage_exists(base, z) {
                                    continue;
                                }
                                let mut s = base.clone();
                                s.recipe.base_quant = quant;
                                s.recipe.precision = precision;
                                s.recipe.attention = attention;
                                s.recipe.latents = lat;
                                s.recipe.lora = lora.clone();
                                s.recipe.optimizer = opt;
                                s.recipe.zero_stage = z;
                                s.recipe.gradient_as_bucket_view &= z == 0;
                                s.recipe.recompute = Recompute::None;
                                s.workload.microbatch = micro;
                                s.workload.accumulation = per_rank / micro;
                                // What the launcher runs of it; a recipe it cannot run is not
                                // in the space, one it runs as another is that other.
                                let Ok(s) = launch.realise(&s) else { continue };
                                if combos.iter().any(|(c, _)| c.spec == s) {
                                    continue;
                                }
                                let mut n = describe_changes(base, &s).len();
                                // Recompute "none" is not a change of its own here; the point
                                // counts its policy.
                                if base.recipe.recompute != Recompute::None {
                                    n -= 1;
                                }
                                let c = ev.combo(s, n);
                                let t0 = ev.time(&c, Recompute::None).total_s;
                                combos.push((c, t0));
                            }
                        }
                    }
                }
            }
        }
    }
    // Fastest first; at equal time fewer changes (stable: enumeration order breaks the rest).
    combos.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.n_changes.cmp(&b.0.n_changes)));

    combos
}

/// The values each lever but precision and recompute takes in a stage's space.
pub(super) struct Levers {
    micros: Vec<u32>,
    loras: Vec<Option<LoraSpec>>,
    quants: Vec<BaseQuant>,
    optimizers: Vec<Optimizer>,
    zeros: Vec<u8>,
    latents: Vec<Latents>,
    attentions: Vec<AttentionMode>,
}

/// [`Levers`] of `base` under `limits`, less what the launcher pins (`pin`).
fn levers(base: &Spec, limits: &Limits, pin: crate::launch::Pinned) -> Levers {
    let w = &base.workload;
    let per_rank = w.batch / w.ranks;
    let micros = if pin.microbatch {
        vec![w.microbatch]
    } else {
        microbatch_candidates(per_rank, w.microbatch)
    };
    // The engine runs no LoRA on a diffusers family yet (`denoiser::check` refuses it).
    let engine_family = base.runtime == Runtime::DitmemCpu && base.model.diffusers.is_some();
    let loras: Vec<Option<LoraSpec>> =
        if limits.allow.lora && base.recipe.lora.is_none() && !engine_family {
            vec![
                None,
                Some(LoraSpec {
                    dtype: Default::default(),
                    rank: PLAN_LORA_RANK.min(base.model.hidden),
                    targets: crate::spec::default_lora_targets(),
                    modules: Vec::new(),
                }),
            ]
        } else {
            vec![base.recipe.lora.clone()]
        };
    // A quantized base (QLoRA's NF4) under LoRA, on the runtime that models it.
    let quants: Vec<BaseQuant> = if limits.allow.quant
        && base.recipe.base_quant == BaseQuant::None
        && matches!(base.runtime, Runtime::Pytorch { .. })
    {
        vec![BaseQuant::None, BaseQuant::Nf4]
    } else {
        vec![base.recipe.base_quant]
    };
    let optimizers: Vec<Optimizer> =
        if limits.allow.eight_bit && base.recipe.optimizer == Optimizer::AdamW {
            vec![Optimizer::AdamW, Optimizer::AdamW8bit]
        } else {
            vec![base.recipe.optimizer]
        };
    let zeros: Vec<u8> = if limits.allow.sharding && w.ranks > 1 && !pin.zero_stage {
        (base.recipe.zero_stage..=3).collect()
    } else {
        vec![base.recipe.zero_stage]
    };
    let latents: Vec<Latents> = if base.recipe.latents == Latents::Encode && !pin.latents {
        vec![Latents::Encode, Latents::Cached]
    } else {
        vec![base.recipe.latents]
    };
    let attentions: Vec<AttentionMode> = match base.recipe.attention {
        AttentionMode::Materialized if !pin.attention => {
            vec![AttentionMode::Materialized, AttentionMode::MemoryEfficient]
        }
        a => vec![a],
    };
    Levers {
        micros,
        loras,
        quants,
        optimizers,
        zeros,
        latents,
        attentions,
    }
}

/// Most microbatch sizes the planner tries per search (see [`microbatch_candidates`]).
pub const PLAN_MAX_MICROBATCHES: usize = 8;

/// The microbatch sizes the planner tries, largest first: the divisors of `per_rank` up to
/// `micro` (the effective batch is kept). When there are more than [`PLAN_MAX_MICROBATCHES`]
/// (a per-rank batch such as 55,440 has 120 divisors), an even spread over them by rank, which
/// keeps the base's microbatch and 1; the planner's time then stays bounded (every combination
/// costs timelines linear in the depth).
pub(crate) fn microbatch_candidates(per_rank: u32, micro: u32) -> Vec<u32> {
    let mut small: Vec<u32> = Vec::new();
    let mut large: Vec<u32> = Vec::new();
    let mut d = 1u32;
    while u64::from(d) * u64::from(d) <= u64::from(per_rank) {
        if per_rank.is_multiple_of(d) {
            small.push(d);
            if d != per_rank / d {
                large.push(per_rank / d);
            }
        }
        d += 1;
    }
    let mut all: Vec<u32> = small
        .into_iter()
        .chain(large.into_iter().rev())
        .filter(|&x| x <= micro)
        .collect();
    all.reverse();
    let n = all.len();
    if n <= PLAN_MAX_MICROBATCHES {
        return all;
    }
    let k = PLAN_MAX_MICROBATCHES;
    let mut out: Vec<u32> = (0..k).map(|j| all[(j * (n - 1)).div_ceil(k - 1)]).collect();
    out.dedup();
    out
}

/// The recompute policies explored for one combination (see the module doc).
pub(super) struct RecomputeSearch<'c> {
    pub(super) combo: &'c Combo,
    pub(super) index: usize,
    /// The combination's fastest time (no recompute).
    pub(super) fastest: f64,
    pub(super) depth: u32,
    pub(super) usable: u64,
    /// The only policies the launcher runs (a script's all-or-none checkpointing, a pinned
    /// policy); `None`: the whole search below.
    pub(super) only: Option<Vec<Recompute>>,
}

impl RecomputeSearch<'_> {
    /// Evaluate the combination's recompute points into `points` and `front`; false when it is
    /// pruned (every point of it dominated).
    pub(super) fn run(
        &self,
        ev: &mut Evaluator<'_, '_>,
        points: &mut Vec<Point>,
        front: &mut Vec<(f64, u64)>,
    ) -> bool {
        let (c, ci, t0) = (self.combo, self.index, self.fastest);
        let (depth, usable) = (self.depth, self.usable);
        if dominated(front, t0, persistent(&c.table.1)) {
            return false;
        }
        let add = |p: Point, points: &mut Vec<Point>, front: &mut Vec<(f64, u64)>| {
            push_front(front, p.time.total_s, p.peak);
            let peak = p.peak;
            points.push(p);
            peak
        };
        if let Some(only) = &self.only {
            for rc in only {
                let p = ev.point(c, Some(ci), rc.clone());
                add(p, points, front);
            }
            return true;
        }
        // The leanest policies: every block recomputed; all but the last (rebuilding the last
        // block in backward costs a second copy of its output beside the kept one, so `all` can
        // be leaner at the end of forward yet heavier in backward); the attention cores only
        // (leaner on very shallow models).
        // Evaluated together: their replays run side by side (`Evaluator::points`).
        let mut rcs = vec![Recompute::All, Recompute::AttentionOnly];
        if depth > 1 {
            rcs.extend(recompute_candidates(depth - 1, depth));
        }
        let mut batch = ev.points(c, Some(ci), rcs);
        let placements = batch.split_off(2);
        let attn = batch.pop().expect("attention-only");
        let all_p = batch.pop().expect("all");
        let all_peak = all_p.peak;
        let below = (depth > 1).then(|| leanest(placements));
        let below_peak = below.as_ref().map_or(u64::MAX, |p| p.peak);
        let floor = all_peak.min(below_peak).min(attn.peak);
        let skip = dominated(front, t0, floor);
        add(all_p, points, front);
        if let Some(p) = below {
            add(p, points, front);
        }
        add(attn, points, front);
        if skip {
            return false;
        }
        let p0 = ev.point(c, Some(ci), Recompute::None);
        let peak0 = add(p0, points, front);
        if peak0 > usable && below_peak <= usable {
            // Smallest k in 1..depth−1 with peak(k) ≤ usable; peak falls with k on that range.
            let (mut lo, mut hi) = (0u32, depth - 1);
            while hi - lo > 1 {
                let mid = (lo + hi) / 2;
                let p = ev.point_k(c, Some(ci), mid, depth);
                let fits = p.peak <= usable;
                add(p, points, front);
                if fits {
                    hi = mid;
                } else {
                    lo = mid;
                }
            }
        } else if peak0 > below_peak && depth > 3 {
            // Mid-way point so that the front shows what partial recompute trades.
            let p = ev.point_k(c, Some(ci), depth / 2, depth);
            add(p, points, front);
        }
        true
    }
}

/// The Pareto front over every point, fastest first.
pub(super) fn pareto_front(
    points: &[Point],
    candidate: &dyn Fn(&Point) -> Candidate,
) -> Vec<Candidate> {
    let mut sorted: Vec<&Point> = points.iter().collect();
    sorted.sort_by(|a, b| {
        a.time
            .total_s
            .total_cmp(&b.time.total_s)
            .then(a.peak.cmp(&b.peak))
            .then(a.n_changes.cmp(&b.n_changes))
    });
    let mut pareto: Vec<Candidate> = Vec::new();
    let mut best_peak = u64::MAX;
    for p in &sorted {
        if p.peak < best_peak {
            best_peak = p.peak;
            pareto.push(candidate(p));
        }
    }
    pareto
}
