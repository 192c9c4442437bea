//! The diffusers families the engine executes beside the original DiT ([`crate::model`],
//! [`crate::layers`]), one folder per family, each sharing the fused ops of [`crate::ops`]:
//!
//! - [`pixart`]: `PixArtTransformer2DModel` (adaLN-single, self- and cross-attention, the
//!   caption projection).
//! - [`sd3`]: `SD3Transformer2DModel` (MMDiT joint blocks over a context and an image stream,
//!   the pooled-text embedder, optional q/k RMSNorm).
//! - [`flux`]: `FluxTransformer2DModel` (double-stream joint-attention blocks, single-stream
//!   blocks, q/k RMSNorm, 2-D RoPE).
//! - [`sana`]: `SanaTransformer2DModel` (adaLN-single, ReLU linear self-attention, softmax
//!   cross-attention, the GLUMBConv Mix-FFN, the caption projection and its RMSNorm).
//! - [`wan`]: `WanTransformer3DModel` (video latents, 3-D patchify and RoPE, q/k RMSNorm,
//!   cross-attention to umT5 states).
//! - [`lora`]: PEFT's LoRA on any family's linears (which modules, names, init, frozen base).
//!
//! [`Arch`] says which model a spec describes; `register_families!` below is the one list a
//! family is registered in (one line each), and [`Arch::family`] its [`EngineFamily`].

pub(crate) mod adaln;
pub(crate) mod config;
pub mod cross;
pub mod dit;
pub mod dit_diffusers;
pub(crate) mod family;
pub mod flux;
pub mod lora;
pub mod pixart;
pub mod sana;
pub mod sd3;
pub(crate) mod tiny;
pub mod wan;

pub(crate) use family::EngineFamily;

use ditmem_budget::{Family, Spec};

/// Whether a trained tensor of `arch` has a gradient that is zero in exact arithmetic: the key
/// bias of a softmax attention whose keys are `W·y + b` and nothing more before the scores. It
/// adds qᵢ·b to every score of query i's row, which the softmax ignores (shift invariance), so
/// its gradient Σⱼ dkⱼ = Σᵢ qᵢ Σⱼ dSᵢⱼ vanishes (each row of dS sums to zero). What a step
/// computes for it is rounding noise; `verify` judges it against the whole gradient instead of
/// its own norm. Per family (checked against the f64 gradients by `tests/verify_families.rs`):
///
/// - DiT: none — the key bias is a third of `attn.qkv.bias`, whose q and v thirds are not zero.
/// - PixArt: `attn1.to_k.bias` (self-attention) and `attn2.to_k.bias` (cross-attention to the
///   caption): both plain softmax attentions without q/k norm.
/// - diffusers' DiT: `attn1.to_k.bias` (plain softmax self-attention, separate biased q, k, v).
/// - Sana: `attn2.to_k.bias` (softmax cross-attention). Not attn1's: ReLU(k + b) is no shift of
///   the linear attention's keys.
/// - SD3, Flux: none. Joint attention: `to_k.bias` shifts the image keys only and
///   `add_k_proj.bias` the text keys only, so a row's scores do not all move together; with q/k
///   RMSNorm (SD3.5, Flux) the bias also enters before a normalisation, and Flux's RoPE rotates
///   each key by its own position.
/// - Wan: none: q/k RMSNorm after the bias in both attentions, and RoPE in the self-attention.
pub fn zero_gradient(arch: &Arch, name: &str) -> bool {
    let softmax_key_biases = arch.family().softmax_key_biases();
    softmax_key_biases.iter().any(|b| {
        name.strip_suffix(b)
            .is_some_and(|head| head.is_empty() || head.ends_with('.'))
    })
}

use crate::error::{EngineError, Result};

/// The one list of the families the engine runs (one line each; the original DiT is `Arch::Dit`
/// beside them): each line a variant of [`Arch`] named as the budget's `Family` and `Dims`
/// variants, holding the family's geometry, which reads the budget's dims with `new(spec, dims)`
/// and implements [`EngineFamily`] (in its `mod.rs`) and `trainer::state::FamilyLayout` (in its
/// `step.rs`). `for_each_family!(m)` hands the list to the macro `m`: `define_arch` here,
/// `layout_dispatch` in `trainer.rs` (the step's concern, which this file must not name: the
/// steps stand on `diffusion.rs` and `model.rs`, which ask this file).
macro_rules! for_each_family {
    ($m:ident) => {
        $m! {
            /// A `PixArtTransformer2DModel` from `model.diffusers`.
            Pixart(pixart::PixartGeom),
            /// An `SD3Transformer2DModel` from `model.diffusers`.
            Sd3(sd3::Sd3Geom),
            /// A `FluxTransformer2DModel` from `model.diffusers`.
            Flux(flux::FluxGeom),
            /// A `SanaTransformer2DModel` from `model.diffusers`.
            Sana(sana::SanaGeom),
            /// A `WanTransformer3DModel` from `model.diffusers`.
            Wan(wan::WanGeom),
            /// diffusers' `DiTTransformer2DModel` from `model.diffusers`.
            DitDiffusers(dit_diffusers::DitdGeom),

        }
    };
}
pub(crate) use for_each_family;

/// [`Arch`], its constructor and [`Arch::family`] from the registration list.
macro_rules! define_arch {
    ($($(#[$doc:meta])* $variant:ident($geom:ty),)*) => {
        /// The model of a spec, as the engine runs it.
        #[derive(Debug, Clone, PartialEq)]
        pub enum Arch {
            /// The original DiT of `model`'s own fields.
            Dit,
            $($(#[$doc])* $variant($geom),)*
        }

        impl Arch {
            /// The model of `spec`; a family the engine does not run yet is an error naming it.
            pub fn of(spec: &Spec) -> Result<Arch> {
                let Some(fm) = ditmem_budget::denoiser::family(spec)? else {
                    return Ok(Arch::Dit);
                };
                match (&fm.dims, fm.family) {
                    $((ditmem_budget::Dims::$variant(d), Family::$variant) => {
                        Ok(Arch::$variant(<$geom>::new(spec, d)?))
                    })*
                    _ => Err(EngineError::unsupported(
                        format!("model.diffusers ({}, {})", fm.class_name, fm.family.name()),
                        "the engine runs the original DiT and the diffusers DiT, PixArt, SD3, Flux, Sana and Wan 2.1 transformers so far",
                    )),
                }
            }

            /// What the engine asks of this model's family.
            pub(crate) fn family(&self) -> &dyn EngineFamily {
                match self {
                    Arch::Dit => &dit::params::Dit,
                    $(Arch::$variant(g) => g,)*
                }
            }
        }
    };
}

for_each_family!(define_arch);
