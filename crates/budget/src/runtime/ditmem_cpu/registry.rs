//! The one place a diffusers family is registered with the `ditmem-cpu` runtime: [`rules`] tries
//! each family's geometry reader in turn and returns the first that reads the spec, as a
//! [`FamilyRules`]. A new family is one line of [`FAMILIES`] (and its file implementing the
//! trait). None: the original DiT, whose rules are the step's own (`segments.rs`, `block.rs`).

use crate::runtime::ditmem_cpu::family::FamilyRules;
use crate::runtime::ditmem_cpu::{dit_diffusers, flux, pixart, sana, sd3, wan};
use crate::spec::Spec;

/// A family's reader: its rules for a spec of that family, None for any other.
type Reader = fn(&Spec) -> Option<Box<dyn FamilyRules>>;

/// Every registered family, in the order they are tried (each reads only its own `_class_name`,
/// so the order does not change which one answers).
const FAMILIES: &[Reader] = &[
    |s| pixart::PixGeo::of(s).map(|g| Box::new(g) as Box<dyn FamilyRules>),
    |s| sd3::Sd3Geo::of(s).map(|g| Box::new(g) as Box<dyn FamilyRules>),
    |s| flux::FluxGeo::of(s).map(|g| Box::new(g) as Box<dyn FamilyRules>),
    |s| sana::SanaGeo::of(s).map(|g| Box::new(g) as Box<dyn FamilyRules>),
    |s| wan::WanGeo::of(s).map(|g| Box::new(g) as Box<dyn FamilyRules>),
    |s| dit_diffusers::DitdGeo::of(s).map(|g| Box::new(g) as Box<dyn FamilyRules>),
];

/// The rules of `spec`'s family; None for the original DiT (and any model no family reads).
pub(crate) fn rules(spec: &Spec) -> Option<Box<dyn FamilyRules>> {
    FAMILIES.iter().find_map(|read| read(spec))
}
