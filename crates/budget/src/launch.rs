//! What the launcher of a plan can run, as constraints of the search.
//!
//! A plan exported for the diffusers example scripts (`--emit diffusers`, or the accelerate /
//! DeepSpeed configs whose launch line names such a script) runs the script as it is written, not
//! the recipe the budget would like: its gradient checkpointing is all blocks or none, its caching
//! and quantization are what its flags allow, and it keeps some frozen parts resident whatever the
//! plan says. [`Launch::realise`] maps a candidate recipe onto what the script runs — or says why
//! the script cannot run it — so that the planner searches, and prints the figures of, exactly the
//! recipe the export launches. `custom` (your own train script) keeps the whole space; the export
//! then carries the code for what no script flag does.
//!
//! Each behaviour below cites the line of the script at diffusers [`DIFFUSERS_TAG`]
//! ([`DIFFUSERS_COMMIT`](crate::export::scripts::DIFFUSERS_COMMIT)) it comes from.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::error::SpecError;
use crate::export::{script_for, Script, DIFFUSERS_TAG};
use crate::families::Family;
use crate::spec::{
    AttentionMode, BaseQuant, Latents, LoraDtype, Optimizer, Precision, Recipe, Recompute, Spec,
    TextEncoders,
};

/// Who launches the plan: a diffusers example script (directly, or through the accelerate /
/// DeepSpeed configs whose launch line names it), or your own script.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Launcher {
    /// Your own train script: every lever of the space; the export carries the code for what no
    /// flag does (blocks i…j checkpointed, an NF4 base).
    #[default]
    Custom,
    /// `accelerate launch` of the family's diffusers script (`--emit diffusers`).
    Diffusers,
    /// `accelerate launch --config_file accelerate_config.yaml` of the family's script.
    Accelerate,
    /// The same, under DeepSpeed (`ds_config.json`).
    Deepspeed,
}

impl Launcher {
    pub const fn name(self) -> &'static str {
        match self {
            Launcher::Custom => "custom",
            Launcher::Diffusers => "diffusers",
            Launcher::Accelerate => "accelerate",
            Launcher::Deepspeed => "deepspeed",
        }
    }

    /// Whether the launch runs a diffusers example script (where the family has one).
    pub(crate) const fn runs_script(self) -> bool {
        !matches!(self, Launcher::Custom)
    }
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Launcher {
    type Err = SpecError;
    fn from_str(s: &str) -> Result<Self, SpecError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "custom" => Ok(Launcher::Custom),
            "diffusers" => Ok(Launcher::Diffusers),
            "accelerate" => Ok(Launcher::Accelerate),
            "deepspeed" | "ds" => Ok(Launcher::Deepspeed),
            _ => Err(SpecError::invalid(
                "plan.launcher",
                format!(
                    "'{}' is not a launcher; allowed: diffusers, accelerate, deepspeed, custom",
                    s.chars().take(60).collect::<String>()
                ),
            )),
        }
    }
}

/// The recipe fields the user set (a flag, or the `--config` file): the planner never changes
/// them, and a launcher that cannot run them is an error rather than a silent change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Pinned {
    pub latents: bool,
    pub recompute: bool,
    pub attention: bool,
    pub microbatch: bool,
    pub zero_stage: bool,
    pub text_encoders: bool,
    pub lora_modules: bool,
    pub ema: bool,
    /// `workload.text_tokens` given (`--text-tokens` or the spec file).
    pub text_tokens: bool,
}

/// The launcher, the family its script is chosen by, and what the user pinned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Launch {
    pub launcher: Launcher,
    pub family: Family,
    pub pinned: Pinned,
}

impl Default for Launch {
    /// Your own script: the whole space.
    fn default() -> Self {
        Launch {
            launcher: Launcher::Custom,
            family: Family::Dit,
            pinned: Pinned::default(),
        }
    }
}

/// One behaviour of a diffusers script that the plan follows, with its source line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) struct Behaviour {
    pub what: &'static str,
    /// `file:line` at [`DIFFUSERS_TAG`].
    pub source: &'static str,
}

/// The SD3 scripts' validation (`--validation_prompt`, not in the export): at the end of epoch 0
/// they reload the three text encoders, cast them to `weight_dtype` and build a
/// `StableDiffusion3Pipeline` around them, which `log_validation` moves to the device;
/// `log_validation`'s `del pipeline` drops its own name and `del text_encoder_one, …` the
/// script's, but `main()`'s `pipeline` still holds the pipeline, so from epoch 1 on CLIP-L,
/// CLIP-G and T5-XXL stay on the device (10.4 GiB in fp16) through every training step.
pub(crate) const SD3_VALIDATION_KEEPS_ENCODERS: &str =
    "with --validation_prompt (not in this export) the validation pipeline built at the end of \
     epoch 0 stays referenced by main()'s `pipeline` (log_validation's `del pipeline` drops its \
     own name only), so from epoch 1 on the three text encoders stay on the device in \
     weight_dtype, not run: plan such a run with --text-encoders online to count them";

/// The behaviours of `script` the plan models (what stays resident, what the flags allow).
pub(crate) fn behaviours(script: &Script) -> Vec<Behaviour> {
    let b = |what, source| Behaviour { what, source };
    let mut out = vec![b(
        "gradient checkpointing is all blocks or none (transformer.enable_gradient_checkpointing())",
        match script.file_name() {
            "train_dreambooth_lora_flux.py" => "train_dreambooth_lora_flux.py:1249-1250",
            "train_dreambooth_flux.py" => "train_dreambooth_flux.py:1212-1213",
            "train_dreambooth_sd3.py" => "train_dreambooth_sd3.py:1173-1174",
            "train_dreambooth_lora_sd3.py" => "train_dreambooth_lora_sd3.py:1243-1244",
            _ => "train_dreambooth_lora_sana.py:1039-1040",
        },
    )];
    out.push(b(
        "no option stores the frozen base quantized (no NF4 / int8 flag in parse_args)",
        "parse_args",
    ));
    match script.file_name() {
        "train_dreambooth_lora_flux.py" => {
            out.push(b(
                "the text encoders stay on the device: `del text_encoder_one, text_encoder_two` \
                 leaves them in the `text_encoders` list, and each step re-encodes the batch's \
                 prompts with them",
                "train_dreambooth_lora_flux.py:1492,1521,1738-1740",
            ));
        }
        "train_dreambooth_lora_sana.py" => {
            out.push(b(
                "Gemma-2 stays in the text-encoding pipeline (`del text_encoder` drops a name \
                 only), on the device unless --offload moves it back to the CPU after encoding",
                "train_dreambooth_lora_sana.py:1031-1037,1222,1229-1230,1250",
            ));
            out.push(b(
                "the whole AutoencoderDC (fp32) is moved to the device to encode and stays there \
                 unless --offload: its decoder, never run in the step, is counted resident",
                "train_dreambooth_lora_sana.py:1017,1389-1393",
            ));
        }
        "train_dreambooth_lora_sd3.py" => {
            out.push(b(
                "--cache_latents casts the images to weight_dtype while the VAE stays fp32: under \
                 fp16/bf16 the VAE's conv fails (Input type and bias type should be the same), so \
                 latents are cached only with --mixed_precision no",
                "train_dreambooth_lora_sd3.py:1237,1596-1599",
            ));
            out.push(b(
                "with one --instance_prompt the text encoders are freed after encoding it once",
                "train_dreambooth_lora_sd3.py:1559-1563",
            ));
            out.push(b(
                SD3_VALIDATION_KEEPS_ENCODERS,
                "train_dreambooth_lora_sd3.py:1903-1933,199,224",
            ));
        }
        "train_dreambooth_flux.py" => {
            out.push(b(
                "no --cache_latents: the VAE encodes every step",
                "train_dreambooth_flux.py:1575,1607",
            ));
            out.push(b(
                "with one --instance_prompt the text encoders are freed after encoding it once",
                "train_dreambooth_flux.py:1411-1418",
            ));
        }
        "train_dreambooth_sd3.py" => {
            out.push(b(
                "no --cache_latents: the VAE encodes every step",
                "train_dreambooth_sd3.py:1555,1570",
            ));
            out.push(b(
                "with one --instance_prompt the text encoders are freed after encoding it once",
                "train_dreambooth_sd3.py:1398-1402",
            ));
            out.push(b(
                SD3_VALIDATION_KEEPS_ENCODERS,
                "train_dreambooth_sd3.py:1716-1747,175,200",
            ));
        }
        _ => {}
    }
    if script.lora {
        out.push(b(
            "the LoRA adapters are upcast to fp32 only under fp16; under bf16 they, their \
             gradients and AdamW's state stay bf16 (the plan counts them so on one rank: \
             lora.dtype = weight; over several ranks it counts fp32 adapters)",
            match script.file_name() {
                "train_dreambooth_lora_flux.py" => "train_dreambooth_lora_flux.py:1379-1384",
                "train_dreambooth_lora_sd3.py" => "train_dreambooth_lora_sd3.py:1408-1413",
                _ => "train_dreambooth_lora_sana.py:1132-1135",
            },
        ));
    }
    out
}

/// The text tokens per encoder a diffusers script encodes with its `--max_sequence_length`
/// default (T5 for Flux and SD3 after CLIP's fixed 77; Gemma-2 for Sana), at v0.40.0:
/// train_dreambooth_flux.py:329-331 (77; the LoRA script's 512, train_dreambooth_lora_flux.py:
/// 349-351, whatever the checkpoint: FLUX.1-schnell's pipeline default is 256),
/// train_dreambooth_sd3.py:315-317 and train_dreambooth_lora_sd3.py:339-341 (77),
/// train_dreambooth_lora_sana.py:308-310 (300). Measured: the full Flux export on a tiny
/// pipeline encodes 77 T5 tokens (bench/ecosystem/runs/2026-12-06-epyc-end-to-end).
/// Keyed by the spec's diffusers `_class_name`: a model the script does not load (the
/// original DiT exported with `--emit-family flux`) keeps its own tokens.
pub(crate) fn script_text_tokens(file_name: &str, spec: &Spec) -> Option<&'static [u32]> {
    let class = spec
        .model
        .diffusers
        .as_ref()
        .and_then(|m| m.get("_class_name"))
        .and_then(|v| v.as_str())
        .unwrap_or("");
    match (file_name, class) {
        ("train_dreambooth_flux.py", "FluxTransformer2DModel") => Some(&[77, 77]),
        ("train_dreambooth_lora_flux.py", "FluxTransformer2DModel") => Some(&[77, 512]),
        ("train_dreambooth_sd3.py" | "train_dreambooth_lora_sd3.py", "SD3Transformer2DModel") => {
            Some(&[77, 77])
        }
        ("train_dreambooth_lora_sana.py", "SanaTransformer2DModel") => Some(&[300]),
        _ => None,
    }
}

/// Why a launcher cannot run a recipe.
fn cannot(script: &Script, what: impl fmt::Display) -> String {
    format!(
        "{} (diffusers {DIFFUSERS_TAG}) cannot {what}; plan with --launcher custom to keep it \
         (your own script, with the code in the export)",
        script.file_name()
    )
}

impl Launch {
    /// The diffusers script a recipe launches, if the launcher runs one and the family has it.
    pub fn script(&self, spec: &Spec) -> Option<Script> {
        if !self.launcher.runs_script() {
            return None;
        }
        script_for(self.family, spec.recipe.lora.is_some()).ok()
    }

    /// Whether recompute is all blocks or none for this recipe.
    pub(crate) fn whole_model_recompute(&self, spec: &Spec) -> bool {
        self.script(spec).is_some()
    }

    /// The recipe the launcher runs for `spec`, or why it cannot run it. Fields the user pinned
    /// are never changed: a pinned value the script cannot run is an error.
    pub(crate) fn realise(&self, spec: &Spec) -> Result<Spec, String> {
        let Some(script) = self.script(spec) else {
            return Ok(spec.clone());
        };
        let mut s = spec.clone();
        refuse_flagless(&script, &s.recipe)?;
        follow_script(&script, &mut s.recipe, self.pinned)?;
        self.script_defaults(&script, &mut s);
        Ok(s)
    }

    /// What the script sets that the spec leaves open: the text tokens it encodes, the LoRA
    /// adapters' dtype and targets.
    fn script_defaults(&self, script: &Script, s: &mut Spec) {
        // The text tokens the script encodes when the spec gives none: its own
        // --max_sequence_length default (the export passes no --max_sequence_length), not the
        // family's. CLIP's 77 are fixed (tokenizer max_length=77).
        if !self.pinned.text_tokens {
            if let Some(t) = script_text_tokens(script.file_name(), s) {
                s.workload.text_tokens = Some(t.to_vec());
            }
        }
        let r = &mut s.recipe;
        if let Some(l) = &mut r.lora {
            // `cast_training_params(transformer, dtype=torch.float32)` runs only under
            // `if args.mixed_precision == "fp16"` (train_dreambooth_lora_flux.py:1379-1384,
            // train_dreambooth_lora_sd3.py:1408-1413, train_dreambooth_lora_sana.py:1132-1135):
            // under bf16 the adapters stay in weight_dtype. Over several ranks the sharding rules
            // count fp32 adapters (a few bytes per adapter parameter more than the run holds).
            l.dtype = if r.precision == Precision::Bf16Mixed && s.workload.ranks == 1 {
                LoraDtype::Weight
            } else {
                LoraDtype::Fp32
            };
            if l.modules.is_empty() && s.model.diffusers.is_some() {
                if let Some(m) = self.family.facts().script_lora_layers {
                    l.modules = m.iter().map(|x| x.to_string()).collect();
                }
            }
        }
    }
}

/// Refuses what no flag of the script runs, pinned or not.
fn refuse_flagless(script: &Script, r: &Recipe) -> Result<(), String> {
    // All or none: a partial policy is not a flag (`--gradient_checkpointing` only).
    if !matches!(r.recompute, Recompute::None | Recompute::All) {
        return Err(cannot(
            script,
            format!(
                "recompute {}: --gradient_checkpointing is every block or none",
                r.recompute
            ),
        ));
    }
    if r.base_quant != BaseQuant::None {
        return Err(cannot(
            script,
            format!("store the base {} (no such flag)", r.base_quant.name()),
        ));
    }
    if r.paged_optimizer {
        return Err(cannot(script, "use a paged 8-bit AdamW"));
    }
    if r.optimizer == Optimizer::Sgd {
        return Err(cannot(script, "train with SGD (AdamW or Prodigy only)"));
    }
    if matches!(r.precision, Precision::Fp64 | Precision::Bf16Pure) {
        return Err(cannot(
            script,
            format!(
                "train in {} (--mixed_precision no, fp16 or bf16)",
                r.precision
            ),
        ));
    }
    Ok(())
}

/// The script's own EMA, attention, latents and text encoders in place of the recipe's; a
/// pinned value it does not run is refused.
fn follow_script(script: &Script, r: &mut Recipe, p: Pinned) -> Result<(), String> {
    if r.ema.enabled {
        if p.ema {
            return Err(cannot(script, "keep an EMA copy (no --use_ema)"));
        }
        r.ema.enabled = false;
    }
    if r.attention == AttentionMode::Materialized {
        // diffusers' attention processors call F.scaled_dot_product_attention.
        if p.attention {
            return Err(cannot(
                script,
                "materialize attention (its processors call SDPA)",
            ));
        }
        r.attention = AttentionMode::MemoryEfficient;
    }
    if r.latents == Latents::Cached {
        let crashes =
            script.file_name() == "train_dreambooth_lora_sd3.py" && r.precision != Precision::Fp32;
        if !script.has("--cache_latents") || crashes {
            if p.latents {
                return Err(cannot(
                    script,
                    if crashes {
                        "cache latents under fp16/bf16 (the fp32 VAE fails on the images \
                         cast to weight_dtype: train_dreambooth_lora_sd3.py:1237,1596)"
                    } else {
                        "cache latents (no --cache_latents)"
                    },
                ));
            }
            r.latents = Latents::Encode;
        }
    }
    // Where the frozen text encoders are during the step.
    let ok: &[TextEncoders] = match script.file_name() {
        // train_dreambooth_lora_flux.py:1492,1521,1738-1740: kept and re-run every step.
        "train_dreambooth_lora_flux.py" => &[TextEncoders::Online],
        // train_dreambooth_lora_sana.py:1222,1229-1230: kept, on the device unless --offload.
        "train_dreambooth_lora_sana.py" => &[TextEncoders::Online, TextEncoders::Offloaded],
        // The others free them after one fixed prompt (cached), or keep them on the device
        // for per-image captions (online); none has --offload.
        _ => &[TextEncoders::Cached, TextEncoders::Online],
    };
    if !ok.contains(&r.text_encoders) {
        if p.text_encoders {
            return Err(cannot(
                script,
                format!(
                    "keep the text encoders {} (it runs them {})",
                    r.text_encoders.name(),
                    ok.iter().map(|t| t.name()).collect::<Vec<_>>().join(" or ")
                ),
            ));
        }
        r.text_encoders = ok[0];
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flux_lora() -> Spec {
        let map =
            serde_json::from_str(crate::families::preset_config("flux.1-dev").unwrap()).unwrap();
        let mut s = crate::denoiser::with_family(Spec::default_xl(), "flux.1-dev", map).unwrap();
        s.recipe.lora = Some(lora(16));
        s
    }

    fn script(pinned: Pinned) -> Launch {
        Launch {
            launcher: Launcher::Diffusers,
            family: Family::Flux,
            pinned,
        }
    }

    #[test]
    fn the_flux_lora_script_keeps_its_text_encoders_and_default_layers() {
        let r = script(Pinned::default()).realise(&flux_lora()).unwrap();
        assert_eq!(r.recipe.text_encoders, TextEncoders::Online);
        assert_eq!(r.recipe.lora.as_ref().unwrap().modules.len(), 12);
        // Pinned cached encoders: an error, not a change.
        let p = Pinned {
            text_encoders: true,
            ..Pinned::default()
        };
        assert!(script(p).realise(&flux_lora()).is_err());
        // Your own script: as given.
        let custom = Launch::default();
        assert_eq!(custom.realise(&flux_lora()).unwrap(), flux_lora());
    }

    #[test]
    fn the_scripts_encode_their_own_default_text_tokens() {
        // The full Flux script pads T5 to 77 tokens (the family's FLUX.1-dev default is 512).
        let mut s = flux_lora();
        s.recipe.lora = None;
        let r = script(Pinned::default()).realise(&s).unwrap();
        assert_eq!(r.workload.text_tokens, Some(vec![77, 77]));
        // The LoRA script: 512.
        let r = script(Pinned::default()).realise(&flux_lora()).unwrap();
        assert_eq!(r.workload.text_tokens, Some(vec![77, 512]));
        // Tokens the user gave are kept (the export must pass them); tokens set for the full
        // script follow a switch to the LoRA script.
        let mut s = flux_lora();
        s.workload.text_tokens = Some(vec![77, 256]);
        let p = Pinned {
            text_tokens: true,
            ..Pinned::default()
        };
        let r = script(p).realise(&s).unwrap();
        assert_eq!(r.workload.text_tokens, Some(vec![77, 256]));
        s.workload.text_tokens = Some(vec![77, 77]);
        let r = script(Pinned::default()).realise(&s).unwrap();
        assert_eq!(r.workload.text_tokens, Some(vec![77, 512]));
        // A model the script does not load (the original DiT) keeps none.
        let r = script(Pinned::default())
            .realise(&Spec::default_xl())
            .unwrap();
        assert_eq!(r.workload.text_tokens, None);
        // Your own script: the family's default stays.
        assert_eq!(
            Launch::default()
                .realise(&flux_lora())
                .unwrap()
                .workload
                .text_tokens,
            None
        );
    }

    #[test]
    fn partial_recompute_and_nf4_are_not_in_the_scripts() {
        let mut s = flux_lora();
        s.recipe.recompute = Recompute::EveryK(2);
        assert!(script(Pinned::default()).realise(&s).is_err());
        let mut s = flux_lora();
        s.recipe.base_quant = BaseQuant::Nf4;
        assert!(script(Pinned::default()).realise(&s).is_err());
        let mut s = flux_lora();
        s.recipe.recompute = Recompute::All;
        assert!(script(Pinned::default()).realise(&s).is_ok());
    }

    /// LoRA of `rank` on the default targets, the script's modules and dtype left open.
    fn lora(rank: u32) -> crate::spec::LoraSpec {
        crate::spec::LoraSpec {
            rank,
            targets: crate::spec::default_lora_targets(),
            modules: Vec::new(),
            dtype: crate::spec::LoraDtype::default(),
        }
    }

    fn preset(name: &str) -> Spec {
        let map = serde_json::from_str(crate::families::preset_config(name).unwrap()).unwrap();
        crate::denoiser::with_family(Spec::default_xl(), name, map).unwrap()
    }

    #[test]
    fn the_sd3_scripts_say_their_validation_keeps_the_text_encoders() {
        let has = |f, lora| {
            behaviours(&script_for(f, lora).unwrap())
                .iter()
                .any(|b| b.what == SD3_VALIDATION_KEEPS_ENCODERS)
        };
        assert!(has(Family::Sd3, false) && has(Family::Sd3, true));
        // train_dreambooth_flux.py:1802 `del pipeline`s in main(): nothing stays.
        assert!(!has(Family::Flux, false));
    }

    #[test]
    fn sanas_default_lora_layers_train_three_projections_of_both_attentions() {
        let mut s = preset("sana-600m");
        s.recipe.lora = Some(lora(4));
        let launch = Launch {
            launcher: Launcher::Diffusers,
            family: Family::Sana,
            pinned: Pinned::default(),
        };
        let r = launch.realise(&s).unwrap();
        let m = &r.recipe.lora.as_ref().unwrap().modules;
        assert_eq!(m, &["to_k", "to_q", "to_v"]);
        // peft's LoRA on a Linear(d, d): A (r × d) and B (d × r). `to_k`, `to_q`, `to_v` match
        // in attn1 (self) and attn2 (cross, whose keys and values read the caption projected
        // to d): 6 adapters per block.
        let (d, depth, rank) = (u64::from(r.model.hidden), u64::from(r.model.depth), 4);
        let trained: u64 = crate::denoiser::param_table(&r)
            .iter()
            .filter(|t| t.role == crate::params::ParamRole::Trained)
            .map(|t| t.numel())
            .sum();
        assert_eq!(trained, depth * 6 * 2 * rank * d);
    }

    #[test]
    fn the_sd3_lora_script_caches_latents_only_in_fp32() {
        let mut s = preset("sd3-medium");
        s.recipe.lora = Some(lora(8));
        s.recipe.latents = Latents::Cached;
        let sd3 = |pinned| Launch {
            launcher: Launcher::Diffusers,
            family: Family::Sd3,
            pinned,
        };
        for p in [Precision::Bf16Mixed, Precision::Fp16Mixed] {
            s.recipe.precision = p;
            // The images in weight_dtype meet the fp32 VAE: the VAE encodes in the step.
            let r = sd3(Pinned::default()).realise(&s).unwrap();
            assert_eq!(r.recipe.latents, Latents::Encode);
            let pinned = Pinned {
                latents: true,
                ..Pinned::default()
            };
            let e = sd3(pinned).realise(&s).unwrap_err();
            assert!(e.contains("1237,1596"), "{e}");
        }
        s.recipe.precision = Precision::Fp32;
        let r = sd3(Pinned::default()).realise(&s).unwrap();
        assert_eq!(r.recipe.latents, Latents::Cached);
    }

    #[test]
    fn the_lora_scripts_keep_bf16_adapters_under_bf16_only() {
        let dtype = |p: Precision, ranks: u32| {
            let mut s = flux_lora();
            s.recipe.precision = p;
            s.workload.ranks = ranks;
            let r = script(Pinned::default()).realise(&s).unwrap();
            r.recipe.lora.unwrap().dtype
        };
        assert_eq!(dtype(Precision::Bf16Mixed, 1), LoraDtype::Weight);
        assert_eq!(dtype(Precision::Fp16Mixed, 1), LoraDtype::Fp32);
        assert_eq!(dtype(Precision::Fp32, 1), LoraDtype::Fp32);
        assert_eq!(dtype(Precision::Bf16Mixed, 2), LoraDtype::Fp32);
    }

    #[test]
    fn the_full_flux_script_encodes_latents_every_step() {
        let mut s = flux_lora();
        s.recipe.lora = None;
        s.recipe.latents = Latents::Cached;
        let r = script(Pinned::default()).realise(&s).unwrap();
        assert_eq!(r.recipe.latents, Latents::Encode);
        let p = Pinned {
            latents: true,
            ..Pinned::default()
        };
        assert!(script(p).realise(&s).is_err());
    }
}
