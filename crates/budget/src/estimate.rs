//! `estimate`: the budget of one step — parameters, the op inventory of each segment, the
//! timeline and its peak — as one serialisable value.

use serde::Serialize;

use crate::denoiser::param_table;
use crate::error::SpecError;
use crate::events::{Breakdown, Phase, StaticBytes};
use crate::params::{count, ParamCounts};
use crate::runtime::pytorch::caching_allocator::AllocEvent;
use crate::runtime::pytorch::cuda::{cuda_report_of, CudaReport};
use crate::runtime::pytorch::trace::allocation_sequence;
use crate::runtime::{model_for, SegmentCosts, Shape};
use crate::segment::{Segment, TensorKind};
use crate::spec::{Dtype, Spec};
use crate::timeline::{
    segment_costs, simulate_step_with, static_bytes, Timeline, LAID_OUT_MICROBATCHES,
};

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
    /// The frozen encoders that run inside the step (VAE when latents are encoded, text
    /// encoders when online or offloaded), in the order a microbatch runs them.
    pub encoders: Vec<crate::encoders::EncoderRun>,
    /// On `pytorch:cuda`: the caching allocator over the step's allocations — max allocated and
    /// reserved, fragmentation, what `nvidia-smi` shows and whether it fits the spec's GPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cuda: Option<CudaReport>,
    /// Whether the step fits the spec's GPU (its device bytes within capacity); absent without a GPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fits: Option<bool>,
}

/// The spec checks [`estimate`] starts with (the denoiser's, and a family the runtime models).
fn check_estimable(spec: &Spec) -> Result<(), SpecError> {
    crate::denoiser::check(spec)?;
    if let Some(fm) = crate::denoiser::family(spec)? {
        if !crate::runtime::pytorch::families::supported(fm.family) {
            return Err(SpecError::invalid(
                "runtime",
                format!(
                    "the pytorch runtime has no op inventory for {} ({}) yet; allowed: ditmem params \
                     for its parameters, or a family the runtime models",
                    fm.class_name,
                    fm.family.name()
                ),
            ));
        }
    }
    Ok(())
}

/// What a lever's row reads of a budget (`levers.rs`): the CUDA report and the step's peak
/// (`peak_bytes`), each as [`estimate`] computes it, with the same checks in the same order (so
/// the same errors) — without the rest of the budget (inventory, breakdowns, encoder runs), which
/// the row never shows.
pub(crate) fn need_inputs(spec: &Spec) -> Result<(Option<CudaReport>, u64), SpecError> {
    check_estimable(spec)?;
    let table = param_table(spec);
    let st = static_bytes(spec, &table);
    let costs = segment_costs(spec);
    let peak_bytes = simulate_step_with(spec, &table, &st, &costs, LAID_OUT_MICROBATCHES)
        .peak()
        .total();
    let cuda = cuda_of(spec, &table)?;
    spec.tokens()?;
    Ok((cuda, peak_bytes))
}

/// Allocation sequences built in this process, by their spec less `cuda.alloc_conf` (which is
/// not part of a sequence: `cuda_report_of`): the expandable-segments lever replays the
/// sequence of the spec as given. A few are kept, the last built first.
type Sequences = Vec<(String, std::sync::Arc<Vec<AllocEvent>>)>;
const KEPT_SEQUENCES: usize = 4;

/// On `pytorch:cuda`, the CUDA report of `spec` (`table` is its parameter table), with its
/// allocation sequence built once per process for every allocator setting.
fn cuda_of(
    spec: &Spec,
    table: &[crate::params::ParamTensor],
) -> Result<Option<CudaReport>, SpecError> {
    if !matches!(
        spec.runtime,
        crate::spec::Runtime::Pytorch {
            device: crate::spec::TorchDevice::Cuda,
            ..
        }
    ) {
        return Ok(None);
    }
    static BUILT: std::sync::Mutex<Sequences> = std::sync::Mutex::new(Vec::new());
    let mut plain = spec.clone();
    if let Some(c) = plain.cuda.as_mut() {
        c.alloc_conf.clear();
    }
    let key = format!("{plain:?}");
    let kept = BUILT
        .lock()
        .ok()
        .and_then(|v| v.iter().find(|(k, _)| *k == key).map(|(_, e)| e.clone()));
    let events = match kept {
        Some(e) => e,
        None => {
            let e = std::sync::Arc::new(allocation_sequence(spec, table));
            if let Ok(mut v) = BUILT.lock() {
                v.insert(0, (key, e.clone()));
                v.truncate(KEPT_SEQUENCES);
            }
            e
        }
    };
    cuda_report_of(spec, table, &events)
}

/// Budget a spec: validate it, count parameters, build the inventory and simulate the step.
pub fn estimate(spec: &Spec) -> Result<Budget, SpecError> {
    check_estimable(spec)?;
    let table = param_table(spec);
    let params = count(&table);
    let st = static_bytes(spec, &table);
    let segments = segment_costs(spec);
    let timeline = simulate_step_with(spec, &table, &st, &segments, LAID_OUT_MICROBATCHES);
    let ev = timeline.peak().clone();
    let rt = model_for(spec);
    let dims = Shape::new(spec);
    let kept = segments.kept();
    let engine_family = (spec.runtime == crate::spec::Runtime::DitmemCpu)
        .then(|| {
            crate::runtime::ditmem_cpu::registry::rules(spec).map(|r| r.inventory_segments(spec))
        })
        .flatten()
        .map(|segs| {
            segs.iter()
                .zip(kept.iter())
                .map(|(seg, k)| inventory(seg, k.activations + k.weight_casts))
                .collect::<Vec<_>>()
        });
    let torch_family = || {
        crate::runtime::pytorch::families::family_segments(spec).map(|segs| {
            segs.iter()
                .map(|seg| {
                    let k = crate::runtime::pytorch::allocator::simulate(seg, 0, &[]).kept;
                    inventory(seg, k.activations + k.weight_casts)
                })
                .collect::<Vec<_>>()
        })
    };
    let family_inv = engine_family.or_else(torch_family);
    let inv = family_inv.unwrap_or_else(|| {
        vec![
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
        ]
    });
    let peak = Peak {
        bytes: ev.total(),
        phase: ev.phase,
        label: ev.label.clone(),
        block: ev.block,
        microbatch: ev.microbatch,
        breakdown: ev.live,
        dominant: ev.live.dominant().0,
    };
    let cuda = cuda_of(spec, &table)?;
    let fits = cuda.as_ref().and_then(|c| c.fits);
    Ok(Budget {
        encoders: crate::encoders::encoder_runs(spec),
        cuda,
        fits,
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
        let forward_of = |microbatch| {
            b.timeline
                .events
                .iter()
                .find(|e| e.phase == Phase::Forward && e.microbatch == microbatch)
                .unwrap()
        };
        let fwd_mb1 = forward_of(1);
        assert_eq!(fwd_mb1.live.gradients, b.static_bytes.gradients);
        assert!(fwd_mb1.live.gradients > 0);
        assert_eq!(forward_of(0).live.gradients, 0);
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

    /// The estimate is a function of the spec: the CPU enters through `spec.cpu`, never from the
    /// host. With the figures of the two CPUs the suite runs on — an AMD EPYC (Zen 4: AVX512-BF16,
    /// 1 MiB of L2 per core) and an Intel Xeon (Sapphire Rapids: AVX512-BF16, 2 MiB of L2 per
    /// core), 2 threads each — a step that multiplies through `gemm` differs by exactly the two
    /// threads' extra slabs (measured on the engine: 2 MiB more with the Xeon's sysfs cache sizes),
    /// and a bf16 step on the kernel, which makes no `gemm` product, not at all.
    #[test]
    fn the_budget_follows_the_spec_cpu_not_the_host() {
        use crate::spec::{Bf16Products, CpuSpec};
        let epyc = CpuSpec {
            threads: 2,
            bf16_products: Bf16Products::Kernel,
            gemm_l2_bytes: 1 << 20,
            gemm_isa: crate::spec::GemmIsa::Avx512,
            ..CpuSpec::REFERENCE
        };
        let xeon = CpuSpec {
            gemm_l2_bytes: 2 << 20,
            ..epyc
        };
        let on = |mut s: Spec, cpu: CpuSpec| {
            s.cpu = Some(cpu);
            estimate(&s).unwrap()
        };
        let mut fp32 = small();
        fp32.recipe.precision = Precision::Fp32;
        let (a, b) = (on(fp32.clone(), epyc), on(fp32.clone(), xeon));
        // `runtime` also holds candle's bookkeeping of landed gradients, the same on both.
        assert_eq!(b.breakdown.runtime - a.breakdown.runtime, 2 << 20);
        assert!(a.breakdown.runtime >= 2 << 20);
        assert_eq!(b.peak_bytes - a.peak_bytes, 2 << 20);
        assert_eq!(
            estimate(&fp32).unwrap().peak_bytes,
            a.peak_bytes,
            "no cpu: the reference"
        );

        let mut bf16 = small();
        bf16.recipe.precision = Precision::Bf16Mixed;
        let (a, b) = (on(bf16.clone(), epyc), on(bf16.clone(), xeon));
        assert_eq!(a.breakdown.runtime, b.breakdown.runtime);
        assert!(a.breakdown.runtime < 1 << 20, "no slab");
        assert_eq!(a.peak_bytes, b.peak_bytes);
        // Widened, the same step multiplies through gemm: its slabs, and the widened path's
        // own workspace instead of the kernel's packed operands (less at this peak: the widened
        // MLP backward goes by row chunks and column blocks, the kernel's over whole buffers).
        let widened = on(
            bf16.clone(),
            CpuSpec {
                bf16_products: Bf16Products::Widen,
                ..xeon
            },
        );
        assert_eq!(widened.breakdown.runtime - b.breakdown.runtime, 4 << 20);
        assert_ne!(widened.breakdown.workspace, b.breakdown.workspace);
        assert!(widened.peak_bytes > b.peak_bytes);

        // Four threads: twice the slabs (and the attention keeps a scratch per thread).
        let two = on(fp32.clone(), epyc);
        let four = on(fp32, CpuSpec { threads: 4, ..epyc });
        assert_eq!(four.breakdown.runtime - two.breakdown.runtime, 2 << 20);
        assert!(four.peak_bytes >= two.peak_bytes + (2 << 20));
    }

    /// `gemm`'s depth block comes from the L1: on a Zen 1 (L1d 32 KiB 8-way, L2 512 KiB 8-way,
    /// L3 8 MiB 16-way) a product deeper than 512 packs 512-deep panels, where the reference's
    /// roomier L1 (48 KiB 12-way) packs the whole depth. The engine's weight gradients go by
    /// 256-row chunks (`DW_ROWS`), shallower than either depth block, so an fp32 step whose
    /// backward multiplies 1,024 rows into each weight gradient packs alike on both.
    #[test]
    fn the_budget_follows_the_spec_caches() {
        use crate::runtime::ditmem_cpu::gemm_pack::{call_heap_bytes, GemmCache, GemmCall};
        use crate::spec::{Bf16Products, CpuSpec, GemmIsa};
        assert_eq!(GemmCache::of(&CpuSpec::REFERENCE), GemmCache::REFERENCE);
        let zen1 = CpuSpec {
            threads: 2,
            bf16_products: Bf16Products::Widen,
            gemm_l2_bytes: 512 << 10,
            gemm_isa: GemmIsa::Avx2,
            gemm_l1_bytes: 32 << 10,
            gemm_l1_ways: 8,
            gemm_l2_ways: 8,
            gemm_l3_bytes: 8 << 20,
            gemm_l3_ways: 16,
        };
        let as_reference = CpuSpec {
            gemm_l1_bytes: 48 << 10,
            gemm_l1_ways: 12,
            gemm_l2_ways: 16,
            gemm_l3_bytes: 32 << 20,
            ..zen1
        };
        // dW (1536 × 384) of 1,024 rows, as the direct linear hands it to gemm: the packed
        // rhs panel is kc × 1536 f32 (+ the flags), 3,145,744 bytes measured around the call on a
        // Zen 1; the reference packs the whole depth at once.
        let dw = GemmCall {
            m: 1536,
            n: 384,
            k: 1024,
            dst: (384, 1),
            lhs: (1, 1536),
            rhs: (384, 1),
            elem: 4,
            threads: 2,
        };
        let pack = |cpu: &CpuSpec| call_heap_bytes(cpu.gemm_isa, &GemmCache::of(cpu), &dw);
        assert_eq!(pack(&zen1), 3_145_744);
        assert_eq!(pack(&as_reference), 6_291_468);
        let mut s = small();
        s.recipe.precision = Precision::Fp32;
        s.workload.microbatch = 16;
        s.workload.batch = 16;
        let on = |cpu| {
            let mut t = s.clone();
            t.cpu = Some(cpu);
            estimate(&t).unwrap().peak_bytes
        };
        // The engine makes dW by chunks of DW_ROWS (256) rows, shallower than either depth
        // block: at the step level the two caches pack the same.
        assert_eq!(
            call_heap_bytes(
                zen1.gemm_isa,
                &GemmCache::of(&zen1),
                &GemmCall { k: 256, ..dw }
            ),
            call_heap_bytes(
                as_reference.gemm_isa,
                &GemmCache::of(&as_reference),
                &GemmCall { k: 256, ..dw }
            ),
        );
        assert_eq!(on(zen1), on(as_reference), "256-row dW chunks pack alike");
    }

    #[test]
    fn a_cpu_section_is_validated_and_belongs_to_the_engine_runtime() {
        use crate::spec::{Bf16Products, CpuSpec};
        let field = |s: &Spec| s.validate().unwrap_err().field().map(str::to_string);
        let mut s = small();
        s.cpu = Some(CpuSpec {
            threads: 0,
            ..CpuSpec::REFERENCE
        });
        assert_eq!(field(&s).as_deref(), Some("cpu.threads"));
        s.cpu = Some(CpuSpec {
            gemm_l2_bytes: 0,
            ..CpuSpec::REFERENCE
        });
        assert_eq!(field(&s).as_deref(), Some("cpu.gemm_l2_bytes"));
        for (cpu, name) in [
            (
                CpuSpec {
                    gemm_l1_bytes: 16,
                    ..CpuSpec::REFERENCE
                },
                "cpu.gemm_l1_bytes",
            ),
            (
                CpuSpec {
                    gemm_l1_ways: 0,
                    ..CpuSpec::REFERENCE
                },
                "cpu.gemm_l1_ways",
            ),
            (
                CpuSpec {
                    gemm_l2_ways: 1 << 20,
                    ..CpuSpec::REFERENCE
                },
                "cpu.gemm_l2_ways",
            ),
            (
                CpuSpec {
                    gemm_l3_bytes: u64::MAX,
                    ..CpuSpec::REFERENCE
                },
                "cpu.gemm_l3_bytes",
            ),
            (
                CpuSpec {
                    gemm_l3_ways: 0,
                    ..CpuSpec::REFERENCE
                },
                "cpu.gemm_l3_ways",
            ),
        ] {
            s.cpu = Some(cpu);
            assert_eq!(field(&s).as_deref(), Some(name));
        }
        // No L3 is a CPU gemm can block for.
        s.cpu = Some(CpuSpec {
            gemm_l3_bytes: 0,
            ..CpuSpec::REFERENCE
        });
        s.validate().unwrap();
        s.cpu = Some(CpuSpec {
            bf16_products: Bf16Products::Widen,
            ..CpuSpec::REFERENCE
        });
        s.validate().unwrap();
        s.runtime = "pytorch:cuda".parse().unwrap();
        assert_eq!(field(&s).as_deref(), Some("cpu"));
        // Written and read back: the section survives TOML.
        let mut t = small();
        t.cpu = Some(CpuSpec {
            threads: 3,
            ..CpuSpec::REFERENCE
        });
        let back: Spec = toml::from_str(&t.to_toml().unwrap()).unwrap();
        assert_eq!(back.cpu, t.cpu);
        // A section written before the cache fields existed reads as the reference machine's.
        let text = t.to_toml().unwrap();
        let trimmed: String = text
            .lines()
            .filter(|l| {
                !l.starts_with("gemm_l1_")
                    && !l.starts_with("gemm_l2_ways")
                    && !l.starts_with("gemm_l3_")
            })
            .map(|l| format!("{l}\n"))
            .collect();
        assert_ne!(trimmed, text, "the section holds the cache fields");
        let back: Spec = toml::from_str(&trimmed).unwrap();
        assert_eq!(back.cpu, t.cpu, "the reference's caches");
        assert!("fast".parse::<Bf16Products>().is_err());
    }
}
