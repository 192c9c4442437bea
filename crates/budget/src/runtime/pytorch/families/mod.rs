//! The diffusers families as PyTorch runs them: each family's stages, op by op, with what each op
//! saves for backward (the rule sources [AG], [MM], [AC], [SDPA] are listed in `pytorch/mod.rs`),
//! for the step of `bench/torch_peer/family_peer.py` (the diffusers training scripts' step with
//! cached text embeddings and latents). Ground truth of every rule: the saved-tensor dumps in
//! `bench/torch_peer/runs/2026-12-01-epyc-families-saved/families_saved.txt` (`family_saved.py`).
//!
//! One file per family ([`dit`] is diffusers' `DiTTransformer2DModel`), [`common`] the pieces
//! they share (the family context, timestep embedders, the loss).

mod common;
mod dit;
mod flux;
mod pixart;
mod sana;
mod sd3;
mod wan;

pub use common::Fam;

use crate::families::{Dims, Family, FamilyModel};
use crate::runtime::pytorch::device::PyTorch;
use crate::runtime::pytorch::stages::Stages;
use crate::segment::Segment;
use crate::spec::Spec;

/// Whether the `pytorch` runtime has the op inventory of a family.
pub const fn supported(family: Family) -> bool {
    match family {
        Family::Dit => true,
        Family::DitDiffusers => dit::READY,
        Family::Pixart => pixart::READY,
        Family::Sd3 => sd3::READY,
        Family::Flux => flux::READY,
        Family::Sana => sana::READY,
        Family::Wan => wan::READY,
    }
}

/// The stages of a family spec's step.
pub fn stages(rt: &PyTorch, spec: &Spec, fm: &FamilyModel) -> Stages {
    let f = Fam::new(rt, spec, fm);
    match &fm.dims {
        // The original DiT has its own rules (`rules.rs`); `stages.rs` never sends it here.
        Dims::Dit(_) => Stages::default(),
        Dims::DitDiffusers(d) => dit::stages(&f, d),
        Dims::Pixart(d) => pixart::stages(&f, d),
        Dims::Sd3(d) => sd3::stages(&f, d),
        Dims::Flux(d) => flux::stages(&f, d),
        Dims::Sana(d) => sana::stages(&f, d),
        Dims::Wan(d) => wan::stages(&f, d),
    }
}

/// The stages of a spec's step: the original DiT, or its diffusers family.
pub fn of_spec(rt: &PyTorch, spec: &Spec) -> Stages {
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
pub fn family_segments(spec: &Spec) -> Option<Vec<Segment>> {
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
