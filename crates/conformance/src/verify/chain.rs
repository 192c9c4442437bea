//! The rounding stages a family's blocks chain on the longest path from the first weights to the
//! loss ([`super::Growth::forward_chain`]), counted from each family's block structure (its
//! module docs, "Block composition") with one rule for all: every op that rounds a new tensor
//! on the path counts once — a projection, a q/k norm, a RoPE, the scores q·kᵀ, the softmax,
//! P·v, the output projection — except the MLP / FFN, which counts once with the norm and
//! modulation before it (fc1 → activation → fc2: the DiT's calibration counted it so, and its
//! κ_P absorbs the ratio). The embedding and the final layer add 2 on every family.

use crate::families::Arch;

/// Stages of one softmax attention from its input to its output projection: q (or the fused
/// qkv), q·kᵀ, softmax, P·v, `to_out`.
const SOFTMAX_ATTENTION: u64 = 5;

/// The MLP / FFN with its norm and modulation, as one stage (see the module docs).
const MLP: u64 = 1;

/// The patch embedding before the blocks and the final layer after them.
pub(crate) const OUTSIDE_BLOCKS: u64 = 2;

/// Rounding stages chained by the blocks of `arch` (`depth` blocks for the families with one
/// kind of block), summed over the blocks.
pub(crate) fn block_stages(arch: &Arch, depth: u64) -> u64 {
    match arch {
        // qkv, q·kᵀ, softmax, P·v, proj; the MLP: 6 (the calibration's count).
        Arch::Dit => depth * (SOFTMAX_ATTENTION + MLP),
        // diffusers' DiT: the same block as the DiT's with q, k, v as three linears (one
        // stage beside each other); its per-block embedder feeds the modulation, beside the
        // stream: 6.
        Arch::DitDiffusers(_) => depth * (SOFTMAX_ATTENTION + MLP),
        // Self-attention, then the cross-attention whose query is its output, then the MLP: 11.
        Arch::Pixart(_) => depth * (2 * SOFTMAX_ATTENTION + MLP),
        // One joint attention (+ the per-head RMSNorm of q and k with `qk_norm`), then the MLP
        // of each stream: 6, or 7 (SD3.5). SD3.5's dual-attention blocks add `attn2` beside the
        // joint attention, not after it (it reads the block input's LN, as the joint attention
        // does, and joins the residual before norm2), with as many stages as it: not longer.
        Arch::Sd3(g) => depth * (SOFTMAX_ATTENTION + u64::from(g.qk_norm) + MLP),
        // Double-stream blocks: the joint attention with RMSNorm and RoPE on q (+2), then the
        // FFN: 8. Single-stream blocks: the attention with RMSNorm and RoPE (+2) whose output
        // `proj_out` shares with the parallel MLP (proj_mlp → GELU, one stage beside the
        // attention's four, so not on the longest path): 7.
        Arch::Flux(g) => {
            g.double as u64 * (SOFTMAX_ATTENTION + 2 + MLP)
                + g.single as u64 * (SOFTMAX_ATTENTION + 2)
        }
        // The ReLU linear self-attention: q, φ = ReLU, KV·φ(q) and z·φ(q), their ratio,
        // `to_out` (5, as a softmax attention's); the softmax cross-attention (5); the Mix-FFN:
        // conv_inverted → SiLU + depthwise conv → GLU → conv_point, one stage more than an MLP
        // (the depthwise conv is a second sum between the two pointwise ones): 12.
        Arch::Sana(_) => depth * (SOFTMAX_ATTENTION + SOFTMAX_ATTENTION + MLP + 1),
        // Self-attention with RMSNorm and RoPE on q (7), the cross-attention with RMSNorm on q
        // (norm2 counted with its q projection: 6), the FFN with norm3: 14.
        Arch::Wan(_) => depth * ((SOFTMAX_ATTENTION + 2) + (SOFTMAX_ATTENTION + 1) + MLP),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The DiT's count is the one its tolerances were calibrated with (6 per block); Wan's the
    /// 14 its module derived by hand before this file (self-attention 7: q, its RMSNorm, RoPE,
    /// q·kᵀ, softmax, P·v, `to_out`; cross-attention 6; the FFN with norm3 as one).
    #[test]
    fn counts_match_the_earlier_derivations() {
        assert_eq!(block_stages(&Arch::Dit, 2), 12);
        let wan = Arch::of(&crate::families::wan::tiny_spec(2, 2, 5, 7).unwrap()).unwrap();
        assert_eq!(block_stages(&wan, 1), 14);
    }
}
