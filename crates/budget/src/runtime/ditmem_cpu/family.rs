//! What the step replay asks of a diffusers family, as one trait: [`FamilyRules`]. Each family's
//! `ditmem_cpu.rs` (`crates/budget/src/families/<family>/`) implements it on its geometry
//! (`PixGeo`, …); `crate::families::registry` lists them, the one place a family is registered;
//! the step (`step.rs`), the segments (`segments.rs`) and the op inventory (`estimate.rs`) ask
//! [`super::registry`] and never name a family. Twin: the engine's `trainer/family.rs`
//! (`FamilyStep`).
//!
//! A family whose blocks are all of one kind (PixArt, Sana, Wan, diffusers' DiT) implements
//! [`OneBlockKind`] instead — its three graphs and what its embed hands on — and gets
//! [`FamilyRules`] from it: the simulation and the op inventory are assembled the same way for
//! each. Flux (double- and single-stream blocks) and SD3 (joint, last and dual-attention blocks)
//! implement [`FamilyRules`] themselves.
//!
//! This file names no family and no other file of this folder but the types it returns and the
//! assembly it calls (`sims.rs`), so the family files and their callers both stand on it.

use crate::families::FamilyModel;
use crate::params::ParamTensor;
use crate::runtime::costs::Sims;
use crate::runtime::ditmem_cpu::dtypes::grad_dtype;
use crate::runtime::ditmem_cpu::graph::{to_segment, Graph, Nid};
use crate::runtime::ditmem_cpu::sims::{self, EmbedOutputs, EmbedSim};
use crate::runtime::shape::Shape;
use crate::segment::Segment;
use crate::spec::Spec;

/// One family's rules for the `ditmem-cpu` runtime, on the geometry its `of(spec)` read.
pub(crate) trait FamilyRules {
    /// The engine's three segments (embed, blocks, final layer) simulated for the step replay.
    fn sims(&self, spec: &Spec) -> Sims;

    /// Elements of one sample's cached text embeddings (T·width): the engine's `Batch` holds
    /// them in f64.
    fn text_elems(&self) -> u64;

    /// The segments (embed, a block, final) as generic segments, for a budget's op inventory.
    fn inventory_segments(&self, spec: &Spec) -> [Segment; 3];

    /// The blocks that are SD3.5's dual-attention blocks, by index; none for other families.
    fn dual_blocks(&self) -> Vec<u64> {
        Vec::new()
    }

    /// Whether the embed's backward adds `t`'s gradient into a buffer a block landed (diffusers'
    /// DiT: block 0's embedder, whose second use the engine runs in the embed segment); false
    /// for the other families.
    fn summed_by_embed(&self, _t: &ParamTensor) -> bool {
        false
    }

    /// Whether the step multiplies through candle's `gemm` crate whatever the dtype: true for
    /// every family, whose attention over separate q, k, v (`super::separate`; Sana's
    /// cross-attention) runs on the generic kernels in every dtype.
    fn step_uses_gemm(&self) -> bool {
        true
    }
}

/// A model's op inventory ([`FamilyRules::inventory_segments`]) from its three graphs: the
/// embed, a block and the final layer as generic segments, in that order.
pub(crate) fn inventory([embed, block, final_layer]: [&Graph; 3]) -> [Segment; 3] {
    [
        to_segment(embed, "embed"),
        to_segment(block, "block"),
        to_segment(final_layer, "final"),
    ]
}

/// Caption tokens T of a spec whose model reads one text encoder's sequence (PixArt, Sana, Wan):
/// the first encoder's ([`crate::denoiser::text_tokens`]; 0 without one).
pub(crate) fn caption_tokens(spec: &Spec, fm: &FamilyModel) -> u64 {
    let tokens = crate::denoiser::text_tokens(spec, &fm.geometry());
    tokens.first().copied().unwrap_or(0)
}

/// The embed segment's graph and what it hands on (see [`EmbedOutputs`]).
pub(crate) struct EmbedGraph {
    pub graph: Graph,
    /// The residual stream(s) the first block reads.
    pub streams: Vec<Nid>,
    /// The conditioning every block reads (leaf copies, gradients summed).
    pub conds: Vec<Nid>,
    /// Results the blocks read that nothing differentiates.
    pub tables: Vec<Nid>,
}

impl EmbedGraph {
    /// The embed segment backpropagated from its streams and conditioning
    /// ([`sims::embed_sim`]), the conditioning's gradients summed in the gradient dtype (the
    /// family schedule's).
    pub(crate) fn simulate(self, sh: &Shape) -> EmbedSim {
        sims::embed_sim(
            self.graph,
            &EmbedOutputs {
                streams: &self.streams,
                conds: &self.conds,
                tables: &self.tables,
                frozen: sh.frozen_embed,
            },
            grad_dtype(sh.precision),
        )
    }

    /// The embed of one residual stream `x0` and the conditioning `conds`, no tables; both bound
    /// (the trainer's locals), the stream last.
    pub(crate) fn of_stream(mut graph: Graph, x0: Nid, conds: Vec<Nid>) -> EmbedGraph {
        graph.bind(x0);
        EmbedGraph {
            graph,
            streams: vec![x0],
            conds,
            tables: Vec::new(),
        }
    }
}

/// A family of one kind of block, as its three graphs: the embed, one block on a leaf copy of
/// its input, the final layer with the loss. [`FamilyRules`] follows from them (the blanket
/// impl below): the embed backpropagated from its outputs, the block tracked and untracked, the
/// embed's host scratch, the op inventory — the same assembly for every such family.
pub(crate) trait OneBlockKind {
    /// Width of the timestep sinusoid the embed makes on the host (in f64).
    fn freq(&self) -> u64;

    /// [`FamilyRules::text_elems`].
    fn caption_elems(&self) -> u64;

    /// The embed segment as the trainer builds it.
    fn embed(&self, sh: &Shape) -> EmbedGraph;

    /// One block on a leaf copy of its input, tracked or not (`track`: what the engine
    /// releases): (graph, input leaf, output).
    fn block(&self, sh: &Shape, track: bool) -> (Graph, Nid, Nid);

    /// The output side and the loss on a leaf copy of the last block's output: (graph, leaf,
    /// root).
    fn final_layer(&self, sh: &Shape) -> (Graph, Nid, Nid);

    /// Transient host bytes of the embed forward beyond its graph ([`sims::embed_scratch`]).
    fn embed_scratch(&self, sh: &Shape) -> u64 {
        sims::embed_scratch(sh, self.freq(), sh.b * self.caption_elems())
    }

    /// [`FamilyRules::summed_by_embed`].
    fn summed_by_embed(&self, _t: &ParamTensor) -> bool {
        false
    }
}

impl<T: OneBlockKind> FamilyRules for T {
    /// The three segments simulated: every block as the one block, tracked on a leaf copy and
    /// untracked; the embed backpropagated from its streams and conditioning, its conditioning
    /// gradients summed in the gradient dtype.
    fn sims(&self, spec: &Spec) -> Sims {
        let sh = Shape::new(spec);
        let block = sims::block_sim(|track| self.block(&sh, track));
        let (fg, fleaf, froot) = self.final_layer(&sh);
        let embed = self.embed(&sh).simulate(&sh);
        let final_layer = sims::final_sim(&fg, fleaf, froot);
        sims::sims(embed, block, final_layer, self.embed_scratch(&sh))
    }

    fn text_elems(&self) -> u64 {
        self.caption_elems()
    }

    fn inventory_segments(&self, spec: &Spec) -> [Segment; 3] {
        let sh = Shape::new(spec);
        inventory([
            &self.embed(&sh).graph,
            &self.block(&sh, true).0,
            &self.final_layer(&sh).0,
        ])
    }

    fn summed_by_embed(&self, t: &ParamTensor) -> bool {
        OneBlockKind::summed_by_embed(self, t)
    }
}
