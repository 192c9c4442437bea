//! The step timeline: a simulation of one optimizer step (after warm-up) over the op inventory.
//!
//! Forward runs segment by segment (embedder, blocks, final layer + loss); a stored block keeps
//! its graph, a recomputed block keeps only its output. Backward runs in reverse: a recomputed
//! block is rebuilt first, each segment's graph is freed after its backward, and its parameter
//! gradients land in the gradient buffers, which stay live across accumulated microbatches. The
//! optimizer step follows with its per-tensor scratch, then the EMA update. Every event carries the
//! live bytes by category; the peak is the largest total over the events.

use serde::Serialize;

use crate::graph::{simulate, SegmentCost};
use crate::params::{count, param_table, stored_dtype, ParamRole, ParamTensor};
use crate::runtime::{block_param_elems, model_for, Dims};
use crate::spec::{Dtype, Latents, Optimizer, Precision, Prediction, Spec};

/// Live bytes by what they are.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Breakdown {
    /// Parameters used as they are stored: trained weights (fp32, fp64, bf16-pure), frozen
    /// weights, and the persistent compute copy when masters are sharded.
    pub weights: u64,
    /// fp32 master weights of mixed precision (the trained parameters).
    pub master_weights: u64,
    /// Low-precision copies of weights made for compute, alive while a graph uses them.
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
pub struct Events(pub Vec<Event>);

impl Events {
    pub fn push(
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

/// The simulated step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Timeline {
    pub events: Vec<Event>,
    /// Index of the peak event.
    pub peak_index: usize,
}

impl Timeline {
    pub fn peak(&self) -> &Event {
        &self.events[self.peak_index]
    }

    /// Highest live total per phase.
    pub fn phase_peaks(&self) -> Vec<(Phase, u64)> {
        let mut out: Vec<(Phase, u64)> = Vec::new();
        for e in &self.events {
            match out.iter_mut().find(|(p, _)| *p == e.phase) {
                Some((_, v)) => *v = (*v).max(e.total()),
                None => out.push((e.phase, e.total())),
            }
        }
        out
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
    /// Largest transient of one tensor's optimizer update (generic runtimes).
    pub optimizer_scratch: u64,
    /// Largest transient of one tensor's EMA update (generic runtimes).
    pub ema_scratch: u64,
}

/// Parameters of the SD VAE encoder (+ quant_conv), from the diffusers Encoder definition.
pub const SD_VAE_ENCODER_PARAMS: u64 = 34_163_592 + 72;
/// Parameters of the 16-channel VAE encoder (SD3 / Flux layout).
pub const VAE16_ENCODER_PARAMS: u64 = 34_274_208;
/// No-grad activation peak of the SD VAE encoder per image, in elements per pixel: about four
/// live 128-channel tensors at full resolution (an estimate from the encoder's ResnetBlock2D
/// forward, not a measurement; see `dit-facts.md` §2).
pub const VAE_ENCODE_ELEMS_PER_PIXEL: u64 = 512;

/// Bitsandbytes block size for 8-bit optimizer state quantisation (one fp32 absmax per block).
pub const ADAM8BIT_BLOCK: u64 = 256;
/// Tensors smaller than this keep 32-bit state under bitsandbytes' 8-bit optimizers.
pub const ADAM8BIT_MIN_SIZE: u64 = 4096;

fn shard(bytes: u64, ranks: u64, on: bool) -> u64 {
    if on {
        bytes.div_ceil(ranks)
    } else {
        bytes
    }
}

/// Optimizer state bytes of one trained tensor.
pub fn optimizer_state_bytes(elems: u64, optimizer: Optimizer, precision: Precision) -> u64 {
    let sd = precision.optimizer_dtype().size();
    match optimizer {
        Optimizer::Sgd => 0,
        Optimizer::AdamW => 2 * elems * sd,
        Optimizer::AdamW8bit if elems < ADAM8BIT_MIN_SIZE => 2 * elems * 4,
        Optimizer::AdamW8bit => 2 * (elems + elems.div_ceil(ADAM8BIT_BLOCK) * 4),
    }
}

/// The persistent bytes of the model states under the spec (per rank).
pub fn static_bytes(spec: &Spec, table: &[ParamTensor]) -> StaticBytes {
    let r = &spec.recipe;
    let p = r.precision;
    let ranks = u64::from(spec.workload.ranks);
    let z = r.zero_stage;
    let rt = model_for(spec);
    let mut s = StaticBytes::default();
    for t in table {
        let n = t.numel();
        let dt = stored_dtype(t, p);
        match t.role {
            ParamRole::Frozen => s.weights += n * dt.size(),
            ParamRole::Trained => {
                let bytes = n * dt.size();
                if p.is_mixed() {
                    s.master_weights += shard(bytes, ranks, z >= 1);
                    if z >= 1 {
                        // Each rank needs the full compute copy once masters are sharded.
                        s.weights += shard(n * p.compute_dtype().size(), ranks, z >= 3);
                    }
                } else {
                    s.weights += shard(bytes, ranks, z >= 3);
                }
                s.gradients += shard(n * rt.grad_dtype(p).size(), ranks, z >= 2);
                s.optimizer_state += shard(optimizer_state_bytes(n, r.optimizer, p), ranks, z >= 1);
                if r.ema.enabled {
                    s.ema += shard(n * r.ema.dtype.size(), ranks, z >= 3);
                    s.ema_scratch = s.ema_scratch.max(rt.ema_scratch(n, r.ema.dtype));
                }
                s.optimizer_scratch =
                    s.optimizer_scratch
                        .max(rt.optimizer_scratch(n, p, r.optimizer));
            }
        }
    }
    if r.latents == Latents::Encode {
        let vae = if spec.model.in_channels == 16 {
            VAE16_ENCODER_PARAMS
        } else {
            SD_VAE_ENCODER_PARAMS
        };
        s.encoder_weights = vae * vae_dtype(p).size();
    }
    s
}

/// DiT's `train.py` encodes in fp32 outside autocast; fp64 keeps fp64, bf16-pure casts the VAE.
pub fn vae_dtype(p: Precision) -> Dtype {
    match p {
        Precision::Fp64 => Dtype::F64,
        Precision::Bf16Pure => Dtype::Bf16,
        _ => Dtype::F32,
    }
}

/// Costs of the three segments of a runtime described by generic segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct GenericCosts {
    pub embed: SegmentCost,
    pub block: SegmentCost,
    pub final_layer: SegmentCost,
}

/// What the step replay needs about each segment, computed once per spec (the planner caches it
/// across candidates that share the segment shapes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SegmentCosts {
    /// The ditmem engine, replayed node for node.
    Engine(crate::candle_step::Sims),
    /// A runtime whose segments are replayed by the generic block-wise timeline.
    Generic(GenericCosts),
}

/// What one segment keeps while its graph lives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Kept {
    pub activations: u64,
    pub weight_casts: u64,
    /// The segment's output (the next segment's input).
    pub output: u64,
}

impl Kept {
    pub fn total(&self) -> u64 {
        self.activations + self.weight_casts + self.output
    }
}

impl SegmentCosts {
    /// What the embed segment, a stored block and the final layer keep.
    pub fn kept(&self) -> [Kept; 3] {
        match self {
            SegmentCosts::Engine(s) => [&s.embed, &s.block, &s.final_layer].map(|x| Kept {
                activations: x.activations + x.leaf,
                weight_casts: x.weight_casts,
                output: x.output,
            }),
            SegmentCosts::Generic(g) => [&g.embed, &g.block, &g.final_layer].map(|x| Kept {
                activations: x.kept.activations,
                weight_casts: x.kept.weight_casts,
                output: x.output_bytes,
            }),
        }
    }
}

pub fn segment_costs(spec: &Spec) -> SegmentCosts {
    match spec.runtime {
        crate::spec::Runtime::DitmemCpu => SegmentCosts::Engine(crate::candle_step::sims(spec)),
        _ => {
            let rt = model_for(spec);
            let dims = Dims::new(spec);
            let keep = rt.keeps_all_outputs();
            let saved = |seg: &crate::graph::Segment, t| rt.saves(seg, t);
            SegmentCosts::Generic(GenericCosts {
                embed: simulate(&rt.embed_segment(&dims), keep, &saved),
                block: simulate(&rt.block_segment(&dims), keep, &saved),
                final_layer: simulate(&rt.final_segment(&dims), keep, &saved),
            })
        }
    }
}

/// Simulate one optimizer step of the spec.
pub fn simulate_step(spec: &Spec) -> Timeline {
    let table = param_table(spec);
    let st = static_bytes(spec, &table);
    let costs = segment_costs(spec);
    simulate_step_with(spec, &table, &st, &costs, u32::MAX)
}

/// Simulate with precomputed parts. Only the first `max_microbatches` microbatches are laid out:
/// every microbatch after the first starts from the same state (gradient buffers live), so the
/// second one already shows the steady case.
pub fn simulate_step_with(
    spec: &Spec,
    table: &[ParamTensor],
    st: &StaticBytes,
    costs: &SegmentCosts,
    max_microbatches: u32,
) -> Timeline {
    let mut events = match costs {
        SegmentCosts::Engine(sims) => {
            crate::candle_step::replay(spec, table, st, sims, max_microbatches)
        }
        // PyTorch replays its own step (graphs released op by op, foreach optimizer, autocast cache).
        SegmentCosts::Generic(_)
            if matches!(spec.runtime, crate::spec::Runtime::Pytorch { .. }) =>
        {
            crate::runtime_pytorch::replay(spec, table, st, max_microbatches)
        }
        SegmentCosts::Generic(g) => generic_replay(spec, table, st, g, max_microbatches),
    };
    if spec.recipe.latents == Latents::Encode {
        // The frozen VAE encoder runs first, without gradient, on the images of a microbatch;
        // its weights stay resident for the whole step.
        let w = &spec.workload;
        let pixels = u64::from(w.height) * u64::from(w.width);
        let b = u64::from(w.microbatch);
        for e in events.iter_mut() {
            e.live.encoder += st.encoder_weights;
        }
        if let Some(first) = events.first().cloned() {
            let mut at = first.live;
            at.data += b * 3 * pixels * 4;
            at.encoder +=
                b * VAE_ENCODE_ELEMS_PER_PIXEL * pixels * vae_dtype(spec.recipe.precision).size();
            events.insert(
                1,
                Event {
                    phase: Phase::Encode,
                    label: "vae encode (inside)".into(),
                    block: None,
                    microbatch: 0,
                    inside: true,
                    live: at,
                },
            );
        }
    }
    let peak_index = events
        .iter()
        .enumerate()
        .max_by_key(|(i, e)| (e.total(), std::cmp::Reverse(*i)))
        .map(|(i, _)| i)
        .unwrap_or(0);
    Timeline { events, peak_index }
}

/// The block-wise timeline for runtimes described by generic segments: forward segment by
/// segment (a stored block keeps its graph, a recomputed one its output), backward in reverse
/// (a recomputed block is rebuilt first, each graph freed after its backward, parameter
/// gradients landing in buffers that stay live across microbatches), then the optimizer step.
fn generic_replay(
    spec: &Spec,
    table: &[ParamTensor],
    st: &StaticBytes,
    costs: &GenericCosts,
    max_microbatches: u32,
) -> Vec<Event> {
    let counts = count(table);
    let st = *st;
    let r = &spec.recipe;
    let w = &spec.workload;
    let p = r.precision;
    let ad = p.accum_dtype();
    let depth = spec.model.depth;
    let ranks = u64::from(w.ranks);
    let z = r.zero_stage;
    let dims = Dims::new(spec);

    // Gradients of the trained parameters per segment, in the gradient dtype (sharded from ZeRO-2).
    let grad_size = p.param_dtype().size();
    let seg_grads = |segment: Option<u32>| -> u64 {
        table
            .iter()
            .filter(|t| t.role == ParamRole::Trained)
            .filter(|t| match segment {
                Some(i) => t.block == Some(i),
                None => t.block.is_none(),
            })
            .map(|t| t.numel() * grad_size)
            .sum()
    };
    let block_grads = seg_grads(Some(0));
    let outer_grads = seg_grads(None);
    // Stage 3 gathers one block's weights in the compute dtype while the block runs.
    let gather = if z >= 3 && ranks > 1 {
        block_param_elems(spec) * p.compute_dtype().size()
    } else {
        0
    };

    let base = Breakdown {
        weights: st.weights,
        master_weights: st.master_weights,
        optimizer_state: st.optimizer_state,
        ema: st.ema,
        // The encoder's weights are added to every event by `simulate_step_with`.
        ..Breakdown::default()
    };
    let mut ev = Events::default();
    ev.push(Phase::Start, "step start".into(), None, 0, false, base);

    let mut live = base;
    let c_bytes = dims.b * dims.d * ad.size();
    for mb in 0..w.accumulation.min(max_microbatches.max(1)) {
        // The microbatch: x0 and noise (the ε target is the noise tensor itself), t and labels.
        let mut data = 2 * dims.latent * ad.size() + dims.b * (ad.size() + 4 + 2 * ad.size());
        if r.prediction == Prediction::V {
            data += dims.latent * ad.size();
        }
        live.data = data;
        if r.latents == Latents::Encode {
            let pixels = u64::from(w.height) * u64::from(w.width);
            let images = dims.b * 3 * pixels * 4;
            let acts = dims.b * VAE_ENCODE_ELEMS_PER_PIXEL * pixels * vae_dtype(p).size();
            let mut at = live;
            at.data += images;
            at.encoder += acts;
            ev.push(
                Phase::Encode,
                "vae encode (inside)".into(),
                None,
                mb,
                true,
                at,
            );
        }

        // Forward.
        let fwd = |live: &mut Breakdown, cost: &SegmentCost, tracked: bool| -> Breakdown {
            let mut inside = *live;
            inside.workspace += gather;
            if tracked {
                inside.activations += cost.fwd_peak;
            } else {
                inside.activations += cost.untracked_peak;
            }
            if tracked {
                live.activations += cost.kept.activations + cost.output_bytes;
                live.weight_casts += cost.kept.weight_casts;
            } else {
                live.activations += cost.output_bytes;
            }
            inside
        };
        let inside = fwd(&mut live, &costs.embed, true);
        ev.push(
            Phase::Forward,
            "embed (inside)".into(),
            None,
            mb,
            true,
            inside,
        );
        ev.push(Phase::Forward, "embed".into(), None, mb, false, live);
        for i in 0..depth {
            let tracked = !r.recompute.recomputes_block(i);
            let inside = fwd(&mut live, &costs.block, tracked);
            ev.push(
                Phase::Forward,
                format!("block {i} (inside)"),
                Some(i),
                mb,
                true,
                inside,
            );
            ev.push(
                Phase::Forward,
                format!("block {i}"),
                Some(i),
                mb,
                false,
                live,
            );
        }
        let inside = fwd(&mut live, &costs.final_layer, true);
        ev.push(
            Phase::Forward,
            "final + loss (inside)".into(),
            None,
            mb,
            true,
            inside,
        );
        ev.push(Phase::Forward, "loss".into(), None, mb, false, live);

        // Backward. `bwd` frees the segment's graph and output, lands its parameter gradients in
        // the buffers, and leaves the input gradient live.
        let grads_exist = mb > 0;
        let bwd = |live: &mut Breakdown,
                   cost: &SegmentCost,
                   grad_out: u64,
                   seg_grad: u64,
                   tracked: bool|
         -> Breakdown {
            let mut inside = *live;
            inside.workspace += gather;
            if !tracked {
                // Rebuild the graph first (its output is a fresh copy of the stored one).
                inside.activations += cost.kept.activations + cost.output_bytes;
                inside.weight_casts += cost.kept.weight_casts;
            }
            inside.workspace += grad_out + cost.bwd_transient_peak;
            if grads_exist {
                // buffer + new: the sum exists beside the old buffer and the in-flight gradient.
                inside.workspace += shard(seg_grad, ranks, z >= 2);
            }
            if tracked {
                live.activations -= cost.kept.activations + cost.output_bytes;
                live.weight_casts -= cost.kept.weight_casts;
            } else {
                live.activations -= cost.output_bytes;
            }
            if !grads_exist {
                live.gradients += shard(seg_grad, ranks, z >= 2);
            }
            inside
        };
        // Gradient of the loss, then of the residual stream flowing down.
        let x_grad = dims.e() * ad.size();
        let final_grads = table
            .iter()
            .filter(|t| t.role == ParamRole::Trained && t.name.starts_with("final_layer"))
            .map(|t| t.numel() * grad_size)
            .sum::<u64>();
        let embed_grads = outer_grads - final_grads;
        let inside = bwd(&mut live, &costs.final_layer, ad.size(), final_grads, true);
        ev.push(
            Phase::Backward,
            "final + loss (inside)".into(),
            None,
            mb,
            true,
            inside,
        );
        live.workspace += x_grad + c_bytes;
        ev.push(
            Phase::Backward,
            "final + loss".into(),
            None,
            mb,
            false,
            live,
        );
        for i in (0..depth).rev() {
            let tracked = !r.recompute.recomputes_block(i);
            // The upstream gradient is already counted in workspace: it is the grad_out.
            live.workspace -= x_grad;
            let inside = bwd(&mut live, &costs.block, x_grad, block_grads, tracked);
            ev.push(
                Phase::Backward,
                format!("block {i} (inside)"),
                Some(i),
                mb,
                true,
                inside,
            );
            live.workspace += x_grad;
            ev.push(
                Phase::Backward,
                format!("block {i}"),
                Some(i),
                mb,
                false,
                live,
            );
        }
        live.workspace -= x_grad;
        let inside = bwd(&mut live, &costs.embed, x_grad, embed_grads, true);
        ev.push(
            Phase::Backward,
            "embed (inside)".into(),
            None,
            mb,
            true,
            inside,
        );
        live.workspace -= c_bytes;
        live.data = 0;
        ev.push(Phase::Backward, "embed".into(), None, mb, false, live);
    }

    // Optimizer step and EMA.
    if counts.trained > 0 {
        let mut inside = live;
        inside.workspace += st.optimizer_scratch;
        ev.push(
            Phase::Optimizer,
            format!("{} (inside)", r.optimizer.name()),
            None,
            0,
            true,
            inside,
        );
        if r.ema.enabled {
            let mut inside = live;
            inside.workspace += st.ema_scratch;
            ev.push(
                Phase::Optimizer,
                "ema (inside)".into(),
                None,
                0,
                true,
                inside,
            );
        }
    }
    live.gradients = 0;
    ev.push(Phase::Optimizer, "step end".into(), None, 0, false, live);

    ev.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoder_weights_are_counted_once() {
        for runtime in ["ditmem-cpu", "pytorch"] {
            let mut s = Spec::small();
            s.runtime = runtime.parse().unwrap();
            let cached = simulate_step(&s).events[0].live.encoder;
            s.recipe.latents = Latents::Encode;
            let st = static_bytes(&s, &param_table(&s));
            let encode = simulate_step(&s).events[0].live.encoder;
            assert_eq!(cached, 0, "{runtime}");
            assert_eq!(encode, st.encoder_weights, "{runtime}");
        }
    }
}
