//! The vocabulary the agreement grids are written in: the policies a family's grid runs on its
//! base ([`FAMILY_POLICIES`], [`policy_grid`]), a grid being written ([`GridBuilder`]: variations
//! of the base, other models of the family, the LoRA specs) and the variations every grid shares
//! (accumulation, a larger image, odd text lengths, SGD without EMA, a block list). Each family's
//! grid is in its own file, `crate::families::<family>` (`<family>_grid`; the original DiT's
//! `grid`); this
//! file names no family.

use ditmem_budget::{AttentionMode, LoraSpec, Optimizer, Precision, Recompute, Spec};

/// One (precision, recompute, attention) policy of a grid.
pub(crate) type Policy = (Precision, Recompute, AttentionMode);

/// The policies every diffusers family's grid runs on its base: each precision with the
/// stored, materialized step, and the recompute policies and the memory-efficient attention
/// spread over the precisions.
pub(crate) const FAMILY_POLICIES: [Policy; 11] = {
    use AttentionMode::{Materialized as Mat, MemoryEfficient as Me};
    use Precision as P;
    use Recompute as R;
    [
        (P::Fp32, R::None, Mat),
        (P::Fp32, R::None, Me),
        (P::Fp32, R::All, Mat),
        (P::Fp32, R::AttentionOnly, Mat),
        (P::Bf16Mixed, R::None, Mat),
        (P::Bf16Mixed, R::EveryK(2), Me),
        (P::Fp16Mixed, R::None, Me),
        (P::Fp16Mixed, R::All, Mat),
        (P::Bf16Pure, R::None, Mat),
        (P::Fp64, R::None, Mat),
        (P::Fp64, R::AttentionOnly, Mat),
    ]
};

/// `base` under each policy, named `"{prefix} {precision} recompute {policy} {attention}"`.
pub(crate) fn policy_grid(prefix: &str, base: &Spec, policies: &[Policy]) -> Vec<(String, Spec)> {
    policies
        .iter()
        .map(|(p, rc, a)| {
            let mut s = base.clone();
            s.recipe.precision = *p;
            s.recipe.recompute = rc.clone();
            s.recipe.attention = *a;
            (format!("{prefix} {p} recompute {rc} {}", a.name()), s)
        })
        .collect()
}

/// A grid being written: its specs so far, each named after the grid's prefix, and the base
/// its variations start from.
pub(crate) struct GridBuilder {
    pub(crate) prefix: &'static str,
    pub(crate) base: Spec,
    pub(crate) specs: Vec<(String, Spec)>,
}

impl GridBuilder {
    /// The policy part of a grid on `base`, names prefixed by `prefix` (none when empty).
    pub(crate) fn new(prefix: &'static str, base: Spec, policies: &[Policy]) -> Self {
        let specs = policy_grid(prefix, &base, policies);
        GridBuilder {
            prefix,
            base,
            specs,
        }
    }

    fn name(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{} {name}", self.prefix)
        }
    }

    /// The base changed by `f`.
    pub(crate) fn vary(&mut self, name: &str, f: impl FnOnce(&mut Spec)) -> &mut Self {
        let mut s = self.base.clone();
        f(&mut s);
        self.specs.push((self.name(name), s));
        self
    }

    /// Another model of the family (not the base's), with the base's fp32 EMA and, when given,
    /// `recompute`, on this process's CPU.
    pub(crate) fn model(
        &mut self,
        name: &str,
        mut s: Spec,
        recompute: Option<Recompute>,
    ) -> &mut Self {
        s.recipe.ema.enabled = true;
        if let Some(rc) = recompute {
            s.recipe.recompute = rc;
        }
        self.specs.push((self.name(name), crate::host::resolve(&s)));
        self
    }

    /// The family's LoRA specs on the base ([`lora_specs`]).
    pub(crate) fn lora(&mut self) -> &mut Self {
        self.lora_custom(&DEFAULT_CUSTOM_LORA)
    }

    /// [`Self::lora`] with `custom` the rank-16 spec's modules ([`lora_specs_on`]).
    pub(crate) fn lora_custom(&mut self, custom: &[&str]) -> &mut Self {
        let more = lora_specs_on(self.prefix, &self.base, custom);
        self.specs.extend(more);
        self
    }

    pub(crate) fn finish(self) -> Vec<(String, Spec)> {
        self.specs
    }
}

/// The base of a family's grid: its tiny spec named `name`, with an fp32 EMA as in the training
/// scripts, on this process's CPU.
pub(crate) fn family_base(mut s: Spec, name: &str) -> Spec {
    s.model.name = name.into();
    s.recipe.ema.enabled = true;
    crate::host::resolve(&s)
}

/// `n` samples in one microbatch.
pub(crate) fn batch(s: &mut Spec, n: u32) {
    s.workload.batch = n;
    s.workload.microbatch = n;
}

pub(crate) fn memory_efficient(s: &mut Spec) {
    s.recipe.attention = AttentionMode::MemoryEfficient;
}

pub(crate) fn text_tokens(s: &mut Spec, tokens: &[u32]) {
    s.workload.text_tokens = Some(tokens.to_vec());
}

/// 8 samples in 4 microbatches of 2, bf16-mixed (every grid's accumulation spec).
pub(crate) const ACCUMULATION: &str = "batch 8 = 2 × accumulation 4, bf16-mixed";
pub(crate) fn accumulation(s: &mut Spec) {
    s.workload.batch = 8;
    s.workload.microbatch = 2;
    s.workload.accumulation = 4;
    s.recipe.precision = Precision::Bf16Mixed;
}

/// A 256×256 image (256 tokens at patch 2) in one microbatch of 2, memory-efficient attention.
pub(crate) const LARGER_IMAGE: &str = "256×256 (256 tokens), batch 2, memory-efficient";
pub(crate) fn larger_image(s: &mut Spec) {
    s.workload.height = 256;
    s.workload.width = 256;
    batch(s, 2);
    memory_efficient(s);
}

/// `tokens` text tokens (per encoder), memory-efficient attention.
pub(crate) fn text_tokens_me(tokens: &'static [u32]) -> impl FnOnce(&mut Spec) {
    move |s| {
        text_tokens(s, tokens);
        memory_efficient(s);
    }
}

/// `tokens` text tokens (per encoder) in one microbatch of 2, memory-efficient attention.
pub(crate) fn text_tokens_batch2_me(tokens: &'static [u32]) -> impl FnOnce(&mut Spec) {
    move |s| {
        text_tokens(s, tokens);
        batch(s, 2);
        memory_efficient(s);
    }
}

pub(crate) const SGD: &str = "SGD, no EMA";
pub(crate) fn sgd_without_ema(s: &mut Spec) {
    s.recipe.optimizer = Optimizer::Sgd;
    s.recipe.ema.enabled = false;
}

/// One sample, the listed blocks recomputed: named `"batch 1, blocks:{list}"`.
pub(crate) fn one_sample_blocks(g: &mut GridBuilder, blocks: &[u32]) {
    let rc = Recompute::Blocks(blocks.to_vec());
    g.vary(&format!("batch 1, {rc}"), |s| {
        batch(s, 1);
        s.recipe.recompute = rc;
    });
}

pub(crate) fn lora(rank: u32, modules: &[&str]) -> Option<LoraSpec> {
    Some(LoraSpec {
        dtype: Default::default(),
        rank,
        targets: ditmem_budget::default_lora_targets(),
        modules: modules.iter().map(|m| m.to_string()).collect(),
    })
}

/// A family grid's LoRA specs on its `base`: the family's default modules (the diffusers
/// script's, `ditmem_budget::denoiser::lora_modules`) at rank 4 under bf16-mixed and at rank 8
/// under fp32 with every block recomputed, and a custom list at rank 16 that reaches the embed
/// and output sides too (`linear_1`: the timestep and caption MLPs; `proj_out`: the output
/// projection, and Flux's single blocks' own) under fp16-mixed with the attention-only policy.
pub fn lora_specs(family: &str, base: &Spec) -> Vec<(String, Spec)> {
    lora_specs_on(family, base, &DEFAULT_CUSTOM_LORA)
}

/// The rank-16 LoRA spec's modules of [`lora_specs`].
pub(crate) const DEFAULT_CUSTOM_LORA: [&str; 4] = ["to_q", "to_v", "linear_1", "proj_out"];

/// [`lora_specs`] with `custom` the rank-16 spec's modules (diffusers' DiT has no `linear_1`:
/// its own list reaches its feed-forward, norm and output sides).
pub(crate) fn lora_specs_on(family: &str, base: &Spec, custom: &[&str]) -> Vec<(String, Spec)> {
    use ditmem_budget::{Precision as P, Recompute as R};
    let custom_name = format!(
        "LoRA r16 ({}), fp16-mixed, attention-only",
        custom.join(", ")
    );
    [
        (
            "LoRA r4 (defaults), bf16-mixed".to_string(),
            P::Bf16Mixed,
            R::None,
            lora(4, &[]),
        ),
        (
            "LoRA r8 (defaults), fp32, recompute all".to_string(),
            P::Fp32,
            R::All,
            lora(8, &[]),
        ),
        (
            custom_name,
            P::Fp16Mixed,
            R::AttentionOnly,
            lora(16, custom),
        ),
    ]
    .into_iter()
    .map(|(name, p, rc, l)| {
        let mut s = base.clone();
        s.recipe.precision = p;
        s.recipe.recompute = rc;
        s.recipe.lora = l;
        (format!("{family} {name}"), s)
    })
    .collect()
}
