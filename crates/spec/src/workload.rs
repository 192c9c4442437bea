//! What one optimizer step trains on ([`Workload`]) and the token grid of one image
//! ([`TokenGrid`]).

use crate::model::default_in_channels;
use serde::{Deserialize, Serialize};

/// What one optimizer step trains on: image size, latent geometry and how the batch is split.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    /// Image height in pixels.
    pub height: u32,
    /// Image width in pixels.
    pub width: u32,
    /// VAE downsampling factor (8 for the SD VAE).
    #[serde(default = "default_vae_factor")]
    pub vae_factor: u32,
    /// Latent channels the VAE produces; must equal `model.in_channels`.
    #[serde(default = "default_in_channels")]
    pub latent_channels: u32,
    /// Images per optimizer step, over all ranks and microbatches.
    pub batch: u32,
    /// Images per forward/backward pass on one rank.
    pub microbatch: u32,
    /// Microbatches accumulated before each optimizer step.
    #[serde(default = "default_one")]
    pub accumulation: u32,
    /// Data-parallel ranks.
    #[serde(default = "default_one")]
    pub ranks: u32,
    /// Video frames per sample in pixel space (1 for images). A video family compresses them
    /// in time (Wan: (frames − 1) / 4 + 1 latent frames).
    #[serde(default = "default_one", skip_serializing_if = "is_one")]
    pub frames: u32,
    /// The VAE's temporal compression (Wan: 4); 1 for image VAEs.
    #[serde(default = "default_one", skip_serializing_if = "is_one")]
    pub vae_temporal_factor: u32,
    /// Text tokens per text encoder of the model's family, in the family's order (e.g. Flux:
    /// CLIP, T5; SD3: CLIP, T5); absent: the family's default. Only for text-conditioned families.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_tokens: Option<Vec<u32>>,
}

fn is_one(v: &u32) -> bool {
    *v == 1
}

fn default_vae_factor() -> u32 {
    8
}
fn default_one() -> u32 {
    1
}

/// Token geometry of one image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TokenGrid {
    /// Latent height (H / vae_factor).
    pub latent_h: u32,
    /// Latent width (W / vae_factor).
    pub latent_w: u32,
    /// Token rows (latent_h / p).
    pub rows: u32,
    /// Token columns (latent_w / p).
    pub cols: u32,
}

impl TokenGrid {
    pub fn tokens(&self) -> u64 {
        u64::from(self.rows) * u64::from(self.cols)
    }
}
