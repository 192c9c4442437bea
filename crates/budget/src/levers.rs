//! One change at a time: the levers a user can pull on a spec, each estimated alone.
//!
//! `estimate` answers "and what should I change?" with the one lever that helps most; the
//! planner searches combinations (`plan.rs`). A lever here is a single edit of the spec a user
//! can make with one flag (recompute, attention, microbatch, optimizer, encoders, allocator
//! setting, ZeRO stage, LoRA), budgeted like any spec, with its predicted step time on the
//! same device profile so that a lever that fits can be ranked by what it costs.

use serde::Serialize;

use crate::cost::{step_time, DeviceProfile};
use crate::error::SpecError;
use crate::estimate::{estimate, Budget};
use crate::plan::PLAN_LORA_RANK;
use crate::spec::{
    AttentionMode, Latents, LoraSpec, Optimizer, Precision, Recompute, Runtime, Spec, TextEncoders,
    TorchDevice,
};

/// One single-flag change and what it does to the step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Lever {
    /// What changes, in words ("recompute all 57 blocks").
    pub change: String,
    /// The flag that makes it (`--recompute all`).
    pub flag: String,
    /// The spec with the change.
    #[serde(skip)]
    pub spec: Spec,
    /// What has to fit on the device (see [`need_bytes`]).
    pub need_bytes: u64,
    /// Whether it fits the spec's GPU; `None` without a GPU.
    pub fits: Option<bool>,
    /// Predicted step time, and its ratio to the unchanged spec's.
    pub step_time_s: f64,
    pub slowdown: f64,
    /// Whether the change alters what is trained or how it is rounded (LoRA, precision, 8-bit
    /// state), not only where the bytes go.
    pub changes_training: bool,
}

/// What has to fit on the device for a budget: on `pytorch:cuda` what `nvidia-smi` would show
/// (reserved segments + context), and when the allocator's replay ran out of the card, at least
/// the step's allocated peak plus the context (the replay stops at the failing request, so its
/// own maxima undercount); elsewhere the step's peak.
pub fn need_bytes(b: &Budget) -> u64 {
    match &b.cuda {
        Some(c) if c.oom.is_some() => c.device_bytes.max(b.peak.bytes + c.context_bytes),
        Some(c) => c.device_bytes,
        None => b.peak.bytes,
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

/// The single-flag changes that apply to `base`, each as (change, flag, spec, changes training).
fn candidates(base: &Spec) -> Vec<(String, String, Spec, bool)> {
    let mut out = Vec::new();
    let r = &base.recipe;
    let cuda = matches!(
        base.runtime,
        Runtime::Pytorch {
            device: TorchDevice::Cuda,
            ..
        }
    );
    let mut push = |change: String, flag: &str, edit: &dyn Fn(&mut Spec), training: bool| {
        let mut s = base.clone();
        edit(&mut s);
        out.push((change, flag.to_string(), s, training));
    };
    if r.recompute != Recompute::All {
        push(
            format!("recompute all {} blocks", base.model.depth),
            "--recompute all",
            &|s| s.recipe.recompute = Recompute::All,
            false,
        );
    }
    if r.attention == AttentionMode::Materialized {
        push(
            "memory-efficient attention".into(),
            "--attention memory-efficient",
            &|s| s.recipe.attention = AttentionMode::MemoryEfficient,
            false,
        );
    }
    let w = &base.workload;
    if w.microbatch > 1 {
        let micro = w.microbatch / 2;
        let acc = w.accumulation.saturating_mul(w.microbatch / micro.max(1));
        if micro * acc * w.ranks == w.batch {
            push(
                format!("microbatch {micro} × accumulation {acc} (same batch)"),
                &format!("--microbatch {micro} --accumulation {acc}"),
                &|s| {
                    s.workload.microbatch = micro;
                    s.workload.accumulation = acc;
                },
                false,
            );
        }
    }
    if r.latents == Latents::Encode {
        push(
            "cache the latents (no VAE in the step)".into(),
            "--latents cached",
            &|s| s.recipe.latents = Latents::Cached,
            false,
        );
    }
    if !r.text_encoders.is_cached() {
        push(
            "cache the caption embeddings (no text encoder in the step)".into(),
            "--text-encoders cached",
            &|s| s.recipe.text_encoders = TextEncoders::Cached,
            false,
        );
    }
    if r.optimizer == Optimizer::AdamW && cuda {
        push(
            "8-bit AdamW (bitsandbytes)".into(),
            "--optimizer adamw-8bit",
            &|s| s.recipe.optimizer = Optimizer::AdamW8bit,
            true,
        );
    }
    if cuda {
        let conf = base
            .cuda
            .as_ref()
            .map(|c| c.alloc_conf.clone())
            .unwrap_or_default();
        if !conf.contains("expandable_segments") {
            let joined = if conf.is_empty() {
                crate::plan::EXPANDABLE_SEGMENTS.to_string()
            } else {
                format!("{conf},{}", crate::plan::EXPANDABLE_SEGMENTS)
            };
            push(
                format!("PYTORCH_CUDA_ALLOC_CONF={joined}"),
                &format!("--alloc-conf {joined}"),
                &|s| {
                    s.cuda.get_or_insert_with(Default::default).alloc_conf = joined.clone();
                },
                false,
            );
        }
    }
    if w.ranks > 1 && r.zero_stage < 3 {
        let stage = r.zero_stage + 1;
        push(
            format!("ZeRO stage {stage} over {} ranks", w.ranks),
            &format!("--zero {stage}"),
            &|s| s.recipe.zero_stage = stage,
            false,
        );
    }
    if r.lora.is_none() && base.model.diffusers.is_some() {
        push(
            format!("LoRA rank {PLAN_LORA_RANK} on the frozen base (trains adapters only)"),
            &format!("--lora-rank {PLAN_LORA_RANK}"),
            &|s| {
                s.recipe.lora = Some(LoraSpec {
                    rank: PLAN_LORA_RANK,
                    targets: crate::spec::default_lora_targets(),
                    modules: Vec::new(),
                })
            },
            true,
        );
    }
    if r.precision == Precision::Fp32 && cuda {
        push(
            "bf16 mixed precision".into(),
            "--precision bf16-mixed",
            &|s| s.recipe.precision = Precision::Bf16Mixed,
            true,
        );
    }
    out
}

/// Every single-flag lever of `base` that the budget accepts, budgeted, in the order of
/// [`rank`]. A change the spec's runtime or family refuses is left out.
pub fn levers(base: &Spec, base_budget: &Budget) -> Vec<Lever> {
    let profile = profile_for(base);
    let base_time = step_time(base, &profile).total_s.max(1e-12);
    let base_need = need_bytes(base_budget);
    let mut out: Vec<Lever> = candidates(base)
        .into_iter()
        .filter_map(|(change, flag, spec, changes_training)| {
            let b = estimate(&spec).ok()?;
            let need = need_bytes(&b);
            // A lever that saves nothing is not one.
            if need >= base_need {
                return None;
            }
            let t = step_time(&spec, &profile).total_s;
            Some(Lever {
                change,
                flag,
                fits: fits(&b),
                need_bytes: need,
                step_time_s: t,
                slowdown: t / base_time,
                changes_training,
                spec,
            })
        })
        .collect();
    rank(&mut out);
    out
}

/// The order levers are offered in: those that fit first, and among them those that leave
/// training as it is, then the least slowdown; those that do not fit by what they save.
pub fn rank(levers: &mut [Lever]) {
    levers.sort_by(|a, b| {
        let fit = |l: &Lever| l.fits != Some(true);
        fit(a)
            .cmp(&fit(b))
            .then_with(|| {
                if a.fits == Some(true) && b.fits == Some(true) {
                    a.changes_training
                        .cmp(&b.changes_training)
                        .then(a.slowdown.total_cmp(&b.slowdown))
                } else {
                    a.need_bytes.cmp(&b.need_bytes)
                }
            })
            .then_with(|| a.change.cmp(&b.change))
    });
}

/// The one change `estimate` names: the best-ranked lever.
pub fn best(base: &Spec, base_budget: &Budget) -> Result<Option<Lever>, SpecError> {
    Ok(levers(base, base_budget).into_iter().next())
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
        });
        s
    }

    #[test]
    fn every_lever_saves_bytes_and_the_first_that_fits_leads() {
        // DiT-XL/2 at 256², batch 32 on a 24 GB card: activations dominate, recompute fits.
        let s = on("rtx-4090");
        let b = estimate(&s).unwrap();
        let ls = levers(&s, &b);
        assert!(!ls.is_empty());
        for l in &ls {
            assert!(l.need_bytes < need_bytes(&b), "{}", l.change);
        }
        let first_non_fit = ls.iter().position(|l| l.fits != Some(true));
        if let Some(i) = first_non_fit {
            assert!(ls[i..].iter().all(|l| l.fits != Some(true)));
        }
        assert!(ls[0].fits.is_some());
    }

    #[test]
    fn a_lever_already_pulled_is_not_offered() {
        let mut s = on("h100-sxm");
        s.recipe.recompute = Recompute::All;
        let b = estimate(&s).unwrap();
        assert!(levers(&s, &b).iter().all(|l| l.flag != "--recompute all"));
    }
}
