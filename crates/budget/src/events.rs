//! The events of a step replay: live bytes by category ([`Breakdown`]) at each moment
//! ([`Event`]) of each phase, and the persistent bytes a replay starts from ([`StaticBytes`]).
//!
//! Below every runtime: each runtime's step replay produces these, and the timeline
//! (`timeline.rs`) orders them and finds the peak.

use serde::Serialize;

/// Live bytes by what they are.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Breakdown {
    /// Parameters used as they are stored: trained weights (fp32, fp64, bf16-pure), frozen
    /// weights, and the persistent compute copy when masters are sharded.
    pub weights: u64,
    /// fp32 master weights of mixed precision (the trained parameters).
    pub master_weights: u64,
    /// Copies of weights made for compute, alive while a graph uses them: autocast's
    /// low-precision copies, and parameters all-gathered from their shards (ZeRO-3, FSDP2).
    pub weight_casts: u64,
    /// Accumulated gradient buffers of the trained parameters.
    pub gradients: u64,
    /// Optimizer state (AdamW m and v).
    pub optimizer_state: u64,
    /// The EMA copy of the weights.
    pub ema: u64,
    /// Tensors kept for backward (graphs and block outputs).
    pub activations: u64,
    /// Transient buffers: in-flight gradients, op scratch, gathers.
    pub workspace: u64,
    /// The frozen VAE encoder: weights and its activations while it runs.
    pub encoder: u64,
    /// The microbatch: latents, noise, timesteps, labels (and images when encoding).
    pub data: u64,
    /// What the executor itself holds: candle's per-thread matmul packing buffers (ditmem-cpu).
    pub runtime: u64,
}

impl Breakdown {
    pub fn total(&self) -> u64 {
        self.entries().iter().map(|(_, v)| v).sum()
    }

    /// (name, bytes) pairs in display order.
    pub fn entries(&self) -> [(&'static str, u64); 11] {
        [
            ("weights", self.weights),
            ("master_weights", self.master_weights),
            ("weight_casts", self.weight_casts),
            ("gradients", self.gradients),
            ("optimizer_state", self.optimizer_state),
            ("ema", self.ema),
            ("activations", self.activations),
            ("workspace", self.workspace),
            ("encoder", self.encoder),
            ("data", self.data),
            ("runtime", self.runtime),
        ]
    }

    /// Whether a category of [`Breakdown::entries`] is a plural noun ("weights are", "optimizer
    /// state is"), for the sentences that name it.
    pub(crate) fn is_plural(category: &str) -> bool {
        matches!(
            category,
            "weights" | "master_weights" | "weight_casts" | "gradients" | "activations"
        )
    }

    /// The largest category and its bytes.
    pub fn dominant(&self) -> (&'static str, u64) {
        self.entries()
            .into_iter()
            .max_by_key(|(_, v)| *v)
            .unwrap_or(("weights", 0))
    }
}

/// Phases of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Start,
    Encode,
    Forward,
    Backward,
    Optimizer,
}

impl Phase {
    pub const fn name(self) -> &'static str {
        match self {
            Phase::Start => "start",
            Phase::Encode => "encode",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
        }
    }
}

/// One moment of the step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Event {
    pub phase: Phase,
    /// What just happened ("block 3", "block 3 (inside)", "loss", "adamw (inside)").
    pub label: String,
    /// Block index, for block events.
    pub block: Option<u32>,
    /// Microbatch index within the accumulation.
    pub microbatch: u32,
    /// True for the worst moment inside a segment, false for a boundary between segments.
    pub inside: bool,
    pub live: Breakdown,
}

impl Event {
    pub fn total(&self) -> u64 {
        self.live.total()
    }
}

/// The events of a replay, in the order they happen.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Events(pub Vec<Event>);

impl Events {
    pub(crate) fn push(
        &mut self,
        phase: Phase,
        label: String,
        block: Option<u32>,
        microbatch: u32,
        inside: bool,
        live: Breakdown,
    ) {
        self.0.push(Event {
            phase,
            label,
            block,
            microbatch,
            inside,
            live,
        });
    }
}

/// Persistent bytes of a step, before any activation exists.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StaticBytes {
    pub weights: u64,
    pub master_weights: u64,
    /// Gradient buffers once they exist (per rank).
    pub gradients: u64,
    pub optimizer_state: u64,
    pub ema: u64,
    pub encoder_weights: u64,
    /// Largest transient of one tensor's optimizer update (0 for both runtimes).
    pub optimizer_scratch: u64,
    /// Largest transient of one tensor's EMA update (0 for both runtimes).
    pub ema_scratch: u64,
    /// Model states kept in host memory by offload (`recipe.offload`), per rank: not on the
    /// device, not in the timeline.
    pub host_bytes: u64,
}

/// Microbatches a step replay lays out: the first (gradient buffers created) and the second
/// (buffers live, gradients summed in). Every later microbatch starts from the state the second
/// one started from and ends in the state it ended in, so it repeats the second one event for
/// event; the budget's own cost does not grow with the accumulation count.
pub(crate) const LAID_OUT_MICROBATCHES: u32 = 2;

/// How many of `accumulation` microbatches a replay asked for `max` lays out: never fewer than
/// [`LAID_OUT_MICROBATCHES`] (the ones the others repeat), never more than the step has. Every
/// runtime's replay loops over this count.
pub(crate) fn laid_out_microbatches(accumulation: u32, max: u32) -> u32 {
    accumulation.min(max.max(LAID_OUT_MICROBATCHES))
}
