//! What each family's dimensions answer, as one trait: [`FamilyDims`]. Each family's `mod.rs`
//! implements it on its dims (`PixartDims`, …); `model.rs`'s [`super::Dims`] picks the family's
//! with one `match` and asks it. Also the types the answers are made of ([`Geometry`],
//! [`TextEncoder`]) and the geometry every diffusers transformer over an f8 VAE shares
//! ([`diffusers_f8`]).
//!
//! This file names no family: the family files and `model.rs` both stand on it.

use serde::Serialize;

use super::defaults::TrainingDefaults;
use super::table::Table;

/// A text encoder whose output the model reads, as the family's training scripts feed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TextEncoder {
    pub name: &'static str,
    /// Tokens the scripts encode by default (`max_sequence_length` and the like).
    pub default_tokens: u64,
    /// Width of each token embedding the transformer reads.
    pub width: u64,
    /// Whether its tokens enter the transformer's sequence (false: only a pooled vector, as
    /// Flux's CLIP-L).
    pub sequence: bool,
}

impl TextEncoder {
    /// T5-XXL at `tokens` tokens of `width`, in the sequence.
    pub(crate) fn t5(tokens: u64, width: u64) -> TextEncoder {
        TextEncoder {
            name: "T5-XXL",
            default_tokens: tokens,
            width,
            sequence: true,
        }
    }
}

/// What a spec needs of a model beyond its parameter table: the token geometry, the VAE it
/// reads latents from, and its text encoders.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Geometry {
    /// Transformer blocks over every stack (Flux: double + single).
    pub blocks: u64,
    pub hidden: u64,
    pub heads: u64,
    /// Latent pixels per token side (the patch size; 2 for Flux's 2×2 packing of patch 1).
    pub patch: u64,
    /// Latent channels of the VAE the model reads (before Flux's packing).
    pub latent_channels: u64,
    /// The VAE's spatial downsampling.
    pub vae_factor: u64,
    /// The VAE's temporal compression (Wan: 4; images: 1).
    pub vae_temporal_factor: u64,
    /// Width of the MLP / feed-forward hidden layer.
    pub mlp: u64,
    /// Text encoders in the family's order (empty: class-conditional).
    pub text: Vec<TextEncoder>,
}

/// A diffusers transformer of `blocks` blocks `hidden` wide with `heads` heads over an f8 VAE
/// (SD's, SD3's) of `latent_channels`, MLP 4× wide, with its text encoders: the families'
/// config files name these fields alike; each family overrides what differs.
pub(crate) fn diffusers_f8(
    [blocks, hidden, heads, patch, latent_channels]: [u64; 5],
    text: Vec<TextEncoder>,
) -> Geometry {
    Geometry {
        blocks,
        hidden,
        heads,
        patch,
        latent_channels,
        vae_factor: 8,
        vae_temporal_factor: 1,
        mlp: 4 * hidden,
        text,
    }
}

/// One family's answers about a model of its dimensions.
pub(crate) trait FamilyDims {
    /// Hidden size of the transformer stream: its geometry's.
    fn hidden(&self) -> u64 {
        self.geometry("").hidden
    }

    /// Every tensor the model holds, in module order, pushed onto `t`.
    fn table(&self, t: &mut Table);

    /// The model's geometry; `name` is the preset's, or the path of a `--model` config.json.
    fn geometry(&self, name: &str) -> Geometry;

    /// The workload the family trains at by default; None keeps the DiT workload (256²,
    /// batch 32).
    fn training_defaults(&self) -> Option<TrainingDefaults> {
        None
    }

    /// Its blocks (of every kind).
    fn layers(&self) -> u64;

    /// The kinds of block the model stacks, with how many of each it has: one kind by default.
    fn block_kinds(&self) -> Vec<(&'static str, u64)> {
        vec![("block", self.layers())]
    }

    /// Keep `counts` blocks of each kind ([`FamilyDims::block_kinds`]'s order), counts already
    /// checked against the model's.
    fn keep_blocks(&mut self, counts: &[u64]);
}
