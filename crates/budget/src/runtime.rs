//! Runtime models: what each executor allocates and keeps per op.
//!
//! The op inventory depends on who executes the step. The ditmem engine (candle) composes its ops
//! from candle primitives and keeps every intermediate of a tracked graph; PyTorch's autograd keeps
//! only what each op's backward reads and rounds allocations in its caching allocator. A runtime is
//! a [`RuntimeModel`]; the timeline and the planner only talk to the trait, so a new runtime is a
//! new implementation plus a [`crate::spec::Runtime`] variant.

use crate::graph::{Segment, Tid};
use crate::params::block_linears;
use crate::spec::{AttentionMode, Dtype, LoraTarget, Precision, Recompute, Spec};

/// Dimensions of one microbatch, shared by every segment builder.
#[derive(Debug, Clone)]
pub struct Dims {
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
    pub attn_dropout: bool,
    pub mlp_dropout: bool,
}

impl Dims {
    pub fn new(spec: &Spec) -> Dims {
        let m = &spec.model;
        let s = spec.tokens().unwrap_or(0);
        let b = u64::from(spec.workload.microbatch);
        let p2 = u64::from(m.patch) * u64::from(m.patch);
        Dims {
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
            attn_dropout: m.attn_dropout > 0.0,
            mlp_dropout: m.mlp_dropout > 0.0,
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
}

/// Where a runtime's per-op rules come from and how it allocates.
pub trait RuntimeModel {
    fn name(&self) -> &'static str;
    /// Forward graph of the input side: noising, patch embedding, timestep and label embedders.
    fn embed_segment(&self, dims: &Dims) -> Segment;
    /// Forward graph of one DiT block.
    fn block_segment(&self, dims: &Dims) -> Segment;
    /// Forward graph of the final layer and the loss.
    fn final_segment(&self, dims: &Dims) -> Segment;
    /// True when a tracked graph keeps every op output (candle); false when only what backward
    /// reads is kept (PyTorch autograd).
    fn keeps_all_outputs(&self) -> bool;
    /// Whether the tensor is saved for backward when `keeps_all_outputs` is false.
    fn saves(&self, _seg: &Segment, _t: Tid) -> bool {
        true
    }
    /// Dtype of the gradient buffers under a precision policy.
    fn grad_dtype(&self, precision: Precision) -> Dtype {
        precision.param_dtype()
    }
    /// Transient bytes of one optimizer update of a tensor with `elems` elements (beyond its
    /// state), for runtimes replayed by the generic block-wise timeline.
    fn optimizer_scratch(
        &self,
        _elems: u64,
        _precision: Precision,
        _optimizer: crate::spec::Optimizer,
    ) -> u64 {
        0
    }
    /// Transient bytes of the EMA update of a tensor with `elems` elements.
    fn ema_scratch(&self, _elems: u64, _dtype: Dtype) -> u64 {
        0
    }
    /// Bytes an allocation of `bytes` really takes (allocator rounding).
    fn round(&self, bytes: u64) -> u64 {
        bytes
    }
}

/// The ditmem engine on the CPU. Its graphs are built node for node in [`crate::candle`] and its
/// step is replayed in [`crate::candle_step`]; the segments below are those graphs seen as
/// generic segments (for the op inventory and the time model).
pub struct DitmemCpu;

impl RuntimeModel for DitmemCpu {
    fn name(&self) -> &'static str {
        "ditmem-cpu"
    }

    fn embed_segment(&self, dims: &Dims) -> Segment {
        crate::candle::to_segment(&crate::candle_step::embed_graph(dims).0, "embed")
    }

    fn block_segment(&self, dims: &Dims) -> Segment {
        let sh = crate::candle_step::shape(dims);
        crate::candle::to_segment(&crate::candle::block(&sh).0, "block")
    }

    fn final_segment(&self, dims: &Dims) -> Segment {
        crate::candle::to_segment(&crate::candle_step::final_graph(dims).0, "final")
    }

    fn keeps_all_outputs(&self) -> bool {
        true
    }

    fn grad_dtype(&self, precision: Precision) -> Dtype {
        crate::candle_step::grad_dtype(precision)
    }
}

/// The rules for a spec's runtime.
pub fn model_for(spec: &Spec) -> &'static dyn RuntimeModel {
    match spec.runtime {
        crate::spec::Runtime::DitmemCpu => &DitmemCpu,
        crate::spec::Runtime::Pytorch { device, sdpa } => {
            crate::runtime_pytorch::PyTorch::instance(device, sdpa)
        }
    }
}

/// Element count of the largest linear of a block (used by sharded weight gathers).
pub fn block_param_elems(spec: &Spec) -> u64 {
    block_linears(spec)
        .iter()
        .map(|(_, _, o, i)| o * i + o)
        .sum()
}
