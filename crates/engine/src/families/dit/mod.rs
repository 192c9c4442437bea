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

use ditmem_spec::Spec;

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
