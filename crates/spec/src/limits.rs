//! The caps on a spec's sizes ([`LIMITS`], `MAX_*`): generously above any real model, so that
//! every spec that passes [`Spec::validate`](crate::Spec::validate) is estimated and planned
//! within a bounded time and memory.

/// The largest tensor a spec may ask for (2⁵⁰ elements, 8 PiB in f64): byte counts stay u64.
pub const MAX_TENSOR_ELEMS: u128 = 1 << 50;

/// Largest `model.depth` (DiT-XL has 28 blocks; the largest published DiTs fewer than 100).
pub const MAX_DEPTH: u32 = 1024;
/// Largest `model.hidden` and `model.heads` (real DiTs: hidden ≤ 8192).
pub const MAX_HIDDEN: u32 = 65_536;
/// Largest `model.patch`.
pub const MAX_PATCH: u32 = 256;
/// Largest `model.in_channels` and `workload.latent_channels` (VAEs: 4 to 64).
pub const MAX_CHANNELS: u32 = 1024;
/// Largest `model.mlp_ratio` (DiT: 4).
pub const MAX_MLP_RATIO: u32 = 64;
/// Largest `model.num_classes` (ImageNet: 1000).
pub const MAX_NUM_CLASSES: u32 = 1 << 24;
/// Largest `model.freq_embed` (DiT: 256).
pub const MAX_FREQ_EMBED: u32 = 65_536;
/// Largest `workload.height` and `workload.width` in pixels.
pub const MAX_SIDE: u32 = 65_536;
/// Largest `workload.vae_factor` (SD VAE: 8).
pub const MAX_VAE_FACTOR: u32 = 64;
/// Most image tokens per sample (real DiTs: ≤ 65,536 per frame).
pub const MAX_TOKENS: u64 = 1 << 20;
/// Largest `workload.microbatch` (images per forward on one rank).
pub const MAX_MICROBATCH: u32 = 65_536;
/// Largest `workload.accumulation`.
pub const MAX_ACCUMULATION: u32 = 1 << 20;
/// Most video frames per sample (Wan 2.1: 81).
pub const MAX_FRAMES: u32 = 4096;
/// Most text encoders of one model (SD3: 3, counted as CLIP and T5 sequences).
pub(crate) const MAX_TEXT_ENCODERS: usize = 4;
/// Most text tokens per encoder (T5 in Flux: 512).
pub const MAX_TEXT_TOKENS: u32 = 65_536;
/// Largest `workload.ranks` (GPU clusters: ≤ 100k devices).
pub const MAX_RANKS: u32 = 1 << 20;

/// The caps of [`Spec::validate`] as (field, largest allowed value), for help texts and tests.
pub const LIMITS: [(&str, u64); 16] = [
    ("model.depth", MAX_DEPTH as u64),
    ("model.hidden", MAX_HIDDEN as u64),
    ("model.heads", MAX_HIDDEN as u64),
    ("model.patch", MAX_PATCH as u64),
    ("model.in_channels", MAX_CHANNELS as u64),
    ("model.mlp_ratio", MAX_MLP_RATIO as u64),
    ("model.num_classes", MAX_NUM_CLASSES as u64),
    ("model.freq_embed", MAX_FREQ_EMBED as u64),
    ("workload.height", MAX_SIDE as u64),
    ("workload.width", MAX_SIDE as u64),
    ("workload.vae_factor", MAX_VAE_FACTOR as u64),
    ("workload.latent_channels", MAX_CHANNELS as u64),
    ("workload.microbatch", MAX_MICROBATCH as u64),
    ("workload.accumulation", MAX_ACCUMULATION as u64),
    ("workload.ranks", MAX_RANKS as u64),
    ("tokens per image", MAX_TOKENS),
];
