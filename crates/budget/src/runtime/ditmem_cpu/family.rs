//! What the step replay asks of a diffusers family, as one trait: [`FamilyRules`]. Each family's
//! file (`pixart.rs`, `sd3.rs`, `flux.rs`, `sana.rs`, `wan.rs`) implements it on its geometry
//! (`PixGeo`, …); [`super::registry`] lists them, the one place a family is registered; the
//! step (`step.rs`), the segments (`segments.rs`) and the op inventory (`estimate.rs`) ask the
//! registry and never name a family. Twin: the engine's `trainer/family.rs` (`FamilyStep`).
//!
//! This file names no family and no other file of this folder but the types it returns, so the
//! family files and their callers both stand on it.

use crate::params::ParamTensor;
use crate::runtime::costs::Sims;
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
