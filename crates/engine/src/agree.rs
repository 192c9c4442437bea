//! Budget against measurement: run a spec on the engine with the counting allocator and hold the
//! budget's timeline against what was measured, boundary by boundary.
//!
//! The compared quantity is the step's own memory: the peak above the live bytes just before the
//! step (after warm-up, so optimizer state exists). What lives before the step is compared
//! separately (`resident`): model states, the batch and candle's per-thread matmul packing
//! buffers are predicted; the trainer's own bookkeeping (parameter names, maps) is not, and shows
//! as the small remaining overhead.

use ditmem_budget::Phase as BudgetPhase;
use ditmem_budget::{Budget, Spec};
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

/// The spec the grid varies: [`Spec::small`] with an fp32 EMA, as in DiT's training script, on
/// this process's CPU ([`crate::host::resolve`]).
pub fn grid_base() -> Spec {
    let mut s = Spec::small();
    s.model.name = "grid-d2-h64".into();
    s.recipe.ema.enabled = true;
    crate::host::resolve(&s)
}

/// The agreement grid: precision × recompute × attention on the base, then batch splits,
/// resolution and patch, depth, LoRA, optimizer and EMA variations. Every spec runs in about a
/// second in release on 2 cores.
pub fn grid() -> Vec<(String, Spec)> {
    use ditmem_budget::{AttentionMode as A, LoraSpec, Optimizer, Precision as P, Recompute as R};
    let mut out = Vec::new();
    let base = grid_base();
    for p in [P::Fp64, P::Fp32, P::Bf16Mixed, P::Fp16Mixed] {
        for rc in [R::None, R::EveryK(2), R::All, R::AttentionOnly] {
            for a in [A::Materialized, A::MemoryEfficient] {
                if rc == R::AttentionOnly && a == A::MemoryEfficient {
                    continue;
                }
                let mut s = base.clone();
                s.model.depth = 3;
                s.recipe.precision = p;
                s.recipe.recompute = rc.clone();
                s.recipe.attention = a;
                out.push((format!("d3 {p} recompute {rc} {}", a.name()), s));
            }
        }
    }
    let mut add = |name: &str, f: &dyn Fn(&mut Spec)| {
        let mut s = base.clone();
        f(&mut s);
        out.push((name.to_string(), s));
    };
    add("bf16-pure", &|s| s.recipe.precision = P::Bf16Pure);
    add("batch 8 = 4 × accumulation 2", &|s| {
        s.workload.batch = 8;
        s.workload.accumulation = 2;
    });
    add("batch 8 = 2 × accumulation 4, bf16-mixed", &|s| {
        s.workload.batch = 8;
        s.workload.microbatch = 2;
        s.workload.accumulation = 4;
        s.recipe.precision = P::Bf16Mixed;
    });
    add("batch 1", &|s| {
        s.workload.batch = 1;
        s.workload.microbatch = 1;
    });
    add("256×256 patch 4 (64 tokens)", &|s| {
        s.workload.height = 256;
        s.workload.width = 256;
        s.model.patch = 4;
    });
    add("256×256 patch 2 (256 tokens), batch 2", &|s| {
        s.workload.height = 256;
        s.workload.width = 256;
        s.workload.batch = 2;
        s.workload.microbatch = 2;
    });
    add("128×256 patch 2 (128 tokens), memory-efficient", &|s| {
        s.workload.width = 256;
        s.recipe.attention = A::MemoryEfficient;
    });
    add("hidden 128, 8 heads, depth 4, every-2", &|s| {
        s.model.hidden = 128;
        s.model.heads = 8;
        s.model.depth = 4;
        s.recipe.recompute = R::EveryK(2);
    });
    add("LoRA rank 8 on qkv,proj,fc1,fc2", &|s| {
        s.recipe.lora = Some(LoraSpec {
            rank: 8,
            targets: ditmem_budget::default_lora_targets(),
            modules: Vec::new(),
        })
    });
    add("LoRA rank 4 on all, bf16-mixed, recompute all", &|s| {
        s.recipe.lora = Some(LoraSpec {
            rank: 4,
            targets: ditmem_budget::LoraTarget::ALL.to_vec(),
            modules: Vec::new(),
        });
        s.recipe.precision = P::Bf16Mixed;
        s.recipe.recompute = R::All;
    });
    add("SGD, no EMA", &|s| {
        s.recipe.optimizer = Optimizer::Sgd;
        s.recipe.ema.enabled = false;
    });
    add("EMA in bf16", &|s| {
        s.recipe.ema.dtype = ditmem_budget::Dtype::Bf16
    });
    add("learn_sigma off, v-prediction", &|s| {
        s.model.learn_sigma = false;
        s.recipe.prediction = ditmem_budget::Prediction::V;
    });
    add("blocks:1 of depth 4", &|s| {
        s.model.depth = 4;
        s.recipe.recompute = R::Blocks(vec![1]);
    });
    out
}

/// The PixArt grid's base: [`crate::families::pixart::tiny_spec`] (2 blocks of 4 × 16-wide heads,
/// 64 image tokens, 13 caption tokens of width 32, batch 4) with an fp32 EMA, on this process's
/// CPU.
pub fn pixart_grid_base() -> Result<Spec> {
    let mut s = crate::families::pixart::tiny_spec(2, 4, 13)?;
    s.model.name = "pixart-d2-h64".into();
    s.recipe.ema.enabled = true;
    Ok(crate::host::resolve(&s))
}

/// The PixArt agreement grid: precisions × recompute policies × attention modes on the base,
/// then accumulation, odd caption lengths (1, 77 and 300 tokens: more keys than a streaming
/// block; 300 in both attention modes), a deeper and wider model, SGD without EMA and a block
/// list. Each spec runs in well under a second in release on 2 cores.
pub fn pixart_grid() -> Result<Vec<(String, Spec)>> {
    use ditmem_budget::{AttentionMode as A, Optimizer, Precision as P, Recompute as R};
    let base = pixart_grid_base()?;
    let mut out = Vec::new();
    for (p, rc, a) in [
        (P::Fp32, R::None, A::Materialized),
        (P::Fp32, R::None, A::MemoryEfficient),
        (P::Fp32, R::All, A::Materialized),
        (P::Fp32, R::AttentionOnly, A::Materialized),
        (P::Bf16Mixed, R::None, A::Materialized),
        (P::Bf16Mixed, R::EveryK(2), A::MemoryEfficient),
        (P::Fp16Mixed, R::None, A::MemoryEfficient),
        (P::Fp16Mixed, R::All, A::Materialized),
        (P::Bf16Pure, R::None, A::Materialized),
        (P::Fp64, R::None, A::Materialized),
        (P::Fp64, R::AttentionOnly, A::Materialized),
    ] {
        let mut s = base.clone();
        s.recipe.precision = p;
        s.recipe.recompute = rc.clone();
        s.recipe.attention = a;
        out.push((format!("pixart {p} recompute {rc} {}", a.name()), s));
    }
    let mut add = |name: &str, f: &dyn Fn(&mut Spec)| {
        let mut s = base.clone();
        f(&mut s);
        out.push((format!("pixart {name}"), s));
    };
    add("batch 8 = 2 × accumulation 4, bf16-mixed", &|s| {
        s.workload.batch = 8;
        s.workload.microbatch = 2;
        s.workload.accumulation = 4;
        s.recipe.precision = P::Bf16Mixed;
    });
    add("1 caption token", &|s| {
        s.workload.text_tokens = Some(vec![1])
    });
    add("77 caption tokens, memory-efficient", &|s| {
        s.workload.text_tokens = Some(vec![77]);
        s.recipe.attention = A::MemoryEfficient;
    });
    add("300 caption tokens, batch 2, memory-efficient", &|s| {
        s.workload.text_tokens = Some(vec![300]);
        s.workload.batch = 2;
        s.workload.microbatch = 2;
        s.recipe.attention = A::MemoryEfficient;
    });
    add("300 caption tokens, batch 2", &|s| {
        s.workload.text_tokens = Some(vec![300]);
        s.workload.batch = 2;
        s.workload.microbatch = 2;
    });
    add("256×256 (256 tokens), batch 2, memory-efficient", &|s| {
        s.workload.height = 256;
        s.workload.width = 256;
        s.workload.batch = 2;
        s.workload.microbatch = 2;
        s.recipe.attention = A::MemoryEfficient;
    });
    add("SGD, no EMA", &|s| {
        s.recipe.optimizer = Optimizer::Sgd;
        s.recipe.ema.enabled = false;
    });
    add("batch 1, blocks:1", &|s| {
        s.workload.batch = 1;
        s.workload.microbatch = 1;
        s.recipe.recompute = R::Blocks(vec![1]);
    });
    let mut deep = crate::families::pixart::tiny_spec(4, 6, 19)?;
    deep.recipe.ema.enabled = true;
    deep.recipe.recompute = R::EveryK(2);
    out.push((
        "pixart 4 blocks × 6 heads (hidden 96), 19 tokens, every-2".into(),
        crate::host::resolve(&deep),
    ));
    out.extend(lora_specs("pixart", &base));
    Ok(out)
}

/// The SD3 grid's base: [`crate::families::sd3::tiny_spec`] (3 joint blocks of 4 × 16-wide
/// heads, hidden 64, 16 latent channels), 5 + 8 caption tokens, EMA on.
pub fn sd3_grid_base() -> Result<Spec> {
    let mut s = crate::families::sd3::tiny_spec(3, 4, false, 5, 8)?;
    s.model.name = "sd3-d3-h64".into();
    s.recipe.ema.enabled = true;
    Ok(crate::host::resolve(&s))
}

/// The SD3 agreement grid: precisions × recompute policies × attention modes on the base, then
/// q/k RMSNorm (SD3.5), accumulation, odd caption lengths (1 + 0 … 77 + 77: more keys than a
/// streaming block), one block (only the `context_pre_only` one), SGD without EMA and a block
/// list. Each spec runs in well under a second in release on 2 cores.
pub fn sd3_grid() -> Result<Vec<(String, Spec)>> {
    use ditmem_budget::{AttentionMode as A, Optimizer, Precision as P, Recompute as R};
    let base = sd3_grid_base()?;
    let mut out = Vec::new();
    for (p, rc, a) in [
        (P::Fp32, R::None, A::Materialized),
        (P::Fp32, R::None, A::MemoryEfficient),
        (P::Fp32, R::All, A::Materialized),
        (P::Fp32, R::AttentionOnly, A::Materialized),
        (P::Bf16Mixed, R::None, A::Materialized),
        (P::Bf16Mixed, R::EveryK(2), A::MemoryEfficient),
        (P::Fp16Mixed, R::None, A::MemoryEfficient),
        (P::Fp16Mixed, R::All, A::Materialized),
        (P::Bf16Pure, R::None, A::Materialized),
        (P::Fp64, R::None, A::Materialized),
        (P::Fp64, R::AttentionOnly, A::Materialized),
    ] {
        let mut s = base.clone();
        s.recipe.precision = p;
        s.recipe.recompute = rc.clone();
        s.recipe.attention = a;
        out.push((format!("sd3 {p} recompute {rc} {}", a.name()), s));
    }
    let mut add = |name: &str, f: &dyn Fn(&mut Spec)| {
        let mut s = base.clone();
        f(&mut s);
        out.push((format!("sd3 {name}"), s));
    };
    add("batch 8 = 2 × accumulation 4, bf16-mixed", &|s| {
        s.workload.batch = 8;
        s.workload.microbatch = 2;
        s.workload.accumulation = 4;
        s.recipe.precision = P::Bf16Mixed;
    });
    add("1 + 1 caption tokens", &|s| {
        s.workload.text_tokens = Some(vec![1, 1])
    });
    add("77 + 77 caption tokens, memory-efficient", &|s| {
        s.workload.text_tokens = Some(vec![77, 77]);
        s.recipe.attention = A::MemoryEfficient;
    });
    add("77 + 77 caption tokens, batch 2", &|s| {
        s.workload.text_tokens = Some(vec![77, 77]);
        s.workload.batch = 2;
        s.workload.microbatch = 2;
    });
    add("SGD, no EMA", &|s| {
        s.recipe.optimizer = Optimizer::Sgd;
        s.recipe.ema.enabled = false;
    });
    add("batch 1, blocks:1,2", &|s| {
        s.workload.batch = 1;
        s.workload.microbatch = 1;
        s.recipe.recompute = R::Blocks(vec![1, 2]);
    });
    for (name, layers, heads, qk, rc) in [
        ("q/k RMSNorm (SD3.5), every-2", 3, 4, true, R::EveryK(2)),
        ("q/k RMSNorm, bf16-mixed", 3, 4, true, R::None),
        ("1 block (context_pre_only only)", 1, 4, false, R::None),
        (
            "4 blocks × 6 heads (hidden 96), q/k RMSNorm, all",
            4,
            6,
            true,
            R::All,
        ),
    ] {
        let mut s = crate::families::sd3::tiny_spec(layers, heads, qk, 7, 12)?;
        s.recipe.ema.enabled = true;
        s.recipe.recompute = rc;
        if name.contains("bf16") {
            s.recipe.precision = P::Bf16Mixed;
        }
        out.push((format!("sd3 {name}"), crate::host::resolve(&s)));
    }
    out.extend(lora_specs("sd3", &base));
    Ok(out)
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

/// The Flux grid's base: [`crate::families::flux::tiny_spec`] (one double-stream and two
/// single-stream blocks of 4 × 16-wide heads, 64 image tokens, 13 T5 tokens of width 32, a
/// pooled width of 24, the guidance embedder, batch 4) with an fp32 EMA, on this process's CPU.
pub fn flux_grid_base() -> Result<Spec> {
    let mut s = crate::families::flux::tiny_spec(1, 2, 4, 13, true)?;
    s.model.name = "flux-d1s2-h64".into();
    s.recipe.ema.enabled = true;
    Ok(crate::host::resolve(&s))
}

/// The Flux agreement grid: precisions × recompute policies × attention modes on the base,
/// then accumulation, odd T5 lengths (1, 77 and 300 tokens), a larger image, SGD without EMA, a
/// block list across the two kinds of block, no guidance embedder, and a deeper, wider model.
pub fn flux_grid() -> Result<Vec<(String, Spec)>> {
    use ditmem_budget::{AttentionMode as A, Optimizer, Precision as P, Recompute as R};
    let base = flux_grid_base()?;
    let mut out = Vec::new();
    for (p, rc, a) in [
        (P::Fp32, R::None, A::Materialized),
        (P::Fp32, R::None, A::MemoryEfficient),
        (P::Fp32, R::All, A::Materialized),
        (P::Fp32, R::AttentionOnly, A::Materialized),
        (P::Bf16Mixed, R::None, A::Materialized),
        (P::Bf16Mixed, R::EveryK(2), A::MemoryEfficient),
        (P::Fp16Mixed, R::None, A::MemoryEfficient),
        (P::Fp16Mixed, R::All, A::Materialized),
        (P::Bf16Pure, R::None, A::Materialized),
        (P::Fp64, R::None, A::Materialized),
        (P::Fp64, R::AttentionOnly, A::Materialized),
    ] {
        let mut s = base.clone();
        s.recipe.precision = p;
        s.recipe.recompute = rc.clone();
        s.recipe.attention = a;
        out.push((format!("flux {p} recompute {rc} {}", a.name()), s));
    }
    let mut add = |name: &str, f: &dyn Fn(&mut Spec)| {
        let mut s = base.clone();
        f(&mut s);
        out.push((format!("flux {name}"), s));
    };
    add("batch 8 = 2 × accumulation 4, bf16-mixed", &|s| {
        s.workload.batch = 8;
        s.workload.microbatch = 2;
        s.workload.accumulation = 4;
        s.recipe.precision = P::Bf16Mixed;
    });
    add("1 T5 token", &|s| {
        s.workload.text_tokens = Some(vec![77, 1])
    });
    add("77 T5 tokens, memory-efficient", &|s| {
        s.workload.text_tokens = Some(vec![77, 77]);
        s.recipe.attention = A::MemoryEfficient;
    });
    add("300 T5 tokens, batch 2, memory-efficient", &|s| {
        s.workload.text_tokens = Some(vec![77, 300]);
        s.workload.batch = 2;
        s.workload.microbatch = 2;
        s.recipe.attention = A::MemoryEfficient;
    });
    add("256×256 (256 tokens), batch 2, memory-efficient", &|s| {
        s.workload.height = 256;
        s.workload.width = 256;
        s.workload.batch = 2;
        s.workload.microbatch = 2;
        s.recipe.attention = A::MemoryEfficient;
    });
    add("SGD, no EMA", &|s| {
        s.recipe.optimizer = Optimizer::Sgd;
        s.recipe.ema.enabled = false;
    });
    add("batch 1, blocks:0,1", &|s| {
        s.workload.batch = 1;
        s.workload.microbatch = 1;
        s.recipe.recompute = R::Blocks(vec![0, 1]);
    });
    let mut plain = crate::families::flux::tiny_spec(1, 2, 4, 13, false)?;
    plain.recipe.ema.enabled = true;
    out.push((
        "flux no guidance embedder (schnell-like)".into(),
        crate::host::resolve(&plain),
    ));
    let mut deep = crate::families::flux::tiny_spec(2, 3, 6, 19, true)?;
    deep.recipe.ema.enabled = true;
    deep.recipe.recompute = R::EveryK(2);
    out.push((
        "flux 2 + 3 blocks × 6 heads (hidden 96), 19 tokens, every-2".into(),
        crate::host::resolve(&deep),
    ));
    out.extend(lora_specs("flux", &base));
    Ok(out)
}

/// The Sana grid's base: [`crate::families::sana::tiny_spec`] (2 blocks of 4 × 16-wide heads,
/// cross-attention 2 × 32 wide, Mix-FFN 160 wide, 64 image tokens on an 8×8 grid, 13 caption
/// tokens of width 48, batch 4) with an fp32 EMA, on this process's CPU.
pub fn sana_grid_base() -> Result<Spec> {
    let mut s = crate::families::sana::tiny_spec(2, 4, 13)?;
    s.model.name = "sana-d2-h64".into();
    s.recipe.ema.enabled = true;
    Ok(crate::host::resolve(&s))
}

/// The Sana agreement grid: precisions × recompute policies × attention modes (of the softmax
/// cross-attention; the linear self-attention has one form) on the base, then accumulation,
/// odd caption lengths, an odd and non-square token grid (7×5: the depthwise conv's borders),
/// a deeper model with biased q/k/v, SGD without EMA, a block list, and LoRA (the scripts'
/// default targets; and the Mix-FFN-free list `to_q, to_v` on bias-less projections).
pub fn sana_grid() -> Result<Vec<(String, Spec)>> {
    use ditmem_budget::{AttentionMode as A, LoraSpec, Optimizer, Precision as P, Recompute as R};
    let base = sana_grid_base()?;
    let mut out = Vec::new();
    for (p, rc, a) in [
        (P::Fp32, R::None, A::Materialized),
        (P::Fp32, R::None, A::MemoryEfficient),
        (P::Fp32, R::All, A::Materialized),
        (P::Fp32, R::AttentionOnly, A::Materialized),
        (P::Bf16Mixed, R::None, A::Materialized),
        (P::Bf16Mixed, R::EveryK(2), A::MemoryEfficient),
        (P::Fp16Mixed, R::None, A::MemoryEfficient),
        (P::Fp16Mixed, R::All, A::Materialized),
        (P::Bf16Pure, R::None, A::Materialized),
        (P::Fp64, R::None, A::Materialized),
    ] {
        let mut s = base.clone();
        s.recipe.precision = p;
        s.recipe.recompute = rc.clone();
        s.recipe.attention = a;
        out.push((format!("sana {p} recompute {rc} {}", a.name()), s));
    }
    let mut add = |name: &str, f: &dyn Fn(&mut Spec)| {
        let mut s = base.clone();
        f(&mut s);
        out.push((format!("sana {name}"), s));
    };
    add("batch 8 = 2 × accumulation 4, bf16-mixed", &|s| {
        s.workload.batch = 8;
        s.workload.microbatch = 2;
        s.workload.accumulation = 4;
        s.recipe.precision = P::Bf16Mixed;
    });
    add("1 caption token", &|s| {
        s.workload.text_tokens = Some(vec![1])
    });
    add("300 caption tokens, batch 2, memory-efficient", &|s| {
        s.workload.text_tokens = Some(vec![300]);
        s.workload.batch = 2;
        s.workload.microbatch = 2;
        s.recipe.attention = A::MemoryEfficient;
    });
    add("224×160 (7×5 tokens), memory-efficient", &|s| {
        s.workload.height = 224;
        s.workload.width = 160;
        s.recipe.attention = A::MemoryEfficient;
    });
    add("SGD, no EMA", &|s| {
        s.recipe.optimizer = Optimizer::Sgd;
        s.recipe.ema.enabled = false;
    });
    add("batch 1, blocks:1", &|s| {
        s.workload.batch = 1;
        s.workload.microbatch = 1;
        s.recipe.recompute = R::Blocks(vec![1]);
    });
    add("LoRA r4 (to_k, to_q, to_v, to_out.0), bf16-mixed", &|s| {
        s.recipe.precision = P::Bf16Mixed;
        s.recipe.lora = Some(LoraSpec {
            rank: 4,
            targets: ditmem_budget::default_lora_targets(),
            modules: Vec::new(),
        });
    });
    add("LoRA r8 (to_q, to_v), fp32, recompute all", &|s| {
        s.recipe.recompute = R::All;
        s.recipe.lora = Some(LoraSpec {
            rank: 8,
            targets: ditmem_budget::default_lora_targets(),
            modules: vec!["to_q".into(), "to_v".into()],
        });
    });
    let mut cfg = crate::families::sana::tiny_config(4, 6);
    cfg.insert("attention_bias".into(), serde_json::Value::Bool(true));
    let mut deep = ditmem_budget::denoiser::with_family(Spec::small(), "sana-d4-h96", cfg)?;
    deep.workload.height = 256;
    deep.workload.width = 256;
    deep.workload.text_tokens = Some(vec![19]);
    deep.recipe.attention = ditmem_budget::AttentionMode::Materialized;
    deep.recipe.ema.enabled = true;
    deep.recipe.recompute = R::EveryK(2);
    out.push((
        "sana 4 blocks × 6 heads (hidden 96), biased q/k/v, 19 tokens, every-2".into(),
        crate::host::resolve(&deep),
    ));
    Ok(out)
}

/// The Wan grid's base: [`crate::families::wan::tiny_spec`] (2 blocks of 2 × 16-wide heads,
/// 64×64 pixels at 9 frames: 3 latent frames of 4×4 tokens, 48 video tokens, 13 umT5 tokens of
/// width 32, batch 4) with an fp32 EMA, on this process's CPU.
pub fn wan_grid_base() -> Result<Spec> {
    let mut s = crate::families::wan::tiny_spec(2, 2, 9, 13)?;
    s.model.name = "wan-d2-h32".into();
    s.workload.height = 64;
    s.workload.width = 64;
    s.recipe.ema.enabled = true;
    Ok(crate::host::resolve(&s))
}

/// The Wan agreement grid: precisions × recompute policies × attention modes on the base,
/// then accumulation, odd token counts (1 and 77 umT5 tokens, one latent frame, an odd
/// 5×3 token grid), a wider and deeper model, SGD without EMA and a block list.
pub fn wan_grid() -> Result<Vec<(String, Spec)>> {
    use ditmem_budget::{AttentionMode as A, Optimizer, Precision as P, Recompute as R};
    let base = wan_grid_base()?;
    let mut out = Vec::new();
    for (p, rc, a) in [
        (P::Fp32, R::None, A::Materialized),
        (P::Fp32, R::None, A::MemoryEfficient),
        (P::Fp32, R::All, A::Materialized),
        (P::Fp32, R::AttentionOnly, A::Materialized),
        (P::Bf16Mixed, R::None, A::Materialized),
        (P::Bf16Mixed, R::EveryK(2), A::MemoryEfficient),
        (P::Fp16Mixed, R::None, A::MemoryEfficient),
        (P::Fp16Mixed, R::All, A::Materialized),
        (P::Bf16Pure, R::None, A::Materialized),
        (P::Fp64, R::None, A::Materialized),
        (P::Fp64, R::AttentionOnly, A::Materialized),
    ] {
        let mut s = base.clone();
        s.recipe.precision = p;
        s.recipe.recompute = rc.clone();
        s.recipe.attention = a;
        out.push((format!("wan {p} recompute {rc} {}", a.name()), s));
    }
    let mut add = |name: &str, f: &dyn Fn(&mut Spec)| {
        let mut s = base.clone();
        f(&mut s);
        out.push((format!("wan {name}"), s));
    };
    add("batch 8 = 2 × accumulation 4, bf16-mixed", &|s| {
        s.workload.batch = 8;
        s.workload.microbatch = 2;
        s.workload.accumulation = 4;
        s.recipe.precision = P::Bf16Mixed;
    });
    add("1 umT5 token", &|s| s.workload.text_tokens = Some(vec![1]));
    add("77 umT5 tokens, memory-efficient", &|s| {
        s.workload.text_tokens = Some(vec![77]);
        s.recipe.attention = A::MemoryEfficient;
    });
    add("1 frame (an image)", &|s| s.workload.frames = 1);
    add("80×48 (5×3 tokens a frame), 5 frames, bf16-mixed", &|s| {
        s.workload.height = 80;
        s.workload.width = 48;
        s.workload.frames = 5;
        s.recipe.precision = P::Bf16Mixed;
    });
    add(
        "17 frames (5 latent frames, 80 tokens), batch 2, memory-efficient",
        &|s| {
            s.workload.frames = 17;
            s.workload.batch = 2;
            s.workload.microbatch = 2;
            s.recipe.attention = A::MemoryEfficient;
        },
    );
    add("SGD, no EMA", &|s| {
        s.recipe.optimizer = Optimizer::Sgd;
        s.recipe.ema.enabled = false;
    });
    add("batch 1, blocks:1", &|s| {
        s.workload.batch = 1;
        s.workload.microbatch = 1;
        s.recipe.recompute = R::Blocks(vec![1]);
    });
    let mut deep = crate::families::wan::tiny_spec(4, 4, 5, 19)?;
    deep.workload.height = 64;
    deep.workload.width = 64;
    deep.recipe.ema.enabled = true;
    deep.recipe.recompute = R::EveryK(2);
    out.push((
        "wan 4 blocks × 4 heads (hidden 64), 5 frames, 19 tokens, every-2".into(),
        crate::host::resolve(&deep),
    ));
    out.extend(lora_specs("wan", &base));
    Ok(out)
}

/// A family grid's LoRA specs on its `base`: the family's default modules (the diffusers
/// script's, `ditmem_budget::denoiser::lora_modules`) at rank 4 under bf16-mixed and at rank 8
/// under fp32 with every block recomputed, and a custom list at rank 16 that reaches the embed
/// and output sides too (`linear_1`: the timestep and caption MLPs; `proj_out`: the output
/// projection, and Flux's single blocks' own) under fp16-mixed with the attention-only policy.
pub fn lora_specs(family: &str, base: &Spec) -> Vec<(String, Spec)> {
    use ditmem_budget::{LoraSpec, Precision as P, Recompute as R};
    let lora = |rank: u32, modules: &[&str]| LoraSpec {
        rank,
        targets: ditmem_budget::default_lora_targets(),
        modules: modules.iter().map(|m| m.to_string()).collect(),
    };
    let custom = ["to_q", "to_v", "linear_1", "proj_out"];
    [
        (
            "LoRA r4 (defaults), bf16-mixed",
            P::Bf16Mixed,
            R::None,
            lora(4, &[]),
        ),
        (
            "LoRA r8 (defaults), fp32, recompute all",
            P::Fp32,
            R::All,
            lora(8, &[]),
        ),
        (
            "LoRA r16 (to_q, to_v, linear_1, proj_out), fp16-mixed, attention-only",
            P::Fp16Mixed,
            R::AttentionOnly,
            lora(16, &custom),
        ),
    ]
    .into_iter()
    .map(|(name, p, rc, l)| {
        let mut s = base.clone();
        s.recipe.precision = p;
        s.recipe.recompute = rc;
        s.recipe.lora = Some(l);
        (format!("{family} {name}"), s)
    })
    .collect()
}
