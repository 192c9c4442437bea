//! The step timeline: a simulation of one optimizer step (after warm-up) over the op inventory.
//!
//! Forward runs segment by segment (embedder, blocks, final layer + loss); a stored block keeps
//! its graph, a recomputed block keeps only its output. Backward runs in reverse: a recomputed
//! block is rebuilt first, each segment's graph is freed after its backward, and its parameter
//! gradients land in the gradient buffers, which stay live across accumulated microbatches. The
//! optimizer step follows with its per-tensor scratch, then the EMA update. Every event carries the
//! live bytes by category; the peak is the largest total over the events.
//!
//! The replay itself belongs to the spec's runtime (reached through
//! [`crate::runtime::RuntimeModel`]); this file holds what every runtime shares: the persistent
//! bytes of the model states, the frozen VAE encoder, and the peak.

use serde::Serialize;

use crate::events::{Event, Phase, StaticBytes};
use crate::params::{param_table, stored_dtype, ParamRole, ParamTensor};
use crate::runtime::{model_for, SegmentCosts};
use crate::spec::{Dtype, Latents, Optimizer, Precision, Spec};

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

/// What the spec's runtime's step replay needs about each segment.
pub fn segment_costs(spec: &Spec) -> SegmentCosts {
    model_for(spec).segment_costs(spec)
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
    // Each runtime replays its own step; the timeline adds the encoder and finds the peak.
    let mut events = model_for(spec).replay(spec, table, st, costs, max_microbatches);
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
