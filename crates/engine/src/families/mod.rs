//! The diffusers families the engine executes beside the original DiT ([`crate::model`],
//! [`crate::block`]), one folder per family, each sharing the fused ops of [`crate::ops`]:
//!
//! - [`pixart`]: `PixArtTransformer2DModel` (adaLN-single, self- and cross-attention, the
//!   caption projection).
//! - [`wan`]: `WanTransformer3DModel` (video latents, 3-D patchify and RoPE, q/k RMSNorm,
//!   cross-attention to umT5 states).
//!
//! [`Arch`] says which model a spec describes; the trainer schedules both the same way.

pub mod pixart;
pub mod wan;

use ditmem_budget::{Family, Spec};

/// Whether a trained tensor's gradient is zero in exact arithmetic: the key bias of a softmax
/// attention (diffusers' `to_k.bias`) adds q·b_k to every score of a query's row, which the
/// softmax ignores, so its gradient Σⱼ dkⱼ = Σᵢ qᵢ Σⱼ dSᵢⱼ vanishes (each row of dS sums to
/// zero). What a step computes for it is rounding noise; `verify` judges it against the whole
/// gradient instead of its own norm.
pub fn zero_gradient(name: &str) -> bool {
    name.ends_with(".to_k.bias")
}

use crate::error::{EngineError, Result};

/// The model of a spec, as the engine runs it.
#[derive(Debug, Clone, PartialEq)]
pub enum Arch {
    /// The original DiT of `model`'s own fields.
    Dit,
    /// A `PixArtTransformer2DModel` from `model.diffusers`.
    Pixart(pixart::PixartGeom),
    /// A `WanTransformer3DModel` from `model.diffusers`.
    Wan(wan::WanGeom),
}

impl Arch {
    /// The model of `spec`; a family the engine does not run yet is an error naming it.
    pub fn of(spec: &Spec) -> Result<Arch> {
        let fm = ditmem_budget::denoiser::family(spec)?;
        match fm {
            None => Ok(Arch::Dit),
            Some(fm) => match (&fm.dims, fm.family) {
                (ditmem_budget::Dims::Pixart(d), Family::Pixart) => {
                    Ok(Arch::Pixart(pixart::PixartGeom::new(spec, d)?))
                }
                (ditmem_budget::Dims::Wan(d), Family::Wan) => {
                    Ok(Arch::Wan(wan::WanGeom::new(spec, d)?))
                }
                _ => Err(EngineError::unsupported(
                    format!("model.diffusers ({}, {})", fm.class_name, fm.family.name()),
                    "the engine runs the original DiT, PixArtTransformer2DModel and WanTransformer3DModel so far",
                )),
            },
        }
    }
}
