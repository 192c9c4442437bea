//! Reading a diffusers `config.json`: `_class_name` picks the family (with diffusers' remapping of
//! a legacy `Transformer2DModel` by its `norm_type`), whose reader takes the keys ([`super::config`]
//! holds the key rules and limits).

use serde_json::{Map, Value};

use super::config::{cut, shown, Cfg};
use super::model::{Dims, FamilyModel};
use super::{dit, flux, pixart, sana, sd3, wan};
use crate::error::SpecError;

/// Largest config.json read: 1 MiB (the published ones are under 2 KB).
pub const MAX_CONFIG_JSON_BYTES: usize = 1 << 20;

/// The classes `_class_name` may name.
pub(crate) const CLASSES: &str =
    "DiTTransformer2DModel, PixArtTransformer2DModel, SD3Transformer2DModel, \
FluxTransformer2DModel, SanaTransformer2DModel, WanTransformer3DModel, Transformer2DModel \
(norm_type ada_norm_zero or ada_norm_single)";

/// Read a diffusers transformer `config.json`.
pub fn from_config_json(text: &str) -> Result<FamilyModel, SpecError> {
    if text.len() > MAX_CONFIG_JSON_BYTES {
        return Err(SpecError::invalid(
            "config.json",
            format!(
                "is {} bytes; allowed: at most {MAX_CONFIG_JSON_BYTES}",
                text.len()
            ),
        ));
    }
    let value: Value = serde_json::from_str(text).map_err(|e| SpecError::Parse {
        format: "JSON",
        message: e.to_string(),
        location: String::new(),
    })?;
    let Value::Object(map) = value else {
        return Err(SpecError::invalid(
            "config.json",
            "is not a JSON object; allowed: a diffusers config.json ({\"_class_name\": …})",
        ));
    };
    from_config_map(map)
}

/// Read a diffusers transformer config already parsed into a JSON object (a spec's
/// `model.diffusers`).
pub(crate) fn from_config_map(map: Map<String, Value>) -> Result<FamilyModel, SpecError> {
    let mut cfg = Cfg::new(map);
    let class = match cfg.map.get("_class_name") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => {
            return Err(SpecError::invalid(
                "_class_name",
                format!("is not a string; allowed: {CLASSES}"),
            ))
        }
        None => {
            return Err(SpecError::invalid(
                "_class_name",
                format!("is missing; allowed: {CLASSES}"),
            ))
        }
    };
    let dims = match class.as_str() {
        "DiTTransformer2DModel" => Dims::DitDiffusers(dit::from_config(&mut cfg, false)?),
        "PixArtTransformer2DModel" => Dims::Pixart(pixart::from_config(&mut cfg, false)?),
        // diffusers' _CLASS_REMAPPING_DICT (models/model_loading_utils.py): a legacy
        // Transformer2DModel config loads as DiT or PixArt by its norm_type.
        "Transformer2DModel" => match cfg.map.get("norm_type") {
            Some(Value::String(s)) if s == "ada_norm_zero" => Dims::DitDiffusers(dit::from_config(&mut cfg, true)?),
            Some(Value::String(s)) if s == "ada_norm_single" => {
                Dims::Pixart(pixart::from_config(&mut cfg, true)?)
            }
            other => {
                return Err(SpecError::invalid(
                    "norm_type",
                    format!(
                        "{} with _class_name Transformer2DModel is not modelled (diffusers remaps only \
                         these two); allowed: \"ada_norm_zero\" (DiT), \"ada_norm_single\" (PixArt)",
                        shown(other)
                    ),
                ))
            }
        },
        "SD3Transformer2DModel" => Dims::Sd3(sd3::from_config(&mut cfg)?),
        "FluxTransformer2DModel" => Dims::Flux(flux::from_config(&mut cfg)?),
        "SanaTransformer2DModel" => Dims::Sana(sana::from_config(&mut cfg)?),
        "WanTransformer3DModel" => Dims::Wan(wan::from_config(&mut cfg)?),
        other => {
            return Err(SpecError::invalid(
                "_class_name",
                format!("'{}' is not modelled; allowed: {CLASSES}", cut(other)),
            ))
        }
    };
    cfg.finish(&class)?;
    Ok(FamilyModel::new("config.json", dims))
}
