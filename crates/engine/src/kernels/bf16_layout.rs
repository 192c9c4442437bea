//! The vocabulary shared by the bf16 GEMM ([`super::gemm_bf16`]) and its AVX-512 packing
//! (`pack_bf16_avx512`): the micro-kernel tile and the packing source. A file of its own so that
//! both use it and neither uses the other back (`crates/cli/tests/no_import_cycles.rs`).

use half::bf16;

/// Rows of the micro-kernel tile.
pub(crate) const MR: usize = 6;
/// Columns of the micro-kernel tile (4 × 16 f32 lanes).
pub const NR: usize = 64;
/// k pairs per block: a B micro-panel is `KC_PAIRS · NR · 4` bytes (16 KiB, half of L1).
pub(crate) const KC_PAIRS: usize = 64;

/// A packing source: bf16 values moved as they are, or f32 values rounded to nearest even.
#[derive(Clone, Copy)]
pub enum Src<'a> {
    Bf16(&'a [bf16]),
    F32(&'a [f32]),
}

impl Src<'_> {
    /// Values in the source (the bound the vectorised packing checks its reads against).
    pub fn len(&self) -> usize {
        match self {
            Src::Bf16(s) => s.len(),
            Src::F32(s) => s.len(),
        }
    }
}
