//! Per-segment costs: what a runtime's step replay needs about its three segments, computed once
//! per spec and cached by the planner across candidates that share the segment shapes.
//!
//! [`Sims`] are the ditmem-cpu segments replayed node for node (made by
//! `runtime::ditmem_cpu::segments`); [`GenericCosts`] are generic segments simulated under a
//! runtime's retention rule (PyTorch). Both serialise into the budget's `segments` field.

use serde::Serialize;

use crate::segment::SegmentCost;

/// The results of simulating one segment's graph.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SegSim {
    /// Activations the tracked graph owns, leaves and output excluded.
    pub activations: u64,
    /// Weight casts the tracked graph owns.
    pub weight_casts: u64,
    /// The leaf copy the segment runs on (0 for the embed segment).
    pub leaf: u64,
    /// The output buffer.
    pub output: u64,
    /// Highest bytes while building the tracked graph (leaf and output included).
    pub fwd_peak: u64,
    /// Highest bytes of a no-grad forward on the input (blocks only; output included).
    pub untracked_peak: u64,
    /// The backward root's own buffers during backward.
    pub root: u64,
    /// Candle backward replay: the store and temporaries at the backward's worst moment, and
    /// the activations the graph's ops had freed by then (`Backward::released`).
    pub bwd_peak: u64,
    pub bwd_released: u64,
    pub bwd_store: u64,
    pub bwd_leaf_grads: u64,
    /// Of [`SegSim::output`] (the embed: its streams): the buffers' data bytes, which the family
    /// schedule releases once a stored reader has copied them into its leaves
    /// ([`Sims::streams_once`]).
    pub output_data: u64,
}

/// A second kind of block after the first `start` blocks (Flux's single-stream blocks after its
/// double-stream ones): `first` is block `start` (which may read the streams of the first kind
/// and join them), `rest` every later one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SecondBlocks {
    pub start: u32,
    pub first: SegSim,
    pub rest: SegSim,
}

/// SD3.5's dual-attention (MMDiT-X) blocks, the spec's `dual_attention_layers`: `block` any
/// of them but the last block, `last` the last block when it is one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DualBlocks {
    pub block: SegSim,
    pub last: SegSim,
}

/// The three segments of the engine under a spec.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Sims {
    pub embed: SegSim,
    pub block: SegSim,
    pub final_layer: SegSim,
    /// The conditioning leaf shared by blocks and final layer (b·D).
    pub c_leaf: u64,
    /// Transient bytes of the embed forward beyond its graph (host f64 latents, the noisy
    /// latents and their patchified copy).
    pub embed_scratch: u64,
    /// What the embed's locals still hold after its backward, until `microbatch` returns
    /// (activations, weight casts).
    pub embed_tail: (u64, u64),
    /// The gradients of the conditioning leaves, summed over the blocks and the final layer and
    /// held from the final layer's backward to the embed's (DiT: c, (b, D) in the accumulation
    /// dtype; PixArt: t6, the embedded timestep and the caption in the gradient dtype), with
    /// candle's bookkeeping.
    pub cond_grad: u64,
    /// The last block when it differs from the others (SD3's `context_pre_only` block: one
    /// stream out, fewer weights); None when every block is [`Sims::block`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_block: Option<SegSim>,
    /// Blocks of a second kind (None: every block is `block`).
    pub second: Option<SecondBlocks>,
    /// SD3.5's dual-attention blocks (None: no block is one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dual: Option<DualBlocks>,
    /// The family schedule (`trainer/family.rs`, `release_streams`): a stored segment's input
    /// streams are released once copied into its leaves, so each stream is held once.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub streams_once: bool,
}

/// Costs of the three segments of a runtime described by generic segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct GenericCosts {
    pub embed: SegmentCost,
    pub block: SegmentCost,
    pub final_layer: SegmentCost,
}

/// What the step replay needs about each segment, computed once per spec (the planner caches it
/// across candidates that share the segment shapes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
// Few of these live at once (one per cached spec shape), so the Engine variant's size (a
// second block kind's segments) is not worth a box.
#[allow(clippy::large_enum_variant)]
pub enum SegmentCosts {
    /// The ditmem engine, replayed node for node.
    Engine(Sims),
    /// A runtime described by generic segments (PyTorch).
    Generic(GenericCosts),
}

/// What one segment keeps while its graph lives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Kept {
    pub activations: u64,
    pub weight_casts: u64,
    /// The segment's output (the next segment's input).
    pub output: u64,
}

impl Kept {
    pub fn total(&self) -> u64 {
        self.activations + self.weight_casts + self.output
    }
}

impl SegmentCosts {
    /// What the embed segment, a stored block and the final layer keep.
    pub fn kept(&self) -> [Kept; 3] {
        match self {
            SegmentCosts::Engine(s) => [&s.embed, &s.block, &s.final_layer].map(|x| Kept {
                activations: x.activations + x.leaf,
                weight_casts: x.weight_casts,
                output: x.output,
            }),
            SegmentCosts::Generic(g) => [&g.embed, &g.block, &g.final_layer].map(|x| Kept {
                activations: x.kept.activations,
                weight_casts: x.kept.weight_casts,
                output: x.output_bytes,
            }),
        }
    }
}
