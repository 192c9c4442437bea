//! The diffusers families as PyTorch runs them: each family's stages, op by op, with what each op
//! saves for backward (the rule sources [AG], [MM], [AC], [SDPA] are listed in `pytorch/mod.rs`),
//! for the step of `bench/torch_peer/family_peer.py` (the diffusers training scripts' step with
//! cached text embeddings and latents). Ground truth of every rule: the saved-tensor dumps in
//! `bench/torch_peer/runs/2026-12-01-epyc-families-saved/families_saved.txt` (`family_saved.py`).
//!
//! Each family's rules are its folder's `pytorch.rs` (`crates/budget/src/families/<family>/`;
//! `families/dit/pytorch.rs` is diffusers' `DiTTransformer2DModel`), listed in
//! `crate::families::registry`; this file dispatches to them, [`common`] holds the pieces they
//! share (the family context, the timestep sinusoid, the noising and the losses).

pub(crate) mod common;

pub(crate) use common::Fam;

use crate::families::{registry, Family, FamilyModel};
use crate::runtime::pytorch::device::PyTorch;
use crate::runtime::pytorch::stages::Stages;
use crate::segment::Segment;
use crate::spec::Spec;

/// Whether the `pytorch` runtime has the op inventory of a family: the original DiT's own
/// rules, or the family's registered `pytorch.rs`.
pub(crate) fn supported(family: Family) -> bool {
    family == Family::Dit || registry::of(family).is_some()
}

/// The stages of a family spec's step (none for the original DiT, which has its own rules,
/// `rules.rs`; `stages.rs` never sends it here).
pub(crate) fn stages(rt: &PyTorch, spec: &Spec, fm: &FamilyModel) -> Stages {
    let f = Fam::new(rt, spec, fm);
    registry::of(fm.family)
        .and_then(|r| (r.pytorch)(&f, &fm.dims))
        .unwrap_or_default()
}

/// The stages of a spec's step: the original DiT, or its diffusers family.
pub(crate) fn of_spec(rt: &PyTorch, spec: &Spec) -> Stages {
    let mut st = match crate::denoiser::family(spec) {
        Ok(Some(fm)) => stages(rt, spec, &fm),
        _ => crate::runtime::pytorch::stages::dit(rt, spec),
    };
    let p = spec.recipe.precision;
    if crate::sharding::Scheme::of(spec).low_precision_module(p) {
        crate::runtime::pytorch::sharding::low_precision_module(&mut st, p);
    }
    st
}

/// A family spec's stage segments, input side first (None for the original DiT, whose three
/// segments the runtime's builders give): the op inventory and the generic costs of the
/// estimate read them.
pub(crate) fn family_segments(spec: &Spec) -> Option<Vec<Segment>> {
    crate::denoiser::family(spec).ok().flatten()?;
    let st = of_spec(crate::runtime::pytorch::device::for_spec(spec), spec);
    Some(
        st.stages
            .into_iter()
            .filter(|s| s.count > 0)
            .map(|s| s.seg)
            .collect(),
    )
}
