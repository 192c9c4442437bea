//! One change at a time: the levers a user can pull on a spec, each budgeted alone and ranked
//! against a card.
//!
//! `estimate` names the one lever that helps most and `ditmem oom` ranks them against the card
//! an out-of-memory message came from; the planner searches combinations (`plan/`), and is
//! asked here for its fastest combination when no single lever fits. A lever is a single edit
//! of the spec a user makes with one setting (the allocator's expandable segments, recompute,
//! microbatch with accumulation, memory-efficient attention, bf16-mixed, 8-bit AdamW, cached
//! latents or text embeddings, LoRA, an NF4 base, ZeRO over the ranks), budgeted like any spec,
//! with its predicted step time on the card's profile so that levers that fit are ranked by
//! what they cost.

use std::collections::HashMap;

use serde::Serialize;

use crate::cost::{step_time_with, DeviceProfile, TimeInputs};
use crate::error::SpecError;
use crate::estimate::Budget;
use crate::plan::{microbatch_candidates, plan, recompute_first, Allow, Limits, PLAN_LORA_RANK};
use crate::runtime::pytorch::cuda::CudaReport;
use crate::spec::{
    AttentionMode, BaseQuant, Latents, LoraSpec, Optimizer, Precision, Recipe, Recompute, Runtime,
    Spec, TextEncoders, TorchDevice,
};

/// What has to fit on the device for a budget: on `pytorch:cuda` what `nvidia-smi` would show
/// (reserved segments + context), and when the allocator's replay ran out of the card, at least
/// the step's allocated peak plus the context (the replay stops at the failing request, so its
/// own maxima undercount); elsewhere the step's peak.
pub fn need_bytes(b: &Budget) -> u64 {
    need_bytes_of(b.cuda.as_ref(), b.peak.bytes)
}

/// [`need_bytes`] of a budget's CUDA report and step peak.
fn need_bytes_of(cuda: Option<&CudaReport>, peak_bytes: u64) -> u64 {
    match cuda {
        Some(c) if c.oom.is_some() => c.device_bytes.max(peak_bytes + c.context_bytes),
        Some(c) => c.device_bytes,
        None => peak_bytes,
    }
}

/// Whether a budget fits its spec's GPU (`None` when the spec names none).
pub fn fits(b: &Budget) -> Option<bool> {
    b.cuda
        .as_ref()
        .and_then(|c| c.fits.map(|f| f && c.oom.is_none()))
}

/// The device profile the time model uses for a spec: its GPU (an A100 80 GB when a CUDA spec
/// names none, as `plan` does), or the measured CPU profile.
pub fn profile_for(spec: &Spec) -> DeviceProfile {
    let cuda = matches!(
        spec.runtime,
        Runtime::Pytorch {
            device: TorchDevice::Cuda,
            ..
        }
    );
    if !cuda {
        return DeviceProfile::cpu_default();
    }
    let name = spec
        .cuda
        .as_ref()
        .and_then(|c| c.gpu.as_deref())
        .unwrap_or("a100-80gb");
    crate::gpu::lookup(name)
        .or_else(|_| crate::gpu::lookup("a100-80gb"))
        .map(DeviceProfile::for_gpu)
        .unwrap_or_else(|_| DeviceProfile::cpu_default())
}

/// One recipe evaluated against the card: the spec as given, one lever moved, or the planner's
/// combination.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Lever {
    /// `as given`, `expandable segments`, `recompute`, `microbatch`, `8-bit AdamW`, `cached
    /// latents`, `cached text embeddings`, `memory-efficient attention`, `bf16-mixed`, `LoRA`,
    /// `NF4 base`, `ZeRO`, `combined` (the planner's).
    pub lever: String,
    /// The change from the spec, in words.
    pub change: String,
    /// What `nvidia-smi` would show at the peak: the caching allocator's reserved segments and
    /// the CUDA context (at least the allocated peak and the context where the replay stopped at
    /// the card's capacity).
    pub device_peak_bytes: u64,
    /// The step's peak of requested bytes (what `max_memory_allocated` counts, before rounding).
    pub allocated_peak_bytes: u64,
    pub fits: bool,
    /// Predicted step time on the card's profile (the time model, not a measurement).
    pub step_time_s: f64,
    /// Step time relative to the spec as given, minus one (0.25: 25 % slower).
    pub slowdown: f64,
    /// What it costs beside time (numerics, what is trained), when anything.
    pub note: String,
    /// The spec with the lever pulled (the flags that make it: the CLI's `change_flags`).
    #[serde(skip)]
    pub spec: Spec,
}

/// The levers ranked against one card.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LeverReport {
    /// The spec as given.
    pub base: Lever,
    /// Fitting levers first, by step time (then peak); then the rest by peak.
    pub levers: Vec<Lever>,
    /// The card the spec was evaluated on (catalog name).
    pub gpu: String,
    /// What this process may use on the card (for `oom`: the message's total capacity less
    /// other processes' memory); absent when the spec names no card.
    pub budget_bytes: Option<u64>,
    pub headroom: f64,
    /// `budget × (1 − headroom)`: what a recipe's device peak must stay within.
    pub usable_bytes: Option<u64>,
    /// The time model's profile.
    pub profile: String,
    /// Whether the planner ran (it does when no single lever fits).
    pub planned: bool,
    /// Levers left out because they were not allowed (in the JSON, in words: "LoRA (--allow
    /// lora)").
    pub not_allowed: Vec<NotAllowed>,
}

/// A lever left out because `--allow` did not name it: what it is and the name that allows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotAllowed {
    pub what: &'static str,
    pub allow: &'static str,
}

impl std::fmt::Display for NotAllowed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (--allow {})", self.what, self.allow)
    }
}

impl Serialize for NotAllowed {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Options of [`rank_levers`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LeverOptions {
    /// Memory this process may use: the card's capacity, or the message's total less other
    /// processes'. Without one nothing "fits": levers are ranked by the memory they leave.
    pub budget_bytes: Option<u64>,
    pub headroom: f64,
    /// Which levers that change what is trained may be used (LoRA, a quantized base, bf16-pure,
    /// a precision change). 8-bit AdamW is always tried, and ZeRO over the spec's ranks when it
    /// has several.
    pub allow: Allow,
    /// When no single lever fits, ask the planner for its fastest combination (seconds, where
    /// single levers take milliseconds).
    pub combine: bool,
}

/// A lever's figures: peak on the device ([`need_bytes`]), allocated peak, step time.
type Figures = (u64, u64, f64);

/// Most specs whose [`Figures`] one process keeps (a few bytes each beside the key).
const MAX_EVALUATED: usize = 4_096;

/// The [`Figures`] of the specs evaluated in this process, by spec and profile (each a pure
/// function of both): `estimate` ranks the levers up to three times over the same specs
/// (with the card's budget, without, with LoRA allowed), and its own budget is the base's.
fn evaluated() -> &'static std::sync::Mutex<std::collections::HashMap<String, Figures>> {
    static M: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<String, Figures>>> =
        std::sync::OnceLock::new();
    M.get_or_init(Default::default)
}

fn evaluated_key(spec: &Spec, profile: &DeviceProfile) -> String {
    format!("{spec:?}\n{profile:?}")
}

fn keep(key: String, x: Figures) {
    if let Ok(mut m) = evaluated().lock() {
        if m.len() >= MAX_EVALUATED {
            m.clear();
        }
        m.insert(key, x);
    }
}

/// Peak on the device ([`need_bytes`]), allocated peak and step time of `spec`.
fn evaluate(spec: &Spec, profile: &DeviceProfile) -> Result<Figures, SpecError> {
    let key = evaluated_key(spec, profile);
    if let Some(x) = evaluated().lock().ok().and_then(|m| m.get(&key).copied()) {
        return Ok(x);
    }
    let (cuda, peak_bytes) = crate::estimate::need_inputs(spec)?;
    let x = (
        need_bytes_of(cuda.as_ref(), peak_bytes),
        peak_bytes,
        step_seconds(spec, profile),
    );
    keep(key, x);
    Ok(x)
}

/// `step_time(spec, profile).total_s`, with its table- and graph-built inputs ([`TimeInputs`])
/// made once per process for the specs that differ only in the allocator's settings or the
/// optimizer: neither is read by [`TimeInputs::of`] (parameter table, segment graphs, shape;
/// `step_time_with` reads the optimizer from the spec itself), so the expandable-segments and
/// 8-bit AdamW levers take the base's.
fn step_seconds(spec: &Spec, profile: &DeviceProfile) -> f64 {
    type Kept = std::sync::Mutex<std::collections::HashMap<String, TimeInputs>>;
    static INPUTS: std::sync::OnceLock<Kept> = std::sync::OnceLock::new();
    let mut plain = spec.clone();
    if let Some(c) = plain.cuda.as_mut() {
        c.alloc_conf.clear();
    }
    plain.recipe.optimizer = Optimizer::AdamW;
    let key = evaluated_key(&plain, profile);
    let m = INPUTS.get_or_init(Default::default);
    let inputs = match m.lock().ok().and_then(|m| m.get(&key).copied()) {
        Some(i) => i,
        None => {
            let i = TimeInputs::of(spec, profile);
            if let Ok(mut m) = m.lock() {
                if m.len() >= MAX_EVALUATED {
                    m.clear();
                }
                m.insert(key, i);
            }
            i
        }
    };
    step_time_with(spec, profile, &inputs).total_s
}

/// Take `b`, the budget of `spec`, as that spec's evaluation against `profile`, so that ranking
/// the levers of `spec` does not budget it again.
pub fn remember(spec: &Spec, profile: &DeviceProfile, b: &Budget) {
    keep(
        evaluated_key(spec, profile),
        (need_bytes(b), b.peak_bytes, step_seconds(spec, profile)),
    );
}

fn has_expandable(spec: &Spec) -> bool {
    spec.cuda.as_ref().is_some_and(|c| {
        c.alloc_conf
            .split(',')
            .any(|kv| kv.trim().eq_ignore_ascii_case("expandable_segments:true"))
    })
}

fn with_expandable(spec: &Spec) -> Spec {
    let mut s = spec.clone();
    let c = s.cuda.get_or_insert_with(Default::default);
    let mut parts: Vec<&str> = c
        .alloc_conf
        .split(',')
        .map(str::trim)
        .filter(|kv| !kv.is_empty() && !kv.starts_with("expandable_segments"))
        .collect();
    parts.push("expandable_segments:True");
    c.alloc_conf = parts.join(",");
    s
}

/// Evaluate the spec as given and each single lever against the budget, then (when none fits)
/// the planner's fastest combination; ranked: fitting recipes by predicted step time, then the
/// rest by device peak. Levers that do not apply to the spec (already set) are left out; a lever
/// whose spec does not validate (e.g. a quantized base without LoRA) too.
pub fn rank_levers(
    base: &Spec,
    opts: &LeverOptions,
    profile: &DeviceProfile,
) -> Result<LeverReport, SpecError> {
    if !(0.0..0.9).contains(&opts.headroom) {
        return Err(SpecError::invalid(
            "headroom",
            "out of range; allowed: 0 ≤ headroom < 0.9",
        ));
    }
    let usable = opts
        .budget_bytes
        .map(|b| (b as f64 * (1.0 - opts.headroom)).floor() as u64);
    let ready = evaluate_up_front(base, profile);
    let base_figures = match ready.get(&format!("{base:?}")) {
        Some(Some(x)) => *x,
        _ => evaluate(base, profile)?,
    };
    let mut t = LeverTable {
        base,
        profile,
        usable,
        t0: base_figures.2,
        ready,
        levers: Vec::new(),
        not_allowed: Vec::new(),
    };
    let base_row = t.row("as given", "none".into(), base_figures, "", base);
    // The order levers are pushed in is the order equal-ranked rows keep (the sort is stable).
    if is_cuda(base) && !has_expandable(base) {
        t.push_if_budgets(
            "expandable segments",
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True".into(),
            "segments grow by mapped pages: less fragmentation, no cost in the step",
            with_expandable(base),
        );
    }
    t.recompute();
    t.microbatch();
    for single in SINGLE_LEVERS.iter().filter(|l| (l.applies)(&base.recipe)) {
        let mut s = base.clone();
        (single.apply)(&mut s);
        t.push_if_budgets(single.lever, (single.change)(&base.recipe), single.note, s);
    }
    t.adapters(&opts.allow);
    t.zero();
    let planned = t.combined(opts, base_row.fits)?;
    let LeverTable {
        mut levers,
        not_allowed,
        ..
    } = t;
    levers.sort_by(|a, b| {
        b.fits.cmp(&a.fits).then_with(|| {
            if a.fits {
                a.step_time_s
                    .total_cmp(&b.step_time_s)
                    .then(a.device_peak_bytes.cmp(&b.device_peak_bytes))
            } else {
                a.device_peak_bytes.cmp(&b.device_peak_bytes)
            }
        })
    });
    let gpu = base
        .cuda
        .as_ref()
        .and_then(|c| c.gpu.clone())
        .unwrap_or_default();
    Ok(LeverReport {
        base: base_row,
        levers,
        gpu,
        budget_bytes: opts.budget_bytes,
        headroom: opts.headroom,
        usable_bytes: usable,
        profile: profile.name.clone(),
        planned,
        not_allowed,
    })
}

fn is_cuda(spec: &Spec) -> bool {
    matches!(
        spec.runtime,
        Runtime::Pytorch {
            device: TorchDevice::Cuda,
            ..
        }
    )
}

/// A lever that is one edit of the recipe, tried when it applies (the setting is not already
/// there): its row's name, the change in words and a note.
struct SingleLever {
    lever: &'static str,
    note: &'static str,
    applies: fn(&Recipe) -> bool,
    apply: fn(&mut Spec),
    change: fn(&Recipe) -> String,
}

/// The single-edit levers, in the order their rows are pushed.
const SINGLE_LEVERS: [SingleLever; 5] = [
    SingleLever {
        lever: "attention",
        note: "",
        applies: |r| r.attention == AttentionMode::Materialized,
        apply: |s| s.recipe.attention = AttentionMode::MemoryEfficient,
        change: |_| "memory-efficient attention (SDPA flash / efficient)".into(),
    },
    SingleLever {
        lever: "bf16-mixed",
        note: "autocast: bf16 compute, fp32 master weights",
        applies: |r| r.precision == Precision::Fp32 || r.precision == Precision::Fp64,
        apply: |s| s.recipe.precision = Precision::Bf16Mixed,
        change: |r| format!("precision {} → bf16-mixed", r.precision),
    },
    SingleLever {
        lever: "8-bit AdamW",
        note: "block-wise 8-bit optimizer state: changes the optimizer's numerics",
        applies: |r| r.optimizer == Optimizer::AdamW,
        apply: |s| s.recipe.optimizer = Optimizer::AdamW8bit,
        change: |_| "optimizer adamw → adamw-8bit (bitsandbytes)".into(),
    },
    SingleLever {
        lever: "cached latents",
        note: "",
        applies: |r| r.latents == Latents::Encode,
        apply: |s| s.recipe.latents = Latents::Cached,
        change: |_| "encode the latents beforehand (the VAE leaves the step)".into(),
    },
    SingleLever {
        lever: "cached text embeddings",
        note: "",
        applies: |r| r.text_encoders != TextEncoders::Cached,
        apply: |s| s.recipe.text_encoders = TextEncoders::Cached,
        change: |r| {
            format!(
                "text encoders {} → cached (embeddings computed beforehand)",
                r.text_encoders.name()
            )
        },
    },
];

/// The base and the single levers that depend on no other's result, evaluated side by side up
/// front (`plan::in_parallel`), keyed by the spec's `Debug` text; `None` for a spec that does not
/// validate or budget. The base's own error is left out (the caller evaluates it again to
/// return it). The rest (the smallest recompute and microbatch that fit, the ZeRO stage) are
/// evaluated as they are reached.
fn evaluate_up_front(base: &Spec, profile: &DeviceProfile) -> HashMap<String, Option<Figures>> {
    let mut first: Vec<Spec> = vec![base.clone()];
    // Each under the condition its lever is tried on in `rank_levers`.
    if is_cuda(base) && !has_expandable(base) {
        first.push(with_expandable(base));
    }
    let (r, depth) = (&base.recipe, base.model.depth);
    if r.recompute != Recompute::All && depth > 0 {
        let mut s = base.clone();
        s.recipe.recompute = recompute_first(depth, depth);
        first.push(s);
    }
    for single in SINGLE_LEVERS.iter().filter(|l| (l.applies)(r)) {
        let mut s = base.clone();
        (single.apply)(&mut s);
        first.push(s);
    }
    crate::plan::in_parallel(&first, |s| {
        let r = if std::ptr::eq(s, &first[0]) {
            evaluate(s, profile).map_err(Some)
        } else {
            s.validate()
                .ok()
                .and_then(|_| evaluate(s, profile).ok())
                .ok_or(None)
        };
        (format!("{s:?}"), r)
    })
    .into_iter()
    .filter_map(|(k, r)| match r {
        Ok(x) => Some((k, Some(x))),
        Err(None) => Some((k, None)),
        Err(Some(_)) => None,
    })
    .collect()
}

/// The levers found so far for one base spec, and what each needs to be budgeted and ranked.
struct LeverTable<'a> {
    base: &'a Spec,
    profile: &'a DeviceProfile,
    /// The budget less the headroom.
    usable: Option<u64>,
    /// The base's step time, which each row's slowdown is against.
    t0: f64,
    ready: HashMap<String, Option<Figures>>,
    levers: Vec<Lever>,
    not_allowed: Vec<NotAllowed>,
}

impl LeverTable<'_> {
    fn under(&self, device_bytes: u64) -> bool {
        self.usable.is_some_and(|u| device_bytes <= u)
    }

    fn fits(&self, x: &Figures) -> bool {
        self.under(x.0)
    }

    /// The figures of `s`: from the up-front batch, else budgeted now; `None` when it does not
    /// validate or budget.
    fn try_spec(&self, s: &Spec) -> Option<Figures> {
        if let Some(x) = self.ready.get(&format!("{s:?}")) {
            return *x;
        }
        s.validate().ok()?;
        evaluate(s, self.profile).ok()
    }

    fn row(&self, lever: &str, change: String, (d, a, t): Figures, note: &str, s: &Spec) -> Lever {
        Lever {
            lever: lever.into(),
            change,
            device_peak_bytes: d,
            allocated_peak_bytes: a,
            fits: self.under(d),
            step_time_s: t,
            slowdown: if self.t0 > 0.0 {
                t / self.t0 - 1.0
            } else {
                0.0
            },
            note: note.into(),
            spec: s.clone(),
        }
    }

    fn push_if_budgets(&mut self, lever: &str, change: String, note: &str, s: Spec) {
        if let Some(x) = self.try_spec(&s) {
            let row = self.row(lever, change, x, note, &s);
            self.levers.push(row);
        }
    }

    /// Recompute: every block, then the smallest number of leading blocks that still fits.
    fn recompute(&mut self) {
        let (base, depth) = (self.base, self.base.model.depth);
        if base.recipe.recompute == Recompute::All || depth == 0 {
            return;
        }
        let at = |k: u32| {
            let mut s = base.clone();
            s.recipe.recompute = recompute_first(k, depth);
            self.try_spec(&s).map(|x| (k, x, s))
        };
        let Some(mut best) = at(depth) else {
            return;
        };
        if self.fits(&best.1) && depth > 1 {
            // Smallest k that fits: the peak falls with k, the time rises.
            let (mut lo, mut hi) = (0u32, depth);
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                match at(mid) {
                    Some(p) if self.fits(&p.1) => {
                        hi = mid;
                        best = p;
                    }
                    _ => lo = mid,
                }
            }
        }
        let change = if best.0 >= depth {
            format!("recompute all {depth} blocks (gradient checkpointing)")
        } else {
            format!("recompute the first {} of {depth} blocks", best.0)
        };
        let row = self.row(
            "recompute",
            change,
            best.1,
            "forward runs twice in those blocks",
            &best.2,
        );
        self.levers.push(row);
    }

    /// A smaller microbatch with more accumulation (the same batch): the largest that fits.
    fn microbatch(&mut self) {
        let w = &self.base.workload;
        if w.microbatch <= 1 {
            return;
        }
        let per_rank = w.microbatch.saturating_mul(w.accumulation);
        let mut chosen = None;
        let mut candidates: Vec<u32> = microbatch_candidates(per_rank, w.microbatch)
            .into_iter()
            .filter(|&m| m < w.microbatch)
            .collect();
        if self.usable.is_none() {
            // Nothing fits without a budget: the search ends at the last candidate that
            // budgets, so that one is looked for from the end.
            candidates.reverse();
        }
        for m in candidates {
            let mut s = self.base.clone();
            s.workload.microbatch = m;
            s.workload.accumulation = per_rank / m;
            if let Some(x) = self.try_spec(&s) {
                let done = self.fits(&x) || self.usable.is_none();
                chosen = Some((m, per_rank / m, x, s));
                if done {
                    break;
                }
            }
        }
        if let Some((m, acc, x, s)) = chosen {
            let change = format!(
                "microbatch {} → {m}, accumulation {} → {acc} (same batch)",
                w.microbatch, w.accumulation
            );
            let row = self.row("microbatch", change, x, "", &s);
            self.levers.push(row);
        }
    }

    /// LoRA on a full fine-tune, or an NF4 base under LoRA — each only where `--allow` lets it.
    fn adapters(&mut self, allow: &Allow) {
        let base = self.base;
        if base.recipe.lora.is_none() {
            if !allow.lora {
                self.not_allowed.push(NotAllowed {
                    what: "LoRA",
                    allow: "lora",
                });
                return;
            }
            let mut s = base.clone();
            s.recipe.lora = Some(LoraSpec {
                dtype: Default::default(),
                rank: PLAN_LORA_RANK,
                targets: crate::spec::default_lora_targets(),
                modules: Vec::new(),
            });
            self.push_if_budgets(
                "LoRA",
                format!("train LoRA rank {PLAN_LORA_RANK} adapters, the base frozen"),
                "changes what is trained",
                s,
            );
        } else if base.recipe.base_quant == BaseQuant::None {
            if !allow.quant {
                self.not_allowed.push(NotAllowed {
                    what: "a quantized base",
                    allow: "quant",
                });
                return;
            }
            let mut s = base.clone();
            s.recipe.base_quant = BaseQuant::Nf4;
            self.push_if_budgets(
                "NF4 base",
                "store the frozen base NF4 (QLoRA, bitsandbytes)".into(),
                "changes the frozen weights' numerics",
                s,
            );
        }
    }

    /// ZeRO over the ranks the run already has: the lowest stage that fits (without a budget
    /// the last that budgets, as for the microbatch). It changes neither what is trained nor
    /// the devices.
    fn zero(&mut self) {
        let w = &self.base.workload;
        if w.ranks <= 1 || self.base.recipe.zero_stage != 0 {
            return;
        }
        let stages: [u8; 3] = if self.usable.is_none() {
            [3, 2, 1]
        } else {
            [1, 2, 3]
        };
        let mut chosen = None;
        for stage in stages {
            let mut s = self.base.clone();
            s.recipe.zero_stage = stage;
            if let Some(x) = self.try_spec(&s) {
                let done = self.fits(&x) || self.usable.is_none();
                chosen = Some((stage, x, s));
                if done {
                    break;
                }
            }
        }
        if let Some((stage, x, s)) = chosen {
            let change = format!("ZeRO stage {stage} over the {} ranks", w.ranks);
            let row = self.row("ZeRO", change, x, "adds communication", &s);
            self.levers.push(row);
        }
    }

    /// When asked, with a budget that neither the base nor any single lever meets: the
    /// planner's fastest combination (or its smallest peak). Returns whether it was asked.
    fn combined(&mut self, opts: &LeverOptions, base_fits: bool) -> Result<bool, SpecError> {
        let Some(budget_bytes) = opts.budget_bytes else {
            return Ok(false);
        };
        if !opts.combine || base_fits || self.levers.iter().any(|l| l.fits) {
            return Ok(false);
        }
        let allow = Allow {
            eight_bit: true,
            sharding: self.base.workload.ranks > 1,
            ..opts.allow
        };
        let limits = Limits {
            budget_bytes,
            headroom: opts.headroom,
            allow,
        };
        let p = plan(self.base, &limits, self.profile)?;
        let t = p.predicted_step_time_s;
        self.levers.push(Lever {
            lever: "combined".into(),
            change: p
                .changes
                .iter()
                .map(String::as_str)
                .map(compact_blocks)
                .collect::<Vec<_>>()
                .join("; "),
            device_peak_bytes: p.predicted_peak_bytes,
            allocated_peak_bytes: p.breakdown.total(),
            fits: p.feasible,
            step_time_s: t,
            slowdown: if self.t0 > 0.0 {
                t / self.t0 - 1.0
            } else {
                0.0
            },
            note: if p.feasible {
                "the planner's fastest recipe that fits (ditmem plan)".into()
            } else {
                "the planner's smallest peak: nothing allowed fits".into()
            },
            spec: p.plan,
        });
        Ok(true)
    }
}

/// A planner change with its block list as ranges: "recompute 23 of 57 blocks
/// (blocks:0,1,2,…,21,23)" → "… (blocks 0–21, 23)".
pub(crate) fn compact_blocks(change: &str) -> String {
    let Some(i) = change.find("(blocks:") else {
        return change.to_string();
    };
    let rest = &change[i + "(blocks:".len()..];
    let Some(end) = rest.find(')') else {
        return change.to_string();
    };
    let Ok(mut v) = rest[..end]
        .split(',')
        .map(|t| t.trim().parse::<u32>())
        .collect::<Result<Vec<u32>, _>>()
    else {
        return change.to_string();
    };
    v.sort_unstable();
    v.dedup();
    let mut parts: Vec<String> = Vec::new();
    let mut k = 0;
    while k < v.len() {
        let mut j = k;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        parts.push(if j == k {
            v[k].to_string()
        } else {
            format!("{}–{}", v[k], v[j])
        });
        k = j + 1;
    }
    format!(
        "{}(blocks {}){}",
        &change[..i],
        parts.join(", "),
        &rest[end + 1..]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on(gpu: &str) -> Spec {
        let mut s = Spec::default_xl();
        s.runtime = Runtime::Pytorch {
            device: TorchDevice::Cuda,
            sdpa: crate::spec::SdpaBackend::Auto,
        };
        s.cuda = Some(crate::spec::CudaSpec {
            gpu: Some(gpu.into()),
            alloc_conf: String::new(),
            gpu_memory: None,
        });
        s
    }

    fn options(budget: Option<u64>) -> LeverOptions {
        LeverOptions {
            budget_bytes: budget,
            headroom: 0.0,
            allow: Allow::default(),
            combine: false,
        }
    }

    /// A lever's row is budgeted without the rest of the budget (`estimate::need_inputs`) and
    /// its step time from kept inputs (`step_seconds`): both equal the whole estimate's, on a
    /// card it fits, one it does not (the replay stops at the failing request), with expandable
    /// segments and 8-bit AdamW (whose time inputs are the base's), and without a card.
    #[test]
    fn a_levers_figures_equal_the_whole_estimate() {
        let mut specs = Vec::new();
        for gpu in ["a100-80gb", "t4"] {
            let mut s = on(gpu);
            s.workload.batch = 64;
            s.workload.microbatch = 64;
            specs.push(s.clone());
            specs.push(with_expandable(&s));
            s.recipe.optimizer = Optimizer::AdamW8bit;
            specs.push(s);
        }
        let mut s = on("a100-80gb");
        s.cuda = None;
        specs.push(s);
        let profile = profile_for(&specs[0]);
        let mut ooms = 0;
        for s in &specs {
            let b = crate::estimate::estimate(s).unwrap();
            ooms += usize::from(b.cuda.as_ref().is_some_and(|c| c.oom.is_some()));
            let (cuda, peak) = crate::estimate::need_inputs(s).unwrap();
            assert_eq!(cuda, b.cuda, "{:?}", s.recipe.optimizer);
            assert_eq!(peak, b.peak_bytes);
            assert_eq!(need_bytes_of(cuda.as_ref(), peak), need_bytes(&b));
            for _ in 0..2 {
                assert_eq!(
                    step_seconds(s, &profile),
                    crate::cost::step_time(s, &profile).total_s
                );
                assert_eq!(
                    evaluate(s, &profile).unwrap(),
                    (
                        need_bytes(&b),
                        b.peak_bytes,
                        crate::cost::step_time(s, &profile).total_s
                    )
                );
            }
        }
        assert!(ooms > 0, "no spec ran out of its card");
    }

    #[test]
    fn levers_that_fit_lead_and_each_is_its_own_spec() {
        // DiT-XL/2 at 256², batch 32 on a 24 GB card: activations dominate, recompute fits.
        let s = on("rtx-4090");
        let cap = crate::gpu::lookup("rtx-4090").unwrap().capacity_bytes();
        let r = rank_levers(&s, &options(Some(cap)), &profile_for(&s)).unwrap();
        assert!(!r.base.fits);
        assert!(r.levers[0].fits, "{:?}", r.levers[0].lever);
        let first_miss = r
            .levers
            .iter()
            .position(|l| !l.fits)
            .unwrap_or(r.levers.len());
        assert!(r.levers[first_miss..].iter().all(|l| !l.fits));
        // Fitting levers by time, the rest by what they leave.
        for w in r.levers[..first_miss].windows(2) {
            assert!(w[0].step_time_s <= w[1].step_time_s);
        }
        for w in r.levers[first_miss..].windows(2) {
            assert!(w[0].device_peak_bytes <= w[1].device_peak_bytes);
        }
        for l in &r.levers {
            assert_ne!(l.spec, s, "{} changes the spec", l.lever);
            let again = crate::estimate::estimate(&l.spec).unwrap();
            assert_eq!(need_bytes(&again), l.device_peak_bytes, "{}", l.lever);
        }
    }

    #[test]
    fn without_a_card_nothing_fits_and_the_biggest_saving_leads() {
        let mut s = on("rtx-4090");
        s.cuda = None;
        let r = rank_levers(&s, &options(None), &profile_for(&s)).unwrap();
        assert!(r.levers.iter().all(|l| !l.fits));
        assert_eq!(r.usable_bytes, None);
        let least = r.levers.iter().map(|l| l.device_peak_bytes).min().unwrap();
        assert_eq!(r.levers[0].device_peak_bytes, least);
    }

    #[test]
    fn a_lever_already_pulled_is_not_offered() {
        let mut s = on("h100-sxm");
        s.recipe.recompute = Recompute::All;
        let r = rank_levers(&s, &options(None), &profile_for(&s)).unwrap();
        assert!(r.levers.iter().all(|l| l.lever != "recompute"));
    }
}
