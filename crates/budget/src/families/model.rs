//! A model of a family: the [`Family`], its dimensions ([`Dims`], one variant per family file) and
//! [`FamilyModel`] (the dimensions and where they came from), with the dispatch to each family's
//! table.

use serde::Serialize;

use super::defaults::TrainingDefaults;
use super::dit::{DitDiffusersDims, DitDims};
use super::flux::FluxDims;
use super::pixart::PixartDims;
use super::sana::SanaDims;
use super::sd3::Sd3Dims;
use super::table::{count, FamilyCounts, FamilyTensor, Table};
use super::wan::WanDims;
use super::{dit, flux, pixart, sana, sd3, wan};
use crate::error::SpecError;
use crate::spec::ModelSpec;

/// The model families ditmem knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Family {
    /// The original facebookresearch/DiT `models.py` (what `params.rs` and the engine count).
    Dit,
    /// diffusers' `DiTTransformer2DModel`: a timestep + label embedder inside every block.
    DitDiffusers,
    /// `PixArtTransformer2DModel` (PixArt-α and -Σ).
    Pixart,
    /// `SD3Transformer2DModel` (SD3, SD3.5; MMDiT and MMDiT-X).
    Sd3,
    /// `FluxTransformer2DModel` (FLUX.1 dev / schnell).
    Flux,
    /// `SanaTransformer2DModel`.
    Sana,
    /// `WanTransformer3DModel` (Wan 2.1 text-to-video).
    Wan,
}

impl Family {
    pub const fn name(self) -> &'static str {
        match self {
            Family::Dit => "dit",
            Family::DitDiffusers => "dit-diffusers",
            Family::Pixart => "pixart",
            Family::Sd3 => "sd3",
            Family::Flux => "flux",
            Family::Sana => "sana",
            Family::Wan => "wan",
        }
    }

    /// The diffusers class (or, for the original DiT, the reference module).
    pub const fn class_name(self) -> &'static str {
        match self {
            Family::Dit => "DiT (facebookresearch/DiT models.py)",
            Family::DitDiffusers => "DiTTransformer2DModel",
            Family::Pixart => "PixArtTransformer2DModel",
            Family::Sd3 => "SD3Transformer2DModel",
            Family::Flux => "FluxTransformer2DModel",
            Family::Sana => "SanaTransformer2DModel",
            Family::Wan => "WanTransformer3DModel",
        }
    }

    pub const ALL: [Family; 7] = [
        Family::Dit,
        Family::DitDiffusers,
        Family::Pixart,
        Family::Sd3,
        Family::Flux,
        Family::Sana,
        Family::Wan,
    ];
}

/// The dimensions of one model, by family.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "family", rename_all = "kebab-case")]
pub enum Dims {
    Dit(DitDims),
    DitDiffusers(DitDiffusersDims),
    Pixart(PixartDims),
    Sd3(Sd3Dims),
    Flux(FluxDims),
    Sana(SanaDims),
    Wan(WanDims),
}

impl Dims {
    pub const fn family(&self) -> Family {
        match self {
            Dims::Dit(_) => Family::Dit,
            Dims::DitDiffusers(_) => Family::DitDiffusers,
            Dims::Pixart(_) => Family::Pixart,
            Dims::Sd3(_) => Family::Sd3,
            Dims::Flux(_) => Family::Flux,
            Dims::Sana(_) => Family::Sana,
            Dims::Wan(_) => Family::Wan,
        }
    }

    /// Hidden size of the transformer stream.
    pub fn hidden(&self) -> u64 {
        match self {
            Dims::Dit(d) => u64::from(d.model.hidden),
            Dims::DitDiffusers(d) => d.inner(),
            Dims::Pixart(d) => d.inner(),
            Dims::Sd3(d) => d.inner(),
            Dims::Flux(d) => d.inner(),
            Dims::Sana(d) => d.inner(),
            Dims::Wan(d) => d.inner(),
        }
    }

    /// Every tensor the model holds, in module order.
    pub fn table(&self) -> Vec<FamilyTensor> {
        let mut t = Table::default();
        match self {
            Dims::Dit(d) => dit::original_table(d, &mut t),
            Dims::DitDiffusers(d) => dit::diffusers_table(d, &mut t),
            Dims::Pixart(d) => pixart::table(d, &mut t),
            Dims::Sd3(d) => sd3::table(d, &mut t),
            Dims::Flux(d) => flux::table(d, &mut t),
            Dims::Sana(d) => sana::table(d, &mut t),
            Dims::Wan(d) => wan::table(d, &mut t),
        }
        t.0
    }

    /// Parameter and buffer totals, per module group.
    pub fn counts(&self) -> FamilyCounts {
        count(&self.table())
    }
}

/// A model of a family: its dimensions and where they came from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FamilyModel {
    /// The preset name, or "config.json".
    pub name: String,
    pub family: Family,
    pub class_name: &'static str,
    pub dims: Dims,
}

impl FamilyModel {
    pub fn new(name: impl Into<String>, dims: Dims) -> FamilyModel {
        let family = dims.family();
        FamilyModel {
            name: name.into(),
            family,
            class_name: family.class_name(),
            dims,
        }
    }

    /// The original DiT of a `ModelSpec` at a square image side (pixels, VAE factor 8).
    pub(crate) fn original_dit(
        model: ModelSpec,
        image_size: u32,
    ) -> Result<FamilyModel, SpecError> {
        let p = model.patch.max(1);
        if image_size == 0 || !image_size.is_multiple_of(8 * p) {
            return Err(SpecError::invalid(
                "image_size",
                format!("{image_size} is not a multiple of 8 × patch {p}"),
            ));
        }
        let name = model.name.clone();
        Ok(FamilyModel::new(
            name,
            Dims::Dit(DitDims { model, image_size }),
        ))
    }
}

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

impl FamilyModel {
    /// The workload the family trains at by default (its file's `training_defaults`); None for
    /// the original DiT and diffusers' DiT, which keep the DiT workload (256², batch 32).
    pub fn training_defaults(&self) -> Option<TrainingDefaults> {
        match &self.dims {
            Dims::Dit(_) | Dims::DitDiffusers(_) => None,
            Dims::Pixart(d) => Some(d.training_defaults()),
            Dims::Sd3(d) => Some(d.training_defaults()),
            Dims::Flux(d) => Some(d.training_defaults()),
            Dims::Sana(d) => Some(d.training_defaults()),
            Dims::Wan(d) => Some(d.training_defaults()),
        }
    }

    /// The geometry of the model: VAEs per family from the published pipelines — SD VAE f8c4
    /// (DiT, PixArt), SD3/Flux VAE f8c16 (Flux packs 2×2 latent pixels into one 64-wide token),
    /// DC-AE f32c32 (Sana), Wan-VAE f8 × t4, c16. Text encoders as the diffusers training scripts
    /// encode them: PixArt T5-XXL 120 tokens (α; Σ: 300), SD3 CLIP-L ⊕ CLIP-G 77 + T5-XXL 77
    /// (`train_dreambooth_sd3.py` `--max_sequence_length 77`), Flux CLIP-L pooled + T5-XXL 512
    /// (dev; schnell 256), Sana Gemma-2-2B 300, Wan umT5-XXL 512.
    pub fn geometry(&self) -> Geometry {
        let t5 = |tokens, width| TextEncoder {
            name: "T5-XXL",
            default_tokens: tokens,
            width,
            sequence: true,
        };
        // A diffusers transformer of `num_layers` blocks of `inner()` width over an f8 VAE (SD's,
        // SD3's), MLP 4× wide, with its text encoders: the families' config files name the
        // fields alike, so one macro reads them from each (each arm overrides what differs).
        macro_rules! diffusers_f8 {
            ($d:expr, $text:expr) => {
                Geometry {
                    blocks: $d.num_layers,
                    hidden: $d.inner(),
                    heads: $d.num_attention_heads,
                    patch: $d.patch_size,
                    latent_channels: $d.in_channels,
                    vae_factor: 8,
                    vae_temporal_factor: 1,
                    mlp: 4 * $d.inner(),
                    text: $text,
                }
            };
        }
        match &self.dims {
            Dims::Dit(d) => {
                let m = &d.model;
                Geometry {
                    blocks: u64::from(m.depth),
                    hidden: u64::from(m.hidden),
                    heads: u64::from(m.heads),
                    patch: u64::from(m.patch),
                    latent_channels: u64::from(m.in_channels),
                    vae_factor: 8,
                    vae_temporal_factor: 1,
                    mlp: u64::from(m.mlp_hidden()),
                    text: Vec::new(),
                }
            }
            Dims::DitDiffusers(d) => diffusers_f8!(d, Vec::new()),
            Dims::Pixart(d) => diffusers_f8!(
                d,
                vec![t5(
                    // By name: a preset's, or the path of a --model config.json (a Hub
                    // snapshot's path names the checkpoint, "PixArt-Sigma-XL-2-1024-MS").
                    if self.name.to_ascii_lowercase().contains("sigma") {
                        300
                    } else {
                        120
                    },
                    d.caption_channels.unwrap_or(d.cross_attention_dim),
                )]
            ),
            Dims::Sd3(d) => diffusers_f8!(
                d,
                vec![
                    TextEncoder {
                        name: "CLIP-L ⊕ CLIP-G",
                        default_tokens: 77,
                        width: d.joint_attention_dim,
                        sequence: true,
                    },
                    t5(77, d.joint_attention_dim),
                ]
            ),
            // Flux packs 2×2 latent pixels of 16 channels into one 64-wide token.
            Dims::Flux(d) => Geometry {
                blocks: d.num_layers + d.num_single_layers,
                patch: 2 * d.patch_size,
                latent_channels: d.in_channels / 4,
                ..diffusers_f8!(
                    d,
                    vec![
                        TextEncoder {
                            name: "CLIP-L (pooled)",
                            default_tokens: 77,
                            width: d.pooled_projection_dim,
                            sequence: false,
                        },
                        t5(
                            if d.guidance_embeds { 512 } else { 256 },
                            d.joint_attention_dim,
                        ),
                    ]
                )
            },
            // DC-AE f32c32, and Sana's own MLP width.
            Dims::Sana(d) => Geometry {
                vae_factor: 32,
                mlp: d.mlp_hidden(),
                ..diffusers_f8!(
                    d,
                    vec![TextEncoder {
                        name: "Gemma-2-2B",
                        default_tokens: 300,
                        width: d.caption_channels,
                        sequence: true,
                    }]
                )
            },
            Dims::Wan(d) => Geometry {
                blocks: d.num_layers,
                hidden: d.inner(),
                heads: d.num_attention_heads,
                patch: d.patch_size[1],
                latent_channels: d.in_channels,
                vae_factor: 8,
                vae_temporal_factor: 4,
                mlp: d.ffn_dim,
                text: vec![TextEncoder {
                    name: "umT5-XXL",
                    default_tokens: 512,
                    width: d.text_dim,
                    sequence: true,
                }],
            },
        }
    }
}

impl Dims {
    /// The kinds of block a model stacks, with how many of each it has: Flux's double- and
    /// single-stream blocks, SD3.5's dual-attention (MMDiT-X) and plain joint blocks; one kind
    /// for the other families.
    pub fn block_kinds(&self) -> Vec<(&'static str, u64)> {
        match self {
            Dims::Dit(d) => vec![("block", u64::from(d.model.depth))],
            Dims::DitDiffusers(d) => vec![("block", d.num_layers)],
            Dims::Pixart(d) => vec![("block", d.num_layers)],
            Dims::Sana(d) => vec![("block", d.num_layers)],
            Dims::Wan(d) => vec![("block", d.num_layers)],
            Dims::Flux(d) => vec![
                ("double-stream block", d.num_layers),
                ("single-stream block", d.num_single_layers),
            ],
            Dims::Sd3(d) => {
                let dual = d.dual_attention_layers.len() as u64;
                if dual == 0 {
                    vec![("block", d.num_layers)]
                } else {
                    vec![
                        ("dual-attention block", dual),
                        ("joint block", d.num_layers.saturating_sub(dual)),
                    ]
                }
            }
        }
    }

    /// The same model with fewer blocks, every other dimension kept (a real-width model a CPU
    /// can hold): `keep` holds one count per kind of block ([`Dims::block_kinds`]), or one
    /// count for every kind. Each count is 1 ≤ N ≤ the model's blocks of that kind; SD3.5 keeps
    /// its first N dual-attention blocks and first N joint blocks in their order. `field` names
    /// the setting in errors.
    pub fn with_depth(&self, keep: &[u32], field: &str) -> Result<Dims, SpecError> {
        let kinds = self.block_kinds();
        let listed = kinds
            .iter()
            .map(|(k, n)| format!("{n} {k}s"))
            .collect::<Vec<_>>()
            .join(" + ");
        let form = if kinds.len() == 1 { "N" } else { "N, or D,S" };
        if keep.is_empty() || (keep.len() != 1 && keep.len() != kinds.len()) {
            return Err(SpecError::invalid(
                field,
                format!(
                    "{} counts for a model of {listed}; allowed: {form} (1 to each kind's count)",
                    keep.len()
                ),
            ));
        }
        let counts: Vec<u64> = (0..kinds.len())
            .map(|i| u64::from(keep[if keep.len() == 1 { 0 } else { i }]))
            .collect();
        for (&n, (kind, have)) in counts.iter().zip(&kinds) {
            if n < 1 || n > *have {
                return Err(SpecError::invalid(
                    field,
                    format!(
                        "{n} {kind}s, but the model has {listed}; allowed: {form} with 1 ≤ N ≤ \
                         {have} {kind}s"
                    ),
                ));
            }
        }
        let mut out = self.clone();
        match &mut out {
            Dims::Dit(d) => d.model.depth = counts[0] as u32,
            Dims::DitDiffusers(d) => d.num_layers = counts[0],
            Dims::Pixart(d) => d.num_layers = counts[0],
            Dims::Sana(d) => d.num_layers = counts[0],
            Dims::Wan(d) => d.num_layers = counts[0],
            Dims::Flux(d) => {
                d.num_layers = counts[0];
                d.num_single_layers = counts[1];
            }
            Dims::Sd3(d) if d.dual_attention_layers.is_empty() => d.num_layers = counts[0],
            Dims::Sd3(d) => {
                // Walk the blocks in order, keeping each while its kind's count lasts.
                let (mut dual_left, mut joint_left) = (counts[0], counts[1]);
                let mut dual = Vec::new();
                let mut kept = 0u64;
                for i in 0..d.num_layers {
                    if d.dual_attention_layers.contains(&i) {
                        if dual_left > 0 {
                            dual_left -= 1;
                            dual.push(kept);
                            kept += 1;
                        }
                    } else if joint_left > 0 {
                        joint_left -= 1;
                        kept += 1;
                    }
                }
                d.num_layers = kept;
                d.dual_attention_layers = dual;
            }
        }
        Ok(out)
    }
}
