//! The rounding stages a family's blocks chain on the longest path from the first weights to the
//! loss ([`super::Growth::forward_chain`]), counted from each family's block structure (its
//! module docs, "Block composition") with one rule for all: every op that rounds a new tensor
//! on the path counts once — a projection, a q/k norm, a RoPE, the scores q·kᵀ, the softmax,
//! P·v, the output projection — except the MLP / FFN, which counts once with the norm and
//! modulation before it (fc1 → activation → fc2: the DiT's calibration counted it so, and its
//! κ_P absorbs the ratio). The embedding and the final layer add 2 on every family.
//!
//! Each family applies the rule to its own block in
//! [`VerifyFamily::block_stages`](crate::families::VerifyFamily::block_stages)
//! (`families/<family>.rs`).

/// Stages of one softmax attention from its input to its output projection: q (or the fused
/// qkv), q·kᵀ, softmax, P·v, `to_out`.
pub(crate) const SOFTMAX_ATTENTION: u64 = 5;

/// The MLP / FFN with its norm and modulation, as one stage (see the module docs).
pub(crate) const MLP: u64 = 1;

/// The patch embedding before the blocks and the final layer after them.
pub(crate) const OUTSIDE_BLOCKS: u64 = 2;
