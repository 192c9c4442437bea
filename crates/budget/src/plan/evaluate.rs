//! Evaluating candidates: the clock and cache one search shares, the (time, peak) points of a
//! combination's recompute policies, and on `pytorch:cuda` the allocator replays behind a
//! point's device bytes.

use std::collections::HashMap;
use std::rc::Rc;
use std::time::Instant;

use crate::cost::{elementwise_forward_s, step_time_with, DeviceProfile, StepTime, TimeInputs};
use crate::denoiser::param_table;
use crate::events::{Breakdown, StaticBytes};
use crate::params::{ParamRole, ParamTensor};
use crate::runtime::SegmentCosts;
use crate::spec::{AttentionMode, BaseQuant, Latents, Optimizer, Precision, Recompute, Spec};
use crate::timeline::{segment_costs, simulate_step_with, static_bytes, LAID_OUT_MICROBATCHES};

use super::types::*;

/// The clock of one [`plan_with`] call and the points its stages share.
pub(super) struct Run<'a> {
    pub(super) control: SearchControl<'a>,
    pub(super) start: Instant,
    pub(super) deadline: Option<Instant>,
    pub(super) stage: usize,
    pub(super) stages: usize,
    /// Points simulated so far, by recipe and split (see [`Evaluator::point`]).
    pub(super) cache: HashMap<String, Point>,
    pub(super) simulated: usize,
}

impl Run<'_> {
    pub(super) fn over(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    pub(super) fn report(&self, done: usize, combinations: usize) {
        if let Some(f) = self.control.progress {
            f(&Progress {
                stage: self.stage,
                stages: self.stages,
                done,
                combinations,
                timelines: self.simulated,
                elapsed_s: self.start.elapsed().as_secs_f64(),
            });
        }
    }
}

/// A (time, peak) point of the search; specs and words are made only for the points shown.
#[derive(Debug, Clone)]
pub(super) struct Point {
    /// Index into the combinations, or `None` for the base exactly as given.
    pub(super) combo: Option<usize>,
    pub(super) recompute: Recompute,
    pub(super) peak: u64,
    pub(super) breakdown: Breakdown,
    pub(super) time: StepTime,
    pub(super) n_changes: usize,
    /// Fits only with `expandable_segments:True` added to the allocator settings
    /// ([`device_peak`]).
    pub(super) expandable: bool,
}

impl Point {
    /// This point (simulated for another combination, or earlier) as the point of combination
    /// `ci` with the policy `rc`.
    fn for_combo(&self, c: &Combo, ci: Option<usize>, rc: &Recompute) -> Point {
        Point {
            combo: ci,
            n_changes: n_changes(c, rc, self.expandable),
            ..self.clone()
        }
    }
}

/// The changes from the base of combination `c` with policy `rc`: the combination's, the
/// policy when it recomputes, and `expandable_segments:True` when the point needs it.
fn n_changes(c: &Combo, rc: &Recompute, expandable: bool) -> usize {
    c.n_changes + usize::from(*rc != Recompute::None) + usize::from(expandable)
}

/// One setting of every lever but recompute.
pub(super) struct Combo {
    pub(super) spec: Spec,
    pub(super) table: Rc<(Vec<ParamTensor>, StaticBytes)>,
    pub(super) costs: Rc<(SegmentCosts, TimeInputs)>,
    pub(super) n_changes: usize,
}

pub(super) type TableKey = (Option<u32>, Precision, Optimizer, u8, Latents, BaseQuant);

pub(super) type SegKey = (Option<u32>, Precision, AttentionMode, u32, bool, BaseQuant);

/// Caches the parts of the budget and the time model that many candidates share.
pub(super) struct Evaluator<'a, 'r> {
    pub(super) profile: &'a DeviceProfile,
    pub(super) run: &'a mut Run<'r>,
    pub(super) tables: HashMap<TableKey, Rc<(Vec<ParamTensor>, StaticBytes)>>,
    pub(super) segments: HashMap<SegKey, Rc<(SegmentCosts, TimeInputs)>>,
    pub(super) evaluated: usize,
    /// The usable budget: a CUDA candidate whose allocated peak and context already exceed it is
    /// not replayed on the allocator (it cannot fit; its device bytes are at least that).
    pub(super) usable: u64,
    /// Whether a CUDA candidate may be fitted with `expandable_segments:True` (not the base as
    /// given: a combination equal to it gets the setting as a change).
    pub(super) expandable: bool,
}

impl Evaluator<'_, '_> {
    pub(super) fn table(&mut self, spec: &Spec) -> Rc<(Vec<ParamTensor>, StaticBytes)> {
        let r = &spec.recipe;
        let key = (
            r.lora.as_ref().map(|l| l.rank),
            r.precision,
            r.optimizer,
            r.zero_stage,
            r.latents,
            r.base_quant,
        );
        self.tables
            .entry(key)
            .or_insert_with(|| {
                let t = param_table(spec);
                let st = static_bytes(spec, &t);
                Rc::new((t, st))
            })
            .clone()
    }

    pub(super) fn segments(
        &mut self,
        spec: &Spec,
        trained: f64,
        dequant: f64,
    ) -> Rc<(SegmentCosts, TimeInputs)> {
        let r = &spec.recipe;
        let key = (
            r.lora.as_ref().map(|l| l.rank),
            r.precision,
            r.attention,
            spec.workload.microbatch,
            r.recompute == Recompute::AttentionOnly,
            r.base_quant,
        );
        let profile = self.profile;
        self.segments
            .entry(key)
            .or_insert_with(|| {
                let inputs = TimeInputs {
                    trained_params: trained,
                    cast_params: trained,
                    dequant_params: dequant,
                    elementwise_s: elementwise_forward_s(spec, profile),
                };
                Rc::new((segment_costs(spec), inputs))
            })
            .clone()
    }

    pub(super) fn combo(&mut self, spec: Spec, n_changes: usize) -> Combo {
        let table = self.table(&spec);
        let trained = trained_params(&table.0);
        let dequant = crate::cost::dequant_params(&spec, &table.0);
        let costs = self.segments(&spec, trained, dequant);
        Combo {
            spec,
            table,
            costs,
            n_changes,
        }
    }

    /// Peak, breakdown and time of `c` with the recompute policy `rc`.
    pub(super) fn point(&mut self, c: &Combo, ci: Option<usize>, rc: Recompute) -> Point {
        self.points(c, ci, vec![rc])
            .pop()
            .expect("one point per policy")
    }

    /// [`Self::point`] of each policy of `rcs`, in order, in two passes over the batch: the
    /// first takes each policy from the cache or simulates its timeline and time
    /// ([`Self::simulate`]); the second ([`Self::replay`]) runs the allocator replays of the
    /// new points side by side ([`in_parallel`]: they are independent, and each point is what
    /// `point` alone gives) and fills the cache. [`Pending`] carries the first pass's results
    /// to the second.
    pub(super) fn points(
        &mut self,
        c: &Combo,
        ci: Option<usize>,
        rcs: Vec<Recompute>,
    ) -> Vec<Point> {
        let mut out: Vec<Option<Point>> = vec![None; rcs.len()];
        let mut pending: Vec<(usize, Pending)> = Vec::new();
        for (i, rc) in rcs.into_iter().enumerate() {
            let mut spec = c.spec.clone();
            spec.recipe.recompute = rc.clone();
            // Within one plan only the recipe and the split vary; the same ones give the same
            // point.
            let key = format!(
                "{:?}|{:?}|{}|{}",
                spec.recipe, spec.workload, self.expandable, self.usable
            );
            if let Some(p) = self.run.cache.get(&key) {
                out[i] = Some(p.for_combo(c, ci, &rc));
                continue;
            }
            let p = if pending.iter().any(|(_, p)| p.key == key) {
                // The same policy twice in one batch: the second is the first's point (as the
                // cache would give it).
                Pending {
                    alias: true,
                    key,
                    spec,
                    rc,
                    breakdown: Breakdown::default(),
                    allocated: 0,
                    time: None,
                }
            } else {
                self.simulate(c, spec, rc, key)
            };
            pending.push((i, p));
        }
        self.replay(c, ci, pending, &mut out);
        out.into_iter()
            .map(|p| p.expect("every policy has its point"))
            .collect()
    }

    /// The first pass of [`Self::points`] for a policy not seen yet: its timeline's peak and
    /// its step time.
    fn simulate(&mut self, c: &Combo, spec: Spec, rc: Recompute, key: String) -> Pending {
        self.evaluated += 1;
        self.run.simulated += 1;
        let attn_only = rc == Recompute::AttentionOnly;
        let (costs, inputs) = if attn_only {
            let (trained, dequant) = (c.costs.1.trained_params, c.costs.1.dequant_params);
            let seg = self.segments(&spec, trained, dequant);
            (seg.0, seg.1)
        } else {
            (c.costs.0, c.costs.1)
        };
        let tl = crate::profile::time(
            crate::profile::Phase::Timeline,
            |_| 1,
            || simulate_step_with(&spec, &c.table.0, &c.table.1, &costs, LAID_OUT_MICROBATCHES),
        );
        let e = tl.peak();
        let time = step_time_with(&spec, self.profile, &inputs);
        Pending {
            alias: false,
            key,
            spec,
            rc,
            breakdown: e.live,
            allocated: e.total(),
            time: Some(time),
        }
    }

    /// The second pass of [`Self::points`]: the allocator replays of the pending points side
    /// by side, each point into `out` and the cache (an alias takes its first's point).
    fn replay(
        &mut self,
        c: &Combo,
        ci: Option<usize>,
        pending: Vec<(usize, Pending)>,
        out: &mut [Option<Point>],
    ) {
        let (table, usable) = (&c.table.0, self.usable);
        let replays: Vec<&Pending> = pending
            .iter()
            .map(|(_, p)| p)
            .filter(|p| !p.alias)
            .collect();
        let mut peaks = in_parallel(&replays, |p| {
            device_peak(&p.spec, table, p.allocated, usable)
        })
        .into_iter();
        for (i, p) in pending {
            if p.alias {
                let first = self.run.cache.get(&p.key).expect("evaluated above");
                out[i] = Some(first.for_combo(c, ci, &p.rc));
                continue;
            }
            let dp = peaks.next().expect("one replay per pending point");
            let (peak, expandable) = dp
                .map(|(plain, grown)| match grown {
                    Some(g) if self.expandable => (g, true),
                    // Without the setting, the plain replay's device bytes.
                    _ => (plain, false),
                })
                .unwrap_or((p.allocated, false));
            let point = Point {
                combo: ci,
                n_changes: n_changes(c, &p.rc, expandable),
                recompute: p.rc,
                peak,
                breakdown: p.breakdown,
                time: p.time.expect("a timed point"),
                expandable,
            };
            self.run.cache.insert(p.key, point.clone());
            out[i] = Some(point);
        }
    }

    /// The leanest of [`recompute_candidates`] for `k` recomputed blocks.
    pub(super) fn point_k(&mut self, c: &Combo, ci: Option<usize>, k: u32, depth: u32) -> Point {
        leanest(self.points(c, ci, recompute_candidates(k, depth)))
    }

    pub(super) fn time(&self, c: &Combo, rc: Recompute) -> StepTime {
        let mut spec = c.spec.clone();
        spec.recipe.recompute = rc;
        step_time_with(&spec, self.profile, &c.costs.1)
    }
}

/// A point whose timeline and time are known and whose allocator replay is still to run
/// ([`Evaluator::points`]).
pub(super) struct Pending {
    /// Another pending point of the batch has the same key.
    pub(super) alias: bool,
    pub(super) key: String,
    pub(super) spec: Spec,
    pub(super) rc: Recompute,
    pub(super) breakdown: Breakdown,
    pub(super) allocated: u64,
    pub(super) time: Option<StepTime>,
}

/// The first of `points` with the smallest peak (a later one must be strictly leaner).
pub(super) fn leanest(points: Vec<Point>) -> Point {
    let mut best: Option<Point> = None;
    for p in points {
        if best.as_ref().is_none_or(|b| p.peak < b.peak) {
            best = Some(p);
        }
    }
    best.expect("at least one placement")
}

/// Threads the planner replays allocators on: the machine's (`available_parallelism`), at most
/// 8; `DITMEM_PLAN_THREADS` sets it (1: one at a time).
pub(super) fn plan_threads() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("DITMEM_PLAN_THREADS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n >= 1)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
            .min(8)
    })
}

/// `f` of each item, in order, on up to [`plan_threads`] threads (each a pure function of its
/// item: the results do not depend on how they are spread).
pub(crate) fn in_parallel<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = plan_threads().min(items.len());
    if threads <= 1 {
        return items.iter().map(f).collect();
    }
    let f = &f;
    std::thread::scope(|scope| {
        let others: Vec<_> = (1..threads)
            .map(|t| {
                scope.spawn(move || {
                    items
                        .iter()
                        .skip(t)
                        .step_by(threads)
                        .map(f)
                        .collect::<Vec<R>>()
                })
            })
            .collect();
        let mut parts: Vec<std::vec::IntoIter<R>> = vec![items
            .iter()
            .step_by(threads)
            .map(f)
            .collect::<Vec<R>>()
            .into_iter()];
        for h in others {
            // A panic in a replay is the planner's bug, as it would be on this thread.
            parts.push(
                h.join()
                    .unwrap_or_else(|e| std::panic::resume_unwind(e))
                    .into_iter(),
            );
        }
        (0..items.len())
            .map(|i| parts[i % threads].next().expect("each thread's share"))
            .collect()
    })
}

/// `p` with its device bytes replayed on the allocator: on CUDA a candidate that cannot fit is
/// not replayed during the search (its peak there is a lower bound, allocated + context); the
/// points a plan reports (the base, an infeasible floor) are.
pub(super) fn replayed(p: &Point, spec: &Spec) -> Point {
    let mut out = p.clone();
    let table = param_table(spec);
    if let Some((device, _)) = device_peak(spec, &table, p.breakdown.total(), u64::MAX) {
        out.peak = out.peak.max(device);
    }
    out
}

/// On `pytorch:cuda` what has to fit is what the device shows: the caching allocator's reserved
/// segments (fragmentation included) plus the CUDA context, not the allocated peak. When the
/// allocated peak and the context fit but the reserved segments do not — fragmentation is what
/// breaks the fit — the step is replayed again with `expandable_segments:True` (segments that
/// grow by mapped pages, `caching_allocator.rs`); the second value is its device bytes when
/// that setting makes it fit.
pub(super) fn device_peak(
    spec: &Spec,
    table: &[ParamTensor],
    allocated: u64,
    usable: u64,
) -> Option<(u64, Option<u64>)> {
    let cuda = matches!(
        spec.runtime,
        crate::spec::Runtime::Pytorch {
            device: crate::spec::TorchDevice::Cuda,
            ..
        }
    );
    if !cuda {
        return None;
    }
    let context = spec
        .cuda
        .as_ref()
        .and_then(|c| c.gpu.as_deref())
        .and_then(|g| crate::gpu::lookup(g).ok())
        .map_or(crate::runtime::pytorch::device::CUDA_CONTEXT_BYTES, |g| {
            g.context_bytes
        });
    if allocated + context > usable {
        // Cannot fit (reserved ≥ allocated): the allocator's replay is kept for candidates
        // that may.
        return Some((allocated + context, None));
    }
    let events = crate::runtime::pytorch::trace::allocation_sequence(spec, table);
    let r = crate::runtime::pytorch::cuda::cuda_report_of(spec, table, &events).ok()??;
    let device = |r: &crate::runtime::pytorch::cuda::CudaReport| match r.oom {
        // The allocator stopped at the capacity: the step needs at least its allocated peak
        // and the context.
        Some(_) => r.device_bytes.max(allocated + r.context_bytes),
        None => r.device_bytes,
    };
    let plain = device(&r);
    if plain <= usable || r.max_allocated_bytes + r.context_bytes > usable {
        return Some((plain, None));
    }
    let grown = with_expandable_segments(spec).and_then(|e| {
        // The same sequence: the allocator setting is not part of it.
        let re = crate::runtime::pytorch::cuda::cuda_report_of(&e, table, &events).ok()??;
        let g = device(&re);
        (re.oom.is_none() && g <= usable).then_some(g)
    });
    Some((plain, grown))
}

/// `spec` with `expandable_segments:True` added to its `PYTORCH_CUDA_ALLOC_CONF`; `None` when
/// the setting is already there (or the string does not parse).
pub(super) fn with_expandable_segments(spec: &Spec) -> Option<Spec> {
    let mut s = spec.clone();
    let cs = s.cuda.get_or_insert_with(Default::default);
    let conf = crate::runtime::pytorch::caching_allocator::AllocConf::parse(&cs.alloc_conf).ok()?;
    if conf.expandable_segments {
        return None;
    }
    let rest: Vec<&str> = cs
        .alloc_conf
        .split(',')
        .map(str::trim)
        .filter(|kv| !kv.is_empty() && !kv.starts_with("expandable_segments"))
        .collect();
    let mut parts = rest.join(",");
    if !parts.is_empty() {
        parts.push(',');
    }
    parts.push_str(EXPANDABLE_SEGMENTS);
    cs.alloc_conf = parts;
    Some(s)
}

/// The allocator setting the planner adds where fragmentation breaks the fit.
pub(crate) const EXPANDABLE_SEGMENTS: &str = "expandable_segments:True";

pub(super) fn trained_params(table: &[ParamTensor]) -> f64 {
    table
        .iter()
        .filter(|t| t.role == ParamRole::Trained)
        .map(|t| t.numel() as f64)
        .sum()
}

/// Persistent bytes of a combination: a lower bound of its peak under any recompute policy.
pub(super) fn persistent(st: &StaticBytes) -> u64 {
    st.weights + st.master_weights + st.optimizer_state + st.ema + st.encoder_weights
}

/// `recompute` for the first `k` of `depth` blocks.
pub(crate) fn recompute_first(k: u32, depth: u32) -> Recompute {
    if k == 0 {
        Recompute::None
    } else if k >= depth {
        Recompute::All
    } else {
        Recompute::Blocks((0..k).collect())
    }
}

/// The placements of `k` recomputed blocks the planner compares: the first `k`, and the first
/// `k − 1` plus the one after a gap. In the engine a recomputed block keeps only its input, which
/// is the previous block's output: kept anyway when that block is stored, an extra buffer when it
/// is recomputed too; and a block recomputed late is rebuilt on top of every graph below it. The
/// two placements cover both effects (a test holds them against all `2^depth` subsets).
pub(crate) fn recompute_candidates(k: u32, depth: u32) -> Vec<Recompute> {
    let mut v = vec![recompute_first(k, depth)];
    if k >= 1 && k + 1 < depth {
        let mut blocks: Vec<u32> = (0..k - 1).collect();
        blocks.push(k);
        v.push(Recompute::Blocks(blocks));
    }
    v
}
