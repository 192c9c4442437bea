//! The workload a family is trained at when nothing else says otherwise: what the family's
//! diffusers pipeline generates by default (its `height` / `width` / `num_frames`), one sample
//! per rank and no accumulation (the diffusers training scripts' `--train_batch_size 1`,
//! `--gradient_accumulation_steps 1`). Each family file gives its own ([`TrainingDefaults`]);
//! the text tokens are the family's [`super::TextEncoder::default_tokens`] (a spec without
//! `workload.text_tokens` encodes those), and the runtime is the command's (`pytorch:cuda` for
//! `estimate`, `plan` and `spec`).
//!
//! The original DiT (and diffusers' DiT class) has none: it keeps the spec's DiT workload
//! (256², batch 32).

use serde::Serialize;

/// A family's default workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TrainingDefaults {
    /// Image height and width in pixels.
    pub height: u32,
    pub width: u32,
    /// Video frames per sample (1 for images).
    pub frames: u32,
    /// Samples per forward/backward on one rank.
    pub microbatch: u32,
    /// Microbatches per optimizer step.
    pub accumulation: u32,
}

impl TrainingDefaults {
    /// An image family at `side`², one image per rank.
    pub(crate) fn square(side: u64) -> TrainingDefaults {
        let side = u32::try_from(side).unwrap_or(u32::MAX);
        TrainingDefaults {
            height: side,
            width: side,
            frames: 1,
            microbatch: 1,
            accumulation: 1,
        }
    }

    /// The pipelines' default side: `transformer.config.sample_size × vae_scale_factor` (PixArt,
    /// SD3, Sana pipelines: `default_sample_size = transformer.config.sample_size`), rounded down
    /// to whole patches (at least one).
    pub(crate) fn from_sample_size(
        sample_size: u64,
        patch: u64,
        vae_factor: u64,
    ) -> TrainingDefaults {
        let patch = patch.max(1);
        Self::square((sample_size / patch).max(1) * patch * vae_factor)
    }
}
