//! Budget against measurement: run a spec on the engine with the counting allocator and hold the
//! budget's timeline against what was measured, boundary by boundary.
//!
//! The compared quantity is the step's own memory: the peak above the live bytes just before the
//! step (after warm-up, so optimizer state exists). What lives before the step is compared
//! separately (`resident`): model states, the batch and candle's per-thread matmul packing
//! buffers are predicted; the trainer's own bookkeeping (parameter names, maps) is not, and shows
//! as the small remaining overhead.

use ditmem_budget::Phase as BudgetPhase;
use ditmem_budget::{AttentionMode, Budget, LoraSpec, Optimizer, Precision, Recompute, Spec};
use serde::Serialize;

use crate::measure::{MemoryProbe, Phase};
use crate::run::{run, Measurement, RunOptions};
use crate::Result;

/// One boundary of the step: predicted and measured live bytes above the step's start.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BoundaryPoint {
    pub phase: String,
    pub label: String,
    pub predicted_bytes: u64,
    pub measured_bytes: u64,
}

/// The comparison of one spec.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Agreement {
    pub name: String,
    /// Predicted peak above the step's start.
    pub predicted_peak_bytes: u64,
    /// Measured peak above the live bytes before the step.
    pub measured_peak_bytes: u64,
    /// predicted / measured − 1.
    pub rel_error: f64,
    /// Per phase (forward, backward, optimizer): (predicted, measured) above the step's start.
    pub phase_peaks: Vec<(String, u64, u64)>,
    /// Live bytes before the step: the budget's model states and batch, and the measurement
    /// (above the process's own heap before the trainer existed).
    pub predicted_resident_bytes: u64,
    pub measured_resident_bytes: u64,
    /// measured − predicted resident: the trainer's bookkeeping.
    pub runtime_overhead_bytes: i64,
    /// Boundaries of the last measured step, when their labels line up.
    pub boundaries: Vec<BoundaryPoint>,
    /// Largest |predicted − measured| over the boundaries, relative to the measured peak.
    pub boundary_max_rel_error: f64,
    pub predicted_peak_label: String,
    pub step_time_s: Vec<f64>,
}

fn budget_phase(p: Phase) -> BudgetPhase {
    match p {
        Phase::Forward => BudgetPhase::Forward,
        Phase::Backward => BudgetPhase::Backward,
        Phase::Optimizer => BudgetPhase::Optimizer,
    }
}

/// Compare a finished measurement with the budget of the same spec.
pub fn compare(name: &str, budget: &Budget, m: &Measurement, baseline: u64) -> Agreement {
    let tl = &budget.timeline;
    let start = tl.events.first().map_or(0, |e| e.total());
    let pred_peak = budget.peak_bytes.saturating_sub(start);
    let meas_peak = m.peak_bytes.saturating_sub(m.resident_bytes);
    let rel = |p: u64, q: u64| {
        if q == 0 {
            0.0
        } else {
            p as f64 / q as f64 - 1.0
        }
    };
    let phase_peaks = [Phase::Forward, Phase::Backward, Phase::Optimizer]
        .into_iter()
        .map(|ph| {
            let bp = budget_phase(ph);
            let pred = tl
                .events
                .iter()
                .filter(|e| e.phase == bp)
                .map(|e| e.total())
                .max()
                .unwrap_or(start)
                .saturating_sub(start);
            let meas = m.phase_peak_bytes.get(ph).saturating_sub(m.resident_bytes);
            (ph.name().to_string(), pred, meas)
        })
        .collect();
    // The engine measures every microbatch; the budget lays out two and says the others repeat
    // the second, so its boundaries are expanded to the whole step (as long as the measured one)
    // and every measured microbatch is held against a prediction.
    let all_events = tl.expanded_events();
    let predicted_boundaries: Vec<_> = all_events
        .iter()
        .filter(|e| !e.inside && e.phase != BudgetPhase::Start && e.phase != BudgetPhase::Encode)
        .collect();
    let mut boundaries = Vec::new();
    if predicted_boundaries.len() == m.timeline.len() {
        for (p, q) in predicted_boundaries.iter().zip(&m.timeline) {
            boundaries.push(BoundaryPoint {
                phase: q.phase.name().to_string(),
                label: q.label.clone(),
                predicted_bytes: p.total().saturating_sub(start),
                measured_bytes: q.live_bytes.saturating_sub(m.resident_bytes),
            });
        }
    }
    let boundary_max_rel_error = boundaries
        .iter()
        .map(|b| {
            (b.predicted_bytes as f64 - b.measured_bytes as f64).abs() / meas_peak.max(1) as f64
        })
        .fold(0.0, f64::max);
    let measured_resident = m.resident_bytes.saturating_sub(baseline);
    Agreement {
        name: name.to_string(),
        predicted_peak_bytes: pred_peak,
        measured_peak_bytes: meas_peak,
        rel_error: rel(pred_peak, meas_peak),
        phase_peaks,
        predicted_resident_bytes: start,
        measured_resident_bytes: measured_resident,
        runtime_overhead_bytes: measured_resident as i64 - start as i64,
        boundaries,
        boundary_max_rel_error,
        predicted_peak_label: budget.peak.label.clone(),
        step_time_s: m.step_times_s.clone(),
    }
}

/// Run `spec` (one warm-up and `steps` measured steps) and compare it with its budget.
pub fn measure_and_compare(
    name: &str,
    spec: &Spec,
    steps: u32,
    probe: &dyn MemoryProbe,
) -> Result<(Agreement, Budget, Measurement)> {
    // The budget of the CPU this runs on (the spec's own `cpu` section, else this process's).
    let spec = &crate::host::resolve(spec);
    let budget = ditmem_budget::estimate(spec)?;
    let baseline = probe.live();
    let opts = RunOptions {
        warmup: 1,
        steps: steps.max(1),
        ..RunOptions::default()
    };
    let m = run(spec, &opts, Some(probe), &mut |_| true)?;
    let a = compare(name, &budget, &m, baseline);
    Ok((a, budget, m))
}

/// Summary over a grid: max and median |pred/meas − 1| and the worst spec.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GridSummary {
    pub specs: usize,
    pub max_abs_rel_error: f64,
    pub median_abs_rel_error: f64,
    pub worst: String,
}

pub fn summarize(results: &[Agreement]) -> GridSummary {
    let mut errs: Vec<(f64, &str)> = results
        .iter()
        .map(|a| (a.rel_error.abs(), a.name.as_str()))
        .collect();
    errs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let median = if errs.is_empty() {
        0.0
    } else if errs.len() % 2 == 1 {
        errs[errs.len() / 2].0
    } else {
        (errs[errs.len() / 2 - 1].0 + errs[errs.len() / 2].0) / 2.0
    };
    let (max, worst) = errs.last().map_or((0.0, ""), |&(e, n)| (e, n));
    GridSummary {
        specs: results.len(),
        max_abs_rel_error: max,
        median_abs_rel_error: median,
        worst: worst.to_string(),
    }
}

/// One (precision, recompute, attention) policy of a grid.
pub(crate) type Policy = (Precision, Recompute, AttentionMode);

/// The policies every diffusers family's grid runs on its base: each precision with the
/// stored, materialized step, and the recompute policies and the memory-efficient attention
/// spread over the precisions.
pub(crate) const FAMILY_POLICIES: [Policy; 11] = {
    use AttentionMode::{Materialized as Mat, MemoryEfficient as Me};
    use Precision as P;
    use Recompute as R;
    [
        (P::Fp32, R::None, Mat),
        (P::Fp32, R::None, Me),
        (P::Fp32, R::All, Mat),
        (P::Fp32, R::AttentionOnly, Mat),
        (P::Bf16Mixed, R::None, Mat),
        (P::Bf16Mixed, R::EveryK(2), Me),
        (P::Fp16Mixed, R::None, Me),
        (P::Fp16Mixed, R::All, Mat),
        (P::Bf16Pure, R::None, Mat),
        (P::Fp64, R::None, Mat),
        (P::Fp64, R::AttentionOnly, Mat),
    ]
};

/// `base` under each policy, named `"{prefix} {precision} recompute {policy} {attention}"`.
pub(crate) fn policy_grid(prefix: &str, base: &Spec, policies: &[Policy]) -> Vec<(String, Spec)> {
    policies
        .iter()
        .map(|(p, rc, a)| {
            let mut s = base.clone();
            s.recipe.precision = *p;
            s.recipe.recompute = rc.clone();
            s.recipe.attention = *a;
            (format!("{prefix} {p} recompute {rc} {}", a.name()), s)
        })
        .collect()
}

/// A grid being written: its specs so far, each named after the grid's prefix, and the base
/// its variations start from.
struct GridBuilder {
    prefix: &'static str,
    base: Spec,
    specs: Vec<(String, Spec)>,
}

impl GridBuilder {
    /// The policy part of a grid on `base`, names prefixed by `prefix` (none when empty).
    fn new(prefix: &'static str, base: Spec, policies: &[Policy]) -> Self {
        let specs = policy_grid(prefix, &base, policies);
        GridBuilder {
            prefix,
            base,
            specs,
        }
    }

    fn name(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{} {name}", self.prefix)
        }
    }

    /// The base changed by `f`.
    fn vary(&mut self, name: &str, f: impl FnOnce(&mut Spec)) -> &mut Self {
        let mut s = self.base.clone();
        f(&mut s);
        self.specs.push((self.name(name), s));
        self
    }

    /// Another model of the family (not the base's), with the base's fp32 EMA and, when given,
    /// `recompute`, on this process's CPU.
    fn model(&mut self, name: &str, mut s: Spec, recompute: Option<Recompute>) -> &mut Self {
        s.recipe.ema.enabled = true;
        if let Some(rc) = recompute {
            s.recipe.recompute = rc;
        }
        self.specs.push((self.name(name), crate::host::resolve(&s)));
        self
    }

    /// The family's LoRA specs on the base ([`lora_specs`]).
    fn lora(&mut self) -> &mut Self {
        self.lora_custom(&DEFAULT_CUSTOM_LORA)
    }

    /// [`Self::lora`] with `custom` the rank-16 spec's modules ([`lora_specs_on`]).
    fn lora_custom(&mut self, custom: &[&str]) -> &mut Self {
        let more = lora_specs_on(self.prefix, &self.base, custom);
        self.specs.extend(more);
        self
    }

    fn finish(self) -> Vec<(String, Spec)> {
        self.specs
    }
}

/// The base of a family's grid: its tiny spec named `name`, with an fp32 EMA as in the training
/// scripts, on this process's CPU.
fn family_base(mut s: Spec, name: &str) -> Spec {
    s.model.name = name.into();
    s.recipe.ema.enabled = true;
    crate::host::resolve(&s)
}

/// `n` samples in one microbatch.
fn batch(s: &mut Spec, n: u32) {
    s.workload.batch = n;
    s.workload.microbatch = n;
}

fn memory_efficient(s: &mut Spec) {
    s.recipe.attention = AttentionMode::MemoryEfficient;
}

fn text_tokens(s: &mut Spec, tokens: &[u32]) {
    s.workload.text_tokens = Some(tokens.to_vec());
}

/// 8 samples in 4 microbatches of 2, bf16-mixed (every grid's accumulation spec).
const ACCUMULATION: &str = "batch 8 = 2 × accumulation 4, bf16-mixed";
fn accumulation(s: &mut Spec) {
    s.workload.batch = 8;
    s.workload.microbatch = 2;
    s.workload.accumulation = 4;
    s.recipe.precision = Precision::Bf16Mixed;
}

/// A 256×256 image (256 tokens at patch 2) in one microbatch of 2, memory-efficient attention.
const LARGER_IMAGE: &str = "256×256 (256 tokens), batch 2, memory-efficient";
fn larger_image(s: &mut Spec) {
    s.workload.height = 256;
    s.workload.width = 256;
    batch(s, 2);
    memory_efficient(s);
}

/// `tokens` text tokens (per encoder), memory-efficient attention.
fn text_tokens_me(tokens: &'static [u32]) -> impl FnOnce(&mut Spec) {
    move |s| {
        text_tokens(s, tokens);
        memory_efficient(s);
    }
}

/// `tokens` text tokens (per encoder) in one microbatch of 2, memory-efficient attention.
fn text_tokens_batch2_me(tokens: &'static [u32]) -> impl FnOnce(&mut Spec) {
    move |s| {
        text_tokens(s, tokens);
        batch(s, 2);
        memory_efficient(s);
    }
}

const SGD: &str = "SGD, no EMA";
fn sgd_without_ema(s: &mut Spec) {
    s.recipe.optimizer = Optimizer::Sgd;
    s.recipe.ema.enabled = false;
}

/// One sample, the listed blocks recomputed: named `"batch 1, blocks:{list}"`.
fn one_sample_blocks(g: &mut GridBuilder, blocks: &[u32]) {
    let rc = Recompute::Blocks(blocks.to_vec());
    g.vary(&format!("batch 1, {rc}"), |s| {
        batch(s, 1);
        s.recipe.recompute = rc;
    });
}

fn lora(rank: u32, modules: &[&str]) -> Option<LoraSpec> {
    Some(LoraSpec {
        dtype: Default::default(),
        rank,
        targets: ditmem_budget::default_lora_targets(),
        modules: modules.iter().map(|m| m.to_string()).collect(),
    })
}

/// The spec the grid varies: [`Spec::small`] with an fp32 EMA, as in DiT's training script, on
/// this process's CPU ([`crate::host::resolve`]).
pub(crate) fn grid_base() -> Spec {
    family_base(Spec::small(), "grid-d2-h64")
}

/// The agreement grid: precision × recompute × attention on a depth-3 base, then batch
/// splits, resolution and patch, depth, LoRA, optimizer and EMA variations. Every spec runs in
/// about a second in release on 2 cores.
pub fn grid() -> Vec<(String, Spec)> {
    use AttentionMode as A;
    use Precision as P;
    use Recompute as R;
    let mut policies = Vec::new();
    for p in [P::Fp64, P::Fp32, P::Bf16Mixed, P::Fp16Mixed] {
        for rc in [R::None, R::EveryK(2), R::All, R::AttentionOnly] {
            for a in [A::Materialized, A::MemoryEfficient] {
                // Attention-only recompute is the materialized attention's policy.
                if rc != R::AttentionOnly || a == A::Materialized {
                    policies.push((p, rc.clone(), a));
                }
            }
        }
    }
    let base = grid_base();
    let mut d3 = base.clone();
    d3.model.depth = 3;
    let mut specs = policy_grid("d3", &d3, &policies);
    let mut g = GridBuilder {
        prefix: "",
        base,
        specs: Vec::new(),
    };
    g.vary("bf16-pure", |s| s.recipe.precision = P::Bf16Pure)
        .vary("batch 8 = 4 × accumulation 2", |s| {
            s.workload.batch = 8;
            s.workload.accumulation = 2;
        })
        .vary(ACCUMULATION, accumulation)
        .vary("batch 1", |s| batch(s, 1))
        .vary("256×256 patch 4 (64 tokens)", |s| {
            s.workload.height = 256;
            s.workload.width = 256;
            s.model.patch = 4;
        })
        .vary("256×256 patch 2 (256 tokens), batch 2", |s| {
            s.workload.height = 256;
            s.workload.width = 256;
            batch(s, 2);
        })
        .vary("128×256 patch 2 (128 tokens), memory-efficient", |s| {
            s.workload.width = 256;
            memory_efficient(s);
        })
        .vary("hidden 128, 8 heads, depth 4, every-2", |s| {
            s.model.hidden = 128;
            s.model.heads = 8;
            s.model.depth = 4;
            s.recipe.recompute = R::EveryK(2);
        })
        .vary("LoRA rank 8 on qkv,proj,fc1,fc2", |s| {
            s.recipe.lora = lora(8, &[])
        })
        .vary("LoRA rank 4 on all, bf16-mixed, recompute all", |s| {
            s.recipe.lora = Some(LoraSpec {
                dtype: Default::default(),
                rank: 4,
                targets: ditmem_budget::LoraTarget::ALL.to_vec(),
                modules: Vec::new(),
            });
            s.recipe.precision = P::Bf16Mixed;
            s.recipe.recompute = R::All;
        })
        .vary(SGD, sgd_without_ema)
        .vary("EMA in bf16", |s| {
            s.recipe.ema.dtype = ditmem_budget::Dtype::Bf16
        })
        .vary("learn_sigma off, v-prediction", |s| {
            s.model.learn_sigma = false;
            s.recipe.prediction = ditmem_budget::Prediction::V;
        })
        .vary("blocks:1 of depth 4", |s| {
            s.model.depth = 4;
            s.recipe.recompute = R::Blocks(vec![1]);
        });
    specs.extend(g.finish());
    specs
}

/// The PixArt grid's base: [`ditmem_engine::families::pixart::tiny_spec`] (2 blocks of 4 × 16-wide heads,
/// 64 image tokens, 13 caption tokens of width 32, batch 4) with an fp32 EMA, on this process's
/// CPU.
pub fn pixart_grid_base() -> Result<Spec> {
    Ok(family_base(
        ditmem_engine::families::pixart::tiny_spec(2, 4, 13)?,
        "pixart-d2-h64",
    ))
}

/// The PixArt agreement grid: the family policies on the base, then accumulation, odd caption
/// lengths (1, 77 and 300 tokens: more keys than a streaming block; 300 in both attention
/// modes), a larger image, SGD without EMA, a block list and a deeper and wider model. Each
/// spec runs in well under a second in release on 2 cores.
pub fn pixart_grid() -> Result<Vec<(String, Spec)>> {
    let mut g = GridBuilder::new("pixart", pixart_grid_base()?, &FAMILY_POLICIES);
    g.vary(ACCUMULATION, accumulation)
        .vary("1 caption token", |s| text_tokens(s, &[1]))
        .vary("77 caption tokens, memory-efficient", text_tokens_me(&[77]))
        .vary(
            "300 caption tokens, batch 2, memory-efficient",
            text_tokens_batch2_me(&[300]),
        )
        .vary("300 caption tokens, batch 2", |s| {
            text_tokens(s, &[300]);
            batch(s, 2);
        })
        .vary(LARGER_IMAGE, larger_image)
        .vary(SGD, sgd_without_ema);
    one_sample_blocks(&mut g, &[1]);
    g.model(
        "4 blocks × 6 heads (hidden 96), 19 tokens, every-2",
        ditmem_engine::families::pixart::tiny_spec(4, 6, 19)?,
        Some(Recompute::EveryK(2)),
    );
    g.lora();
    Ok(g.finish())
}

/// The SD3 grid's base: [`ditmem_engine::families::sd3::tiny_spec`] (3 joint blocks of 4 × 16-wide
/// heads, hidden 64, 16 latent channels), 5 + 8 caption tokens, EMA on.
pub fn sd3_grid_base() -> Result<Spec> {
    Ok(family_base(
        ditmem_engine::families::sd3::tiny_spec(3, 4, false, 5, 8)?,
        "sd3-d3-h64",
    ))
}

/// The SD3 agreement grid: the family policies on the base, then accumulation, odd caption
/// lengths (1 + 1 … 77 + 77: more keys than a streaming block), SGD without EMA, a block list,
/// q/k RMSNorm (SD3.5), one block (only the `context_pre_only` one), a deeper, wider model and
/// SD3.5's dual-attention blocks.
/// Each spec runs in well under a second in release on 2 cores.
pub fn sd3_grid() -> Result<Vec<(String, Spec)>> {
    use ditmem_engine::families::sd3::{tiny_dual_spec, tiny_spec};
    use Recompute as R;
    let mut g = GridBuilder::new("sd3", sd3_grid_base()?, &FAMILY_POLICIES);
    g.vary(ACCUMULATION, accumulation)
        .vary("1 + 1 caption tokens", |s| text_tokens(s, &[1, 1]))
        .vary(
            "77 + 77 caption tokens, memory-efficient",
            text_tokens_me(&[77, 77]),
        )
        .vary("77 + 77 caption tokens, batch 2", |s| {
            text_tokens(s, &[77, 77]);
            batch(s, 2);
        })
        .vary(SGD, sgd_without_ema);
    one_sample_blocks(&mut g, &[1, 2]);
    let mut qk_bf16 = tiny_spec(3, 4, true, 7, 12)?;
    qk_bf16.recipe.precision = Precision::Bf16Mixed;
    g.model(
        "q/k RMSNorm (SD3.5), every-2",
        tiny_spec(3, 4, true, 7, 12)?,
        Some(R::EveryK(2)),
    )
    .model("q/k RMSNorm, bf16-mixed", qk_bf16, Some(R::None))
    .model(
        "1 block (context_pre_only only)",
        tiny_spec(1, 4, false, 7, 12)?,
        Some(R::None),
    )
    .model(
        "4 blocks × 6 heads (hidden 96), q/k RMSNorm, all",
        tiny_spec(4, 6, true, 7, 12)?,
        Some(R::All),
    );
    // SD3.5's dual-attention blocks (attn2, 9-chunk norm1): blocks 0 and 2 of 3, so a stored
    // dual block, a plain one and a dual last (context_pre_only) block; then SD3.5-medium's
    // layout (dual first) under bf16-mixed and recompute.
    let mut dual_bf16 = tiny_dual_spec(3, 4, &[0, 1], 7, 12)?;
    dual_bf16.recipe.precision = Precision::Bf16Mixed;
    g.model(
        "dual attention [0, 2] (SD3.5), q/k RMSNorm",
        tiny_dual_spec(3, 4, &[0, 2], 7, 12)?,
        Some(R::None),
    )
    .model(
        "dual attention [0, 1] (SD3.5-medium's layout), bf16-mixed, every-2",
        dual_bf16,
        Some(R::EveryK(2)),
    );
    g.lora();
    // LoRA on the dual-attention model, memory-efficient attention: the defaults leave attn2
    // frozen (its input released, its output kept for the attention's backward); the custom
    // targets adapt attn2's to_q and to_v too.
    let mut dual = family_base(tiny_dual_spec(3, 4, &[0, 2], 7, 12)?, "sd3.5-dual");
    memory_efficient(&mut dual);
    g.specs
        .extend(lora_specs("sd3 dual [0, 2], memory-efficient,", &dual));
    Ok(g.finish())
}

/// The Flux grid's base: [`ditmem_engine::families::flux::tiny_spec`] (one double-stream and two
/// single-stream blocks of 4 × 16-wide heads, 64 image tokens, 13 T5 tokens of width 32, a
/// pooled width of 24, the guidance embedder, batch 4) with an fp32 EMA, on this process's CPU.
pub fn flux_grid_base() -> Result<Spec> {
    Ok(family_base(
        ditmem_engine::families::flux::tiny_spec(1, 2, 4, 13, true)?,
        "flux-d1s2-h64",
    ))
}

/// The Flux agreement grid: the family policies on the base, then accumulation, odd T5
/// lengths (1, 77 and 300 tokens; the CLIP prompt stays 77), a larger image, SGD without EMA,
/// a block list across the two kinds of block, no guidance embedder, and a deeper, wider model.
pub fn flux_grid() -> Result<Vec<(String, Spec)>> {
    use ditmem_engine::families::flux::tiny_spec;
    let mut g = GridBuilder::new("flux", flux_grid_base()?, &FAMILY_POLICIES);
    g.vary(ACCUMULATION, accumulation)
        .vary("1 T5 token", |s| text_tokens(s, &[77, 1]))
        .vary("77 T5 tokens, memory-efficient", text_tokens_me(&[77, 77]))
        .vary(
            "300 T5 tokens, batch 2, memory-efficient",
            text_tokens_batch2_me(&[77, 300]),
        )
        .vary(LARGER_IMAGE, larger_image)
        .vary(SGD, sgd_without_ema);
    one_sample_blocks(&mut g, &[0, 1]);
    g.model(
        "no guidance embedder (schnell-like)",
        tiny_spec(1, 2, 4, 13, false)?,
        None,
    )
    .model(
        "2 + 3 blocks × 6 heads (hidden 96), 19 tokens, every-2",
        tiny_spec(2, 3, 6, 19, true)?,
        Some(Recompute::EveryK(2)),
    );
    g.lora();
    Ok(g.finish())
}

/// The Sana grid's base: [`ditmem_engine::families::sana::tiny_spec`] (2 blocks of 4 × 16-wide heads,
/// cross-attention 2 × 32 wide, Mix-FFN 160 wide, 64 image tokens on an 8×8 grid, 13 caption
/// tokens of width 48, batch 4) with an fp32 EMA, on this process's CPU.
pub(crate) fn sana_grid_base() -> Result<Spec> {
    Ok(family_base(
        ditmem_engine::families::sana::tiny_spec(2, 4, 13)?,
        "sana-d2-h64",
    ))
}

/// The Sana agreement grid: the family policies but fp64 attention-only (the attention modes
/// are the softmax cross-attention's; the linear self-attention has one form) on the base,
/// then accumulation, odd caption lengths, an odd and non-square token grid (7×5: the
/// depthwise conv's borders), SGD without EMA, a block list, LoRA (the scripts' default
/// targets; and the Mix-FFN-free list `to_q, to_v` on bias-less projections) and a deeper
/// model with biased q/k/v.
pub fn sana_grid() -> Result<Vec<(String, Spec)>> {
    let policies = &FAMILY_POLICIES[..FAMILY_POLICIES.len() - 1];
    let mut g = GridBuilder::new("sana", sana_grid_base()?, policies);
    g.vary(ACCUMULATION, accumulation)
        .vary("1 caption token", |s| text_tokens(s, &[1]))
        .vary(
            "300 caption tokens, batch 2, memory-efficient",
            text_tokens_batch2_me(&[300]),
        )
        .vary("224×160 (7×5 tokens), memory-efficient", |s| {
            s.workload.height = 224;
            s.workload.width = 160;
            memory_efficient(s);
        })
        .vary(SGD, sgd_without_ema);
    one_sample_blocks(&mut g, &[1]);
    g.vary("LoRA r4 (to_k, to_q, to_v, to_out.0), bf16-mixed", |s| {
        s.recipe.precision = Precision::Bf16Mixed;
        s.recipe.lora = lora(4, &[]);
    })
    .vary("LoRA r8 (to_q, to_v), fp32, recompute all", |s| {
        s.recipe.recompute = Recompute::All;
        s.recipe.lora = lora(8, &["to_q", "to_v"]);
    });
    let mut cfg = ditmem_engine::families::sana::tiny_config(4, 6);
    cfg.insert("attention_bias".into(), serde_json::Value::Bool(true));
    let mut deep = ditmem_budget::denoiser::with_family(Spec::small(), "sana-d4-h96", cfg)?;
    deep.workload.height = 256;
    deep.workload.width = 256;
    text_tokens(&mut deep, &[19]);
    deep.recipe.attention = AttentionMode::Materialized;
    g.model(
        "4 blocks × 6 heads (hidden 96), biased q/k/v, 19 tokens, every-2",
        deep,
        Some(Recompute::EveryK(2)),
    );
    Ok(g.finish())
}

/// The diffusers DiT grid's base: [`ditmem_engine::families::dit_diffusers::tiny_spec`]
/// (`DiTTransformer2DModel`, 2 blocks of 4 × 16-wide heads, 64 tokens, batch 4) with an fp32
/// EMA, on this process's CPU.
pub(crate) fn dit_diffusers_grid_base() -> Result<Spec> {
    Ok(family_base(
        ditmem_engine::families::dit_diffusers::tiny_spec(2, 4)?,
        "dit-diffusers-d2-h64",
    ))
}

/// The diffusers DiT agreement grid: the family policies on the base, then accumulation, a
/// larger image, SGD without EMA, a block list, one block, a deeper and wider model, and LoRA
/// (the defaults, and attention, feed-forward and output-side modules; the timestep embedders
/// are refused, see `DitdGeom::new`). Each spec runs in well under a second in release on 2
/// cores.
pub fn dit_diffusers_grid() -> Result<Vec<(String, Spec)>> {
    use ditmem_engine::families::dit_diffusers::tiny_spec;
    use Recompute as R;
    let mut g = GridBuilder::new(
        "dit-diffusers",
        dit_diffusers_grid_base()?,
        &FAMILY_POLICIES,
    );
    g.vary(ACCUMULATION, accumulation)
        .vary(LARGER_IMAGE, larger_image)
        .vary(SGD, sgd_without_ema);
    one_sample_blocks(&mut g, &[1]);
    g.model("1 block × 2 heads (hidden 32)", tiny_spec(1, 2)?, None);
    g.model(
        "4 blocks × 6 heads (hidden 96), every-2",
        tiny_spec(4, 6)?,
        Some(R::EveryK(2)),
    );
    g.lora_custom(&["to_q", "to_v", "ff.net.2", "norm1.linear", "proj_out_1"]);
    Ok(g.finish())
}

/// The Wan grid's base: [`ditmem_engine::families::wan::tiny_spec`] (2 blocks of 2 × 16-wide heads,
/// 64×64 pixels at 9 frames: 3 latent frames of 4×4 tokens, 48 video tokens, 13 umT5 tokens of
/// width 32, batch 4) with an fp32 EMA, on this process's CPU.
pub fn wan_grid_base() -> Result<Spec> {
    let mut s = ditmem_engine::families::wan::tiny_spec(2, 2, 9, 13)?;
    s.workload.height = 64;
    s.workload.width = 64;
    Ok(family_base(s, "wan-d2-h32"))
}

/// The Wan agreement grid: the family policies on the base, then accumulation, odd token
/// counts (1 and 77 umT5 tokens, one latent frame, an odd 5×3 token grid, 5 latent frames),
/// SGD without EMA, a block list and a wider and deeper model.
pub fn wan_grid() -> Result<Vec<(String, Spec)>> {
    let mut g = GridBuilder::new("wan", wan_grid_base()?, &FAMILY_POLICIES);
    g.vary(ACCUMULATION, accumulation)
        .vary("1 umT5 token", |s| text_tokens(s, &[1]))
        .vary("77 umT5 tokens, memory-efficient", text_tokens_me(&[77]))
        .vary("1 frame (an image)", |s| s.workload.frames = 1)
        .vary("80×48 (5×3 tokens a frame), 5 frames, bf16-mixed", |s| {
            s.workload.height = 80;
            s.workload.width = 48;
            s.workload.frames = 5;
            s.recipe.precision = Precision::Bf16Mixed;
        })
        .vary(
            "17 frames (5 latent frames, 80 tokens), batch 2, memory-efficient",
            |s| {
                s.workload.frames = 17;
                batch(s, 2);
                memory_efficient(s);
            },
        )
        .vary(SGD, sgd_without_ema);
    one_sample_blocks(&mut g, &[1]);
    let mut deep = ditmem_engine::families::wan::tiny_spec(4, 4, 5, 19)?;
    deep.workload.height = 64;
    deep.workload.width = 64;
    g.model(
        "4 blocks × 4 heads (hidden 64), 5 frames, 19 tokens, every-2",
        deep,
        Some(Recompute::EveryK(2)),
    );
    g.lora();
    Ok(g.finish())
}

/// A family grid's LoRA specs on its `base`: the family's default modules (the diffusers
/// script's, `ditmem_budget::denoiser::lora_modules`) at rank 4 under bf16-mixed and at rank 8
/// under fp32 with every block recomputed, and a custom list at rank 16 that reaches the embed
/// and output sides too (`linear_1`: the timestep and caption MLPs; `proj_out`: the output
/// projection, and Flux's single blocks' own) under fp16-mixed with the attention-only policy.
pub fn lora_specs(family: &str, base: &Spec) -> Vec<(String, Spec)> {
    lora_specs_on(family, base, &DEFAULT_CUSTOM_LORA)
}

/// The rank-16 LoRA spec's modules of [`lora_specs`].
const DEFAULT_CUSTOM_LORA: [&str; 4] = ["to_q", "to_v", "linear_1", "proj_out"];

/// [`lora_specs`] with `custom` the rank-16 spec's modules (diffusers' DiT has no `linear_1`:
/// its own list reaches its feed-forward, norm and output sides).
fn lora_specs_on(family: &str, base: &Spec, custom: &[&str]) -> Vec<(String, Spec)> {
    use ditmem_budget::{Precision as P, Recompute as R};
    let custom_name = format!(
        "LoRA r16 ({}), fp16-mixed, attention-only",
        custom.join(", ")
    );
    [
        (
            "LoRA r4 (defaults), bf16-mixed".to_string(),
            P::Bf16Mixed,
            R::None,
            lora(4, &[]),
        ),
        (
            "LoRA r8 (defaults), fp32, recompute all".to_string(),
            P::Fp32,
            R::All,
            lora(8, &[]),
        ),
        (
            custom_name,
            P::Fp16Mixed,
            R::AttentionOnly,
            lora(16, custom),
        ),
    ]
    .into_iter()
    .map(|(name, p, rc, l)| {
        let mut s = base.clone();
        s.recipe.precision = p;
        s.recipe.recompute = rc;
        s.recipe.lora = l;
        (format!("{family} {name}"), s)
    })
    .collect()
}
