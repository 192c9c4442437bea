//! What the engine asks of a model family, in one trait ([`EngineFamily`]): each family's
//! geometry (`families/<family>/params.rs`'s `*Geom`, or the original DiT's [`super::dit::Dit`])
//! implements it in its folder's `mod.rs`, and [`super::Arch::family`] hands it out. Nothing
//! outside `families/` matches on the family: `model.rs` (dims, parameter inventory),
//! `diffusion.rs` (the text inputs) and the verification's zero-gradient rule ask this trait.
//! The step's concern is the trait `trainer::state::FamilyLayout`, which each family implements
//! in its `step.rs`: this file and `families/mod.rs` name no step file, so the files the steps
//! stand on (`diffusion.rs`, `model.rs`) can ask the family without an import circle.

use ditmem_spec::Spec;

use crate::shapes::{Dims, ParamShape};

/// One model family as the engine runs it. Defaults are the original DiT's answers where a
/// family has nothing of its own (no video frames, the spec's MLP width, no text inputs, no
/// key bias with a zero gradient).
pub(crate) trait EngineFamily {
    /// Output channels of the model (a family's from its config: PixArt-α's 8 with a learned
    /// variance).
    fn out_channels(&self, spec: &Spec) -> usize;
    /// Latent frames (a video family's; 1 for images).
    fn frames(&self) -> usize {
        1
    }
    /// The MLP's hidden width when the family's config sets it apart from the spec's
    /// `mlp_hidden()` (Wan's `ffn_dim`).
    fn mlp_hidden(&self) -> Option<usize> {
        None
    }
    /// The cached text inputs a batch carries: (tokens, width, pooled width); zeros for a
    /// class-conditional model.
    fn text_inputs(&self) -> (usize, usize, usize) {
        (0, 0, 0)
    }
    /// Every parameter, in the budget's table order (the DiT's own order for the DiT).
    fn param_shapes(&self, spec: &Spec, d: &Dims) -> Vec<ParamShape>;
    /// The key biases of the family's plain softmax attentions, whose gradient is zero in exact
    /// arithmetic (see [`super::zero_gradient`]).
    fn softmax_key_biases(&self) -> &'static [&'static str] {
        &[]
    }
}
