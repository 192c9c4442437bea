//! The `ditmem-cpu` runtime: the ditmem engine's memory, op by op, as candle 0.11 executes it.
//!
//! The engine (crate `ditmem-engine`) builds every block from candle ops and, for the heavy parts
//! (linears, LayerNorm + modulate, GELU, attention, the gated residuals), its own fused custom ops
//! (`ditmem_engine::ops`, [`graph::Kind::Custom`] here) that keep only what their backward needs
//! and return fresh untracked gradients. Candle keeps
//! every node of a tracked graph alive until the graph's root is dropped, makes a node for each
//! view (`narrow`, `t`, `reshape`, `broadcast_as`), and its `backward` (candle-core
//! `src/backprop.rs`) visits the nodes in reverse depth-first post-order, allocating for each
//! input gradient a `zeros_like` plus an `add` (or `sub`) per contribution, and op-specific
//! temporaries (a `narrow` pads with zeros and concatenates to its input's full size, `gelu`
//! evaluates its derivative through about a dozen temporaries, …). A gradient reaching a tensor
//! that does not track gradients still enters the gradient store and stays there until the store
//! is dropped.
//!
//! This folder rebuilds the engine's graphs node for node ([`graph::Graph`]), and replays
//! candle's backward on them ([`backward::backward`]) with each rule's allocations in the order
//! the code makes them, so that the budget's timeline for the `ditmem-cpu` runtime can be held
//! against the counting allocator to the byte. The rules cite the candle source they follow.
//!
//! Each file is the twin of an engine file:
//! - [`graph`]: candle's node graph and its forward analyses (candle-core's `Tensor_` / storage);
//! - [`backward`]: candle's backward rules (candle-core `src/backprop.rs`);
//! - [`ops`]: the engine's fused ops and kernel workspaces (`ops/`, `kernels/gemm_bf16.rs`,
//!   `ops/attention/bf16.rs`);
//! - [`gemm_pack`]: the per-call packing buffer of the `gemm` crate (`kernels/gemm.rs`);
//! - [`attention`]: the composed attention core (`ops/attention/reference.rs`);
//! - [`separate`]: the attention over separate q, k, v (`ops/attention/separate.rs`);
//! - [`block`]: one DiT block (`block.rs`);
//! - [`parts`]: what the diffusers families of one block kind build alike (timestep embedder,
//!   text projection, `scale_shift_table` modulation, attention and feed-forward parts);
//! - [`dit_diffusers`]: diffusers' DiT's segments (`families/dit_diffusers/block.rs`,
//!   `families/dit_diffusers/step.rs`);
//! - [`flux`]: Flux's segments (`families/flux/block.rs`, `families/flux/step.rs`);
//! - [`pixart`]: PixArt's segments (`families/pixart/block.rs`, `families/pixart/step.rs`);
//! - [`sana`]: Sana's segments and ops (`families/sana/block.rs`, `families/sana/step.rs`,
//!   `ops/{linear_attention,dwconv,glu,rms_norm}.rs`);
//! - [`wan`]: Wan 2.1's segments (`families/wan/block.rs`, `families/wan/step.rs`);
//! - [`segments`]: the three segments of a step and their simulation (`trainer.rs`'s
//!   `microbatch`);
//! - [`sims`]: one segment's simulation ([`sims::seg`]) and the parts every family's
//!   [`crate::runtime::costs::Sims`] is assembled from (`trainer/family.rs`);
//! - [`step`]: the step replay (`trainer.rs`'s `step`);
//! - [`family`]: the trait a family's rules implement ([`family::FamilyRules`], the engine's
//!   `FamilyStep`), and [`registry`]: the one list of families the step and the segments ask;
//! - [`dtypes`]: the gradient dtype rule both crates read (`trainer.rs`'s `grad_dtype` converts it).

pub mod attention;
pub mod backward;
pub mod block;
pub mod cross;
pub(crate) mod dtypes;
pub(crate) mod family;
pub mod gemm_pack;
pub mod graph;
pub mod ops;
pub(crate) mod parts;
pub(crate) mod registry;
pub(crate) mod segments;
pub(crate) mod separate;
pub(crate) mod sims;
pub(crate) mod step;

use crate::events::{Event, StaticBytes};
use crate::params::ParamTensor;
use crate::runtime::costs::SegmentCosts;
use crate::runtime::model::RuntimeModel;
use crate::runtime::shape::Shape;
use crate::segment::Segment;
use crate::spec::{Dtype, Precision, Spec};

/// The ditmem engine on the CPU. Its graphs are built node for node in this folder and its step
/// is replayed in [`step`]; the segments below are those graphs seen as generic segments (for
/// the op inventory and the time model).
pub(crate) struct DitmemCpu;

impl RuntimeModel for DitmemCpu {
    fn name(&self) -> &'static str {
        "ditmem-cpu"
    }

    fn embed_segment(&self, shape: &Shape) -> Segment {
        graph::to_segment(&segments::embed_graph(shape).0, "embed")
    }

    fn block_segment(&self, shape: &Shape) -> Segment {
        graph::to_segment(&block::block(shape).0, "block")
    }

    fn final_segment(&self, shape: &Shape) -> Segment {
        graph::to_segment(&segments::final_graph(shape).0, "final")
    }

    fn keeps_all_outputs(&self) -> bool {
        true
    }

    fn grad_dtype(&self, precision: Precision) -> Dtype {
        dtypes::grad_dtype(precision)
    }

    /// The engine's segments replayed node for node.
    fn segment_costs(&self, spec: &Spec) -> SegmentCosts {
        SegmentCosts::Engine(segments::sims(spec))
    }

    fn replay(
        &self,
        spec: &Spec,
        table: &[ParamTensor],
        st: &StaticBytes,
        costs: &SegmentCosts,
        max_microbatches: u32,
    ) -> Vec<Event> {
        match costs {
            SegmentCosts::Engine(sims) => step::replay(spec, table, st, sims, max_microbatches),
            // Costs made for another runtime: the engine's own, for this spec.
            SegmentCosts::Generic(_) => {
                step::replay(spec, table, st, &segments::sims(spec), max_microbatches)
            }
        }
    }
}
