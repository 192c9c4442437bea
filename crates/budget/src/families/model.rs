//! A model of a family: the [`Family`], its dimensions ([`Dims`], one variant per family file) and
//! [`FamilyModel`] (the dimensions and where they came from), with the dispatch to each family's
//! table.

use serde::Serialize;

use super::defaults::TrainingDefaults;
use super::dit::{DitDiffusersDims, DitDims};
use super::facts::FamilyFacts;
use super::family::FamilyDims;
pub use super::family::{Geometry, TextEncoder};
use super::flux::FluxDims;
use super::pixart::PixartDims;
use super::sana::SanaDims;
use super::sd3::Sd3Dims;
use super::table::{count, FamilyCounts, FamilyTensor, Table};
use super::wan::WanDims;
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

    /// What the family's training looks like in diffusers' scripts ([`FamilyFacts`]), as its
    /// folder states it.
    pub(crate) const fn facts(self) -> &'static FamilyFacts {
        match self {
            Family::Dit => &super::dit::DIT_FACTS,
            Family::DitDiffusers => &super::dit::DIT_DIFFUSERS_FACTS,
            Family::Pixart => &super::pixart::FACTS,
            Family::Sd3 => &super::sd3::FACTS,
            Family::Flux => &super::flux::FACTS,
            Family::Sana => &super::sana::FACTS,
            Family::Wan => &super::wan::FACTS,
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

/// `$body` with `$d` bound to the dimensions whichever family `$dims` holds: the one list of
/// [`Dims`]' variants that [`Dims::rules`] and [`Dims::rules_mut`] dispatch over.
macro_rules! each_family {
    ($dims:expr, $d:ident => $body:expr) => {
        match $dims {
            Dims::Dit($d) => $body,
            Dims::DitDiffusers($d) => $body,
            Dims::Pixart($d) => $body,
            Dims::Sd3($d) => $body,
            Dims::Flux($d) => $body,
            Dims::Sana($d) => $body,
            Dims::Wan($d) => $body,
        }
    };
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

    /// The family's answers ([`FamilyDims`]): the one dispatch on the family of a model's
    /// dimensions; every question below asks it.
    fn rules(&self) -> &dyn FamilyDims {
        each_family!(self, d => d)
    }

    /// [`Dims::rules`], to change the dimensions.
    fn rules_mut(&mut self) -> &mut dyn FamilyDims {
        each_family!(self, d => d)
    }

    /// Hidden size of the transformer stream.
    pub fn hidden(&self) -> u64 {
        self.rules().hidden()
    }

    /// Every tensor the model holds, in module order.
    pub fn table(&self) -> Vec<FamilyTensor> {
        let mut t = Table::default();
        self.rules().table(&mut t);
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

impl FamilyModel {
    /// The workload the family trains at by default (its file's `training_defaults`); None for
    /// the original DiT and diffusers' DiT, which keep the DiT workload (256², batch 32).
    pub fn training_defaults(&self) -> Option<TrainingDefaults> {
        self.dims.rules().training_defaults()
    }

    /// The geometry of the model: VAEs per family from the published pipelines — SD VAE f8c4
    /// (DiT, PixArt), SD3/Flux VAE f8c16 (Flux packs 2×2 latent pixels into one 64-wide token),
    /// DC-AE f32c32 (Sana), Wan-VAE f8 × t4, c16. Text encoders as the diffusers training scripts
    /// encode them: PixArt T5-XXL 120 tokens (α; Σ: 300), SD3 CLIP-L ⊕ CLIP-G 77 + T5-XXL 77
    /// (`train_dreambooth_sd3.py` `--max_sequence_length 77`), Flux CLIP-L pooled + T5-XXL 512
    /// (dev; schnell 256), Sana Gemma-2-2B 300, Wan umT5-XXL 512. Each family's file says its own.
    pub fn geometry(&self) -> Geometry {
        self.dims.rules().geometry(&self.name)
    }
}

impl Dims {
    /// The kinds of block a model stacks, with how many of each it has: Flux's double- and
    /// single-stream blocks, SD3.5's dual-attention (MMDiT-X) and plain joint blocks; one kind
    /// for the other families.
    pub fn block_kinds(&self) -> Vec<(&'static str, u64)> {
        self.rules().block_kinds()
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
        out.rules_mut().keep_blocks(&counts);
        Ok(out)
    }
}
