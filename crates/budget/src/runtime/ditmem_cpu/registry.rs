//! Where the `ditmem-cpu` runtime asks for a diffusers family's rules: [`rules`] reads the spec's
//! family and returns its [`FamilyRules`] from the one list of families,
//! `crate::families::registry` (a new family is a line there, not here). None: the original
//! DiT, whose rules are the step's own (`segments.rs`, `block.rs`).

use crate::runtime::ditmem_cpu::family::FamilyRules;
use crate::spec::Spec;

/// The rules of `spec`'s family; None for the original DiT (and any model no family reads).
pub(crate) fn rules(spec: &Spec) -> Option<Box<dyn FamilyRules>> {
    let fm = crate::denoiser::family(spec).ok().flatten()?;
    (crate::families::registry::of(fm.family)?.ditmem_cpu)(spec, &fm)
}
