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

#[cfg(test)]
use crate::denoiser::param_table;
pub(crate) use crate::events::LAID_OUT_MICROBATCHES;
use crate::events::{laid_out_microbatches, Event, Phase, StaticBytes};
use crate::params::{stored_bytes, stored_dtype, ParamRole, ParamTensor};
use crate::runtime::{model_for, SegmentCosts};
use crate::spec::Spec;

/// Microbatches of the step that the timeline does not lay out: `first..=last` (0-based, as in
/// the event labels) repeat microbatch `as_microbatch` event for event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Repeat {
    pub first: u32,
    pub last: u32,
    pub as_microbatch: u32,
}

impl Repeat {
    /// "microbatches 2..=99 repeat microbatch 1 (not laid out)".
    pub fn describe(&self) -> String {
        let which = if self.first == self.last {
            format!("microbatch {}", self.first)
        } else {
            format!("microbatches {}..={}", self.first, self.last)
        };
        let verb = if self.first == self.last {
            "repeats"
        } else {
            "repeat"
        };
        format!(
            "{which} {verb} microbatch {} event for event (not laid out)",
            self.as_microbatch
        )
    }
}

/// The simulated step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Timeline {
    pub events: Vec<Event>,
    /// Index of the peak event.
    pub peak_index: usize,
    /// Microbatches the step accumulates (`workload.accumulation`).
    pub microbatches: u32,
    /// Microbatches laid out in `events` (the first `laid_out` of them).
    pub laid_out: u32,
    /// The microbatches that are not laid out and the one they repeat; `None` when all are.
    pub repeated: Option<Repeat>,
}

impl Timeline {
    pub fn peak(&self) -> &Event {
        &self.events[self.peak_index]
    }

    /// The events of the whole step, every microbatch laid out: the events of microbatch
    /// `as_microbatch` repeated, renumbered and relabelled, for each microbatch that is not laid
    /// out. For lining the timeline up with a measurement of every microbatch (`compare`,
    /// `agree`); its length grows with the accumulation count, as the measured step does.
    pub fn expanded_events(&self) -> Vec<Event> {
        let Some(r) = self.repeated else {
            return self.events.clone();
        };
        let prefix = format!("microbatch {}: ", r.as_microbatch);
        let unit: Vec<&Event> = self
            .events
            .iter()
            .filter(|e| e.microbatch == r.as_microbatch && e.phase != Phase::Optimizer)
            .collect();
        let split = self
            .events
            .iter()
            .rposition(|e| e.microbatch == r.as_microbatch && e.phase != Phase::Optimizer)
            .map_or(self.events.len(), |i| i + 1);
        let mut out: Vec<Event> = self.events[..split].to_vec();
        for mb in r.first..=r.last {
            out.extend(unit.iter().map(|e| {
                let mut e = (*e).clone();
                e.microbatch = mb;
                if let Some(what) = e.label.strip_prefix(&prefix) {
                    e.label = format!("microbatch {mb}: {what}");
                }
                e
            }));
        }
        out.extend_from_slice(&self.events[split..]);
        out
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

// Two rules of the precision policy that files below the timeline read too (the sharding
// rules, the frozen encoders) live in `precision_rules.rs`; re-exported here where they were.
pub(crate) use crate::precision_rules::ADAM8BIT_MIN_SIZE;

/// The persistent bytes of the model states under the spec (per rank): on one rank as the
/// module holds them; over several ranks as the recipe's scheme shards them
/// ([`crate::sharding::rank_states`]: DDP buckets, ZeRO partitions, FSDP2 shards, offload).
pub(crate) fn static_bytes(spec: &Spec, table: &[ParamTensor]) -> StaticBytes {
    let r = &spec.recipe;
    let p = r.precision;
    let rt = model_for(spec);
    let mut s = StaticBytes::default();
    for t in table {
        let n = t.numel();
        let dt = if t.buffer {
            stored_dtype(t, p, r.lora.is_some())
        } else {
            r.trained_dtype()
        };
        match t.role {
            ParamRole::Frozen => s.weights += stored_bytes(t, p, r.lora.is_some(), r.base_quant),
            ParamRole::Trained => {
                if r.trained_masters() {
                    s.master_weights += n * dt.size();
                } else {
                    s.weights += n * dt.size();
                }
                let gd = if r.low_adapters() {
                    r.trained_dtype()
                } else {
                    rt.grad_dtype(p)
                };
                s.gradients += n * gd.size();
                s.optimizer_state += crate::precision_rules::trained_state_bytes(n, r);
                if r.ema.enabled {
                    s.ema += crate::sharding::ema_bytes(spec, t);
                    s.ema_scratch = s.ema_scratch.max(rt.ema_scratch(n, r.ema.dtype));
                }
                s.optimizer_scratch =
                    s.optimizer_scratch
                        .max(rt.optimizer_scratch(n, p, r.optimizer));
            }
        }
    }
    if let Some(rs) = crate::sharding::rank_states(spec, table, rt.grad_dtype(p)) {
        s.weights = rs.weights_bytes();
        s.master_weights = rs.master_bytes();
        s.optimizer_state = rs.optimizer_state_bytes();
        let full: u64 = table
            .iter()
            .filter(|t| t.role == ParamRole::Trained)
            .map(|t| t.numel() * rs.grad_elem_bytes)
            .sum();
        s.gradients = rs.grad_buffers.iter().sum::<u64>()
            + rs.grad_partition
            + if rs.keep_full_grads { full } else { 0 };
        s.host_bytes = rs.host;
    }
    s.encoder_weights = crate::encoders::resident_bytes(&crate::encoders::encoder_runs(spec));
    s
}

/// What the spec's runtime's step replay needs about each segment.
pub(crate) fn segment_costs(spec: &Spec) -> SegmentCosts {
    model_for(spec).segment_costs(spec)
}

/// Simulate one optimizer step of the spec (the tests' shorthand; `estimate` passes its parts).
#[cfg(test)]
pub(crate) fn simulate_step(spec: &Spec) -> Timeline {
    let table = param_table(spec);
    let st = static_bytes(spec, &table);
    let costs = segment_costs(spec);
    simulate_step_with(spec, &table, &st, &costs, LAID_OUT_MICROBATCHES)
}

/// Simulate with precomputed parts. Only the first `max_microbatches` microbatches are laid out
/// (at least [`LAID_OUT_MICROBATCHES`]): every microbatch after the first starts from the same state (gradient
/// buffers live), so the second one already shows the steady case, and the peak and the phase
/// peaks of [`LAID_OUT_MICROBATCHES`] are those of the full layout (`u32::MAX`, for tests).
pub(crate) fn simulate_step_with(
    spec: &Spec,
    table: &[ParamTensor],
    st: &StaticBytes,
    costs: &SegmentCosts,
    max_microbatches: u32,
) -> Timeline {
    // Each runtime replays its own step; the timeline adds the encoder and finds the peak.
    let mut events = model_for(spec).replay(spec, table, st, costs, max_microbatches);
    let runs = crate::encoders::encoder_runs(spec);
    if !runs.is_empty() {
        // The resident encoders' weights are there for the whole step; each microbatch first
        // runs every encoder without gradient, one after another, from the state its forward
        // starts in.
        let resident = crate::encoders::resident_bytes(&runs);
        for e in events.iter_mut() {
            e.live.encoder += resident;
        }
        let mut at = 0;
        while let Some(k) = events[at..]
            .iter()
            .position(|e| e.phase == Phase::Forward)
            .map(|k| k + at)
        {
            let mb = events[k].microbatch;
            let before = events[k.saturating_sub(1)].live;
            let encodes: Vec<Event> = runs
                .iter()
                .map(|r| {
                    let mut live = before;
                    live.encoder += r.forward_bytes + if r.resident { 0 } else { r.weight_bytes };
                    live.data += r.input_bytes;
                    Event {
                        phase: Phase::Encode,
                        label: format!("{} forward (inside)", r.name),
                        block: None,
                        microbatch: mb,
                        inside: true,
                        live,
                    }
                })
                .collect();
            let n = encodes.len();
            events.splice(k..k, encodes);
            // The next microbatch's forward.
            at = match events[k + n..]
                .iter()
                .position(|e| e.microbatch != mb)
                .map(|j| j + k + n)
            {
                Some(j) => j,
                None => break,
            };
        }
    }
    let peak_index = events
        .iter()
        .enumerate()
        .max_by_key(|(i, e)| (e.total(), std::cmp::Reverse(*i)))
        .map(|(i, _)| i)
        .unwrap_or(0);
    let microbatches = spec.workload.accumulation;
    let laid_out = laid_out_microbatches(microbatches, max_microbatches);
    let repeated = (laid_out < microbatches).then(|| Repeat {
        first: laid_out,
        last: microbatches - 1,
        as_microbatch: laid_out - 1,
    });
    Timeline {
        events,
        peak_index,
        microbatches,
        laid_out,
        repeated,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::Latents;
    use crate::spec::Precision;

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

    /// The recipes the accumulation tests run over: plain, recompute (all, and some blocks),
    /// attention-only, LoRA, fp16-mixed loss scaling, bf16-pure, the VAE in the step.
    fn recipes() -> Vec<Spec> {
        use crate::spec::{LoraSpec, Recompute};
        let mut out = Vec::new();
        for runtime in ["ditmem-cpu", "pytorch", "pytorch:cuda"] {
            let mut base = Spec::small();
            base.model.depth = 3;
            base.runtime = runtime.parse().unwrap();
            base.recipe.ema.enabled = true;
            out.push(base.clone());
            for rc in ["all", "blocks:1", "attention-only"] {
                let mut s = base.clone();
                s.recipe.recompute = rc.parse::<Recompute>().unwrap();
                out.push(s);
            }
            let mut s = base.clone();
            s.recipe.lora = Some(LoraSpec {
                dtype: Default::default(),
                rank: 4,
                targets: crate::spec::default_lora_targets(),
                modules: Vec::new(),
            });
            out.push(s);
            for p in [
                Precision::Fp16Mixed,
                Precision::Bf16Pure,
                Precision::Bf16Mixed,
            ] {
                let mut s = base.clone();
                s.recipe.precision = p;
                out.push(s);
            }
            let mut s = base.clone();
            s.recipe.latents = Latents::Encode;
            out.push(s);
        }
        out
    }

    fn full_layout(s: &Spec) -> Timeline {
        let table = param_table(s);
        let st = static_bytes(s, &table);
        simulate_step_with(s, &table, &st, &segment_costs(s), u32::MAX)
    }

    #[test]
    fn two_microbatches_stand_for_any_accumulation() {
        for base in recipes() {
            for acc in 1..=6u32 {
                let mut s = base.clone();
                s.workload.accumulation = acc;
                s.workload.batch = s.workload.microbatch * acc;
                s.validate().unwrap();
                let what = format!("{} {} accumulation {acc}", s.runtime, recipe_name(&s));
                let short = simulate_step(&s);
                let full = full_layout(&s);
                assert_eq!(full.laid_out, acc, "{what}");
                assert!(full.repeated.is_none(), "{what}");
                assert_eq!(short.microbatches, acc, "{what}");
                assert_eq!(short.laid_out, acc.min(LAID_OUT_MICROBATCHES), "{what}");
                assert_eq!(short.repeated.is_some(), acc > 2, "{what}");
                // The peak, what is live there, where it is, and the phase peaks.
                assert_eq!(short.peak(), full.peak(), "{what}");
                assert_eq!(short.phase_peaks(), full.phase_peaks(), "{what}");
                // Every microbatch that is not laid out repeats microbatch 1 event for event.
                assert_eq!(short.expanded_events(), full.events, "{what}");
                let maxmb = short.events.iter().map(|e| e.microbatch).max().unwrap();
                assert!(maxmb < LAID_OUT_MICROBATCHES, "{what}");
            }
        }
    }

    fn recipe_name(s: &Spec) -> String {
        format!(
            "{} recompute {} lora {} latents {:?}",
            s.recipe.precision,
            s.recipe.recompute,
            s.recipe.lora.is_some(),
            s.recipe.latents
        )
    }

    #[test]
    fn the_replay_does_not_grow_with_the_accumulation_count() {
        for runtime in ["ditmem-cpu", "pytorch"] {
            let mut s = Spec::small();
            s.runtime = runtime.parse().unwrap();
            s.workload.microbatch = 1;
            s.workload.batch = 2;
            s.workload.accumulation = 2;
            let two = simulate_step(&s).events.len();
            s.workload.accumulation = 4_000_000;
            s.workload.batch = 4_000_000;
            let tl = simulate_step(&s);
            assert_eq!(tl.events.len(), two, "{runtime}");
            let r = tl.repeated.unwrap();
            assert_eq!((r.first, r.last, r.as_microbatch), (2, 3_999_999, 1));
            assert!(r
                .describe()
                .contains("microbatches 2..=3999999 repeat microbatch 1"));
        }
    }
}
