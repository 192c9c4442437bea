//! What the conformance suite asks of a family ([`VerifyFamily`]), one implementation per family
//! in `families/<family>.rs`, registered in [`super::of`].

use ditmem_budget::Spec;

use crate::diffusion::Batch;
use crate::trainer::Trainer;
use crate::verify::replay::Probe;
use crate::verify::Result;

/// (attention marker, its key biases' (key bias, sibling) suffix pairs), in the order they are
/// tried: [`VerifyFamily::key_bias_attentions`].
pub(crate) type KeyBiasAttentions =
    &'static [(&'static str, &'static [(&'static str, &'static str)])];

/// A family's part of `verify`: how its blocks chain rounding stages, which key biases cancel
/// beside a query sibling, and the f64 replay of its first forward (the score probe).
pub(crate) trait VerifyFamily {
    /// Rounding stages chained by `depth` blocks on the longest path, summed over the blocks
    /// (the rule in `verify/chain.rs`; a family with two kinds of block counts its own).
    fn block_stages(&self, depth: u64) -> u64;

    /// The family's softmax attentions whose key biases have a sibling: (a part of the tensor
    /// name that marks the attention, such as `.attn1.`, its (key bias, sibling) suffix pairs
    /// from `verify/key_bias.rs`: [`SELF_ATTENTION`](crate::verify::key_bias::SELF_ATTENTION),
    /// [`CROSS_ATTENTION`](crate::verify::key_bias::CROSS_ATTENTION)); none by default.
    fn key_bias_attentions(&self) -> KeyBiasAttentions {
        &[]
    }

    /// The (key bias, query sibling) suffix pairs that apply to tensor `name`: those of the
    /// first of [`Self::key_bias_attentions`] that `name` is in.
    fn key_bias_pairs(&self, name: &str) -> &'static [(&'static str, &'static str)] {
        self.key_bias_attentions()
            .iter()
            .find(|(attention, _)| name.contains(attention))
            .map_or(&[], |(_, pairs)| pairs)
    }

    /// The score probe of the reference's first step (`spec` the reference spec, `t` fresh
    /// weights, `seed` the weights seed) on `batch`.
    fn probe(&self, spec: &Spec, t: &Trainer, seed: u64, batch: &Batch) -> Result<Probe>;

    /// The prefixes of the tensors whose gradients come out of a cancellation the probe
    /// measures; none by default.
    fn amplified_tensors(&self, _spec: &Spec) -> Result<Vec<String>> {
        Ok(Vec::new())
    }

    /// The tensors of block `block` that its q and k are computed from, besides the block's
    /// input stream and the embedded timestep (what an error in q's and k's gradients reaches
    /// inside the block); none by default.
    fn qk_inputs(&self, _block: u32) -> Vec<String> {
        Vec::new()
    }
}
