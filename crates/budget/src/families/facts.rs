//! What a family's training looks like in diffusers' scripts (at `launch::DIFFUSERS_TAG`), as
//! one [`FamilyFacts`] value per family, written in the family's folder (`<family>/mod.rs`
//! `FACTS`; the original DiT's and diffusers' DiT's in `dit/mod.rs`) and reached through
//! `Family::facts`. Every family states every field, or says with
//! [`FamilyFacts::without_script`] that diffusers has no training script for it: a new family
//! cannot inherit one of these by a wildcard arm somewhere else.
//!
//! A leaf: it imports nothing of the crate, so every family folder can use it.

/// A family's facts the budget and the exports read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FamilyFacts {
    /// The transformer block class(es) FSDP wraps one unit at a time
    /// (`fsdp_transformer_layer_cls_to_wrap`, comma-separated), as diffusers
    /// (`src/diffusers/models/…`) or facebookresearch/DiT `models.py` names them.
    pub(crate) fsdp_block_classes: &'static str,
    /// The LoRA modules the budget counts when a LoRA spec names none: the family's LoRA
    /// script's default, or [`DEFAULT_LORA_MODULES`].
    pub(crate) lora_modules: &'static [&'static str],
    /// The LoRA script's `target_modules` when `--lora_layers` is not given, which the diffusers
    /// export writes out; None where the export names no default.
    pub(crate) script_lora_layers: Option<&'static [&'static str]>,
    /// The scripts keep the VAE in fp32 whatever the precision.
    pub(crate) fp32_vae: bool,
    /// What of the VAE the scripts keep on the device while the step runs.
    pub(crate) vae_on_device: VaeOnDevice,
}

impl FamilyFacts {
    /// A family diffusers has no training script for: FSDP wraps `fsdp_block_classes`; the
    /// budget counts [`DEFAULT_LORA_MODULES`] and the export names no `--lora_layers` default;
    /// the VAE is the encoder alone, in the compute dtype (what a plain training loop does).
    pub(crate) const fn without_script(fsdp_block_classes: &'static str) -> FamilyFacts {
        FamilyFacts {
            fsdp_block_classes,
            lora_modules: &DEFAULT_LORA_MODULES,
            script_lora_layers: None,
            fp32_vae: false,
            vae_on_device: VaeOnDevice::Encoder,
        }
    }
}

/// What of the VAE a family's scripts keep on the device while the step runs (`encoders.rs`
/// counts it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum VaeOnDevice {
    /// The encoder alone (and the budget's default where diffusers has no script).
    Encoder,
    /// The whole `AutoencoderKL`, its decoder too, which the step never runs.
    WholeAutoencoderKl,
    /// The whole `AutoencoderDC` between encodes; with `--offload` moved in to encode and back
    /// to the CPU after each.
    WholeAutoencoderDc,
}

/// The attention projections diffusers' LoRA scripts adapted first and PEFT's usual targets
/// for a diffusers attention: the default of a family without a script of its own (PixArt,
/// Wan) and of Sana (whose `train_dreambooth_lora_sana.py` now defaults to `to_k, to_q, to_v`
/// alone; the engine's Sana tests count `to_out.0` too, so a change is the lead's call).
pub(crate) const DEFAULT_LORA_MODULES: [&str; 4] = ["to_k", "to_q", "to_v", "to_out.0"];
