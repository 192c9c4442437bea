//! What the engine asks of a model family, in one trait ([`EngineFamily`]): each family's
//! geometry (`families/<family>/params.rs`'s `*Geom`, or the original DiT's [`super::dit::Dit`])
//! implements it in its folder's `mod.rs`, and [`super::Arch::family`] hands it out. Nothing
//! outside `families/` matches on the family: `model.rs` (dims, parameter inventory),
//! `diffusion.rs` (the text inputs), `trainer.rs` (the step's layout) and the verification's
//! zero-gradient rule ask this trait.

use std::sync::Arc;

use ditmem_spec::Spec;

use crate::error::Result;
use crate::shapes::{Dims, ParamShape};
use crate::trainer::state::{ModelLayout, ParamIndex};

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
    /// Where the model's parameters sit for the step, and so which schedule runs it (the DiT's
    /// own, or the family schedule through `trainer::family::FamilyStep`).
    fn layout(&self, p: &ParamIndex<'_>, d: &Dims) -> Result<Arc<dyn ModelLayout>>;
}
