//! Runtime models: what each executor allocates and keeps per op.
//!
//! The op inventory depends on who executes the step. The ditmem engine (candle) composes its ops
//! from candle primitives and keeps every intermediate of a tracked graph; PyTorch's autograd keeps
//! only what each op's backward reads and rounds allocations in its caching allocator. A runtime is
//! a [`RuntimeModel`]; the timeline, the estimate and the planner only talk to the trait through
//! [`model_for`], so a new runtime is a new folder here, one arm of [`model_for`] and a
//! [`crate::spec::Runtime`] variant.
//!
//! Layout (no file imports a file that imports it back):
//! - [`shape`]: [`Shape`], the one shape struct every segment builder reads;
//! - [`costs`]: [`SegmentCosts`], what a step replay needs about each segment;
//! - [`model`]: the [`RuntimeModel`] trait;
//! - [`ditmem_cpu`]: the ditmem engine on the CPU, the twin of `ditmem-engine`;
//! - [`pytorch`]: PyTorch eager autograd;
//! - this file: [`model_for`], the single way in.

pub(crate) mod costs;
pub(crate) mod ditmem_cpu;
pub(crate) mod model;
pub(crate) mod pytorch;
pub(crate) mod shape;

pub(crate) use costs::SegmentCosts;
pub use costs::{Kept, SegSim, Sims};
pub(crate) use model::RuntimeModel;
pub use shape::Shape;

use crate::spec::{Runtime, Spec};

/// The rules for a spec's runtime.
pub(crate) fn model_for(spec: &Spec) -> &'static dyn RuntimeModel {
    match spec.runtime {
        Runtime::DitmemCpu => &ditmem_cpu::DitmemCpu,
        Runtime::Pytorch { device, sdpa } => pytorch::device::PyTorch::instance(device, sdpa),
    }
}
