//! The diffusers families as PyTorch runs them: each family's stages, op by op, with what each op
//! saves for backward (the rule sources [AG], [MM], [AC], [SDPA] are listed in the folder's
//! `mod.rs` one level up).

use crate::families::FamilyModel;
use crate::runtime::pytorch::device::PyTorch;
use crate::runtime::pytorch::stages::Stages;
use crate::spec::Spec;

/// The stages of a family spec's step.
pub fn stages(rt: &PyTorch, spec: &Spec, fm: &FamilyModel) -> Stages {
    let _ = (rt, spec, fm);
    todo!("family stages")
}
