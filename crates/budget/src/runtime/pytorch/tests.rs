//! Rules of the `pytorch` runtime: what one DiT block saves for backward (dit-facts §4, checked
//! against PyTorch 2.15 with saved-tensor hooks, `bench/torch_peer/saved.py`), checkpointing,
//! the foreach optimizer and the CUDA allocator's rounding.

use crate::estimate::estimate;
use crate::runtime::pytorch::allocator::SegCost;
use crate::runtime::pytorch::device::for_spec;
use crate::runtime::pytorch::device::PyTorch;
use crate::runtime::pytorch::families::of_spec as stages;
use crate::runtime::pytorch::rules::SAVED;
use crate::runtime::pytorch::step::{optimizer_scratch, CPU_RNG_STATE_BYTES};
use crate::runtime::shape::Shape;
use crate::spec::{
    AttentionMode, ModelSpec, Optimizer, Precision, Recompute, Runtime, SdpaBackend, Spec,
    TorchDevice,
};
use crate::timeline::simulate_step;

/// The three segments of an original-DiT spec under PyTorch's rules (the stages' costs, by name).
#[derive(Debug, Clone, Copy, Default)]
struct Costs {
    embed: SegCost,
    block: SegCost,
    final_layer: SegCost,
}

fn costs(spec: &Spec) -> Costs {
    let c = stages(for_spec(spec), spec).costs();
    let at = |i: usize| c.get(i).map(|s| s.cost).unwrap_or_default();
    Costs {
        embed: at(0),
        block: at(1),
        final_layer: at(c.len().saturating_sub(1)),
    }
}

fn spec(precision: Precision, attention: AttentionMode, device: TorchDevice) -> Spec {
    let mut s = Spec::default_xl();
    s.model = ModelSpec::preset("dit-s-2").unwrap();
    s.model.depth = 4;
    s.workload.height = 128;
    s.workload.width = 128;
    s.workload.batch = 4;
    s.workload.microbatch = 4;
    s.recipe.precision = precision;
    s.recipe.attention = attention;
    s.runtime = Runtime::Pytorch {
        device,
        sdpa: SdpaBackend::Auto,
    };
    s
}

/// [`spec`] in fp32 with memory-efficient attention on the CPU.
fn cpu_fp32() -> Spec {
    spec(
        Precision::Fp32,
        AttentionMode::MemoryEfficient,
        TorchDevice::Cpu,
    )
}

/// [`cpu_fp32`] with every block checkpointed, and its step's timeline.
fn cpu_fp32_checkpointed() -> (Spec, crate::timeline::Timeline) {
    let mut s = cpu_fp32();
    s.recipe.recompute = Recompute::All;
    let tl = simulate_step(&s);
    (s, tl)
}

/// (E elements, A elements, S rows, log-sum-exp bytes) of the spec.
fn sizes(s: &Spec) -> (u64, u64, u64, u64) {
    let d = Shape::new(s);
    (d.e(), d.a(), d.rows(), d.b * d.heads * d.s * 4)
}

/// Bytes one stored block keeps: its saved activations plus its input x (saved by norm1),
/// weight copies excluded.
fn block_saved(s: &Spec) -> u64 {
    let c = costs(s);
    let d = Shape::new(s);
    c.block.kept.activations + d.e() * s.recipe.precision.accum_dtype().size()
}

/// Saved bytes of the conditioning path, O(b·D): SiLU(c) (its autocast copy under autocast:
/// the fp32 SiLU output itself is not saved), 1+scale ×2, the gate chunks' storage (the adaLN
/// output, 6·b·D).
fn cond_saved(s: &Spec) -> u64 {
    let d = Shape::new(s);
    let low = s.recipe.precision.compute_dtype().size();
    let f = s.recipe.precision.accum_dtype().size();
    let silu = if s.recipe.precision.is_mixed() {
        d.b * d.d * low
    } else {
        d.b * d.d * f
    };
    silu + 2 * d.b * d.d * low + 6 * d.b * d.d * low
}

/// What one block saves beside the conditioning path ([`cond_saved`]), as
/// `want(E, A, S, log-sum-exp bytes)`, for each (precision, attention, device).
type BlockRule = (
    Precision,
    AttentionMode,
    TorchDevice,
    fn(u64, u64, u64, u64) -> u64,
);

const BLOCK_SAVED: [BlockRule; 6] = {
    use AttentionMode::{Materialized, MemoryEfficient};
    use Precision::{Bf16Mixed, Fp32};
    use TorchDevice::{Cpu, Cuda};
    [
        // Flash (memory-efficient) attention: 80E fp32, 48E under autocast, plus its
        // log-sum-exp and 16 bytes a row.
        (Fp32, MemoryEfficient, Cpu, |e, _, rows, lse| {
            80 * e + lse + 16 * rows
        }),
        (Bf16Mixed, MemoryEfficient, Cpu, |e, _, rows, lse| {
            48 * e + lse + 16 * rows
        }),
        (Bf16Mixed, MemoryEfficient, Cuda, |e, _, rows, lse| {
            48 * e + lse + 16 * rows
        }),
        // timm's explicit path: the bmm operands are reshape copies (q·scale, kᵀ, v), so the
        // fused qkv output is not kept; CUDA autocast runs softmax in fp32 (P 4A) and P@v saves
        // a bf16 copy (2A); the CPU autocast list has no softmax, so P stays bf16 (2A).
        (Bf16Mixed, Materialized, Cuda, |e, a, rows, _| {
            48 * e + 6 * a + 16 * rows
        }),
        (Bf16Mixed, Materialized, Cpu, |e, a, rows, _| {
            48 * e + 2 * a + 16 * rows
        }),
        (Fp32, Materialized, Cpu, |e, a, rows, _| {
            80 * e + 4 * a + 16 * rows
        }),
    ]
};

#[test]
fn block_saves_what_each_precision_attention_and_device_keeps() {
    for (precision, attention, device, want) in BLOCK_SAVED {
        let s = spec(precision, attention, device);
        let (e, a, rows, lse) = sizes(&s);
        let what = format!("{precision:?} {attention:?} {device:?}");
        assert_eq!(
            block_saved(&s),
            want(e, a, rows, lse) + cond_saved(&s),
            "{what}"
        );
    }
}

#[test]
fn autocast_weight_copies_are_two_bytes_per_block_weight() {
    let s = spec(
        Precision::Bf16Mixed,
        AttentionMode::MemoryEfficient,
        TorchDevice::Cpu,
    );
    let d = u64::from(s.model.hidden);
    let c = costs(&s);
    // Saved bf16 weights: adaLN 6D², qkv 3D², proj D², fc1 4D², fc2 4D²; the biases only sit in
    // the autocast cache.
    assert_eq!(c.block.kept.weight_casts, 2 * 18 * d * d);
    assert_eq!(c.block.cache_only, 2 * 15 * d);
    assert_eq!(c.block.ckpt_cache, 2 * (18 * d * d + 15 * d));
    let s = cpu_fp32();
    assert_eq!(costs(&s).block.kept.weight_casts, 0);
}

#[test]
fn checkpointed_blocks_keep_only_their_input() {
    let (s, tl) = cpu_fp32_checkpointed();
    let (e, _, _, _) = sizes(&s);
    let emb = tl.events.iter().find(|ev| ev.label == "embed").unwrap();
    let last = tl.events.iter().find(|ev| ev.label == "block 3").unwrap();
    assert_eq!(
        last.live.activations - emb.live.activations,
        4 * e * 4 + 4 * CPU_RNG_STATE_BYTES,
        "four block outputs (x) in fp32, and the CPU RNG state each checkpoint stashes"
    );
}

#[test]
fn adamw_scratch_follows_the_implementation() {
    use crate::spec::OptimizerImpl::{ForLoop, Foreach, Fused};
    let sc = |p: Precision, o, i| optimizer_scratch(1000, 300, p.optimizer_dtype(), o, i);
    // foreach: `_foreach_sqrt(exp_avg_sqs)`, one fp32 state copy of every parameter at once.
    assert_eq!(sc(Precision::Fp32, Optimizer::AdamW, Foreach), 4000);
    assert_eq!(sc(Precision::Bf16Mixed, Optimizer::AdamW, Foreach), 4000);
    // for-loop: the square root and the quotient of the largest parameter.
    assert_eq!(sc(Precision::Fp32, Optimizer::AdamW, ForLoop), 2 * 300 * 4);
    assert_eq!(sc(Precision::Fp32, Optimizer::AdamW, Fused), 0);
    assert_eq!(sc(Precision::Fp32, Optimizer::Sgd, Foreach), 0);
    // bitsandbytes' 8-bit AdamW: one in-place kernel per parameter, whatever torch's default.
    for i in [Foreach, ForLoop, Fused] {
        assert_eq!(sc(Precision::Fp16Mixed, Optimizer::AdamW8bit, i), 0);
    }
    let mut s = cpu_fp32();
    let opt_ws = |s: &Spec| {
        let b = estimate(s).unwrap();
        let e = b
            .timeline
            .events
            .iter()
            .find(|e| e.label == "adamw (inside)")
            .unwrap()
            .clone();
        assert_eq!(e.live.gradients, b.static_bytes.gradients);
        (e.live.workspace, b)
    };
    // The CPU default is the for-loop (`_default_to_fused_or_foreach`: foreach only on CUDA).
    let (ws, b) = opt_ws(&s);
    assert_eq!(ws, 2 * b.params.largest_trained * 4);
    s.recipe.optimizer_impl = Some(Foreach);
    let (ws, b) = opt_ws(&s);
    assert_eq!(ws, b.params.trained * 4);
    // On CUDA foreach is the default, and the `step` tensors stay on the CPU.
    let cuda = spec(
        Precision::Fp32,
        AttentionMode::MemoryEfficient,
        TorchDevice::Cuda,
    );
    let (ws, b) = opt_ws(&cuda);
    assert_eq!(ws, b.params.trained * 4);
    let start = b.timeline.events[0].live.optimizer_state;
    assert_eq!(start, b.static_bytes.optimizer_state);
    s.recipe.optimizer_impl = None;
    let cpu = estimate(&s).unwrap();
    let tensors = crate::denoiser::param_table(&s)
        .iter()
        .filter(|t| t.role == crate::params::ParamRole::Trained)
        .count() as u64;
    assert_eq!(
        cpu.timeline.events[0].live.optimizer_state,
        cpu.static_bytes.optimizer_state + 4 * tensors
    );
    // 8-bit AdamW on CUDA: inside the step only the model states are live (no scratch).
    let mut bnb = cuda.clone();
    bnb.recipe.optimizer = Optimizer::AdamW8bit;
    let b = estimate(&bnb).unwrap();
    let inside = b
        .timeline
        .events
        .iter()
        .find(|e| e.label == "adamw-8bit (inside)")
        .unwrap();
    assert_eq!(inside.live.workspace, 0);
    assert_eq!(inside.live.gradients, b.static_bytes.gradients);
    assert_eq!(inside.live.optimizer_state, b.static_bytes.optimizer_state);
}

#[test]
fn gradients_of_all_segments_add_up_to_the_parameter_gradients() {
    for p in [Precision::Fp32, Precision::Bf16Mixed] {
        let s = spec(p, AttentionMode::MemoryEfficient, TorchDevice::Cpu);
        let c = costs(&s);
        let depth = u64::from(s.model.depth);
        let b = estimate(&s).unwrap();
        assert_eq!(
            c.embed.param_grads + depth * c.block.param_grads + c.final_layer.param_grads,
            b.static_bytes.gradients
        );
    }
}

#[test]
fn step_returns_to_resident_bytes() {
    for p in [Precision::Fp32, Precision::Bf16Mixed] {
        for rc in [Recompute::None, Recompute::All, Recompute::EveryK(2)] {
            let mut s = spec(p, AttentionMode::Materialized, TorchDevice::Cpu);
            s.recipe.recompute = rc;
            let tl = simulate_step(&s);
            let first = tl.events.first().unwrap().total();
            let last = tl.events.last().unwrap().total();
            assert_eq!(first, last);
            let emb = tl.events.iter().rfind(|e| e.label == "embed").unwrap();
            assert_eq!(emb.live.activations, 0);
            assert_eq!(emb.live.weight_casts, 0);
            assert_eq!(emb.live.workspace, 0);
        }
    }
}

#[test]
fn runtime_strings_round_trip() {
    for text in [
        "pytorch:cpu",
        "pytorch:cuda",
        "pytorch:cuda:sdpa-math",
        "ditmem-cpu",
    ] {
        let r: Runtime = text.parse().unwrap();
        assert_eq!(r.to_string(), text);
    }
    assert_eq!(
        "pytorch".parse::<Runtime>().unwrap(),
        Runtime::Pytorch {
            device: TorchDevice::Cpu,
            sdpa: SdpaBackend::Auto
        }
    );
    let err = "pytorch:tpu".parse::<Runtime>().unwrap_err().to_string();
    assert!(err.contains("runtime"), "{err}");
    assert!("torch".parse::<Runtime>().is_err());
    let mut s = spec(
        Precision::Fp32,
        AttentionMode::MemoryEfficient,
        TorchDevice::Cuda,
    );
    s.runtime = "pytorch:cuda:sdpa-efficient".parse().unwrap();
    let json = serde_json::to_string(&s).unwrap();
    assert!(json.contains("\"runtime\":\"pytorch:cuda:sdpa-efficient\""));
    assert_eq!(Spec::from_json(&json).unwrap(), s);
}

#[test]
fn saved_marker_names_what_backward_reads() {
    let s = cpu_fp32();
    let rt = PyTorch::instance(TorchDevice::Cpu, SdpaBackend::Auto);
    let g = rt.block(&Shape::new(&s));
    let saved: Vec<&str> = g
        .tensors
        .iter()
        .filter(|t| t.name.ends_with(SAVED))
        .map(|t| t.name.as_str())
        .collect();
    assert!(saved.iter().any(|n| n.starts_with("sdpa out")));
    assert!(saved.iter().any(|n| n.starts_with("mlp.fc1")));
    assert!(!saved.iter().any(|n| n.starts_with("x + attn")) || saved.len() > 5);
}

/// PyTorch's CPU flash attention scratch (`FlashAttentionKernel.cpp`), from the source's
/// formula: per thread, qSplit·kvSplit fp32 scores (+ row max, row sum, a qSplit × headSize
/// accumulator) in the forward, `attn` + `grad_attn` in the backward, each again in the reduced
/// dtype for bf16, and a qSplit fp32 `dsum` per running thread.
#[test]
fn cpu_flash_scratch_follows_the_kernel_source() {
    use crate::runtime::pytorch::ops::{cpu_flash_scratch, Attn};
    use crate::spec::Dtype;
    // The SD3 LoRA spec's joint attention: b 4, 4 heads, 64 + 154 tokens, head 16, 2 threads;
    // q ≥ 192 → qSplit 64, kvSplit 218. The profiler's backward buffers: 223,232 B (fp32) and
    // 111,616 B (bf16), plus two dsum rows of 64 fp32.
    let at = Attn {
        b: 4,
        heads: 4,
        sq: 218,
        skv: 218,
        dh: 16,
    };
    let (fwd, bwd) = cpu_flash_scratch(2, at, Dtype::Bf16);
    assert_eq!(bwd, 223_232 + 111_616 + 2 * 64 * 4);
    assert_eq!(
        fwd,
        2 * (64 * 218 + 2 * 64 + 64 * 16) * 4 + 2 * 64 * 218 * 2
    );
    // fp32 inputs: no reduced buffers.
    let (f32_fwd, f32_bwd) = cpu_flash_scratch(2, at, Dtype::F32);
    assert_eq!(f32_bwd, 223_232 + 2 * 64 * 4);
    assert_eq!(f32_fwd, 2 * (64 * 218 + 2 * 64 + 64 * 16) * 4);
    // Per thread: 16 threads hold 8 times the buffers (dsum: one per running thread, 16 heads).
    let (_, b16) = cpu_flash_scratch(16, at, Dtype::F32);
    assert_eq!(b16, 8 * 223_232 + 16 * 64 * 4);
    // The q blocking switches at 192 and 768 rows; kv blocks are at most 512 keys; a q shorter
    // than its block is one block.
    let q = |sq: u64| Attn {
        sq,
        skv: 1024,
        ..at
    };
    // (q rows, its block's rows)
    for (sq, rows) in [(191, 32), (192, 64), (768, 256), (20, 20)] {
        assert_eq!(
            cpu_flash_scratch(1, q(sq), Dtype::F32).1,
            (2 * rows * 512 + rows) * 4,
            "q of {sq} rows"
        );
    }
}

/// The spec's `cpu.threads` reaches the flash attention op of a `pytorch:cpu` block (2, the
/// reference, without a `cpu` section); a `cpu` section on `pytorch:cuda` is refused.
#[test]
fn flash_scratch_follows_the_specs_threads() {
    use crate::runtime::pytorch::ops::cpu_flash_scratch;
    use crate::spec::{CpuSpec, Dtype};
    let mut s = spec(
        Precision::Bf16Mixed,
        AttentionMode::MemoryEfficient,
        TorchDevice::Cpu,
    );
    let sdpa = |s: &Spec| {
        let g = for_spec(s).block(&Shape::new(s));
        let op = g
            .ops
            .iter()
            .find(|o| o.name == "sdpa out")
            .expect("fused sdpa");
        (op.fwd_scratch, op.bwd_scratch)
    };
    // dit-s-2 at 128²: 64 tokens, 6 heads of 64, b 4.
    let at = crate::runtime::pytorch::ops::Attn {
        b: 4,
        heads: 6,
        sq: 64,
        skv: 64,
        dh: 64,
    };
    assert_eq!(sdpa(&s), cpu_flash_scratch(2, at, Dtype::Bf16));
    s.cpu = Some(CpuSpec {
        threads: 32,
        ..CpuSpec::REFERENCE
    });
    s.validate()
        .expect("a cpu section is allowed with pytorch:cpu");
    assert_eq!(sdpa(&s), cpu_flash_scratch(32, at, Dtype::Bf16));
    assert!(sdpa(&s).1 > cpu_flash_scratch(2, at, Dtype::Bf16).1);
    let mut c = spec(
        Precision::Bf16Mixed,
        AttentionMode::MemoryEfficient,
        TorchDevice::Cuda,
    );
    assert_eq!(sdpa(&c), (0, 0));
    c.cpu = Some(CpuSpec::REFERENCE);
    assert!(c.validate().is_err(), "a cpu section on pytorch:cuda");
}

/// `lora.dtype = "weight"` under bf16-mixed: the adapters, their gradients and AdamW's state in
/// bf16 and no fp32 master copy (the diffusers LoRA scripts under `--mixed_precision bf16`);
/// `fp32`: fp32 masters, fp32 gradients, fp32 state. n trained elements: weight → 2n + 2n + 4n,
/// fp32 → 4n + 4n + 8n.
#[test]
fn lora_adapter_dtype_sets_weights_grads_and_state() {
    use crate::spec::LoraDtype;
    // A tiny family spec as `bench/torch_peer/specs/families_lora/` writes them.
    use crate::families::flux::pytorch::tests::tiny;
    const SD3: &str = r#"{"_class_name": "SD3Transformer2DModel", "sample_size": 16,
        "patch_size": 2, "in_channels": 16, "num_layers": 2, "attention_head_dim": 16,
        "num_attention_heads": 4, "joint_attention_dim": 96, "caption_projection_dim": 64,
        "pooled_projection_dim": 80, "out_channels": 16, "pos_embed_max_size": 24}"#;
    let lora = r#"{"rank": 4, "modules": ["to_q", "to_k", "to_v", "to_out.0"]}"#;
    let fp32 = tiny(SD3, "[77, 77]", "bf16-mixed", lora);
    let mut weight = fp32.clone();
    weight.recipe.lora.as_mut().unwrap().dtype = LoraDtype::Weight;
    weight.validate().expect("weight adapters under bf16-mixed");
    let a = estimate(&fp32).unwrap();
    let b = estimate(&weight).unwrap();
    let n = a.params.trained;
    // SD3 tiny, rank 4 on to_q/k/v/out.0 of both blocks (64 wide): 8 modules × 4·(64 + 64).
    assert_eq!(n, 2 * 4 * 4 * (64 + 64));
    let (sa, sb) = (a.static_bytes, b.static_bytes);
    assert_eq!(sa.master_weights, 4 * n);
    assert_eq!(sb.master_weights, 0);
    assert_eq!(sb.weights - sa.weights, 2 * n);
    assert_eq!(sa.gradients, 4 * n);
    assert_eq!(sb.gradients, 2 * n);
    assert_eq!(sa.optimizer_state, 8 * n);
    assert_eq!(sb.optimizer_state, 4 * n);
    assert!(b.peak_bytes < a.peak_bytes);
    // Under fp32 the two are one recipe.
    let mut f = tiny(SD3, "[77, 77]", "fp32", lora);
    let fa = estimate(&f).unwrap().peak_bytes;
    f.recipe.lora.as_mut().unwrap().dtype = LoraDtype::Weight;
    assert_eq!(estimate(&f).unwrap().peak_bytes, fa);
    // Refused by name where nothing runs it.
    for (p, rt) in [
        (Precision::Fp16Mixed, "pytorch:cpu"),
        (Precision::Bf16Mixed, "ditmem-cpu"),
    ] {
        let mut s = weight.clone();
        s.recipe.precision = p;
        s.runtime = rt.parse().unwrap();
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("recipe.lora.dtype"), "{e}");
    }
}

/// One PEFT-adapted linear (frozen fp32 base, fp32 adapters, no autocast) on the CPU, reading
/// `h = op(x0)` of `rows × inp` elements: the segment (output: the base plus the adapter) and
/// the ids of `h` and of the base's matmul.
fn peft_linear(
    rows: u64,
    inp: u64,
    out: u64,
    rank: u64,
) -> (crate::segment::Segment, usize, usize) {
    use crate::runtime::pytorch::ops::{Builder, LoraOn};
    use crate::spec::Dtype;
    let rt = PyTorch::instance(TorchDevice::Cpu, SdpaBackend::Flash);
    let mut bl = Builder::new(rt, Precision::Fp32, AttentionMode::MemoryEfficient, "peft");
    bl.lora = Some(LoraOn {
        rank,
        modules: vec!["ff".into()],
        dtype: Dtype::F32,
    });
    let x0 = bl.g.input("x0", rows * inp, Dtype::F32, true);
    let h = bl.g.op("h", &[x0], rows * inp, Dtype::F32);
    let y = bl.linear_rg(
        "ff",
        h,
        crate::runtime::pytorch::ops::Lin::new(rows, out, inp, true),
    );
    let base =
        bl.g.ops
            .iter()
            .position(|o| o.name.starts_with("ff ["))
            .expect("the base matmul");
    bl.g.output = y;
    (bl.g, h, base)
}

/// A frozen base's `addmm` saves no input (`derivatives.yaml` `addmm`: `self` only for `mat2`'s
/// gradient): the input that lora_A saves is freed once lora_A's `MmBackward0` has run, before
/// the base's backward (which runs last: the lowest sequence number).
#[test]
fn a_frozen_matmul_does_not_hold_its_input() {
    use crate::runtime::pytorch::allocator::{simulate_traced, Ev};
    use crate::runtime::pytorch::rules::{LEFT_UNSAVED, MATMUL};
    let (rows, inp, out, r) = (8, 64, 16, 2);
    let (g, h, base) = peft_linear(rows, inp, out, r);
    assert!(
        g.ops[base].name.ends_with(LEFT_UNSAVED),
        "{}",
        g.ops[base].name
    );
    assert!(g.ops.iter().any(|o| o.name == format!("ff.lora_A{MATMUL}")));
    assert!(g.tensors[h].name.ends_with(SAVED), "lora_A saves h itself");
    let (_, tr) = simulate_traced(&g, rows * out * 4, &[]);
    let n = tr.n;
    let at = |e: Ev| tr.bwd.iter().position(|&x| x == e);
    let freed = at(Ev::Free(h as u64)).expect("h is released");
    // The base's node makes h's second gradient (local id 5n + k).
    let second = tr
        .bwd
        .iter()
        .position(|e| matches!(*e, Ev::Alloc(id, _) if id == 5 * n + base as u64))
        .expect("the base's gradient of h");
    assert!(
        freed < second,
        "h freed at {freed}, base backward at {second}"
    );
}

/// The base's gradient of h meets lora_A's (a reshape view of its 2-D `mm` result): autograd
/// adds them out of place (`input_buffer.cpp` `accumulate`: `old_var + var`) after the base's
/// node released its incoming gradient (`engine.cpp` `evaluate_function`). The backward's worst
/// moment is then h's two gradients and their sum, plus the adapters' weight gradients — by
/// hand from the rules, fp32: 3·rows·inp·4 + (out·r + r·inp)·4 = 6,784 B (the old rule, which
/// held h and counted no sum, gave 7,296 B).
#[test]
fn a_matmul_input_gradient_is_summed_out_of_place() {
    use crate::runtime::pytorch::allocator::simulate;
    let (rows, inp, out, r) = (8u64, 64, 16, 2);
    let (g, _, _) = peft_linear(rows, inp, out, r);
    let c = simulate(&g, rows * out * 4, &[]);
    assert_eq!(
        c.bwd_peak.total(),
        3 * rows * inp * 4 + (out * r + r * inp) * 4
    );
    assert_eq!(c.bwd_peak.total(), 6_784);
    assert_eq!(c.param_grads, (out * r + r * inp) * 4);
}

/// oneDNN's bf16 matmul scratch (`cpu_gemm_scratch`), against the profiler's figures
/// (`bench/torch_peer/gemm_scratch_probe.py`, torch 2.15 CPU, AVX512-BF16): the row block by
/// `compute_blocking_heuristic_avx512` (balanced blocks of at most 256 rows, a block count
/// that divides among the threads), the k block at 512 (1024 above 1024), the threads.
#[test]
fn cpu_gemm_scratch_follows_onednn_blocking() {
    use crate::runtime::pytorch::ops::cpu_gemm_scratch;
    let g = |t, m, k, n| cpu_gemm_scratch(t, m, k, n, false);
    // (threads, m, k, n, measured bytes)
    for (t, m, k, n, b) in [
        (2, 616, 256, 64, 146_048),
        (2, 256, 256, 64, 132_736),
        (2, 513, 256, 64, 133_248),
        (2, 600, 256, 64, 144_000),
        (2, 1024, 256, 64, 198_272),
        (2, 1100, 64, 64, 74_368),
        (2, 2000, 64, 64, 146_048),
        (2, 616, 64, 128, 96_896),
        (2, 600, 64, 256, 120_448),
        (2, 256, 768, 64, 198_272),
        (2, 256, 2048, 64, 329_344),
        (2, 256, 100, 64, 99_968),
        (2, 256, 64, 32, 50_816),
        (2, 16, 64, 64, 26_240),
        (2, 40, 64, 64, 28_288),
        (2, 33, 64, 64, 26_752),
        (1, 616, 256, 64, 73_216),
        (1, 256, 256, 64, 99_328),
        (4, 616, 256, 64, 291_712),
        (4, 256, 256, 64, 199_552),
        (4, 16, 64, 64, 52_096),
        (4, 600, 64, 256, 240_512),
    ] {
        assert_eq!(g(t, m, k, n), b, "({t} threads) {m} × {k} × {n}");
    }
    // The weight gradient gradᵀ·x (left operand transposed), exact where m ≤ 512.
    assert_eq!(cpu_gemm_scratch(2, 64, 256, 64, true), 116_480);
    assert_eq!(cpu_gemm_scratch(2, 256, 256, 256, true), 263_936);
    assert_eq!(cpu_gemm_scratch(2, 0, 256, 64, false), 0);
}

/// `torch.utils.checkpoint(use_reentrant=False)` stashes the CPU generator's state per
/// checkpointed block and `fork_rng` saves it again around the recompute: on the CPU a
/// checkpointed step's recompute moment holds both; on CUDA they are host memory.
#[test]
fn checkpoint_stashes_the_cpu_rng_state() {
    use crate::runtime::pytorch::step::checkpoint_rng_bytes;
    assert_eq!(checkpoint_rng_bytes(TorchDevice::Cpu), CPU_RNG_STATE_BYTES);
    assert_eq!(checkpoint_rng_bytes(TorchDevice::Cuda), 0);
    let (s, tl) = cpu_fp32_checkpointed();
    let c = costs(&s);
    let i = tl
        .events
        .iter()
        .position(|ev| ev.label == "block 3 recompute (inside)")
        .unwrap();
    let before = tl.events[i - 1].live.total();
    // Four stashed states (blocks 0–3) are in `before`; fork_rng's copy is the recompute's.
    assert_eq!(
        tl.events[i].live.total() - before,
        c.block.recompute_peak.total() + CPU_RNG_STATE_BYTES
    );
    // Block 3's own state goes with its backward.
    let after = tl.events.iter().find(|ev| ev.label == "block 3").unwrap();
    assert!(after.live.activations >= 3 * CPU_RNG_STATE_BYTES);
    // And the step ends where it started.
    assert_eq!(
        tl.events.last().unwrap().live.total(),
        tl.events[0].live.total()
    );
}
