//! Each family's part of the conformance suite, one file per family: its rounding stages
//! (`verify/chain.rs`'s rule applied to its block), its key biases' query siblings
//! (`verify/key_bias.rs`), its f64 replay of the first forward (the score probe,
//! `verify/probe.rs`). [`VerifyFamily`] is what the suite asks; [`of`] is the one place a family
//! is registered. Each file also holds the family's agreement grid (`<family>_grid`, written in
//! `agree/builder.rs`'s vocabulary, re-exported by `agree/mod.rs`).

pub(crate) mod dit;
pub(crate) mod dit_diffusers;
mod family;
pub(crate) mod flux;
pub(crate) mod pixart;
pub(crate) mod sana;
pub(crate) mod sd3;
pub(crate) mod wan;

use ditmem_engine::families::Arch;

pub(crate) use family::VerifyFamily;

/// The family of `arch`: one line per family.
pub(crate) fn of(arch: &Arch) -> &dyn VerifyFamily {
    match arch {
        Arch::Dit => &dit::Dit,
        Arch::DitDiffusers(g) => g,
        Arch::Pixart(g) => g,
        Arch::Sd3(g) => g,
        Arch::Flux(g) => g,
        Arch::Sana(g) => g,
        Arch::Wan(g) => g,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The DiT's count is the one its tolerances were calibrated with (6 per block); Wan's the
    /// 14 its module derived by hand before `verify/chain.rs` (self-attention 7: q, its RMSNorm,
    /// RoPE, q·kᵀ, softmax, P·v, `to_out`; cross-attention 6; the FFN with norm3 as one).
    #[test]
    fn counts_match_the_earlier_derivations() {
        assert_eq!(of(&Arch::Dit).block_stages(2), 12);
        let wan = Arch::of(&ditmem_engine::families::wan::tiny_spec(2, 2, 5, 7).unwrap()).unwrap();
        assert_eq!(of(&wan).block_stages(1), 14);
    }
}
