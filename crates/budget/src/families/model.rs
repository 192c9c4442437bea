//! A model of a family: the [`Family`], its dimensions ([`Dims`], one variant per family file) and
//! [`FamilyModel`] (the dimensions and where they came from), with the dispatch to each family's
//! table.

use serde::Serialize;

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
    pub fn original_dit(model: ModelSpec, image_size: u32) -> Result<FamilyModel, SpecError> {
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
