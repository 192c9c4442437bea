//! The [`RuntimeModel`] trait: what the timeline, the estimate and the planner ask of a runtime.
//!
//! A runtime describes its three segments (input side, one block, final layer + loss) as
//! generic [`Segment`]s for the op inventory and the time model, computes what its step replay
//! needs about them ([`SegmentCosts`]), and replays one optimizer step into events. Nothing
//! outside `runtime/` names a runtime: [`crate::runtime::model_for`] picks the implementation.

use crate::events::{Event, StaticBytes};
use crate::params::ParamTensor;
use crate::runtime::costs::{GenericCosts, SegmentCosts};
use crate::runtime::shape::Shape;
use crate::segment::{simulate, Segment, Tid};
use crate::spec::{Dtype, Optimizer, Precision, Spec};

/// Where a runtime's per-op rules come from and how it allocates.
pub(crate) trait RuntimeModel {
    fn name(&self) -> &'static str;
    /// Forward graph of the input side: noising, patch embedding, timestep and label embedders.
    fn embed_segment(&self, shape: &Shape) -> Segment;
    /// Forward graph of one DiT block.
    fn block_segment(&self, shape: &Shape) -> Segment;
    /// Forward graph of the final layer and the loss.
    fn final_segment(&self, shape: &Shape) -> Segment;
    /// True when a tracked graph keeps every op output (candle); false when only what backward
    /// reads is kept (PyTorch autograd).
    fn keeps_all_outputs(&self) -> bool;
    /// Whether the tensor is saved for backward when `keeps_all_outputs` is false.
    fn saves(&self, _seg: &Segment, _t: Tid) -> bool {
        true
    }
    /// Dtype of the gradient buffers under a precision policy.
    fn grad_dtype(&self, precision: Precision) -> Dtype {
        precision.param_dtype()
    }
    /// Transient bytes of one optimizer update of a tensor with `elems` elements (beyond its
    /// state), reported in [`StaticBytes::optimizer_scratch`] (0 for runtimes whose replay
    /// counts the optimizer's temporaries itself).
    fn optimizer_scratch(&self, _elems: u64, _precision: Precision, _optimizer: Optimizer) -> u64 {
        0
    }
    /// Transient bytes of the EMA update of a tensor with `elems` elements, reported in
    /// [`StaticBytes::ema_scratch`].
    fn ema_scratch(&self, _elems: u64, _dtype: Dtype) -> u64 {
        0
    }
    /// What the step replay needs about each segment, computed once per spec (the planner caches
    /// it across candidates that share the segment shapes). By default the three generic
    /// segments simulated under the runtime's retention rule.
    fn segment_costs(&self, spec: &Spec) -> SegmentCosts {
        let shape = Shape::new(spec);
        let keep = self.keeps_all_outputs();
        let saved = |seg: &Segment, t| self.saves(seg, t);
        SegmentCosts::Generic(GenericCosts {
            embed: simulate(&self.embed_segment(&shape), keep, &saved),
            block: simulate(&self.block_segment(&shape), keep, &saved),
            final_layer: simulate(&self.final_segment(&shape), keep, &saved),
        })
    }
    /// The events of one optimizer step. Only the first
    /// [`crate::events::laid_out_microbatches`]`(accumulation, max_microbatches)` microbatches
    /// are laid out (every microbatch after the first starts from the same state; the timeline
    /// records which ones repeat).
    fn replay(
        &self,
        spec: &Spec,
        table: &[ParamTensor],
        st: &StaticBytes,
        costs: &SegmentCosts,
        max_microbatches: u32,
    ) -> Vec<Event>;
}
