//! Human output: aligned tables with binary units, and the plain words that explain a budget.

use ditmem_budget::fmt_bytes;
use ditmem_budget::{Budget, Spec};

/// A simple left/right aligned text table.
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Table {
        Table {
            header: header.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let n = self.header.len();
        let mut width = vec![0usize; n];
        for r in std::iter::once(&self.header).chain(&self.rows) {
            for (i, c) in r.iter().enumerate().take(n) {
                width[i] = width[i].max(c.chars().count());
            }
        }
        let line = |r: &Vec<String>| {
            let mut s = String::from("  ");
            for (i, c) in r.iter().enumerate().take(n) {
                let pad = width[i] - c.chars().count();
                if i == 0 {
                    s.push_str(c);
                    s.push_str(&" ".repeat(pad));
                } else {
                    s.push_str(&" ".repeat(pad + 2));
                    s.push_str(c);
                }
            }
            s.trim_end().to_string()
        };
        let mut out = line(&self.header);
        out.push('\n');
        out.push_str("  ");
        out.push_str(&"-".repeat(width.iter().sum::<usize>() + 2 * (n - 1)));
        for r in &self.rows {
            out.push('\n');
            out.push_str(&line(r));
        }
        out.push('\n');
        out
    }
}

/// Thousands separators for counts.
pub fn fmt_count(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

pub fn pct(part: u64, whole: u64) -> String {
    if whole == 0 {
        "-".into()
    } else {
        format!("{:.1} %", 100.0 * part as f64 / whole as f64)
    }
}

/// One line describing the spec: model, resolution, tokens, batch split.
pub fn spec_line(spec: &Spec) -> String {
    let w = &spec.workload;
    format!(
        "{} at {}×{} ({} tokens), batch {} = microbatch {} × accumulation {} × ranks {}",
        spec.model.name,
        w.height,
        w.width,
        spec.tokens().unwrap_or(0),
        w.batch,
        w.microbatch,
        w.accumulation,
        w.ranks
    )
}

/// One line describing the recipe.
pub fn recipe_line(spec: &Spec) -> String {
    let r = &spec.recipe;
    let lora = r
        .lora
        .as_ref()
        .map(|l| {
            if r.base_quant.is_none() {
                format!(", LoRA rank {}", l.rank)
            } else {
                format!(", LoRA rank {} on a {} base", l.rank, r.base_quant.name())
            }
        })
        .unwrap_or_default();
    let zero = match ditmem_budget::Scheme::of(spec) {
        ditmem_budget::Scheme::Single => String::new(),
        s if r.offload.is_none() => {
            format!(", {} over {} ranks", s.describe(), spec.workload.ranks)
        }
        s => format!(
            ", {} over {} ranks, offload {}",
            s.describe(),
            spec.workload.ranks,
            r.offload
        ),
    };
    let ema = if r.ema.enabled {
        format!("EMA {}", r.ema.dtype)
    } else {
        "no EMA".into()
    };
    // The ditmem-cpu budget depends on the CPU it describes: say which (the spec's `cpu`).
    let cpu = match (spec.runtime, spec.cpu()) {
        (ditmem_budget::Runtime::DitmemCpu, c) => format!(
            " ({} threads, bf16 products {}, gemm slab {} per thread)",
            c.threads,
            if c.bf16_kernel() {
                "on the AVX512-BF16 kernel"
            } else {
                "widened to f32"
            },
            fmt_bytes(c.gemm_l2_bytes)
        ),
        _ => String::new(),
    };
    let text = if r.text_encoders.is_cached() {
        String::new()
    } else {
        format!(", text encoders {}", r.text_encoders.name())
    };
    format!(
        "{}, {}, {} attention, recompute {}, latents {:?}{text}{lora}{zero}, {ema}; runtime {}{cpu}",
        r.precision,
        r.optimizer.name(),
        r.attention.name(),
        r.recompute,
        r.latents,
        spec.runtime
    )
    .replace("Cached", "cached")
    .replace("Encode", "encode")
}

/// What to do about the dominant consumer, in words.
pub fn advice(dominant: &str, budget: &Budget) -> String {
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
fn cuda_lines(c: &ditmem_budget::pytorch::CudaReport, spec: &Spec) -> String {
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
        // No card named: which of the catalog's would hold it (its reserved memory and
        // cuBLAS workspace within the card's capacity less its own context).
        let need = c.max_reserved_bytes + c.cublas_workspace_bytes;
        let (mut yes, mut no): (Vec<&str>, Vec<&str>) = (Vec::new(), Vec::new());
        let bf16 = spec.recipe.precision.compute_dtype() == ditmem_budget::Dtype::Bf16;
        for g in ditmem_budget::gpu::all() {
            if bf16 && !g.dtypes().bf16 {
                continue;
            }
            if need <= g.allocator_bytes() {
                yes.push(g.name);
            } else {
                no.push(g.name);
            }
        }
        o.push_str(&format!(
            "fits (reserved + workspace within each card's capacity less its context; --gpu NAME \
             replays on that card): {}; not: {}{}\n",
            if yes.is_empty() {
                "none of the catalog".to_string()
            } else {
                yes.join(", ")
            },
            if no.is_empty() {
                "none".to_string()
            } else {
                no.join(", ")
            },
            if bf16 {
                " (cards without bf16 left out)"
            } else {
                ""
            }
        ));
    }
    o
}

pub fn estimate_report(b: &Budget, show_inventory: bool) -> String {
    let mut o = String::new();
    o.push_str(&format!("ditmem estimate — {}\n", spec_line(&b.spec)));
    o.push_str(&format!("recipe: {}\n\n", recipe_line(&b.spec)));
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
        let mut t = Table::new(&[
            "encoder",
            "class",
            "parameters",
            "dtype",
            "weights",
            "on the device",
            "forward",
        ]);
        for e in &b.encoders {
            t.row(vec![
                e.name.clone(),
                e.class.to_string(),
                fmt_count(e.params),
                e.dtype.to_string(),
                fmt_bytes(e.weight_bytes),
                if e.resident {
                    "all step"
                } else {
                    "while encoding"
                }
                .to_string(),
                format!("+{}", fmt_bytes(e.forward_bytes)),
            ]);
        }
        o.push_str(&t.render());
        o.push('\n');
    }

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
    let mut t = Table::new(&["live at the peak", "bytes", "share"]);
    for (name, v) in p.breakdown.entries() {
        if v > 0 {
            t.row(vec![name.replace('_', " "), fmt_bytes(v), pct(v, p.bytes)]);
        }
    }
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

    if show_inventory {
        for inv in &b.inventory {
            o.push_str(&format!(
                "\nop inventory: {} (tracked graph keeps {})\n",
                inv.segment,
                fmt_bytes(inv.kept_bytes)
            ));
            let mut t = Table::new(&[
                "op",
                "elements",
                "dtype",
                "new buffer",
                "extra saved",
                "bwd scratch",
            ]);
            for r in &inv.rows {
                t.row(vec![
                    r.op.clone(),
                    fmt_count(r.elems),
                    r.dtype.to_string(),
                    if r.bytes == 0 {
                        "view".into()
                    } else {
                        fmt_bytes(r.bytes)
                    },
                    if r.extra_saved == 0 {
                        "".into()
                    } else {
                        fmt_bytes(r.extra_saved)
                    },
                    if r.bwd_scratch == 0 {
                        "".into()
                    } else {
                        fmt_bytes(r.bwd_scratch)
                    },
                ]);
            }
            o.push_str(&t.render());
        }
    } else {
        o.push_str("(--inventory prints every op of each segment with what it keeps)\n");
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_get_separators() {
        assert_eq!(fmt_count(675_129_632), "675,129,632");
        assert_eq!(fmt_count(12), "12");
    }

    #[test]
    fn table_aligns() {
        let mut t = Table::new(&["a", "bb"]);
        t.row(vec!["long name".into(), "1".into()]);
        let s = t.render();
        assert!(s.contains("long name   1"));
    }
}
