//! `estimate`'s report ([`estimate_report`]): the peak, what dominates it and the advice, the
//! parameter, detail and inventory sections, the CUDA allocator's lines, the levers that would
//! make it fit.

use super::table::{fmt_count, pct, Column, Table};
use super::text::{fit_lines, wrap};
use super::words::{change_flags, recipe_line, short_recipe, spec_line};
use ditmem_budget::fmt_bytes;
use ditmem_budget::gpu::Gpu;
use ditmem_budget::{Budget, EncoderRun, InventoryRow, Spec};

/// What to do about the dominant consumer, in words.
pub(crate) fn advice(dominant: &str, budget: &Budget) -> String {
    let r = &budget.spec.recipe;
    match dominant {
        "activations" | "weight_casts" => {
            let mut ways = Vec::new();
            if r.recompute != ditmem_budget::Recompute::All {
                ways.push("recompute blocks");
            }
            if r.attention == ditmem_budget::AttentionMode::Materialized {
                ways.push("use memory-efficient attention");
            }
            if budget.spec.workload.microbatch > 1 {
                ways.push("lower the microbatch (accumulate to keep the batch)");
            }
            ways.push("or lower the resolution (tokens grow with its area)");
            format!("activations saved for backward dominate: {}", ways.join(", "))
        }
        "optimizer_state" | "master_weights" | "gradients" => {
            "model states dominate: LoRA, 8-bit AdamW or ZeRO sharding over ranks shrink them; accumulation does not".into()
        }
        "encoder" => {
            "the frozen encoders dominate: cache the latents and the caption embeddings \
             beforehand (--latents cached, --text-encoders cached), or offload the text encoders"
                .into()
        }
        "ema" => "the EMA copy dominates: keep it in bf16 or off the device".into(),
        _ => format!("{dominant} dominates"),
    }
}

/// The human report of `estimate`.
/// What the device shows on `pytorch:cuda`: the caching allocator over the step's allocations.
pub(super) fn cuda_lines(c: &ditmem_budget::pytorch::CudaReport, spec: &Spec) -> String {
    let mut o = format!(
        "cuda (caching allocator over a warm-up and a measured step{}): max allocated {}, max reserved {} \
         (fragmentation at the allocated peak {}), cuBLAS workspace {}, context {} → nvidia-smi ≈ {}\n",
        if c.alloc_conf.is_empty() {
            String::new()
        } else {
            format!(", PYTORCH_CUDA_ALLOC_CONF={}", c.alloc_conf)
        },
        fmt_bytes(c.max_allocated_bytes),
        fmt_bytes(c.max_reserved_bytes),
        fmt_bytes(c.fragmentation_at_peak_bytes),
        fmt_bytes(c.cublas_workspace_bytes),
        fmt_bytes(c.context_bytes),
        fmt_bytes(c.device_bytes),
    );
    if c.paged_bytes > 0 {
        o.push_str(&format!(
            "paged optimizer state {} in CUDA managed memory, outside the allocator: on the device \
             while there is room, paged to the host when there is not (not in the figures above)\n",
            fmt_bytes(c.paged_bytes)
        ));
    }
    if let (Some(gpu), Some(cap), Some(fits)) = (c.gpu, c.capacity_bytes, c.fits) {
        match &c.oom {
            None => o.push_str(&format!(
                "fits {gpu} ({} as CUDA reports it): yes, {} free at the peak\n",
                fmt_bytes(cap),
                fmt_bytes(cap.saturating_sub(c.device_bytes))
            )),
            Some(oom) => o.push_str(&format!(
                "fits {gpu} ({}): no — torch.OutOfMemoryError on a {} request with {} allocated and {} reserved{}\n",
                fmt_bytes(cap),
                fmt_bytes(oom.requested),
                fmt_bytes(oom.allocated),
                fmt_bytes(oom.reserved),
                if fits { "" } else { "; plan --gpu finds what fits" }
            )),
        }
    } else {
        let catalog = Catalog::for_step(c, spec);
        let (yes, no) = catalog.split();
        let names = |cards: &[&Gpu]| cards.iter().map(|g| g.name).collect::<Vec<_>>().join(", ");
        o.push_str(&format!(
            "fits (reserved + workspace within each card's capacity less its context; --gpu NAME \
             replays on that card): {}; not: {}{}\n",
            if yes.is_empty() {
                "none of the catalog".to_string()
            } else {
                names(&yes)
            },
            if no.is_empty() {
                "none".to_string()
            } else {
                names(&no)
            },
            if catalog.bf16 {
                " (cards without bf16 left out)"
            } else {
                ""
            }
        ));
    }
    o
}

/// The catalog's cards a step with no card named is held against, in the catalog's order: all
/// of them, or those with bf16 when the step computes in bf16. A card fits when its capacity less
/// its own CUDA context holds the replay's reserved memory and cuBLAS workspace.
struct Catalog {
    cards: Vec<&'static Gpu>,
    need: u64,
    bf16: bool,
}

impl Catalog {
    fn for_step(c: &ditmem_budget::pytorch::CudaReport, spec: &Spec) -> Catalog {
        let bf16 = spec.recipe.precision.compute_dtype() == ditmem_budget::Dtype::Bf16;
        Catalog {
            cards: ditmem_budget::gpu::all()
                .iter()
                .filter(|g| !bf16 || g.dtypes().bf16)
                .collect(),
            need: c.max_reserved_bytes + c.cublas_workspace_bytes,
            bf16,
        }
    }

    /// The cards that fit and those that do not, each in the order of `cards`.
    fn split(&self) -> (Vec<&'static Gpu>, Vec<&'static Gpu>) {
        self.cards
            .iter()
            .copied()
            .partition(|g| self.need <= g.allocator_bytes())
    }
}

pub(super) fn parameters_section(b: &Budget) -> String {
    let mut o = String::new();
    o.push_str(&format!(
        "parameters: {} total = {} trained + {} frozen\n",
        fmt_count(b.params.total),
        fmt_count(b.params.trained),
        fmt_count(b.params.frozen)
    ));
    let mut t = Table::new(&["module", "trained", "frozen"]);
    for m in &b.params.per_module {
        t.row(vec![
            m.name.to_string(),
            fmt_count(m.trained),
            fmt_count(m.frozen),
        ]);
    }
    o.push_str(&t.render());
    o.push('\n');
    if !b.encoders.is_empty() {
        o.push_str(
            "frozen encoders in the step (no gradient, run at the start of each microbatch):\n",
        );
        let columns: [Column<&EncoderRun>; 7] = [
            ("encoder", &|e| e.name.clone()),
            ("class", &|e| e.class.to_string()),
            ("parameters", &|e| fmt_count(e.params)),
            ("dtype", &|e| e.dtype.to_string()),
            ("weights", &|e| fmt_bytes(e.weight_bytes)),
            ("on the device", &|e| {
                if e.resident {
                    "all step"
                } else {
                    "while encoding"
                }
                .to_string()
            }),
            ("forward", &|e| format!("+{}", fmt_bytes(e.forward_bytes))),
        ];
        let t = Table::of(&columns, &b.encoders);
        o.push_str(&t.render());
        o.push('\n');
    }

    o
}

pub(super) fn details_section(b: &Budget) -> String {
    let mut o = String::new();
    let p = &b.peak;
    let mb = if b.spec.workload.accumulation > 1 {
        format!(", microbatch {}", p.microbatch)
    } else {
        String::new()
    };
    o.push_str(&format!(
        "peak: {} ({} B) in {} at {}{mb}\n",
        fmt_bytes(p.bytes),
        fmt_count(p.bytes),
        p.phase.name(),
        p.label
    ));
    let mut t = breakdown_table("live at the peak", &p.breakdown, p.bytes);
    t.row(vec![
        "total".into(),
        fmt_bytes(p.bytes),
        pct(p.bytes, p.bytes),
    ]);
    o.push_str(&t.render());
    let (dom, dom_bytes) = p.breakdown.dominant();
    o.push_str(&format!(
        "dominant: {} ({}) — {}\n\n",
        dom.replace('_', " "),
        pct(dom_bytes, p.bytes),
        advice(dom, b)
    ));

    let mut t = Table::new(&["phase", "highest live"]);
    for (ph, v) in &b.phase_peaks {
        t.row(vec![ph.name().into(), fmt_bytes(*v)]);
    }
    o.push_str(&t.render());
    if let Some(r) = &b.timeline.repeated {
        o.push_str(&format!(
            "timeline: microbatches 0..={} of {} laid out; {} (same peak and phase peaks)\n",
            b.timeline.laid_out - 1,
            b.timeline.microbatches,
            r.describe()
        ));
    }
    if let Some(c) = &b.cuda {
        o.push_str(&cuda_lines(c, &b.spec));
    } else if matches!(
        b.spec.runtime,
        ditmem_budget::Runtime::Pytorch {
            device: ditmem_budget::TorchDevice::Cuda,
            ..
        }
    ) {
        o.push_str(&format!(
            "cuda: the step makes more than {} allocations; the caching allocator is not replayed \
             (reserved memory and fit unknown)\n",
            ditmem_budget::pytorch::MAX_REPLAYED_EVENTS
        ));
    }
    if b.static_bytes.host_bytes > 0 {
        o.push_str(&format!(
            "offload ({}): {} per rank in host memory (optimizer state, fp32 partition and its \
             gradient{}), not on the device\n",
            b.spec.recipe.offload,
            fmt_bytes(b.static_bytes.host_bytes),
            if b.spec.recipe.offload == ditmem_budget::Offload::OptimizerAndParams {
                ", parameters"
            } else {
                ""
            }
        ));
    }
    let seg = b.segments.kept()[1];
    o.push_str(&format!(
        "per block: a stored block keeps {} (activations {}, weight casts {}, output {}); \
         a recomputed block keeps only its input\n",
        fmt_bytes(seg.total()),
        fmt_bytes(seg.activations),
        fmt_bytes(seg.weight_casts),
        fmt_bytes(seg.output)
    ));
    let ratio = p.bytes as f64 / b.weights_times_four.max(1) as f64;
    o.push_str(&format!(
        "\"weights × 4\" would say {}; the simulated peak is {:.2}× that, because activations, casts and \
         workspace depend on tokens, batch and recipe, not on the weights.\n",
        fmt_bytes(b.weights_times_four),
        ratio
    ));

    o
}

pub(super) fn inventory_section(b: &Budget) -> String {
    // A byte count, or `zero` where there are none.
    let bytes_or = |v: u64, zero: &str| if v == 0 { zero.into() } else { fmt_bytes(v) };
    let columns: [Column<&InventoryRow>; 6] = [
        ("op", &|r| r.op.clone()),
        ("elements", &|r| fmt_count(r.elems)),
        ("dtype", &|r| r.dtype.to_string()),
        ("new buffer", &|r| bytes_or(r.bytes, "view")),
        ("extra saved", &|r| bytes_or(r.extra_saved, "")),
        ("bwd scratch", &|r| bytes_or(r.bwd_scratch, "")),
    ];
    let mut o = String::new();
    for inv in &b.inventory {
        o.push_str(&format!(
            "\nop inventory: {} (tracked graph keeps {})\n",
            inv.segment,
            fmt_bytes(inv.kept_bytes)
        ));
        o.push_str(&Table::of(&columns, &inv.rows).render());
    }
    o
}

/// "activations 213 GiB (58 %) · optimizer state 88.7 GiB (24 %) · …": the three largest
/// categories at the peak.
pub(super) fn top_contributors(b: &Budget) -> String {
    top_of(&b.peak.breakdown, b.peak.bytes)
}

/// The three largest categories of a breakdown, with their share of `total`.
pub(crate) fn top_of(breakdown: &ditmem_budget::Breakdown, total: u64) -> String {
    let mut e: Vec<(&str, u64)> = breakdown
        .entries()
        .into_iter()
        .filter(|(_, v)| *v > 0)
        .collect();
    e.sort_by_key(|x| std::cmp::Reverse(x.1));
    e.iter()
        .take(3)
        .map(|(n, v)| {
            format!(
                "{} {} {:.0} %",
                category_words(n),
                fmt_bytes(*v),
                100.0 * *v as f64 / total.max(1) as f64
            )
        })
        .collect::<Vec<_>>()
        .join(" · ")
}

/// The categories of a breakdown that hold bytes, one row each: its bytes and its share of
/// `total`, under the header `title`.
pub(crate) fn breakdown_table(
    title: &str,
    breakdown: &ditmem_budget::Breakdown,
    total: u64,
) -> Table {
    let mut t = Table::new(&[title, "bytes", "share"]);
    for (name, v) in breakdown.entries() {
        if v > 0 {
            t.row(vec![name.replace('_', " "), fmt_bytes(v), pct(v, total)]);
        }
    }
    t
}

/// A breakdown category as a reader names it.
pub(crate) fn category_words(name: &str) -> String {
    match name {
        "ema" => "EMA".into(),
        other => other.replace('_', " "),
    }
}

/// Line 2 of `estimate`: does it fit — the spec's GPU, or the catalog's cards.
pub(super) fn fit_line(b: &Budget) -> String {
    let need = ditmem_budget::levers::need_bytes(b);
    let Some(c) = &b.cuda else {
        return match b.spec.runtime {
            ditmem_budget::Runtime::Pytorch {
                device: ditmem_budget::TorchDevice::Cuda,
                ..
            } => format!(
                "fits: unknown — the step makes more than {} allocations, so the caching \
                 allocator is not replayed",
                fmt_count(ditmem_budget::pytorch::MAX_REPLAYED_EVENTS as u64)
            ),
            rt => format!("fits: runs in host memory on {rt} (no GPU capacity to fit against)"),
        };
    };
    match (c.gpu, c.capacity_bytes) {
        (Some(gpu), Some(cap)) => {
            if ditmem_budget::levers::fits(b) == Some(true) {
                format!(
                    "fits {gpu} ({} as CUDA reports it): yes, {} free at the peak",
                    fmt_bytes(cap),
                    fmt_bytes(cap.saturating_sub(c.device_bytes))
                )
            } else {
                format!(
                    "fits {gpu} ({} as CUDA reports it): no — the step needs {}, {} more",
                    fmt_bytes(cap),
                    fmt_bytes(need),
                    fmt_bytes(need.saturating_sub(cap))
                )
            }
        }
        _ => {
            let mut catalog = Catalog::for_step(c, &b.spec);
            catalog.cards.sort_by_key(|g| g.capacity_bytes());
            let (yes, no) = catalog.split();
            let (cards, bf16) = (&catalog.cards, catalog.bf16);
            let skipped = if bf16 { " with bf16" } else { "" };
            match (yes.first(), no.last()) {
                (Some(small), Some(big)) => format!(
                    "fits {} of {} cards{skipped}, smallest {} ({}); not {} ({}){}",
                    yes.len(),
                    cards.len(),
                    small.name,
                    fmt_bytes(small.capacity_bytes()),
                    big.name,
                    fmt_bytes(big.capacity_bytes()),
                    if no.len() > 1 {
                        format!(" nor {} smaller", no.len() - 1)
                    } else {
                        String::new()
                    }
                ),
                (Some(_), None) => {
                    format!("fits every catalog card{skipped} ({})", cards.len())
                }
                (None, _) => format!(
                    "fits none of the {} catalog cards{skipped} (the largest, {}, has {})",
                    cards.len(),
                    cards.last().map_or("-", |g| g.name),
                    fmt_bytes(cards.last().map_or(0, |g| g.capacity_bytes()))
                ),
            }
        }
    }
}

/// A timeline label as words: the budget marks the moment inside an op or block as
/// "block 3 (inside)"; a reader wants "inside block 3".
pub(crate) fn where_words(label: &str) -> String {
    match label.strip_suffix(" (inside)") {
        Some(what) => format!("inside {what}"),
        None => format!("at {label}"),
    }
}

/// Line 3 of `estimate`: the peak as the device would show it.
pub(super) fn peak_line(b: &Budget) -> String {
    let p = &b.peak;
    match &b.cuda {
        Some(c) if c.oom.is_some() => format!(
            "device peak: ≈ {} = {} allocated + {} context, in {} (the replay ran out)",
            fmt_bytes(ditmem_budget::levers::need_bytes(b)),
            fmt_bytes(p.bytes),
            fmt_bytes(c.context_bytes),
            p.phase.name()
        ),
        Some(c) => format!(
            "device peak: {} as nvidia-smi shows it = {} reserved + {} context, in {}",
            fmt_bytes(c.device_bytes),
            fmt_bytes(c.max_reserved_bytes),
            fmt_bytes(c.context_bytes),
            p.phase.name()
        ),
        None => format!(
            "peak: {} of host memory in {}, {}",
            fmt_bytes(p.bytes),
            p.phase.name(),
            where_words(&p.label)
        ),
    }
}

/// The levers `estimate` offers: the single levers ranked against the spec's card (by what
/// they leave without one); 8-bit AdamW always, LoRA only when nothing else fits a diffusers
/// model trained in full — it changes what is trained. A lever that saves nothing is left out.
pub(crate) fn estimate_levers(
    spec: &Spec,
    b: &Budget,
) -> anyhow::Result<Vec<ditmem_budget::levers::Lever>> {
    use ditmem_budget::levers::{need_bytes, profile_for, rank_levers, remember, LeverOptions};
    let capacity = b.cuda.as_ref().and_then(|c| c.capacity_bytes);
    let profile = profile_for(spec);
    // `b` is the spec's budget: the base row's figures without budgeting it again.
    remember(spec, &profile, b);
    let mut opts = LeverOptions {
        budget_bytes: capacity,
        headroom: 0.0,
        allow: ditmem_budget::Allow::default(),
        combine: false,
    };
    // Whether the base fits the card, as `rank_levers` decides it (its device peak within the
    // budget, no headroom).
    let base_fits = capacity.is_some_and(|c| need_bytes(b) <= (c as f64).floor() as u64);
    let mut r = if base_fits {
        // It fits as it is: the levers by the memory they give back (a card would stop each
        // search at the first setting that fits, which the step already does). Ranked without
        // a budget only: a ranking against the card would be thrown away.
        opts.budget_bytes = None;
        let mut r = rank_levers(spec, &opts, &profile)?;
        r.base.fits = true;
        for l in &mut r.levers {
            l.fits = capacity.is_some_and(|c| l.device_peak_bytes <= c);
        }
        r
    } else {
        rank_levers(spec, &opts, &profile)?
    };
    let none_fits = !r.base.fits && !r.levers.iter().any(|l| l.fits);
    if none_fits && spec.recipe.lora.is_none() && spec.model.diffusers.is_some() {
        opts.allow.lora = true;
        r = rank_levers(spec, &opts, &profile)?;
    }
    let need = need_bytes(b);
    Ok(r.levers
        .into_iter()
        .filter(|l| l.device_peak_bytes < need)
        .collect())
}

/// A lever's change without its trailing aside, to sit in parentheses itself.
pub(super) fn plain_change(change: &str) -> &str {
    match change.rfind(" (") {
        Some(i) if change.ends_with(')') => &change[..i],
        _ => change,
    }
}

/// A lever as flags: what to add to the command line.
pub(super) fn lever_flags(base: &Spec, l: &ditmem_budget::levers::Lever) -> String {
    let f = change_flags(base, &l.spec);
    if f.is_empty() {
        l.lever.clone()
    } else {
        f.join(" ")
    }
}

/// A lever in a few words: its flags, what the step then needs, whether it fits, the time.
pub(super) fn lever_words(b: &Budget, l: &ditmem_budget::levers::Lever) -> String {
    let fits = match (b.cuda.as_ref().and_then(|c| c.capacity_bytes), l.fits) {
        // A lever is chosen as the least change that fits the card to the byte: say how little
        // is left when it is under the planner's default headroom, which a predicted peak
        // (±its stated error) and anything else on the card can take.
        (Some(cap), true) if tight(cap, l.device_peak_bytes) => format!(
            ", fits with {} free",
            fmt_bytes(cap.saturating_sub(l.device_peak_bytes))
        ),
        (Some(_), true) => ", fits".into(),
        (Some(_), false) => ", still too big".into(),
        (None, _) => String::new(),
    };
    format!(
        "{} → {}{fits}, step ×{:.2}",
        lever_flags(&b.spec, l),
        fmt_bytes(l.device_peak_bytes),
        1.0 + l.slowdown
    )
}

/// Whether `peak` leaves less of `capacity` free than `plan`'s default headroom (5 %).
fn tight(capacity: u64, peak: u64) -> bool {
    (capacity.saturating_sub(peak) as f64) < ditmem_budget::DEFAULT_HEADROOM * capacity as f64
}

/// Line 5 of `estimate`: the one change that helps most, said in at most `width` columns when
/// it can be (the lever's description is dropped first).
pub(super) fn change_line(
    b: &Budget,
    levers: &[ditmem_budget::levers::Lever],
    width: usize,
) -> String {
    let fits = ditmem_budget::levers::fits(b);
    let on_card = b.cuda.as_ref().and_then(|c| c.capacity_bytes).is_some();
    let plan_hint = match b.spec.cuda.as_ref().and_then(|c| c.gpu.clone()) {
        Some(g) => format!("ditmem plan --gpu {g}"),
        None if b.cuda.is_some() => "ditmem plan --gpu NAME".into(),
        None => "ditmem plan --budget SIZE".into(),
    };
    let fitted = |long: String, short: String| {
        if long.chars().count() <= width {
            long
        } else {
            short
        }
    };
    // `head` with the lever's description after it, when the line has room for it.
    let described = |head: String, l: &ditmem_budget::levers::Lever| {
        fitted(format!("{head} ({})", plain_change(&l.change)), head)
    };
    // The lever that gives the most memory back, after `lead`; `none` when no lever saves any.
    let most_back = |lead: &str, none: &str| match levers.iter().min_by_key(|l| l.device_peak_bytes)
    {
        Some(l) => described(
            format!("change: {lead}the most memory back: {}", lever_words(b, l)),
            l,
        ),
        None => format!("change: {none}"),
    };
    if fits == Some(true) {
        return most_back("none needed; ", "none needed");
    }
    if !on_card {
        // No card to fit (host memory, or none named): no change is needed of it, so the line
        // offers the most memory back and claims nothing more.
        return most_back("", "no single flag saves memory");
    }
    match levers.first() {
        // What the user needs most here is where to go next: the planner, with the levers it
        // leaves out by default (8-bit AdamW, a quantized base, bf16-pure, …) let in, combines
        // what no one flag does; the single best lever is the detail dropped first.
        Some(l) if !l.fits => fitted(
            format!(
                "change: no one flag is enough; the most: {}; {plan_hint} --allow all combines",
                lever_words(b, l)
            ),
            fitted(
                format!(
                    "change: no one flag is enough (the most: {} → {}); try ditmem plan --allow all",
                    lever_flags(&b.spec, l),
                    fmt_bytes(l.device_peak_bytes)
                ),
                "change: no one flag is enough; try ditmem plan --allow all with these flags".into(),
            ),
        ),
        Some(l) => described(format!("change: {}", lever_words(b, l)), l),
        None => format!("change: no single flag saves memory; {plan_hint} searches combinations"),
    }
}

/// What `estimate` prints: the answer first (five lines: the spec, fits, device peak, top
/// contributors, the change), then the other levers, and the details on request.
pub(crate) struct EstimateView<'a> {
    pub budget: &'a Budget,
    pub levers: &'a [ditmem_budget::levers::Lever],
    pub verbose: bool,
    pub inventory: bool,
    pub width: usize,
}

pub(crate) fn estimate_report(v: &EstimateView<'_>) -> String {
    let b = v.budget;
    let w = v.width;
    let mut o = String::new();
    o.push_str(&wrap(
        &format!("{}; {}", spec_line(&b.spec), short_recipe(&b.spec)),
        w,
        2,
    ));
    o.push_str(&wrap(&fit_line(b), w, 2));
    o.push_str(&wrap(&peak_line(b), w, 2));
    o.push_str(&wrap(&format!("biggest: {}", top_contributors(b)), w, 2));
    o.push_str(&wrap(&change_line(b, v.levers, w), w, 2));
    if let Some(oom) = b.cuda.as_ref().and_then(|c| c.oom) {
        o.push('\n');
        o.push_str(&wrap(
            &format!(
                "out of memory: the caching allocator's replay fails on a {} request (allocation \
                 {} of {}) with {} allocated and {} reserved; its maxima stop there, and the \
                 figures above are what the whole step would need",
                fmt_bytes(oom.requested),
                fmt_count(oom.event as u64 + 1),
                fmt_count(b.cuda.as_ref().map_or(0, |c| c.events as u64)),
                fmt_bytes(oom.allocated),
                fmt_bytes(oom.reserved)
            ),
            w,
            2,
        ));
    }
    // Line 5 named the first lever (the best ranked, or when it fits the one that gives the
    // most memory back, also first then).
    let others: Vec<_> = v.levers.iter().skip(1).take(4).collect();
    if !others.is_empty() {
        o.push('\n');
        let on_card = b.cuda.as_ref().and_then(|c| c.capacity_bytes).is_some();
        let mut t = Table::new(&["step", "needs", "fits", "other levers"]);
        for l in others {
            t.row(vec![
                format!("×{:.2}", 1.0 + l.slowdown),
                fmt_bytes(l.device_peak_bytes),
                match (on_card, l.fits) {
                    (true, true) => "yes",
                    (true, false) => "no",
                    (false, _) => "-",
                }
                .into(),
                lever_flags(&b.spec, l),
            ]);
        }
        o.push_str(&t.render_fit(w));
    }
    o.push('\n');
    o.push_str(&wrap(&format!("recipe: {}", recipe_line(&b.spec)), w, 2));
    if v.verbose {
        o.push('\n');
        o.push_str(&parameters_section(b));
        o.push_str(&details_section(b));
    } else {
        o.push_str(&wrap(
            "more: --verbose (parameters, breakdown, phases, allocator, per block), --inventory \
             (every op), --timeline, --plot FILE.svg",
            w,
            2,
        ));
    }
    if v.inventory {
        o.push_str(&inventory_section(b));
    }
    fit_lines(&o, w)
}
