//! The plan in words: the changes from the base, why it was chosen, why nothing fits.

use crate::cost::DeviceProfile;
use crate::events::Breakdown;
use crate::spec::{
    Latents, LoraDtype, LoraSpec, Optimizer, Precision, Recompute, Spec, TextEncoders,
};
use crate::units::fmt_bytes;

use super::types::*;

pub(super) fn describe_changes(base: &Spec, s: &Spec) -> Vec<String> {
    let (b, r) = (&base.recipe, &s.recipe);
    let mut out = Vec::new();
    if b.precision != r.precision {
        out.push(format!("precision {} → {}", b.precision, r.precision));
    }
    if b.recompute != r.recompute {
        let what = match &r.recompute {
            Recompute::Blocks(v) if v.iter().copied().eq(0..v.len() as u32) => format!(
                "recompute the first {} of {} blocks",
                v.len(),
                s.model.depth
            ),
            Recompute::Blocks(v) => format!(
                "recompute {} of {} blocks ({})",
                v.len(),
                s.model.depth,
                r.recompute
            ),
            Recompute::All => format!("recompute all {} blocks", s.model.depth),
            Recompute::None => "recompute nothing".into(),
            Recompute::AttentionOnly => "recompute the attention core only".into(),
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
        out.push(match r.latents {
            Latents::Cached => "cache the latents (no VAE in the step)".into(),
            Latents::Encode => "encode the latents in the step (the VAE runs every step)".into(),
        });
    }
    if b.text_encoders != r.text_encoders {
        out.push(match r.text_encoders {
            TextEncoders::Online => "the text encoders on the device, run every step".into(),
            TextEncoders::Offloaded => "the text encoders on the host, moved in to encode".into(),
            TextEncoders::Cached => "cached text embeddings (no text encoder in the step)".into(),
        });
    }
    if base.workload.text_tokens != s.workload.text_tokens {
        if let Some(t) = &s.workload.text_tokens {
            let t: Vec<String> = t.iter().map(u32::to_string).collect();
            out.push(format!("text tokens {}", t.join(" + ")));
        }
    }
    if b.ema.enabled != r.ema.enabled {
        out.push(
            if r.ema.enabled {
                "an EMA copy"
            } else {
                "no EMA copy"
            }
            .into(),
        );
    }
    out.extend(lora_changes(b.lora.as_ref(), r.lora.as_ref()));
    if b.base_quant != r.base_quant {
        out.push(format!(
            "base stored {} (bitsandbytes; the adapters train in the compute dtype)",
            r.base_quant.name()
        ));
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
            "ZeRO stage {} over {} ranks ({})",
            r.zero_stage,
            s.workload.ranks,
            crate::sharding::Scheme::of(s).describe()
        ));
    }
    if base.alloc_conf() != s.alloc_conf() {
        out.push(format!(
            "PYTORCH_CUDA_ALLOC_CONF={} (the allocated peak fits, the cached segments do not)",
            s.alloc_conf()
        ));
    }
    out
}

/// What changes of LoRA from `b` to `r`: adapters added, their rank, the modules they adapt,
/// the dtype they are kept in.
fn lora_changes(b: Option<&LoraSpec>, r: Option<&LoraSpec>) -> Vec<String> {
    let (b, r) = match (b, r) {
        (_, None) => return Vec::new(),
        (None, Some(r)) => return vec![format!("LoRA rank {} (base frozen)", r.rank)],
        (Some(b), Some(r)) => (b, r),
    };
    let mut out = Vec::new();
    if b.rank != r.rank {
        out.push(format!("LoRA rank {} → {}", b.rank, r.rank));
    }
    if b.modules != r.modules && !r.modules.is_empty() {
        let first: Vec<&str> = r.modules.iter().take(3).map(String::as_str).collect();
        let more = if r.modules.len() > 3 { ", …" } else { "" };
        out.push(format!(
            "LoRA on {} module names ({}{more})",
            r.modules.len(),
            first.join(", ")
        ));
    }
    if b.dtype != r.dtype {
        out.push(match r.dtype {
            LoraDtype::Weight => "LoRA adapters in the weights' dtype (no fp32 copy)".into(),
            LoraDtype::Fp32 => "LoRA adapters in fp32".into(),
        });
    }
    out
}

/// The smallest peak a search found ([`infeasible_reason`]): its bytes, what they hold, and its
/// changes from the base.
pub(super) struct Floor<'a> {
    pub peak: u64,
    pub breakdown: &'a Breakdown,
    pub changes: &'a [String],
}

/// Why no recipe fits: the smallest peak, what dominates it, and what would widen the search.
/// Under a diffusers `script` the levers no flag of it runs (a quantized base, bf16-pure) are
/// not offered: `--launcher custom` is, which opens them and a partial recompute.
pub(super) fn infeasible_reason(
    limits: &Limits,
    base: &Spec,
    usable: u64,
    floor: Floor<'_>,
    script: Option<&crate::export::Script>,
) -> String {
    let (dom, dom_bytes) = floor.breakdown.dominant();
    let ranks = base.workload.ranks;
    let flagless = |lever: &str| script.is_some() && matches!(lever, "quant" | "bf16-pure");
    let missing: Vec<&str> = [
        // The lever adds adapters to a full fine-tune.
        (!limits.allow.lora && base.recipe.lora.is_none(), "lora"),
        (!limits.allow.eight_bit, "8bit"),
        (!limits.allow.sharding && ranks > 1, "sharding"),
        (!limits.allow.bf16_pure, "bf16-pure"),
        (!limits.allow.precision, "precision"),
        (!limits.allow.quant, "quant"),
    ]
    .into_iter()
    .filter_map(|(m, n)| (m && !flagless(n)).then_some(n))
    .collect();
    format!(
            "no recipe in the allowed space fits {} usable ({} budget less {:.0} % headroom): the smallest \
             peak is {} ({}), where {} {} with {} ({:.0} %){}{}{}",
            fmt_bytes(usable),
            fmt_bytes(limits.budget_bytes),
            100.0 * limits.headroom,
            fmt_bytes(floor.peak),
            changes_or_base(floor.changes),
            dom.replace('_', " "),
            verb(dom, "dominate", "dominates"),
            fmt_bytes(dom_bytes),
            100.0 * dom_bytes as f64 / floor.peak.max(1) as f64,
            if missing.is_empty() {
                String::new()
            } else {
                format!("; --allow {} widens the search", missing.join(","))
            },
            match script {
                Some(s) => format!(
                    "; {} runs no partial recompute, quantized base or bf16-pure: --launcher custom \
                     (your own script) opens them",
                    s.file_name()
                ),
                None => String::new(),
            },
            if ranks == 1 {
                "; sharding (ZeRO) needs --ranks N > 1"
            } else {
                ""
            }
        )
}

pub(super) fn explain(
    base: &Spec,
    base_c: &Candidate,
    chosen: &Candidate,
    usable: u64,
    profile: &DeviceProfile,
) -> String {
    let (dom, dom_bytes) = base_c.breakdown.dominant();
    let share = 100.0 * dom_bytes as f64 / base_c.peak_bytes.max(1) as f64;
    let w = &base.workload;
    if chosen.changes.is_empty() {
        return format!(
            "the base spec already fits: its peak {} is within {} usable, and no recipe that fits is \
             predicted faster on {}; nothing to change",
            fmt_bytes(base_c.peak_bytes),
            fmt_bytes(usable),
            profile.name
        );
    }
    let speed = |c: &Candidate| {
        format!(
            "predicted step {} (base {}, {:+.1} %) on {}",
            fmt_secs(c.time.total_s),
            fmt_secs(base_c.time.total_s),
            100.0 * (c.time.total_s / base_c.time.total_s.max(f64::MIN_POSITIVE) - 1.0),
            profile.name
        )
    };
    let mut s = if base_c.peak_bytes <= usable {
        format!(
            "the base fits ({} of {} usable), but {} is predicted faster and fits too → peak {}, {}",
            fmt_bytes(base_c.peak_bytes),
            fmt_bytes(usable),
            chosen.changes.join("; "),
            fmt_bytes(chosen.peak_bytes),
            speed(chosen)
        )
    } else {
        format!(
            "{} {} {:.0} % of the base peak ({} of {}) at {}×{}, over {} usable: {} → peak {}, {}",
            dom.replace('_', " "),
            verb(dom, "are", "is"),
            share,
            fmt_bytes(dom_bytes),
            fmt_bytes(base_c.peak_bytes),
            w.height,
            w.width,
            fmt_bytes(usable),
            chosen.changes.join("; "),
            fmt_bytes(chosen.peak_bytes),
            speed(chosen)
        )
    };
    let (b, r) = (&base.recipe, &chosen.spec.recipe);
    let mut not_needed = Vec::new();
    if r.precision != Precision::Fp16Mixed && b.precision != Precision::Fp16Mixed {
        not_needed.push("fp16");
    }
    if r.lora.is_none() && b.lora.is_none() {
        not_needed.push("LoRA");
    }
    if r.optimizer == b.optimizer && b.optimizer == Optimizer::AdamW {
        not_needed.push("8-bit AdamW");
    }
    if r.zero_stage == b.zero_stage && w.ranks > 1 {
        not_needed.push("sharding");
    }
    if !not_needed.is_empty() {
        let verb = if not_needed.len() == 1 { "was" } else { "were" };
        s.push_str(&format!("; {} {verb} not needed", not_needed.join(", ")));
    }
    if chosen.spec.workload.microbatch == w.microbatch && w.microbatch > 1 {
        s.push_str("; the microbatch is kept");
    }
    s
}

/// `plural` or `singular` as the breakdown's `category` takes ("weights dominate", "optimizer
/// state dominates").
pub(super) fn verb(category: &str, plural: &'static str, singular: &'static str) -> &'static str {
    if Breakdown::is_plural(category) {
        plural
    } else {
        singular
    }
}

/// The changes of a recipe in words, comma-separated, or "the base" when there are none.
pub(super) fn changes_or_base(changes: &[String]) -> String {
    if changes.is_empty() {
        "the base".to_string()
    } else {
        changes.join(", ")
    }
}
