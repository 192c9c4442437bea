//! The original DiT (facebookresearch/DiT `models.py`) in the engine:
//!
//! - [`params`]: the parameter inventory with the PyTorch names (the initialisation is
//!   [`crate::model`]'s, shared by every family);
//! - [`block`]: the adaLN-Zero block and the final layer (the crate docs list what one block
//!   allocates);
//! - `step.rs`: where its parameters sit for the step and its own schedule (the diffusers
//!   families run the shared family schedule instead).
//!
//! The model's dims are the spec's own `model` fields; the spec carries no `model.diffusers`.

pub mod block;
pub mod params;
pub(crate) mod step;

pub use block::{block_forward, final_forward, BlockSeeds, BlockWeights, FinalWeights};
pub use params::Dit;

use candle_core::{Device, Tensor};
use ditmem_spec::Spec;

use crate::diffusion::Batch;
use crate::error::Result;

use crate::families::EngineFamily;
use crate::shapes::{Dims, ParamShape};

impl EngineFamily for Dit {
    fn out_channels(&self, spec: &Spec) -> usize {
        spec.model.out_channels() as usize
    }

    fn param_shapes(&self, spec: &Spec, d: &Dims) -> Vec<ParamShape> {
        params::param_shapes(spec, d)
    }
}

/// The class ids (`mb.n`) of a microbatch's samples on `dev`, a dropped label's as `null`
/// where the model has a null row (classifier-free guidance: diffusers'
/// `LabelEmbedding.token_drop`), as both DiT families' embed steps and their f64 replays in
/// the conformance suite look them up.
pub fn class_ids(mb: &Batch, null: Option<u32>, dev: &Device) -> Result<Tensor> {
    let ids: Vec<u32> = mb
        .labels
        .iter()
        .zip(&mb.drop_label)
        .map(|(&y, &drop)| match null {
            Some(n) if drop => n,
            _ => y,
        })
        .collect();
    Ok(Tensor::from_vec(ids, mb.n, dev)?)
}
