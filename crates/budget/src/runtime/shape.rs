//! The shape of one microbatch: what every runtime's segment builders read from a spec.
//!
//! One struct for the whole step (input side, blocks, final layer); the ditmem-cpu rules and the
//! PyTorch rules both build their graphs from it. Its twin in the engine is `model::Dims`.

use crate::params::{Module, ParamTensor};
use crate::spec::{AttentionMode, CpuSpec, Dtype, LoraTarget, Precision, Recompute, Spec};

/// Dimensions and dtypes of one microbatch, shared by every segment builder.
#[derive(Debug, Clone)]
pub struct Shape {
    /// Microbatch b.
    pub b: u64,
    /// Tokens per image s.
    pub s: u64,
    /// Hidden size D.
    pub d: u64,
    /// Heads a.
    pub heads: u64,
    /// MLP hidden size.
    pub mlp: u64,
    pub freq: u64,
    /// Rows of the label table (classes + null class).
    pub label_rows: u64,
    pub c_in: u64,
    pub c_out: u64,
    pub patch2: u64,
    /// Latent elements per microbatch (b·C·h·w).
    pub latent: u64,
    pub precision: Precision,
    pub attention: AttentionMode,
    pub attention_only: bool,
    pub lora: Option<(u64, Vec<LoraTarget>)>,
    /// A diffusers family's LoRA module keys (`denoiser::lora_modules`; empty without LoRA).
    pub lora_modules: Vec<String>,
    pub attn_dropout: bool,
    pub mlp_dropout: bool,
    /// The CPU of the ditmem-cpu runtime (threads, bf16 product path, gemm's slab).
    pub cpu: CpuSpec,
    /// A diffusers family whose embed trains nothing (LoRA on the blocks alone): the engine's
    /// family schedule then hands the blocks the conditioning as it is, untracked
    /// (`trainer/family.rs`, `frozen_embed`).
    pub frozen_embed: bool,
}

impl Shape {
    pub fn new(spec: &Spec) -> Shape {
        let m = &spec.model;
        let s = spec.tokens().unwrap_or(0);
        let b = u64::from(spec.workload.microbatch);
        let p2 = u64::from(m.patch) * u64::from(m.patch);
        Shape {
            b,
            s,
            d: u64::from(m.hidden),
            heads: u64::from(m.heads),
            mlp: u64::from(m.mlp_hidden()),
            freq: u64::from(m.freq_embed),
            label_rows: u64::from(m.label_rows()),
            c_in: u64::from(m.in_channels),
            c_out: u64::from(m.out_channels()),
            patch2: p2,
            latent: b * s * p2 * u64::from(m.in_channels),
            precision: spec.recipe.precision,
            attention: spec.recipe.attention,
            attention_only: spec.recipe.recompute == Recompute::AttentionOnly,
            lora: spec
                .recipe
                .lora
                .as_ref()
                .map(|l| (u64::from(l.rank), l.targets.clone())),
            lora_modules: crate::denoiser::lora_modules(spec),
            attn_dropout: m.attn_dropout > 0.0,
            mlp_dropout: m.mlp_dropout > 0.0,
            cpu: spec.cpu(),
            frozen_embed: frozen_embed(spec),
        }
    }

    /// A conditioning leaf of a family's segment (`trainer/family.rs`): a `Var` copy that
    /// collects its gradient, or under a [`Shape::frozen_embed`] the embed's untracked output
    /// itself.
    pub(crate) fn cond_leaf(
        &self,
        g: &mut crate::runtime::ditmem_cpu::graph::Graph,
        name: &str,
        elems: u64,
        dtype: Dtype,
    ) -> crate::runtime::ditmem_cpu::graph::Nid {
        if self.frozen_embed {
            g.constant(name, elems, dtype, false)
        } else {
            g.var(name, elems, dtype, false)
        }
    }

    /// Token-sized elements b·s·D.
    pub fn e(&self) -> u64 {
        self.b * self.s * self.d
    }

    /// Attention-probability elements b·a·s².
    pub fn a(&self) -> u64 {
        self.b * self.heads * self.s * self.s
    }

    /// Rows b·s.
    pub fn rows(&self) -> u64 {
        self.b * self.s
    }

    /// The compute dtype of the precision policy.
    pub fn cd(&self) -> Dtype {
        self.precision.compute_dtype()
    }

    /// The dtype of the residual streams (the accumulation dtype; under LoRA the compute dtype).
    pub fn ad(&self) -> Dtype {
        // Under LoRA the frozen base's dtype (`Precision::stream_dtype`, `Trainer::new`).
        self.precision.stream_dtype(self.lora.is_some())
    }

    /// The LoRA rank of a target, when LoRA adapts it.
    pub(crate) fn lora_for(&self, t: LoraTarget) -> Option<u64> {
        self.lora
            .as_ref()
            .filter(|(_, ts)| ts.contains(&t))
            .map(|(r, _)| *r)
    }

    /// The LoRA rank of a diffusers family's linear `module` (its name relative to the block for
    /// a block's linear: every block adapts the same ones, `denoiser::check`), when LoRA adapts
    /// it (PEFT's suffix matching).
    pub fn lora_rank(&self, module: &str) -> Option<u64> {
        let (r, _) = self.lora.as_ref()?;
        self.lora_modules
            .iter()
            .any(|k| crate::denoiser::matches_module(module, k))
            .then_some(*r)
    }

    /// Dtype weights are stored in (trained masters, or a frozen LoRA base in the compute dtype).
    pub(crate) fn weight_dtype(&self) -> Dtype {
        if self.lora.is_some() {
            self.cd()
        } else {
            self.precision.param_dtype()
        }
    }
}

/// Whether the engine runs `spec`'s embed frozen: a diffusers family under LoRA with no
/// adapter on an embedder (the replay's embed tensors; the engine's
/// `FamilyStep::embed_params`).
pub(crate) fn frozen_embed(spec: &Spec) -> bool {
    use crate::params::ParamRole;
    if spec.recipe.lora.is_none() || !matches!(crate::denoiser::family(spec), Ok(Some(_))) {
        return false;
    }
    !crate::denoiser::param_table(spec)
        .iter()
        .any(|t| is_embed(t) && t.role == ParamRole::Trained)
}

/// A tensor of the output side: the DiT's `final_layer.*`, a family's final-layer group
/// (PixArt's `scale_shift_table` and `proj_out`).
pub(crate) fn is_final(t: &ParamTensor) -> bool {
    t.name.starts_with("final_layer") || (t.block.is_none() && t.module == Module::FinalLayer)
}

/// A tensor of the embed segment: no block, not the output side.
pub(crate) fn is_embed(t: &ParamTensor) -> bool {
    t.block.is_none() && !is_final(t)
}
