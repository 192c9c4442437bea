//! The one list of the diffusers families the runtimes know: [`FAMILIES`], a line per family
//! naming its folder `families/<family>/`, whose `ditmem_cpu.rs` gives its `ditmem-cpu` rules
//! (a [`FamilyRules`]) and whose `pytorch.rs` its PyTorch stages. The runtimes ask this list
//! (`runtime/ditmem_cpu/registry.rs`, `runtime/pytorch/families/mod.rs`) and name no family.
//! The original DiT is not listed: its rules are the runtimes' own (`runtime/ditmem_cpu/block.rs`,
//! `segments.rs`; `runtime/pytorch/rules.rs`, `stages.rs`).
//!
//! This file sits above the family folders and the runtimes' family-independent files: nothing it
//! imports imports it back.

use crate::families::{dit, flux, pixart, sana, sd3, wan, Dims, Family, FamilyModel};
use crate::runtime::ditmem_cpu::family::FamilyRules;
use crate::runtime::pytorch::families::common::Fam;
use crate::runtime::pytorch::stages::Stages;
use crate::spec::Spec;

/// One registered family: its name and its rules in each runtime.
pub(crate) struct Registered {
    pub family: Family,
    /// Its `ditmem-cpu` rules for a spec of the family (None for another family's).
    pub ditmem_cpu: fn(&Spec, &FamilyModel) -> Option<Box<dyn FamilyRules>>,
    /// Its PyTorch stages for dims of the family (None for another family's).
    pub pytorch: fn(&Fam, &Dims) -> Option<Stages>,
}

/// A line of [`FAMILIES`]: the `Family` variant and the folder under `families/`.
macro_rules! family {
    ($variant:ident, $folder:ident) => {
        Registered {
            family: Family::$variant,
            ditmem_cpu: $folder::ditmem_cpu::rules,
            pytorch: $folder::pytorch::stages_of,
        }
    };
}

/// Every registered diffusers family. A new one is a line here (and its folder).
pub(crate) const FAMILIES: &[Registered] = &[
    family!(Pixart, pixart),
    family!(Sd3, sd3),
    family!(Flux, flux),
    family!(Sana, sana),
    family!(Wan, wan),
    family!(DitDiffusers, dit),
];

/// The registration of `family`; None for the original DiT.
pub(crate) fn of(family: Family) -> Option<&'static Registered> {
    FAMILIES.iter().find(|r| r.family == family)
}
