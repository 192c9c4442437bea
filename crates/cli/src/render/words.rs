//! A spec in words and flags: one line for the spec and the recipe, the changes between two
//! specs as tags and as command-line flags.

use super::table::fmt_count;
use ditmem_budget::fmt_bytes;
use ditmem_budget::Spec;

/// One line describing the spec: model, resolution (frames for video), tokens, and the batch
/// as the user meant it: per rank unless there are several ranks or microbatches to say so.
pub(crate) fn spec_line(spec: &Spec) -> String {
    let w = &spec.workload;
    let frames = if w.frames > 1 {
        format!("{} frames × ", w.frames)
    } else {
        String::new()
    };
    format!(
        "{} {frames}{}×{} ({} tokens), {}",
        spec.model.name,
        w.height,
        w.width,
        fmt_count(spec.tokens().unwrap_or(0)),
        batch_words(w)
    )
}

/// The batch in words: "batch 1", "batch 8 = 1 per rank × 8 ranks", "batch 32 = microbatch 4 ×
/// accumulation 8".
pub(crate) fn batch_words(w: &ditmem_budget::Workload) -> String {
    let per_rank = if w.accumulation > 1 {
        format!(
            "microbatch {} × accumulation {}",
            w.microbatch, w.accumulation
        )
    } else {
        format!("{}", w.microbatch)
    };
    match (w.ranks, w.accumulation) {
        (1, 1) => format!("batch {}", w.batch),
        (1, _) => format!("batch {} = {per_rank}", w.batch),
        (r, 1) => format!("batch {} = {per_rank} per rank × {r} ranks", w.batch),
        (r, _) => format!("batch {} = ({per_rank}) per rank × {r} ranks", w.batch),
    }
}

/// One line describing the recipe.
pub(crate) fn recipe_line(spec: &Spec) -> String {
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
            " ({} thread{}, bf16 products {}, gemm slab {} per thread)",
            c.threads,
            if c.threads == 1 { "" } else { "s" },
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

/// The recipe in a few words, for the first line: precision, LoRA, recompute, sharding, where.
pub(crate) fn short_recipe(spec: &Spec) -> String {
    let r = &spec.recipe;
    let mut parts = vec![r.precision.to_string()];
    if let Some(l) = &r.lora {
        parts.push(if r.base_quant.is_none() {
            format!("LoRA rank {}", l.rank)
        } else {
            format!("LoRA rank {} on {}", l.rank, r.base_quant.name())
        });
    }
    if r.recompute != ditmem_budget::Recompute::None {
        parts.push(format!("recompute {}", r.recompute));
    }
    if !matches!(
        ditmem_budget::Scheme::of(spec),
        ditmem_budget::Scheme::Single
    ) {
        parts.push(ditmem_budget::Scheme::of(spec).describe().to_string());
    }
    let gpu = spec.cuda.as_ref().and_then(|c| c.gpu.as_deref());
    // Line 2 names the card (or the catalog's) on CUDA; elsewhere say where it runs.
    let place = match (spec.runtime, gpu) {
        (_, Some(g)) => format!("; on {g}"),
        (
            ditmem_budget::Runtime::Pytorch {
                device: ditmem_budget::TorchDevice::Cuda,
                ..
            },
            None,
        ) => String::new(),
        (rt, None) => format!("; on {rt}"),
    };
    format!("{}{place}", parts.join(", "))
}

/// The changes from `base` to `s` as short tags ("recompute 22/57", "nf4 base", "8-bit AdamW"),
/// for tables and plot labels; the planner's own words (`Candidate::changes`) are the long form.
pub(crate) fn change_tags(base: &Spec, s: &Spec) -> Vec<String> {
    use ditmem_budget::Recompute;
    let (b, r) = (&base.recipe, &s.recipe);
    let mut out = Vec::new();
    if b.precision != r.precision {
        out.push(r.precision.to_string());
    }
    if b.recompute != r.recompute {
        out.push(match &r.recompute {
            Recompute::All => "recompute all".into(),
            Recompute::None => "no recompute".into(),
            Recompute::AttentionOnly => "recompute attention".into(),
            Recompute::Blocks(v) => format!("recompute {}/{}", v.len(), s.model.depth),
            other => format!("recompute {other}"),
        });
    }
    if b.attention != r.attention {
        out.push(match r.attention {
            ditmem_budget::AttentionMode::MemoryEfficient => "mem-efficient attention".into(),
            a => format!("{} attention", a.name()),
        });
    }
    let (bw, w) = (&base.workload, &s.workload);
    if bw.microbatch != w.microbatch || bw.accumulation != w.accumulation {
        out.push(format!("mb {}×acc {}", w.microbatch, w.accumulation));
    }
    if b.latents != r.latents {
        out.push(match r.latents {
            ditmem_budget::Latents::Cached => "cached latents".into(),
            ditmem_budget::Latents::Encode => "VAE in the step".into(),
        });
    }
    if b.text_encoders != r.text_encoders {
        out.push(format!("text encoders {}", r.text_encoders.name()));
    }
    match (&b.lora, &r.lora) {
        (Some(bl), Some(l)) if bl.rank == l.rank => {
            // The same adapters on other modules or in another dtype (a script's own).
            let mut what = Vec::new();
            if bl.modules != l.modules && !l.modules.is_empty() {
                what.push(format!("{} modules", l.modules.len()));
            }
            if bl.dtype != l.dtype {
                what.push(format!("{} dtype", l.dtype.name()));
            }
            if !what.is_empty() {
                out.push(format!("LoRA {}", what.join(", ")));
            }
        }
        (_, Some(l)) if b.lora != r.lora => out.push(format!("LoRA r{}", l.rank)),
        (Some(_), None) => out.push("no LoRA".into()),
        _ => {}
    }
    if b.ema.enabled != r.ema.enabled {
        out.push(if r.ema.enabled { "EMA" } else { "no EMA" }.into());
    }
    if b.base_quant != r.base_quant {
        out.push(format!("{} base", r.base_quant.name()));
    }
    if b.optimizer != r.optimizer {
        out.push(match r.optimizer {
            ditmem_budget::Optimizer::AdamW8bit => "8-bit AdamW".into(),
            o => o.name().to_string(),
        });
    }
    if b.zero_stage != r.zero_stage || b.sharder != r.sharder || b.offload != r.offload {
        out.push(ditmem_budget::Scheme::of(s).describe());
    }
    if base.alloc_conf() != s.alloc_conf() {
        out.push(if s.alloc_conf().contains("expandable_segments:True") {
            "expandable segments".into()
        } else {
            format!("alloc {}", s.alloc_conf())
        });
    }
    out
}

/// A recompute policy as a flag value, runs of three or more blocks written `I-J`
/// (`blocks:0-21,23`; the parser reads both forms).
pub(crate) fn recompute_flag(r: &ditmem_budget::Recompute) -> String {
    let ditmem_budget::Recompute::Blocks(v) = r else {
        return r.to_string();
    };
    let mut parts = Vec::new();
    let mut k = 0;
    while k < v.len() {
        let mut j = k;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        if j >= k + 2 {
            parts.push(format!("{}-{}", v[k], v[j]));
        } else {
            parts.extend(v[k..=j].iter().map(u32::to_string));
        }
        k = j + 1;
    }
    format!("blocks:{}", parts.join(","))
}

/// The `ditmem` flags that turn `base` into `s` (what to add to the command line to estimate or
/// run the plan; `--out` writes the whole spec).
pub(crate) fn change_flags(base: &Spec, s: &Spec) -> Vec<String> {
    let (b, r) = (&base.recipe, &s.recipe);
    let mut out = Vec::new();
    if b.precision != r.precision {
        out.push(format!("--precision {}", r.precision));
    }
    if b.recompute != r.recompute {
        out.push(format!("--recompute {}", recompute_flag(&r.recompute)));
    }
    if b.attention != r.attention {
        out.push(format!("--attention {}", r.attention.name()));
    }
    let (bw, w) = (&base.workload, &s.workload);
    if bw.microbatch != w.microbatch || bw.accumulation != w.accumulation {
        out.push(format!(
            "--microbatch {} --accumulation {}",
            w.microbatch, w.accumulation
        ));
    }
    if b.latents != r.latents {
        out.push(
            match r.latents {
                ditmem_budget::Latents::Cached => "--latents cached",
                ditmem_budget::Latents::Encode => "--latents encode",
            }
            .into(),
        );
    }
    if b.text_encoders != r.text_encoders {
        out.push(format!("--text-encoders {}", r.text_encoders.name()));
    }
    if b.lora != r.lora {
        out.push(format!(
            "--lora-rank {}",
            r.lora.as_ref().map_or(0, |l| l.rank)
        ));
    }
    if b.base_quant != r.base_quant {
        out.push(format!("--base-quant {}", r.base_quant.name()));
    }
    if b.optimizer != r.optimizer {
        out.push(format!("--optimizer {}", r.optimizer.name()));
    }
    if b.zero_stage != r.zero_stage {
        out.push(format!("--zero {}", r.zero_stage));
    }
    if b.sharder != r.sharder {
        out.push(format!("--sharder {}", r.sharder));
    }
    if b.offload != r.offload {
        out.push(format!("--offload {}", r.offload));
    }
    if base.alloc_conf() != s.alloc_conf() {
        out.push(format!("--alloc-conf {}", s.alloc_conf()));
    }
    out
}
