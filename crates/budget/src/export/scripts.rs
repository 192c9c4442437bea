//! The diffusers example train scripts a plan can be exported to, as data: for each family the
//! script that fine-tunes its transformer (full and LoRA), every option its `parse_args` accepts,
//! and the placeholders of the arguments it requires.
//!
//! Read from huggingface/diffusers at tag [`DIFFUSERS_TAG`] (commit [`DIFFUSERS_COMMIT`]): the
//! newest tag of the diffusers snapshot reachable here (the 0.42 examples were not). Each script's
//! `parse_args` is vendored verbatim in `bench/ecosystem/vendor/diffusers_args/`, which
//! `bench/ecosystem/check.py` calls on every emitted command line; a test holds the lists below
//! against those files. Families without a script at that tag (the DiT in both forms, PixArt —
//! only a ControlNet trainer in `examples/research_projects/pixart/` — and Wan) and Sana's full
//! fine-tune (only `train_dreambooth_lora_sana.py`) get the launch line and a note instead.

use crate::families::Family;

/// The diffusers tag the scripts were read from.
pub(crate) const DIFFUSERS_TAG: &str = "v0.40.0";
/// The commit of [`DIFFUSERS_TAG`].
pub(crate) const DIFFUSERS_COMMIT: &str = "d035dcd7cc7c88e0a154609b62887d50bba9fdc2";

/// One diffusers example train script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Script {
    /// Path inside the diffusers repository.
    pub path: &'static str,
    /// Trains LoRA adapters on a frozen base (`--rank`).
    pub lora: bool,
    /// The option strings its `parse_args` accepts beyond [`DREAMBOOTH_COMMON`].
    own_flags: &'static [&'static str],
    /// Required arguments (or one of a required pair) with a placeholder value to edit.
    pub required: &'static [(&'static str, &'static str)],
}

impl Script {
    /// The file name (`train_dreambooth_lora_flux.py`).
    pub fn file_name(&self) -> &'static str {
        self.path.rsplit('/').next().unwrap_or(self.path)
    }

    /// Whether the script's `parse_args` has `flag`.
    pub fn has(&self, flag: &str) -> bool {
        self.flags().any(|f| f == flag)
    }

    /// Every option string its `parse_args` accepts.
    pub fn flags(&self) -> impl Iterator<Item = &'static str> {
        DREAMBOOTH_COMMON.iter().chain(self.own_flags).copied()
    }
}

/// Why a family has no script for a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NoScript {
    pub reason: &'static str,
}

const DREAMBOOTH_REQUIRED_SD3: &[(&str, &str)] = &[
    (
        "--pretrained_model_name_or_path",
        "stabilityai/stable-diffusion-3-medium-diffusers",
    ),
    ("--instance_data_dir", "./instance_images"),
    ("--instance_prompt", "a photo of sks subject"),
    ("--output_dir", "./ditmem-out"),
];
const DREAMBOOTH_REQUIRED_FLUX: &[(&str, &str)] = &[
    (
        "--pretrained_model_name_or_path",
        "black-forest-labs/FLUX.1-dev",
    ),
    ("--instance_data_dir", "./instance_images"),
    ("--instance_prompt", "a photo of sks subject"),
    ("--output_dir", "./ditmem-out"),
];
const DREAMBOOTH_REQUIRED_SANA: &[(&str, &str)] = &[
    (
        "--pretrained_model_name_or_path",
        "Efficient-Large-Model/Sana_1600M_1024px_BF16_diffusers",
    ),
    ("--instance_data_dir", "./instance_images"),
    ("--instance_prompt", "a photo of sks subject"),
    ("--output_dir", "./ditmem-out"),
];

/// The script that trains `family` (LoRA or full), or why there is none.
pub(crate) fn script_for(family: Family, lora: bool) -> Result<Script, NoScript> {
    let s = |path, own_flags, required| Script {
        path,
        lora,
        own_flags,
        required,
    };
    match (family, lora) {
        (Family::Sd3, false) => Ok(s(
            "examples/dreambooth/train_dreambooth_sd3.py",
            TRAIN_DREAMBOOTH_SD3,
            DREAMBOOTH_REQUIRED_SD3,
        )),
        (Family::Sd3, true) => Ok(s(
            "examples/dreambooth/train_dreambooth_lora_sd3.py",
            TRAIN_DREAMBOOTH_LORA_SD3,
            DREAMBOOTH_REQUIRED_SD3,
        )),
        (Family::Flux, false) => Ok(s(
            "examples/dreambooth/train_dreambooth_flux.py",
            TRAIN_DREAMBOOTH_FLUX,
            DREAMBOOTH_REQUIRED_FLUX,
        )),
        (Family::Flux, true) => Ok(s(
            "examples/dreambooth/train_dreambooth_lora_flux.py",
            TRAIN_DREAMBOOTH_LORA_FLUX,
            DREAMBOOTH_REQUIRED_FLUX,
        )),
        (Family::Sana, true) => Ok(s(
            "examples/dreambooth/train_dreambooth_lora_sana.py",
            TRAIN_DREAMBOOTH_LORA_SANA,
            DREAMBOOTH_REQUIRED_SANA,
        )),
        (Family::Sana, false) => Err(NoScript {
            reason: "diffusers has no full fine-tune script for Sana (only \
                     examples/dreambooth/train_dreambooth_lora_sana.py, LoRA)",
        }),
        (Family::Dit | Family::DitDiffusers, _) => Err(NoScript {
            reason: "diffusers has no fine-tune script for the DiT (examples/ trains UNets, \
                     SD3, Flux and Sana); use the accelerate / DeepSpeed configs with your own \
                     train script (facebookresearch/DiT train.py, or a loop around \
                     DiTTransformer2DModel)",
        }),
        (Family::Pixart, _) => Err(NoScript {
            reason: "diffusers has no fine-tune script for the PixArt transformer (only a \
                     ControlNet trainer, examples/research_projects/pixart/\
                     train_pixart_controlnet_hf.py, which trains a ControlNet beside a frozen \
                     transformer); use the accelerate / DeepSpeed configs with your own script",
        }),
        (Family::Wan, _) => Err(NoScript {
            reason: "diffusers has no fine-tune script for Wan; use the accelerate / DeepSpeed \
                     configs with your own script",
        }),
    }
}

/// The option strings every script below accepts (the DreamBooth scripts share their
/// `parse_args` core); each script's list holds only its own beyond these.
const DREAMBOOTH_COMMON: &[&str] = &[
    "--pretrained_model_name_or_path",
    "--revision",
    "--variant",
    "--dataset_name",
    "--dataset_config_name",
    "--instance_data_dir",
    "--cache_dir",
    "--image_column",
    "--caption_column",
    "--repeats",
    "--class_data_dir",
    "--instance_prompt",
    "--class_prompt",
    "--max_sequence_length",
    "--validation_prompt",
    "--num_validation_images",
    "--validation_epochs",
    "--with_prior_preservation",
    "--prior_loss_weight",
    "--num_class_images",
    "--output_dir",
    "--seed",
    "--resolution",
    "--center_crop",
    "--random_flip",
    "--train_batch_size",
    "--sample_batch_size",
    "--num_train_epochs",
    "--max_train_steps",
    "--checkpointing_steps",
    "--checkpoints_total_limit",
    "--resume_from_checkpoint",
    "--gradient_accumulation_steps",
    "--gradient_checkpointing",
    "--learning_rate",
    "--scale_lr",
    "--lr_scheduler",
    "--lr_warmup_steps",
    "--lr_num_cycles",
    "--lr_power",
    "--dataloader_num_workers",
    "--weighting_scheme",
    "--logit_mean",
    "--logit_std",
    "--mode_scale",
    "--optimizer",
    "--use_8bit_adam",
    "--adam_beta1",
    "--adam_beta2",
    "--prodigy_beta3",
    "--prodigy_decouple",
    "--adam_weight_decay",
    "--adam_weight_decay_text_encoder",
    "--adam_epsilon",
    "--prodigy_use_bias_correction",
    "--prodigy_safeguard_warmup",
    "--max_grad_norm",
    "--push_to_hub",
    "--hub_token",
    "--hub_model_id",
    "--logging_dir",
    "--allow_tf32",
    "--report_to",
    "--mixed_precision",
    "--local_rank",
];

/// The option strings, beyond [`DREAMBOOTH_COMMON`], of `train_dreambooth_flux.py`'s `parse_args` (argparse adds `--help`).
const TRAIN_DREAMBOOTH_FLUX: &[&str] = &[
    "--train_text_encoder",
    "--guidance_scale",
    "--text_encoder_lr",
    "--prior_generation_precision",
    "--image_interpolation_mode",
    "--enable_npu_flash_attention",
];

/// The option strings, beyond [`DREAMBOOTH_COMMON`], of `train_dreambooth_lora_flux.py`'s `parse_args` (argparse adds `--help`).
const TRAIN_DREAMBOOTH_LORA_FLUX: &[&str] = &[
    "--rank",
    "--lora_alpha",
    "--lora_dropout",
    "--train_text_encoder",
    "--guidance_scale",
    "--text_encoder_lr",
    "--lora_layers",
    "--cache_latents",
    "--upcast_before_saving",
    "--prior_generation_precision",
    "--enable_npu_flash_attention",
];

/// The option strings, beyond [`DREAMBOOTH_COMMON`], of `train_dreambooth_lora_sana.py`'s `parse_args` (argparse adds `--help`).
const TRAIN_DREAMBOOTH_LORA_SANA: &[&str] = &[
    "--complex_human_instruction",
    "--rank",
    "--lora_alpha",
    "--lora_dropout",
    "--lora_layers",
    "--cache_latents",
    "--upcast_before_saving",
    "--offload",
    "--enable_vae_tiling",
    "--enable_npu_flash_attention",
];

/// The option strings, beyond [`DREAMBOOTH_COMMON`], of `train_dreambooth_lora_sd3.py`'s `parse_args` (argparse adds `--help`).
const TRAIN_DREAMBOOTH_LORA_SD3: &[&str] = &[
    "--rank",
    "--lora_dropout",
    "--train_text_encoder",
    "--text_encoder_lr",
    "--precondition_outputs",
    "--lora_layers",
    "--lora_blocks",
    "--cache_latents",
    "--upcast_before_saving",
    "--prior_generation_precision",
];

/// The option strings, beyond [`DREAMBOOTH_COMMON`], of `train_dreambooth_sd3.py`'s `parse_args` (argparse adds `--help`).
const TRAIN_DREAMBOOTH_SD3: &[&str] = &[
    "--train_text_encoder",
    "--text_encoder_lr",
    "--precondition_outputs",
    "--prior_generation_precision",
];

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// The option strings of a vendored `parse_args` (every `"--name"` literal in it).
    fn vendored_flags(file: &str) -> Option<BTreeSet<String>> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../bench/ecosystem/vendor/diffusers_args")
            .join(file);
        let text = std::fs::read_to_string(path).ok()?;
        let mut out = BTreeSet::new();
        for piece in text.split("\"--").skip(1) {
            let name: String = piece
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            if piece[name.len()..].starts_with('"') && !name.is_empty() {
                out.insert(format!("--{name}"));
            }
        }
        Some(out)
    }

    #[test]
    fn flag_lists_are_the_vendored_parsers() {
        let mut seen = 0;
        for f in Family::ALL {
            for lora in [false, true] {
                let Ok(s) = script_for(f, lora) else { continue };
                assert_eq!(s.lora, lora);
                let want = vendored_flags(s.file_name()).unwrap_or_else(|| {
                    panic!(
                        "bench/ecosystem/vendor/diffusers_args/{} is missing",
                        s.file_name()
                    )
                });
                let have: BTreeSet<String> = s.flags().map(|x| x.to_string()).collect();
                assert_eq!(have, want, "{}", s.path);
                for (req, _) in s.required {
                    assert!(s.has(req), "{} lacks {req}", s.path);
                }
                seen += 1;
            }
        }
        assert_eq!(seen, 5);
    }

    #[test]
    fn the_lora_scripts_have_rank_and_none_has_ema() {
        for f in [Family::Sd3, Family::Flux, Family::Sana] {
            let s = script_for(f, true).unwrap();
            assert!(s.has("--rank"));
            assert!(!s.has("--use_ema"));
            assert!(!s.has("--enable_xformers_memory_efficient_attention"));
        }
        assert!(script_for(Family::Dit, false).is_err());
        assert!(script_for(Family::Pixart, true).is_err());
        assert!(script_for(Family::Sana, false).is_err());
    }
}
