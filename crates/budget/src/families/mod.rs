//! The model families people fine-tune, each with its exact parameter table, read from a diffusers
//! `config.json` or a preset.
//!
//! A model is a [`Family`] plus its dimensions ([`Dims`]). Each family gives every tensor its
//! diffusers class holds — the name `model.named_parameters()` / `named_buffers()` reports (the name
//! PEFT's LoRA targets match), its shape, its module group and whether it is a parameter or a buffer
//! (a fixed position or RoPE table) — so that [`FamilyCounts::parameters`] equals diffusers'
//! `sum(p.numel() for p in model.parameters())` for the config. The peer
//! (`bench/torch_peer/count_params.py`) builds every preset's class on the meta device and its
//! output is pinned in `crates/budget/tests/families_params.rs`.
//!
//! Activations of these families (their op inventories) are the next step: this module only counts
//! what the model holds.

mod config;
mod defaults;
pub(crate) mod dit;
mod facts;
mod family;
pub(crate) mod flux;
pub mod frozen;
mod model;
mod modules;
pub(crate) mod pixart;
mod presets;
mod read;
pub(crate) mod registry;
pub(crate) mod sana;
pub(crate) mod sd3;
mod table;
pub(crate) mod wan;

pub(crate) use defaults::TrainingDefaults;
pub use dit::DitDiffusersDims;
pub(crate) use facts::{VaeOnDevice, DEFAULT_LORA_MODULES};
pub use flux::FluxDims;
pub use model::{Dims, Family, FamilyModel, Geometry, TextEncoder};
pub use pixart::PixartDims;
pub use presets::{preset, preset_config, preset_names, preset_source, unknown_preset};
pub(crate) use read::from_config_map;
pub use read::{from_config_json, MAX_CONFIG_JSON_BYTES};
pub use sana::SanaDims;
pub use sd3::Sd3Dims;
pub(crate) use table::Group;
pub use table::{
    count, state_bytes, FamilyCounts, FamilyTensor, GroupCount, StateBytes, TensorKind,
};
pub use wan::WanDims;

// Layers, each importing only the ones above it in this list: `table` (the tensor table and its
// counts) → `modules` (diffusers' module classes as table builders), `config` (the key reader) and
// `defaults` (the default workload)
// → the family files → `model` (`Family`, `Dims`, `FamilyModel`) → `read` (`config.json` by
// `_class_name`) → `presets`.
