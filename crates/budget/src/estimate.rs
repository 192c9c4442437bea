//! `estimate`: the budget of one step — parameters, the op inventory of each segment, the
//! timeline and its peak — as one serialisable value.

use serde::Serialize;

use crate::error::SpecError;
use crate::events::{Breakdown, Phase, StaticBytes};
use crate::params::{count, param_table, ParamCounts};
use crate::runtime::{model_for, SegmentCosts, Shape};
use crate::segment::{Segment, TensorKind};
use crate::spec::{Dtype, Spec};
use crate::timeline::{segment_costs, simulate_step, static_bytes, Timeline};

/// The peak of the step and what is live there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Peak {
    pub bytes: u64,
    pub phase: Phase,
    pub label: String,
    pub block: Option<u32>,
    pub microbatch: u32,
    pub breakdown: Breakdown,
    /// The largest category at the peak.
    pub dominant: &'static str,
}

/// One row of a segment's op inventory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InventoryRow {
    pub op: String,
    pub elems: u64,
    pub dtype: Dtype,
    /// Bytes of the new buffer (0 for views).
    pub bytes: u64,
    /// Bytes kept beside the output (log-sum-exp).
    pub extra_saved: u64,
    pub fwd_scratch: u64,
    pub bwd_scratch: u64,
}

/// The op inventory of one segment under the spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Inventory {
    pub segment: String,
    pub rows: Vec<InventoryRow>,
    /// Bytes the tracked graph keeps (output excluded).
    pub kept_bytes: u64,
}

fn inventory(seg: &Segment, kept_bytes: u64) -> Inventory {
    let rows = seg
        .ops
        .iter()
        .map(|op| {
            let t = &seg.tensors[op.output];
            InventoryRow {
                op: op.name.clone(),
                elems: t.elems,
                dtype: t.dtype,
                bytes: if t.kind == TensorKind::Alloc {
                    t.bytes()
                } else {
                    0
                },
                extra_saved: op.extra_saved,
                fwd_scratch: op.fwd_scratch,
                bwd_scratch: op.bwd_scratch,
            }
        })
        .collect();
    Inventory {
        segment: seg.name.clone(),
        rows,
        kept_bytes,
    }
}

/// The whole budget of a spec.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Budget {
    pub spec: Spec,
    pub runtime: &'static str,
    pub params: ParamCounts,
    /// Image tokens per sample.
    pub tokens: u64,
    pub peak_bytes: u64,
    pub peak_phase: Phase,
    pub peak: Peak,
    /// Bytes by category at the peak.
    pub breakdown: Breakdown,
    pub static_bytes: StaticBytes,
    pub segments: SegmentCosts,
    /// Highest live bytes per phase.
    pub phase_peaks: Vec<(Phase, u64)>,
    /// What "weights × 4" would have said (weights as stored, times four).
    pub weights_times_four: u64,
    pub timeline: Timeline,
    pub inventory: Vec<Inventory>,
}

/// Budget a spec: validate it, count parameters, build the inventory and simulate the step.
pub fn estimate(spec: &Spec) -> Result<Budget, SpecError> {
    spec.validate()?;
    let table = param_table(spec);
    let params = count(&table);
    let st = static_bytes(spec, &table);
    let segments = segment_costs(spec);
    let timeline = simulate_step(spec);
    let ev = timeline.peak().clone();
    let rt = model_for(spec);
    let dims = Shape::new(spec);
    let kept = segments.kept();
    let inv = vec![
        inventory(
            &rt.embed_segment(&dims),
            kept[0].activations + kept[0].weight_casts,
        ),
        inventory(
            &rt.block_segment(&dims),
            kept[1].activations + kept[1].weight_casts,
        ),
        inventory(
            &rt.final_segment(&dims),
            kept[2].activations + kept[2].weight_casts,
        ),
    ];
    let peak = Peak {
        bytes: ev.total(),
        phase: ev.phase,
        label: ev.label.clone(),
        block: ev.block,
        microbatch: ev.microbatch,
        breakdown: ev.live,
        dominant: ev.live.dominant().0,
    };
    Ok(Budget {
        spec: spec.clone(),
        runtime: rt.name(),
        tokens: spec.tokens()?,
        peak_bytes: peak.bytes,
        peak_phase: peak.phase,
        breakdown: peak.breakdown,
        phase_peaks: timeline.phase_peaks(),
        weights_times_four: 4 * (st.weights + st.master_weights),
        params,
        static_bytes: st,
        segments,
        peak,
        timeline,
        inventory: inv,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{AttentionMode, Precision, Recompute};

    fn small() -> Spec {
        let mut s = Spec::default_xl();
        s.model = crate::spec::ModelSpec::preset("dit-s-2").unwrap();
        s.workload.batch = 4;
        s.workload.microbatch = 4;
        s
    }

    #[test]
    fn peak_is_largest_event() {
        for p in Precision::ALL {
            let mut s = small();
            s.recipe.precision = p;
            let b = estimate(&s).unwrap();
            let max = b.timeline.events.iter().map(|e| e.total()).max().unwrap();
            assert_eq!(b.peak_bytes, max);
            assert_eq!(b.peak_bytes, b.breakdown.total());
        }
    }

    #[test]
    fn recompute_all_lowers_peak() {
        let mut s = small();
        let none = estimate(&s).unwrap().peak_bytes;
        s.recipe.recompute = Recompute::All;
        let all = estimate(&s).unwrap().peak_bytes;
        assert!(
            all < none,
            "recompute-all {all} must peak below none {none}"
        );
    }

    #[test]
    fn accumulation_keeps_gradients_live_in_forward() {
        let mut s = small();
        s.workload.microbatch = 2;
        s.workload.accumulation = 2;
        let b = estimate(&s).unwrap();
        let fwd_mb1 = b
            .timeline
            .events
            .iter()
            .find(|e| e.phase == Phase::Forward && e.microbatch == 1)
            .unwrap();
        assert_eq!(fwd_mb1.live.gradients, b.static_bytes.gradients);
        assert!(fwd_mb1.live.gradients > 0);
        let fwd_mb0 = b
            .timeline
            .events
            .iter()
            .find(|e| e.phase == Phase::Forward && e.microbatch == 0)
            .unwrap();
        assert_eq!(fwd_mb0.live.gradients, 0);
    }

    #[test]
    fn materialized_adds_attention_probabilities_per_stored_block() {
        // The difference in kept bytes per block is a whole number of b·a·s² tensors, and at
        // least one per stored block (P kept for P·v).
        for p in [Precision::Fp32, Precision::Bf16Mixed] {
            let mut s = small();
            s.recipe.precision = p;
            s.recipe.attention = AttentionMode::Materialized;
            let mat = segment_costs(&s).kept()[1].activations;
            s.recipe.attention = AttentionMode::MemoryEfficient;
            let eff = segment_costs(&s).kept()[1].activations;
            let d = Shape::new(&s);
            let a_elems = d.a();
            let lse = d.b * d.heads * d.s * 4;
            let diff = mat + lse - eff;
            assert!(diff >= a_elems * p.compute_dtype().size());
            assert!(diff >= a_elems, "diff {diff} < A {a_elems}");
        }
    }

    #[test]
    fn materialized_scales_with_stored_blocks() {
        // Live activations after the forward differ by (stored blocks) × (what a stored block
        // keeps in materialized mode beyond memory-efficient), whatever the recompute policy;
        // under the ditmem-cpu runtime that difference is P (A-sized, f32) less the streaming
        // kernel's log-sum-exp (A/s).
        let mut s = small();
        s.recipe.precision = Precision::Fp32;
        let d = Shape::new(&s);
        let kept = |mode| {
            let mut t = s.clone();
            t.recipe.attention = mode;
            segment_costs(&t).kept()[1].activations
        };
        let per_block = kept(AttentionMode::Materialized) - kept(AttentionMode::MemoryEfficient);
        assert!(
            per_block >= d.a() * 4 - d.a() * 4 / d.s,
            "{per_block} < A·4 − lse"
        );
        for (rc, stored) in [
            (Recompute::None, 12u64),
            (Recompute::EveryK(2), 6),
            (Recompute::All, 0),
        ] {
            s.recipe.recompute = rc.clone();
            let after_fwd = |mode| {
                let mut t = s.clone();
                t.recipe.attention = mode;
                let b = estimate(&t).unwrap();
                b.timeline
                    .events
                    .iter()
                    .find(|e| e.label == "final" && e.phase == Phase::Forward)
                    .unwrap()
                    .live
                    .activations
            };
            let diff =
                after_fwd(AttentionMode::Materialized) - after_fwd(AttentionMode::MemoryEfficient);
            assert_eq!(diff, stored * per_block, "recompute {rc}");
        }
    }

    #[test]
    fn weights_times_four_is_not_the_peak() {
        let b = estimate(&Spec::default_xl()).unwrap();
        assert_ne!(b.weights_times_four, b.peak_bytes);
        assert!(b.peak_bytes > b.weights_times_four);
    }
}
